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
`--tp N` plans each schedule for N GPUs and runs it as `hrm run` does, N ranks each with its
share of every layer (executor/tensor_parallel.py), and adds the measured seconds per
all-reduce (each rank's, from the record) against the planner's price for the same calls:
    python bench/bench_schedules.py --device cpu --hardware ci-cpu-avx512 --tp 2 \
        --policy "N=16,mu=4,w=0" --gpu-mem 4GB --schedules cgopipe,serial
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


def with_budget(hardware, budget: float, tp: int = 1):
    """The machine with `budget` bytes of GPU memory (tp GPUs of it); a CPU-only profile (this
    host's) with its CPU standing in for a GPU of that size, so that a CPU run is predicted by
    its own model."""
    if hardware.has_gpu:
        sized = hardware.with_resources(gpu_memory_bytes=budget)
    else:
        from hrm.hardware.stand_in import stand_in_profile

        sized = stand_in_profile(hardware, budget)
    return sized.with_gpu_count(tp) if tp > 1 else sized


def plan_all(arch, hardware, workload, budgets, max_batch, dtype, policy_text=None, tp=1,
             schedules=SCHEDULES):  # fmt: skip
    """The best plan per (budget, schedule), or with policy_text that policy's prediction (its
    attention on the GPU under gpu-attention, on the CPU otherwise); for tp GPUs."""
    from hrm.policy import parse_policy_text
    from planner import predict
    from planner.search import NoPolicyFits, search

    plans = {}
    kv = hardware.compute_dtype(dtype)  # a compact weight format keeps KV in 16 bits
    for budget in budgets:
        hw = with_budget(hardware, budget, tp)
        for schedule in schedules:
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
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="weights: a float dtype, int8 or int4; several, comma-separated, run in turn",
    )
    p.add_argument("--dry-run", action="store_true", help="plan and check, load nothing")
    p.add_argument(
        "--policy",
        help="run this policy under every schedule instead of the planner's, e.g. \"N=16,mu=4,"
        'w=0" (attention on the GPU under gpu-attention only)',
    )
    p.add_argument("--tp", type=int, default=1, help="GPUs in tensor parallel (ranks)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated")
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

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), num_layers=args.layers)
    hardware = resolve_hardware(args.hardware)
    budgets = [parse_bytes(x, "--gpu-mem") for x in args.gpu_mem.split(",")]
    workload = Workload(
        prompt_len_mean=args.prompt_len, prompt_len_max=args.prompt_len, gen_len=args.gen_len
    )
    device = torch.device(args.device)
    checkpoints = {}  # by the dtype the layers compute in: one for bfloat16 and its formats
    rows = []
    print(
        f"{'GPU mem':>8} {'dtype':9} {'schedule':14} {'N':>4} {'mu':>4} {'r_w':>5} "
        f"{'pred tok/s':>10} {'meas tok/s':>10} {'err':>6} {'gpu':>5} {'cpu':>5} {'h2d':>5} "
        f"{'H2D GB/s':>8}"
    )
    for dtype in args.dtype.split(","):
        plans = plan_all(arch, hardware, workload, budgets, args.max_batch, dtype, args.policy,
                         args.tp, args.schedules.split(","))  # fmt: skip
        computed = hardware.compute_dtype(dtype)  # what a compact format's layers compute in
        if not args.dry_run and computed not in checkpoints:
            checkpoints[computed] = random_checkpoint(arch, computed)
        g = torch.Generator().manual_seed(0)  # the same prompts for every dtype
        for (budget, schedule), plan in plans.items():
            row = {"gpu_mem_bytes": budget, "schedule": schedule, "dtype": dtype}
            rows.append(row)
            print(f"{budget / 1e9:>7.0f}G {dtype:9} {schedule:14}", end=" ")
            if isinstance(plan, str):
                row.update(fits=False, why=plan)
                print("does not fit")
                continue
            n = plan.policy.batch_size
            ids = torch.randint(0, arch.vocab_size, (n, args.prompt_len), generator=g).tolist()
            prompts = tuple(tuple(x) for x in ids)
            print(_run_one(args, row, plan, arch, checkpoints.get(computed), prompts, device,
                           with_budget(hardware, budget, args.tp)))  # fmt: skip
    _targets(rows)
    report = {"device": str(device), "hardware": hardware.name, "layers": args.layers,
              "dry_run": args.dry_run, "rows": rows}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.output}")
    return 0


def _run_one(args, row, plan, arch, checkpoint, prompts, device, hardware) -> str:
    """Check `plan` against its run, run it unless --dry-run, fill `row`; the table's cells."""
    from executor.run import check_plan
    from hrm.cli.memory_check import available_host_bytes

    pol = plan.policy
    budget = row["gpu_mem_bytes"]
    check_plan(plan, arch, [len(x) for x in prompts], args.gen_len,
               where=f"{row['schedule']} plan", gpu_bytes=budget,
               host_bytes=available_host_bytes(), stand_in=device.type == "cpu",
               device=str(device))  # fmt: skip
    row.update(fits=True, plan=plan.to_dict())
    cells = f"{pol.batch_size:>4} {pol.micro_batch_size:>4} {pol.weights_gpu_fraction:>5.2f}"
    if args.dry_run:
        return f"{cells} {plan.predicted.throughput_tok_s:>10.1f}"
    if args.tp > 1:
        return f"{cells} {measure_tensor_parallel(args, row, plan, prompts, hardware)}"
    record, measured = measure_plan(plan, arch, checkpoint, prompts, args.gen_len, device, budget,
                                    hardware, row["dtype"])  # fmt: skip
    row.update(measured)
    m, f = record.measured, record.measured.busy_fraction
    return (
        f"{cells} {record.predicted['throughput_tok_s']:>10.1f} {m.throughput_tok_s:>10.1f} "
        f"{100 * record.prediction_error:>+5.0f}% {f['gpu']:>5.0%} {f['cpu']:>5.0%} "
        f"{f['h2d']:>5.0%} {row['h2d_gb_per_s']:>8.2f}"
    )


def measure_tensor_parallel(args, row, plan, prompts, hardware) -> str:
    """`plan` run as `hrm run --plan` runs it (its tp ranks started by torch's launcher) on
    random weights; fills `row` with the record and the seconds per all-reduce, measured (the
    ranks' mean) and as the planner prices the same calls (two a layer, a micro-batch and a
    step, of its tokens x hidden in 16 bits). The table's cells."""
    import subprocess
    import tempfile

    from hrm.policy import dtype_bytes
    from hrm.roofline.ops import ACTIVATION_DTYPE
    from planner.transfers import all_reduce_seconds

    with tempfile.TemporaryDirectory() as tmp:
        plan_path = plan.save(Path(tmp) / "plan.json")
        prompts_path = Path(tmp) / "prompts.jsonl"
        prompts_path.write_text("".join(json.dumps({"prompt_token_ids": list(p)}) + "\n"
                                        for p in prompts))  # fmt: skip
        cmd = [sys.executable, "-m", "hrm", "run", "--model", "mixtral-8x7b", "--random-weights",
               "--layers", str(args.layers), "--plan", str(plan_path), "--prompts",
               str(prompts_path), "--gen-len", str(args.gen_len), "--quiet", "--json",
               "--output", str(Path(tmp) / "answers.jsonl")]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    record = json.loads(done.stdout)
    ranks = record["environment"]["ranks"]
    measured = sum(r["all_reduce_s"] for r in ranks) / sum(r["all_reduces"] for r in ranks)
    h, mu, n = plan.geometry["hidden_size"], plan.policy.micro_batch_size, plan.policy.batch_size
    token = h * dtype_bytes(ACTIVATION_DTYPE)
    sizes = [min(mu, n - i) for i in range(0, n, mu)]  # the batch's micro-batches
    calls = [(m * args.prompt_len * token, 1) for m in sizes] + [
        (m * token, args.gen_len - 1) for m in sizes
    ]
    priced = sum(float(all_reduce_seconds(hardware, b)) * k for b, k in calls)
    priced /= sum(k for _, k in calls)
    row.update(record=record, all_reduce_s={"measured": measured, "predicted": priced})
    m = record["measured"]
    return (
        f"{record['predicted']['throughput_tok_s']:>10.1f} {m['throughput_tok_s']:>10.1f}   "
        f"all-reduce {1e3 * measured:.3f} ms measured, {1e3 * priced:.4f} ms priced"
    )


def _targets(rows) -> None:
    """The issue's targets, where the rows have measurements: cgopipe >= 2x serial per budget
    (and dtype); with several dtypes, each schedule's measured and predicted throughput against
    the first dtype's, from this run."""
    at = {(r["gpu_mem_bytes"], r["dtype"], r["schedule"]): r for r in rows if "measured" in r}
    if not at:
        return
    first = next(iter(at))[1]

    def tput(r, key="measured") -> float:
        return r[key]["throughput_tok_s"]

    for budget, dtype, schedule in at:
        r = at[(budget, dtype, schedule)]
        serial = at.get((budget, dtype, "serial"))
        if schedule == "cgopipe" and serial is not None:
            ratio = tput(r) / tput(serial)
            print(f"{budget / 1e9:.0f} GB {dtype}: cgopipe / serial = {ratio:.2f}x")
        base = at.get((budget, first, schedule))
        if dtype != first and base is not None:
            measured = tput(r) / tput(base)
            predicted = tput(r, "predicted") / tput(base, "predicted")
            print(
                f"{budget / 1e9:.0f} GB {schedule}: {dtype} / {first} measured {measured:.2f}x, "
                f"predicted {predicted:.2f}x"
            )


if __name__ == "__main__":
    raise SystemExit(main())
