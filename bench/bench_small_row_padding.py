"""Small-row padding on the CPU: decode with and without `small_pads`, same model, same prompts.

The host is profiled first (`hrm profile --quick` at the bench model's shape) unless `--hardware`
names one; the executor's CPU GEMM choice comes from it (hrm.rules.cpu_gemm) and is run twice: as
chosen, and with its small pads removed (every GEMM of 1-8 rows at its own rows). Small decode
batches give each expert 1-3 rows, where fp32 sgemm on some CPUs runs GEMVs slower than 4 rows.
Runs alternate between the two choices, `--repeats` times after a warm-up of each, and the
median decode time is kept; the planner's prediction of each is printed beside it. Prints a
table; the last line is JSON; the same JSON goes to reports/.

    python bench/bench_small_row_padding.py [--hardware PATH] [--repeats N] [--output F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench_cpu_vs_transformers import (
    ROOT,
    host_cpu_gemm,
    host_description,
    mixtral_config,
    profile_host,
    random_prompts,
    save_checkpoint,
)

MODEL = dict(hidden=1024, width=3584, layers=4)
BATCHES = (1, 2, 4, 8)
PROMPT_LEN, GEN_LEN = 32, 32


def decode_seconds(model, prompts) -> float:
    from executor.generate import generate

    return generate(model, prompts, GEN_LEN).decode_s


def predicted_decode_s(arch, profile, choice, batch: int) -> float:
    from hrm.workload import Workload
    from planner import predict_resident_run

    workload = Workload(prompt_len_mean=PROMPT_LEN, prompt_len_max=PROMPT_LEN, gen_len=GEN_LEN)
    plan = predict_resident_run(
        arch, profile, workload, batch_size=batch, dtype=choice.dtype, cpu_gemm=choice
    )
    return plan.predicted.decode_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", help="profile for the GEMM choice (default: profile host)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--output", help="JSON to write (reports/bench_small_row_padding.json)")
    args = parser.parse_args()
    output = Path(args.output or ROOT / "reports" / "bench_small_row_padding.json")

    from executor.checkpoint import open_checkpoint
    from executor.model import MoEModel

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(mixtral_config(**MODEL), Path(tmp) / "ckpt")
        hardware = args.hardware or str(profile_host(path / "config.json", Path(tmp) / "host.yaml"))
        for dtype in args.dtypes.split(","):
            profile, chosen = host_cpu_gemm(path, hardware, dtype)
            plain = dataclasses.replace(chosen, small_pads={})
            checkpoint = open_checkpoint(path, dtype)
            models = {"padded": MoEModel(checkpoint, chosen), "plain": MoEModel(checkpoint, plain)}
            for batch in BATCHES:
                prompts = random_prompts(batch, PROMPT_LEN)
                times: dict[str, list[float]] = {name: [] for name in models}
                for rep in range(args.repeats + 1):  # the first round warms up
                    for name, model in models.items():
                        seconds = decode_seconds(model, prompts)
                        if rep:
                            times[name].append(seconds)
                measured = {name: statistics.median(t) for name, t in times.items()}
                predicted = {
                    name: predicted_decode_s(checkpoint.arch, profile, choice, batch)
                    for name, choice in (("padded", chosen), ("plain", plain))
                }
                rows.append(
                    {
                        "dtype": dtype,
                        "batch": batch,
                        "small_pads": chosen.to_dict()["small_pads"],
                        "decode_s": measured,
                        "decode_s_samples": times,
                        "predicted_decode_s": predicted,
                        "speedup": measured["plain"] / measured["padded"],
                    }
                )
    print(f"{'dtype':9} {'batch':>5} {'plain s':>8} {'padded s':>9} {'speedup':>8} "
          f"{'pred plain':>10} {'pred padded':>11}")  # fmt: skip
    for r in rows:
        m, p = r["decode_s"], r["predicted_decode_s"]
        print(f"{r['dtype']:9} {r['batch']:>5} {m['plain']:8.3f} {m['padded']:9.3f} "
              f"{r['speedup']:8.2f} {p['plain']:10.3f} {p['padded']:11.3f}")  # fmt: skip
    result = {
        "model": {**MODEL, "prompt_len": PROMPT_LEN, "gen_len": GEN_LEN},
        "host": host_description(),
        "hardware": args.hardware or "this host, profiled quickly at the bench model's shape",
        "repeats": args.repeats,
        "rows": rows,
    }
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
