"""CPU decode attention: the two kernels of executor/attention.py on the same data.

Grouped-query decode over a host KV cache at Mixtral's head shape (32 query, 8 KV heads, d 128),
ragged sequences (a quarter of each batch padded to half the context, masked), for batches and
contexts a CPU-attention plan runs. Prints a table and writes reports/bench_cpu_attention.json.
    python bench/bench_cpu_attention.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor.attention import DECODE_KERNEL, DECODE_KERNELS  # noqa: E402
from hrm.profiling.cpu import host_facts  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def case(batch: int, context: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=g).to(dtype)
    valid = torch.ones(batch, context, dtype=torch.bool)
    valid[: max(1, batch // 4), : context // 2] = False  # left padding of the shorter prompts
    return q, k, v, valid[:, None, None, :]


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int)
    p.add_argument("-o", "--output", default="reports/bench_cpu_attention.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = (1, 8) if args.quick else (1, 8, 32)
    contexts = (128, 512) if args.quick else (128, 512, 2048)
    repeats = 5 if args.quick else 15
    rows = []
    print(f"{'dtype':9} {'batch':>5} {'context':>7} {'sdpa ms':>9} {'matmul ms':>9} {'faster':>7}")
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
                    name = str(dtype).removeprefix("torch.")
                    print(
                        f"{name:9} {b:>5} {s:>7} {1e3 * out['sdpa']:>9.3f} "
                        f"{1e3 * out['matmul']:>9.3f} {faster:>7}"
                    )
                    rows.append(
                        {"dtype": name, "batch": b, "context": s, "seconds": out, "faster": faster}
                    )
    wins = {n: sum(r["faster"] == n for r in rows) for n in DECODE_KERNELS}
    print(f"faster in: {wins}; kept: {DECODE_KERNEL}")
    write_report(
        args.output, {"host": host_section(), "kept": DECODE_KERNEL, "wins": wins, "rows": rows}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
