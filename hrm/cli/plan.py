"""`hrm plan`: the best policy for a model, machine and workload, its predicted throughput, what
binds it, and the FlexGen-like and DeepSpeed-like baselines beside it; `--sweep` shows what a
resource is worth. The planner (and PuLP) are imported inside `run`."""

from __future__ import annotations

import argparse
import json

from hrm.errors import HrmError
from hrm.plan import SCHEDULES
from hrm.policy import DTYPE_BYTES
from hrm.units import format_bandwidth, format_bytes, format_percent, parse_bandwidth, parse_bytes

SWEEPS = ("cpu-mem", "gpu-mem", "pcie")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="find the best batch, micro-batch and placement and predict throughput",
        description="Search batch size N, micro-batch size mu and the placement of attention, "
        "FFN, weights and KV cache (a MILP per (N, mu)) for the highest predicted throughput of "
        "prefill plus decode, and show what binds it and the baselines beside it.",
    )
    p.add_argument("--model", required=True, help="bundled name, config.json or checkpoint dir")
    p.add_argument(
        "--hardware",
        required=True,
        help="bundled profile name or a profile .yaml; a comma-separated list compares machines",
    )
    p.add_argument(
        "--gpus", help="GPU counts to plan the machine with, e.g. 1,2,4 (tensor parallel)"
    )
    p.add_argument(
        "--price",
        help='USD per machine-hour, e.g. "t4=0.35,l4=0.70" (else the profile\'s price_per_hour)',
    )
    _add_job_arguments(p)
    p.add_argument("--cpu-mem", help="CPU memory to plan for, e.g. '128 GB' (default: profile)")
    p.add_argument("--gpu-mem", help="memory per GPU to plan for, e.g. '12 GB' (default: profile)")
    p.add_argument("--pcie", help="host-to-device bandwidth per GPU, e.g. '16 GB/s'")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        help="weights (default: the machine's faster of bfloat16 and float16)",
    )
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), help="KV cache (default: --dtype)")
    p.add_argument("--schedule", default="cgopipe", choices=SCHEDULES, help="(cgopipe)")
    p.add_argument(
        "--disk-tier",
        default="auto",
        choices=("auto", "on", "off"),
        help="weights on the profile's disk: auto where nothing fits the host without (default), "
        "on wherever a larger batch pays for the reads, off never",
    )
    p.add_argument("--top", type=int, default=5, help="how many plans to list (5)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        help="largest N to consider: for a small dataset, or for outputs sooner",
    )
    p.add_argument(
        "--policy",
        help='what-if: predict this policy beside the best, e.g. "N=504,mu=36,attn=cpu,ffn=gpu,'
        'w=0,kv=0" (w and kv fractions of the weights and KV cache on the GPU)',
    )
    p.add_argument("--layers", type=int, help="plan only the model's first L layers")
    _add_output_arguments(p)
    p.set_defaults(run=run)


def _add_output_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "-o",
        "--output",
        help="write the best plan (or --policy) here, for hrm run --plan",
    )
    p.add_argument("--sweep", choices=SWEEPS, help="best throughput as this resource changes")
    p.add_argument("--sweep-values", help="comma-separated sizes or bandwidths (default 1/4x-4x)")
    p.add_argument(
        "--plot",
        help="chart PNG: the sweep (default sweep-RESOURCE-MODEL-HARDWARE.png), or with several "
        "options throughput against cost per token",
    )


def _add_job_arguments(p) -> None:
    """What the plan is for: the job's requests, their lengths, and how they are batched."""
    dataset = p.add_mutually_exclusive_group()
    dataset.add_argument(
        "--dataset-tokens", type=float, help="tokens to generate in all: time and cost of the job"
    )
    dataset.add_argument(
        "--prompts",
        help="JSONL prompts file: plan for its prompts' lengths, at most as many as it has, and "
        "report the job's hours",
    )
    p.add_argument("--tokenizer", help="tokenizer (a checkpoint folder) for --prompts' text")
    p.add_argument(
        "--prompt-len",
        help="mean prompt length (tokens; --prompts counts them), or LO-HI: --requests prompts "
        "of lengths drawn uniformly from LO to HI",
    )
    p.add_argument(
        "--requests",
        type=int,
        help="the job's requests, of --prompt-len and --gen-len (drawn from a range LO-HI; "
        "default 1000 with a range)",
    )
    p.add_argument("--max-prompt-len", type=int, help="longest prompt (default: the mean)")
    p.add_argument("--padding", action="store_true", help="pad every prompt to the longest")
    p.add_argument(
        "--batching",
        choices=("static", "continuous"),
        default="static",
        help="continuous: also plan the job run by continuous batching (hrm run's default), "
        "simulated and priced pass by pass, beside the best static plan; -o writes it",
    )
    p.add_argument(
        "--gen-len",
        help="tokens generated per sequence, or LO-HI: drawn uniformly per request; with "
        "--prompts, the default and cap of each request's max_tokens (default: the largest "
        "max_tokens)",
    )


def run(args: argparse.Namespace) -> int:
    from hrm.cli.plan_compare import gpu_counts
    from hrm.cli.plan_job import hardware_of, max_batch, model, what_if, workload_and_job

    names = _check_flags(args)
    counts = gpu_counts(args.gpus)
    comparing = len(names) > 1 or len(counts or ()) > 1 or args.price is not None
    if comparing and (args.output or args.sweep):
        raise HrmError(
            "-o and --sweep take one machine; leave them out when comparing options "
            "(several --gpus counts, --price or several --hardware)"
        )
    if args.plot and not (args.sweep or comparing):
        raise HrmError("--plot draws a sweep (--sweep) or a comparison (--price with --hardware)")
    arch = model(args)
    workload, job = workload_and_job(args, arch)
    cap = max_batch(args, job)
    if comparing:
        from hrm.cli.plan_compare import run_comparison

        return run_comparison(args, arch, names, workload, job, cap)
    hardware = hardware_of(args)
    if counts:
        hardware = hardware.with_gpu_count(counts[0])
    dtype = args.dtype or hardware.half_dtype
    # a compact weight format keeps the KV cache in the dtype the layers compute in
    kv = args.kv_dtype or hardware.compute_dtype(dtype)
    options = {"schedule": args.schedule, "weight_dtype": dtype, "kv_dtype": kv}
    unrunnable = what_if(arch, hardware, dtype, kv)
    if unrunnable and args.output:
        raise HrmError(
            f"-o: {unrunnable}, so this plan is a what-if that hrm run cannot run; leave out -o "
            "to see it, or plan in a dtype the executor runs"
        )
    if args.sweep:
        return _run_sweep(args, arch, hardware, workload, options)
    from planner.baselines import baselines
    from planner.search import search
    from planner.setting import Setting

    named, requested_weights = _named(args, arch, hardware, workload, options)
    result = search(arch, hardware, workload, top_k=args.top, max_batch_size=cap,
                    disk_tier=args.disk_tier, **options)  # fmt: skip
    base = baselines(Setting(arch=arch, hardware=hardware, workload=workload, **options), cap)
    static = named if named is not None and args.output else result.best
    bound, planned = _beside(args, arch, static, result, hardware, workload, job)
    written = planned["plan"] if planned else static
    if args.output:
        written.save(args.output)
    rate = (written.continuous or written).predicted.throughput_tok_s
    price = hardware.price_per_hour
    if args.json:
        data = plan_json(result, base, args.output)
        if named is not None:
            data["named_policy"] = {
                **named.to_dict(),
                "shortfall": shortfall(named),
                "requested_weights_gpu_fraction": requested_weights,
            }
        data["job"] = job.to_dict(rate, price) if job is not None else None
        data["what_if"] = unrunnable
        data["stage1_bound"] = bound.to_dict() | {"plan_share": rate / bound.generated_per_s}
        data["continuous"] = _continuous_json(planned, bound)
        print(json.dumps(data, indent=2))
        return 0
    print(format_plan(result, base))
    print(bound.describe(rate))
    if planned:
        from hrm.cli.plan_continuous import describe

        print(describe(planned, bound.generated_per_s))
    if unrunnable:
        print(f"what-if: {unrunnable}; hrm run cannot run this plan")
    if named is not None:
        print(format_named(named, result.best, requested_weights))
    if job is not None:
        print(job.describe(rate, price))
    if args.output:
        print(f"wrote {args.output}" + (" (the named policy)" if named is not None else ""))
    return 0


def _beside(args, arch, static, result, hardware, workload, job):
    """MoE-Lens's stage-1 bound at the static plan's dtypes, and with --batching continuous the
    continuous plan over the static ones (only `static` when it is the named policy), with the
    same job in static batches (hrm/cli/plan_continuous.py); else None."""
    from planner.bound import stage1_bound

    pol = static.policy
    bound = stage1_bound(arch, hardware, workload, pol.weight_dtype, pol.kv_dtype)
    if args.batching != "continuous":
        return bound, None
    from hrm.cli.plan_continuous import continuous_plan

    candidates = [static] if static is not result.best else list(result.top)
    return bound, continuous_plan(arch, hardware, workload, job, candidates)


def _continuous_json(planned, bound) -> dict | None:
    if not planned:
        return None
    from hrm.cli.plan_continuous import to_json

    return to_json(planned, bound.generated_per_s)


def _check_flags(args) -> list[str]:
    """Flags checked before any work; returns the --hardware names."""
    from hrm.io import check_writable

    if args.top < 1:
        raise HrmError(f"--top must be at least 1, got {args.top}")
    names = [name.strip() for name in args.hardware.split(",")]
    if not any(names):
        raise HrmError("--hardware: give at least one machine (a bundled name or a .yaml)")
    if not all(names):
        raise HrmError(f"--hardware {args.hardware!r}: an empty name in the list; remove it")
    if args.output:
        check_writable(args.output)
    if args.sweep and args.output:
        raise HrmError("-o writes one plan; leave it out with --sweep (use --plot for the chart)")
    return names


def _named(args, arch, hardware, workload, options):
    """--policy's prediction and the weights fraction it asked for ((None, None) without it).
    With -o it is the plan written, so it must fit."""
    if args.policy is None:
        return None, None
    from hrm.policy import parse_policy_text
    from planner import predict

    policy = parse_policy_text(
        args.policy, weight_dtype=options["weight_dtype"], kv_dtype=options["kv_dtype"]
    )
    named = predict(arch, hardware, workload, policy, args.schedule)
    short = shortfall(named)
    if short and args.output:
        raise HrmError(
            f"--policy does not fit on {hardware.name}: {_shortfall_text(short)}; lower N, mu, "
            "w or kv, or leave out -o to see it beside the best"
        )
    return named, policy.weights_gpu_fraction


def shortfall(plan) -> dict[str, float]:
    """Bytes by which each memory the plan overflows is short (empty when it fits)."""
    mem = plan.memory
    short = {
        "gpu": mem.gpu_bytes - mem.gpu_capacity_bytes if mem.gpu_bytes else 0.0,
        "cpu": mem.cpu_bytes - mem.cpu_capacity_bytes,
    }
    return {device: b for device, b in short.items() if b > 0}


def _shortfall_text(short: dict[str, float]) -> str:
    return ", ".join(f"{d.upper()} memory {format_bytes(b, 3)} short" for d, b in short.items())


def format_named(plan, best, requested_weights: float | None = None) -> str:
    """The named policy with the same breakdown as the best, marked when it does not fit, and
    saying when its weights fraction was rounded to whole tensors (hrm.rules.placement)."""
    ratio = plan.predicted.throughput_tok_s / best.predicted.throughput_tok_s
    short = shortfall(plan)
    fits = "fits" if not short else f"DOES NOT FIT: {_shortfall_text(short)}"
    lines = ["", f"named policy ({fits}): {ratio:.2f}x the best's throughput", *_breakdown(plan)]
    placed = plan.policy.weights_gpu_fraction
    if requested_weights is not None and abs(placed - requested_weights) > 1e-9:
        lines.append(
            f"  note        w={requested_weights:g} is placed as {placed:.4f}: the GPU holds whole "
            "tensors (a layer's dense weights, then whole experts)"
        )
    return "\n".join(lines)


def _breakdown(plan) -> list[str]:
    """Policy, prediction, busy queues, memory per device and what binds, one line each."""
    pred, mem = plan.predicted, plan.memory
    lines = [
        f"  policy      {_placement(plan.policy)}",
        f"  predicted   {pred.throughput_tok_s:.1f} tok/s: prefill {pred.prefill_s:.1f} s + decode "
        f"{pred.decode_s:.1f} s for {pred.generated_tokens} tokens",
        "  busy        "
        + "  ".join(f"{r.upper()} {format_percent(f)}" for r, f in plan.busy_fraction.items()),
    ]
    if mem.gpu_capacity_bytes > 0:
        lines.append(_memory_line("GPU", mem.gpu_bytes, mem.gpu_capacity_bytes, mem.gpu))
    lines.append(_memory_line("CPU", mem.cpu_bytes, mem.cpu_capacity_bytes, mem.cpu))
    if mem.disk_bytes:  # every pass (a step through all layers) reads them once
        per_token = mem.disk_bytes / plan.policy.batch_size
        busy = plan.busy_s.get("disk", 0.0) / pred.total_s if pred.total_s else 0.0
        lines.append(
            f"  disk        {format_bytes(mem.disk_bytes, 3)} of weights read each pass, "
            f"{format_bytes(per_token, 3)} per generated token; busy {format_percent(busy)}"
        )
    full = "none full" if plan.binding_memory == "none" else f"{plan.binding_memory} full"
    lines.append(f"  binds       {plan.bottleneck}; memory: {full}")
    return lines


def plan_json(result, base, output: str | None) -> dict:
    best = result.best
    return {
        **best.to_dict(),
        "busy_fraction": best.busy_fraction,
        # the machine once, at the top level: every plan in the list was made on it
        "top": [{k: v for k, v in p.to_dict().items() if k != "machine"} for p in result.top],
        "baselines": [b.to_dict() for b in base],
        "search": {"status": result.status, **vars(result.stats)},
        "output": output,
    }


def _placement(policy) -> str:
    return (
        f"N={policy.batch_size} mu={policy.micro_batch_size} "
        f"attention {'GPU' if policy.attention_on_gpu else 'CPU'} "
        f"FFN {'GPU' if policy.ffn_on_gpu else 'CPU'} "
        f"weights-on-GPU {format_percent(policy.weights_gpu_fraction)} "
        f"KV-on-GPU {format_percent(policy.kv_gpu_fraction)}"
        + (
            f" weights-on-disk {format_percent(policy.weights_disk_fraction)}"
            if policy.weights_disk_fraction
            else ""
        )  # fmt: skip
    )


def _buffers(parts: dict[str, float]) -> str:
    """The parts of 1 MB or more; where none is (a tiny model), every part that holds bytes."""
    big = [(name, b) for name, b in parts.items() if b >= 1e6]
    shown = big or [(name, b) for name, b in parts.items() if b > 0]
    return ", ".join(f"{name} {format_bytes(b, 3)}" for name, b in shown) or "nothing"


def _memory_line(device: str, used: float, usable: float, parts: dict[str, float]) -> str:
    return (
        f"  {device} memory  {format_bytes(used, 3)} of {format_bytes(usable, 3)} usable: "
        f"{_buffers(parts)}"
    )


def format_plan(result, base) -> str:
    best = result.best
    wl, pol, pred = best.workload, best.policy, best.predicted
    padded = ", padded" if wl.padding else ""
    lines = [
        f"{best.model} on {best.hardware}: prompts {round(wl.prompt_len_mean, 1):g} "
        f"(max {wl.prompt_len_max}{padded}), {wl.gen_len} new tokens, {best.schedule}, "
        f"{pol.weight_dtype} weights, {pol.kv_dtype} KV",
        *_breakdown(best),
        "",
    ]
    lines.append(
        f"  {'':<16}{'N':>6} {'mu':>5} {'attn':>5} {'ffn':>4} {'w-GPU':>6} {'KV-GPU':>7} "
        f"{'tok/s':>9} {'vs best':>8}"
    )
    rows = [(f"#{i + 1}", p) for i, p in enumerate(result.top)]
    rows += [(b.name, b.plan) for b in base]
    for name, p in rows:
        if p is None:
            lines.append(f"  {name:<16}{'does not fit':>40}")
            continue
        q = p.policy
        ratio = p.predicted.throughput_tok_s / pred.throughput_tok_s
        lines.append(
            f"  {name:<16}{q.batch_size:>6} {q.micro_batch_size:>5} "
            f"{'GPU' if q.attention_on_gpu else 'CPU':>5} {'GPU' if q.ffn_on_gpu else 'CPU':>4} "
            f"{format_percent(q.weights_gpu_fraction):>6} {format_percent(q.kv_gpu_fraction):>7} "
            f"{p.predicted.throughput_tok_s:>9.1f} {ratio:>7.2f}x"
        )
    return "\n".join(lines)


def _run_sweep(args, arch, hardware, workload, options) -> int:
    from hrm.io import check_image_path
    from planner.sweep import plot_sweep, sweep

    parse = parse_bandwidth if args.sweep == "pcie" else parse_bytes
    values = None
    if args.sweep_values:
        values = [
            parse(v.strip(), "--sweep-values") for v in args.sweep_values.split(",") if v.strip()
        ]
        if not values:
            raise HrmError("--sweep-values: give at least one value")
    plot_path = args.plot or f"sweep-{args.sweep}-{arch.name}-{hardware.name}.png"
    check_image_path(plot_path, "--plot")
    result = sweep(arch, hardware, workload, resource=args.sweep, values=values, top_k=1, **options)
    if not any(p.plan for p in result.points):
        raise HrmError(
            f"--sweep {args.sweep}: no value fits; at the largest, {result.points[-1].reason}"
        )
    title = (
        f"{arch.name} on {hardware.name}: prompts {round(workload.prompt_len_mean, 1):g}, "
        f"gen {workload.gen_len}"
    )
    plot_sweep(result, plot_path, title)
    if args.json:
        print(json.dumps({**result.to_dict(), "plot": plot_path}, indent=2))
        return 0
    unit = format_bandwidth if args.sweep == "pcie" else format_bytes
    lines = [f"{title}: best throughput against {args.sweep} (profile: {unit(result.current, 3)})"]
    for p in result.points:
        if p.plan is None:
            lines.append(f"  {unit(p.value, 3):>12}  does not fit: {p.reason}")
            continue
        q = p.plan.policy
        lines.append(
            f"  {unit(p.value, 3):>12}  {p.plan.predicted.throughput_tok_s:9.1f} tok/s  "
            f"N={q.batch_size} mu={q.micro_batch_size}  binds: {p.plan.bottleneck}"
        )
    lines.append(f"wrote {plot_path}")
    print("\n".join(lines))
    return 0
