"""CPU decode attention of DeepSeek's latent attention: absorbed against decompressed, same data.

One decode step of one layer over a host cache of latent rows (kv_lora_rank 512 + rotary 64 a
token), ragged sequences (a quarter of each batch padded to half the context, masked), at
DeepSeek-V2-Lite's 16 heads and V3's 128 (keys of 128 + 64, values of 128):
- absorbed (the executor's, executor/latent_attention.py): the queries take in W_k, attend over
  the latent rows as one key/value head (attend_one_step), and W_v follows;
- decompressed (transformers'): every cached latent is widened to each head's key and value
  (c W_k^T, c W_v^T) at every step, then SDPA over them.
Each time includes its variant's own projections. Prints a table and writes
reports/bench_latent_attention.json; docs/decisions.md keeps the choice.
    python bench/bench_latent_attention.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_cpu_attention import host_section, seconds, write_report  # noqa: E402
from executor.attention import attend_one_step  # noqa: E402
from executor.latent_attention import key_up_projection, latent_values  # noqa: E402
from hrm.arch import resolve_model  # noqa: E402


def case(arch, batch: int, context: int, dtype: torch.dtype):
    """A step's queries (nope and rotated parts), the cache's latent rows, the mask, W."""
    g = torch.Generator().manual_seed(0)
    nq, n, r, c = (arch.num_attention_heads, arch.qk_nope_head_dim, arch.rotary_dim,
                   arch.kv_lora_rank)  # fmt: skip
    q = torch.randn(batch, nq, n + r, generator=g).to(dtype)
    rows = torch.randn(batch, 1, context, c + r, generator=g).to(dtype)
    wkv_b = (torch.randn(nq * (n + arch.v_head_dim), c, generator=g) * 0.02).to(dtype)
    valid = torch.ones(batch, context, dtype=torch.bool)
    valid[: max(1, batch // 4), : context // 2] = False  # left padding of the shorter prompts
    w = types.SimpleNamespace(wkv_b=wkv_b, wk_b=None, wv_b=None)  # as a checkpoint holds it
    return q, rows, valid[:, None, None, :], w


def absorbed(arch, q, rows, mask, w):
    n, c = arch.qk_nope_head_dim, arch.kv_lora_rank
    w_k, _ = key_up_projection(arch, w.wkv_b)
    q_latent = torch.matmul(q[..., :n].transpose(0, 1), w_k).transpose(0, 1)  # [B, nq, c]
    queries = torch.cat((q_latent, q[..., n:]), dim=-1)
    out = attend_one_step(queries, rows, rows[..., :c], mask, scale=arch.softmax_scale)
    return latent_values(arch, w, out)


def decompressed(arch, q, rows, mask, w):
    c, nq = arch.kv_lora_rank, arch.num_attention_heads
    w_k, w_vt = key_up_projection(arch, w.wkv_b)  # [nq, n, c], [nq, c, v]
    latent = rows[..., :c]  # [B, 1, S, c]
    keys = torch.cat(
        (torch.matmul(latent, w_k.transpose(1, 2)), rows[..., c:].expand(-1, nq, -1, -1)), dim=-1
    )  # [B, nq, S, n + r]
    values = torch.matmul(latent, w_vt)  # [B, nq, S, v]
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=mask, scale=arch.softmax_scale
    )
    return out.reshape(q.shape[0], -1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int)
    p.add_argument("-o", "--output", default="reports/bench_latent_attention.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    points = {
        "deepseek-v2-lite": ((1, 512), (8, 512), (8, 2048), (32, 512)),
        "deepseek-v3": ((1, 512), (8, 512)),
    }
    if args.quick:
        points = {"deepseek-v2-lite": ((1, 256), (8, 256))}
    rows_out = []
    print(f"{'model':17} {'dtype':9} {'batch':>5} {'context':>7} {'absorbed ms':>11} "
          f"{'decomp. ms':>10} {'ratio':>6} {'max diff':>9}")  # fmt: skip
    with torch.inference_mode():
        for name, shapes in points.items():
            arch = resolve_model(name)
            for dtype in (torch.bfloat16, torch.float32):
                for b, s in shapes:
                    data = case(arch, b, s, dtype)
                    out = {
                        f.__name__: seconds(lambda f=f, a=arch, d=data: f(a, *d), 3)
                        for f in (absorbed, decompressed)
                    }
                    diff = float((absorbed(arch, *data) - decompressed(arch, *data)).abs().max())
                    ratio = out["decompressed"] / out["absorbed"]
                    dt = str(dtype).removeprefix("torch.")
                    ms = {k: 1e3 * v for k, v in out.items()}
                    print(f"{name:17} {dt:9} {b:>5} {s:>7} {ms['absorbed']:>11.2f} "
                          f"{ms['decompressed']:>10.2f} {ratio:>6.1f} {diff:>9.2g}")  # fmt: skip
                    rows_out.append({"model": name, "dtype": dt, "batch": b, "context": s,
                                     "seconds": out, "decompressed_over_absorbed": ratio,
                                     "max_abs_difference": diff})  # fmt: skip
    write_report(args.output, {"host": host_section(), "kept": "absorbed", "rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
