"""What packing a page as it arrives would cost and save, where the CPU stands in for the GPU.

A paged run's pages reach the CPU by a copy (the store's arena into a slot) and run native: the
GEMM reorders its weight on every call. Packing the page once as it arrives (oneDNN's blocked
layout, hrm.rules.gemm_paths.pack_weight) would replace the copy by a reorder and every use by a
packed GEMM. It pays when the uses a page gets between arrivals (a pass's micro-batches) save
more than the reorder costs over the copy:

    uses to break even = (pack - copy) / (native GEMM - packed GEMM)

Each matrix is timed cold, over a rotation of distinct weights larger than the caches, and the
four operations are interleaved round by round, so that the VM's drift moves them alike; the
median of the rounds is kept. Prints a table; the last line is JSON; the same JSON goes to
reports/bench_page_packing.json. Not in CI.

    python bench/bench_page_packing.py [--rows 1,4,16,64] [--rounds 5] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_cpu_vs_transformers import host_description  # noqa: E402

from hrm.rules.gemm_paths import native_linear, pack_weight, packed_linear  # noqa: E402
from hrm.rules.host_memory import keep_freed_host_memory  # noqa: E402

# [out, in] of the matrices a page holds: the bench models' experts (Mixtral-shaped hidden 1024
# width 3584; Qwen3-MoE-shaped 384 wide), a projection, and one Mixtral 8x7B expert matrix
SHAPES = {
    "mixtral bench w1": (3584, 1024),
    "mixtral bench w2": (1024, 3584),
    "qwen3 bench w1": (384, 1024),
    "qwen3 bench w2": (1024, 384),
    "projection 1024": (1024, 1024),
    "mixtral-8x7b w1": (14336, 4096),
}
ROTATION_BYTES = 512 << 20  # distinct weights a timing cycles through: past this host's caches


def per_call(fn, items) -> float:
    """Mean seconds of fn over `items`, one call each (each on data the last calls did not
    touch)."""
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - t0) / len(items)


def measure(shape: tuple[int, int], rows: list[int], rounds: int, dtype) -> dict:
    out_f, in_f = shape
    nbytes = out_f * in_f * torch.finfo(dtype).bits // 8
    count = max(3, ROTATION_BYTES // nbytes)
    weights = [torch.randn(shape, dtype=dtype) * 0.02 for _ in range(count)]
    slot = torch.empty(shape, dtype=dtype)
    packed = [pack_weight(w) for w in weights]
    xs = {r: torch.randn(r, in_f, dtype=dtype) for r in rows}
    ops = {"copy": lambda w: slot.copy_(w), "pack": pack_weight}
    for r in rows:
        ops[f"native {r}"] = lambda w, x=xs[r]: native_linear(x, w)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for r in rows:
        samples[f"packed {r}"] = []
    for rep in range(rounds + 1):  # the first round warms up
        for name, fn in ops.items():
            seconds = per_call(fn, weights)
            if rep:
                samples[name].append(seconds)
        for r in rows:
            seconds = per_call(lambda w, x=xs[r]: packed_linear(x, w), packed)
            if rep:
                samples[f"packed {r}"].append(seconds)
    us = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
    by_rows = {}
    for r in rows:
        saving = us[f"native {r}"] - us[f"packed {r}"]
        extra = us["pack"] - us["copy"]
        by_rows[r] = {
            "native_us": us[f"native {r}"],
            "packed_us": us[f"packed {r}"],
            "break_even_uses": extra / saving if saving > 0 else None,
        }
    return {
        "shape": list(shape),
        "bytes": nbytes,
        "copy_us": us["copy"],
        "pack_us": us["pack"],
        "copy_gb_s": nbytes / us["copy"] / 1e3,
        "pack_gb_s": nbytes / us["pack"] / 1e3,
        "rows": by_rows,
        "samples_us": {name: [v * 1e6 for v in s] for name, s in samples.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--output", help="JSON to write (reports/bench_page_packing.json)")
    args = parser.parse_args()
    from hrm.rules.gemm_paths import packing_missing

    missing = packing_missing(args.dtype)
    if missing is not None:
        print(f"bench_page_packing: this CPU lacks {missing}", file=sys.stderr)
        return 2
    keep_freed_host_memory()  # as the executor runs
    rows = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    results = {name: measure(shape, rows, args.rounds, dtype) for name, shape in SHAPES.items()}
    print(f"{'matrix':18} {'MB':>6} {'copy us':>8} {'pack us':>8} {'rows':>4} {'native us':>9} "
          f"{'packed us':>9} {'uses to pay':>11}")  # fmt: skip
    for name, r in results.items():
        for n, at in r["rows"].items():
            uses = at["break_even_uses"]
            print(f"{name:18} {r['bytes'] / 1e6:6.2f} {r['copy_us']:8.0f} {r['pack_us']:8.0f} "
                  f"{n:>4} {at['native_us']:9.0f} {at['packed_us']:9.0f} "
                  f"{'never' if uses is None else f'{uses:.1f}':>11}")  # fmt: skip
    result = {
        "host": host_description(),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "matrices": results,
    }
    output = Path(args.output or ROOT / "reports" / "bench_page_packing.json")
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
