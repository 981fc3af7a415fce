"""Every schedule at the planner's policy for a GPU memory budget: predicted against measured.

Mixtral 8x7B's geometry with random weights (--layers of them), planned per schedule for the
profile with each --gpu-mem budget (on CUDA the process is capped to it with
torch.cuda.set_per_process_memory_fraction), then run with the offloading executor. Per schedule:
predicted and measured throughput, queue busy fractions, achieved H2D GB/s, peak memory against
the plan. Prints a table and writes JSON (default reports/bench_schedules.json).
    python bench/bench_schedules.py --device cuda --gpu-mem 16GB,24GB --layers 8
    python bench/bench_schedules.py --device cpu --dry-run     (plans and checks only: CI)
On a CPU the CPU stands in for the GPU: the queues, pages and threads all run, but the
prediction is for the profile's GPU, so only the cuda table tests the model; unless --hardware
names a CPU-only profile of this host, whose CPU then stands in for a GPU of each budget in the
plans and the predictions too:
    python bench/bench_schedules.py --device cpu --hardware ci-cpu-avx512 --dtype int4 \
        --policy "N=16,mu=4,w=0" --gpu-mem 4GB
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hrm.arch import resolve_model  # noqa: E402
from hrm.errors import HrmError  # noqa: E402
from hrm.hardware import resolve_hardware  # noqa: E402
from hrm.plan import SCHEDULES  # noqa: E402
from hrm.units import parse_bytes  # noqa: E402
from hrm.workload import Workload  # noqa: E402


def with_budget(hardware, budget: float):
    """The machine with `budget` bytes of GPU memory; a CPU-only profile (this host's) with its
    CPU standing in for a GPU of that size, so that a CPU run is predicted by its own model."""
    if hardware.has_gpu:
        return hardware.with_resources(gpu_memory_bytes=budget)
    from hrm.hardware.stand_in import stand_in_profile

    return stand_in_profile(hardware, budget)


def plan_all(arch, hardware, workload, budgets, max_batch, dtype, policy_text=None):
    """The best plan per (budget, schedule), or with policy_text that policy's prediction (its
    attention on the GPU under gpu-attention, on the CPU otherwise)."""
    from hrm.policy import parse_policy_text
    from planner import predict
    from planner.search import NoPolicyFits, search

    plans = {}
    kv = hardware.compute_dtype(dtype)  # a compact weight format keeps KV in 16 bits
    for budget in budgets:
        hw = with_budget(hardware, budget)
        for schedule in SCHEDULES:
            if policy_text is not None:
                attn = "gpu" if schedule == "gpu-attention" else "cpu"
                text = f"{policy_text},attn={attn},ffn=gpu"
                policy = parse_policy_text(text, weight_dtype=dtype, kv_dtype=kv)
                plans[(budget, schedule)] = predict(arch, hw, workload, policy, schedule)
                continue
            try:
                plans[(budget, schedule)] = search(
                    arch,
                    hw,
                    workload,
                    schedule=schedule,
                    weight_dtype=dtype,
                    kv_dtype=kv,
                    top_k=1,
                    max_batch_size=max_batch,
                ).best
            except NoPolicyFits as exc:
                plans[(budget, schedule)] = str(exc)
    return plans


def measure_plan(plan, arch, checkpoint, prompts, gen_len, device, budget, hardware, dtype):
    """One timed run of `plan` (on CUDA capped at `budget` bytes): (its RunRecord, the row's
    measured fields: prediction, measurement, error, H2D GB/s, peak memory against the plan)."""
    import torch

    from executor.api import RunSpec
    from executor.run import execute
    from hrm.cli.records import run_record

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    spec = RunSpec(checkpoint=None, arch=arch, prompts=prompts, gen_len=gen_len,
                   dtype=dtype, device=str(device))  # fmt: skip
    t0 = time.perf_counter()
    result = execute(spec, plan.policy, plan.schedule, checkpoint=checkpoint,
                     staged=plan.stages_weights, quiet=True)  # fmt: skip
    record = run_record(spec, result, policy=plan.policy, schedule=plan.schedule,
                        profile=hardware, plan=plan)  # fmt: skip
    m = record.measured
    h2d_s = result.environment["busy_s"]["h2d"]
    return record, {
        "wall_s": time.perf_counter() - t0,
        "predicted": record.predicted,
        "measured": m.to_dict(),
        "error": record.prediction_error,
        "h2d_gb_per_s": m.link_bytes["h2d"] / h2d_s / 1e9 if h2d_s else 0.0,
        "planned_gpu_bytes": plan.memory.gpu_bytes,
        "bottleneck": plan.bottleneck,
        "engine": result.environment["engine"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hardware", default="h200-sxm")
    p.add_argument("--gpu-mem", default="16GB,24GB")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="weights: a float dtype, int8 or int4")
    p.add_argument("--dry-run", action="store_true", help="plan and check, load nothing")
    p.add_argument(
        "--policy",
        help="run this policy under every schedule instead of the planner's, e.g. \"N=16,mu=4,"
        'w=0" (attention on the GPU under gpu-attention only)',
    )
    p.add_argument("-o", "--output", default="reports/bench_schedules.json")
    args = p.parse_args()
    try:
        return run(args)
    except HrmError as exc:
        print(f"bench_schedules: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    import torch

    from executor.checkpoint import random_checkpoint
    from executor.run import check_plan
    from hrm.cli.memory_check import available_host_bytes

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), num_layers=args.layers)
    hardware = resolve_hardware(args.hardware)
    budgets = [parse_bytes(x, "--gpu-mem") for x in args.gpu_mem.split(",")]
    workload = Workload(
        prompt_len_mean=args.prompt_len, prompt_len_max=args.prompt_len, gen_len=args.gen_len
    )
    plans = plan_all(arch, hardware, workload, budgets, args.max_batch, args.dtype, args.policy)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    computed = hardware.compute_dtype(args.dtype)  # what a compact format's layers compute in
    checkpoint = None if args.dry_run else random_checkpoint(arch, computed)
    rows = []
    header = (
        f"{'GPU mem':>8} {'schedule':14} {'N':>4} {'mu':>4} {'r_w':>5} {'pred tok/s':>10} "
        f"{'meas tok/s':>10} {'err':>6} {'gpu':>5} {'cpu':>5} {'h2d':>5} {'H2D GB/s':>8}"
    )
    print(header)
    for (budget, schedule), plan in plans.items():
        row = {"gpu_mem_bytes": budget, "schedule": schedule}
        if isinstance(plan, str):
            rows.append({**row, "fits": False, "why": plan})
            print(f"{budget / 1e9:>7.0f}G {schedule:14} does not fit")
            continue
        pol = plan.policy
        n = pol.batch_size
        prompts = tuple(
            tuple(x)
            for x in torch.randint(0, arch.vocab_size, (n, args.prompt_len), generator=g).tolist()
        )
        check_plan(
            plan,
            arch,
            [len(x) for x in prompts],
            args.gen_len,
            where=f"{schedule} plan",
            gpu_bytes=budget,
            host_bytes=available_host_bytes(),
            stand_in=device.type == "cpu",
            device=str(device),
        )
        row.update(fits=True, plan=plan.to_dict())
        if args.dry_run:
            rows.append(row)
            predicted = plan.predicted.throughput_tok_s
            print(
                f"{budget / 1e9:>7.0f}G {schedule:14} {n:>4} {pol.micro_batch_size:>4} "
                f"{pol.weights_gpu_fraction:>5.2f} {predicted:>10.1f}"
            )
            continue
        record, measured = measure_plan(
            plan, arch, checkpoint, prompts, args.gen_len, device, budget,
            with_budget(hardware, budget), args.dtype,
        )  # fmt: skip
        row.update(measured)
        m = record.measured
        rate = row["h2d_gb_per_s"]
        rows.append(row)
        f = m.busy_fraction
        print(
            f"{budget / 1e9:>7.0f}G {schedule:14} {n:>4} {pol.micro_batch_size:>4} "
            f"{pol.weights_gpu_fraction:>5.2f} {record.predicted['throughput_tok_s']:>10.1f} "
            f"{m.throughput_tok_s:>10.1f} {100 * record.prediction_error:>+5.0f}% "
            f"{f['gpu']:>5.0%} {f['cpu']:>5.0%} {f['h2d']:>5.0%} {rate:>8.2f}"
        )
    _targets(rows)
    report = {"device": str(device), "hardware": hardware.name, "layers": args.layers,
              "dry_run": args.dry_run, "rows": rows}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.output}")
    return 0


def _targets(rows) -> None:
    """The issue's targets, where the rows have measurements: cgopipe >= 2x serial per budget."""
    measured = [r for r in rows if "measured" in r]
    for budget in sorted({r["gpu_mem_bytes"] for r in measured}):
        tput = {
            r["schedule"]: r["measured"]["throughput_tok_s"]
            for r in measured
            if r["gpu_mem_bytes"] == budget
        }
        if "cgopipe" in tput and tput.get("serial"):
            print(
                f"{budget / 1e9:.0f} GB: cgopipe / serial = {tput['cgopipe'] / tput['serial']:.2f}x"
            )


if __name__ == "__main__":
    raise SystemExit(main())
