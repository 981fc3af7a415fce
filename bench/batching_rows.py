"""The static and continuous plans of reports/plans.md's batching table, and MoE-Lens's stage-1
bound beside them: what `hrm plan --batching continuous` prints for each setting and job.

A job is drawn as `hrm plan --prompt-len LO-HI --gen-len LO-HI --requests K` draws it (uniform,
seeded). The static figure is the job run as `hrm run --batching static` runs it: the best
static plan's batches of N (the last one short), each priced at its own size and lengths; the
continuous figure is the job simulated pass by pass under the continuous plan
(planner/continuous.py).
"""

from __future__ import annotations

import time

from hrm.arch import resolve_model
from hrm.cli.plan_continuous import continuous_plan
from hrm.cli.plan_job import drawn_job
from hrm.errors import HrmError
from hrm.hardware import resolve_hardware
from planner.bound import stage1_bound
from planner.search import search

# (model, machine, weight format or None for the machine's 16-bit float, GPUs)
SETTINGS = (
    ("mixtral-8x7b", "t4", None, 1),
    ("mixtral-8x7b", "l4", None, 1),
    ("qwen3-30b-a3b", "l4", None, 1),
    ("deepseek-v3", "h100-sxm", "int4", 8),
)
# name -> (prompt length or range, max_tokens or range, requests)
JOBS = {
    "MTBench-like p 20-176 g 32-256": ((20, 176), (32, 256), 2000),
    "RAG-like p 800-1052 g 128": ((800, 1052), 128, 2000),
    "long generation p 100 g 4096": (100, 4096, 600),
    "mixed file p 20-400 g 16-256": ((20, 400), (16, 256), 2000),
}


def batching_rows() -> list[dict]:
    rows = []
    for model, machine, weights, gpus in SETTINGS:
        arch = resolve_model(model)
        hw = resolve_hardware(machine)
        hw = hw.with_gpu_count(gpus) if gpus != hw.gpu_count else hw
        dtype = hw.half_dtype
        for name, (prompt, gen, count) in JOBS.items():
            row = {"model": model, "hardware": hw.name, "weights": weights or dtype, "job": name}
            try:
                rows.append({**row, **_row(arch, hw, weights or dtype, dtype, prompt, gen, count)})
            except HrmError as exc:
                rows.append({**row, "error": str(exc)})
            print(_line(rows[-1]))
    return rows


def _row(arch, hw, weights, kv, prompt, gen, count) -> dict:
    """As `hrm plan --batching continuous` plans it (hrm/cli/plan_continuous.py)."""
    workload, job = drawn_job(prompt, gen, count)
    started = time.perf_counter()
    static = search(arch, hw, workload, weight_dtype=weights, kv_dtype=kv, top_k=5,
                    max_batch_size=count).top  # fmt: skip
    planned = continuous_plan(arch, hw, workload, job, list(static))
    seconds = time.perf_counter() - started
    bound = stage1_bound(arch, hw, workload, weights, kv)
    plan = planned["plan"]
    return {
        "static": static[0].to_dict(),
        "continuous": plan.to_dict(),
        "static_batch_tok_s": static[0].predicted.throughput_tok_s,
        "static_tok_s": planned["static_job"].throughput_tok_s,
        "continuous_tok_s": plan.continuous.predicted.throughput_tok_s,
        "bound": bound.to_dict(),
        "bound_tok_s": bound.generated_per_s,
        "planned_in_s": seconds,
    }


def _line(row: dict) -> str:
    head = f"{row['model']:>14} {row['hardware']:>12} {row['job']:<32}"
    if "error" in row:
        return f"{head} {row['error']}"
    return (f"{head} static {row['static_tok_s']:8.1f}  continuous {row['continuous_tok_s']:8.1f}"
            f"  bound {row['bound_tok_s']:8.1f} tok/s  ({row['planned_in_s']:.1f} s)")  # fmt: skip


def batching_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Continuous batching against static, and MoE-Lens's stage-1 bound",
        "",
        "Made by `bench/batching_rows.py`, as `hrm plan --batching continuous` plans each job: "
        "the requests drawn uniformly (seeded) from the ranges, as `--prompt-len LO-HI "
        "--gen-len LO-HI --requests K` draws them. static = the job in the best static plan's "
        "batches of N, as `hrm run --batching static` runs it (sorted longest first, the last "
        "batch short, each request to its own max_tokens, each batch to its longest); one "
        "batch = that plan's own figure for one full batch; continuous = the job "
        "simulated pass by pass by the executor's admission rule under the continuous plan "
        "(N = its KV pool in sequences of the longest context, R = requests running at most, "
        "T = tokens a pass); bound = T_max of MoE-Lens's stage 1 in generated tokens/s, with "
        "what binds (memory: PME x M / delta; gpu: T_GPU). A continuous pass's attention "
        "first gathers each group's rows out of the pool of blocks (read and written once, "
        "each sequence to the group's longest context): where CPU attention binds, as in the "
        "long generations, that makes continuous slower than static.",
        "",
        "| model | hardware | weights | job | static tok/s (N, mu) | one batch | continuous "
        "tok/s (N, R, T, mu) | x static | bound tok/s (binds) | share of bound |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lead = f"| {r['model']} | {r['hardware']} | {r['weights']} | {r['job']} |"
        if "error" in r:
            lines.append(f"{lead} {r['error']} | | | | | |")
            continue
        sp, cp = r["static"]["policy"], r["continuous"]["policy"]
        c = r["continuous"]["continuous"]
        lines.append(
            f"{lead} {r['static_tok_s']:.1f} ({sp['batch_size']}, {sp['micro_batch_size']}) | "
            f"{r['static_batch_tok_s']:.1f} | "
            f"{r['continuous_tok_s']:.1f} ({cp['batch_size']}, {c['max_running']}, "
            f"{c['token_budget']}, {cp['micro_batch_size']}) | "
            f"{r['continuous_tok_s'] / r['static_tok_s']:.2f}x | {r['bound_tok_s']:.1f} "
            f"({r['bound']['binds']}) | {r['continuous_tok_s'] / r['bound_tok_s']:.0%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(batching_markdown(batching_rows()))
