"""`hrm plan`: the best policy for a model, machine and workload, its predicted throughput, what
binds it, and the FlexGen-like and DeepSpeed-like baselines beside it; `--sweep` shows what a
resource is worth. The planner (and PuLP) are imported inside `run`."""

from __future__ import annotations

import argparse
import json
import math

from hrm.errors import HrmError
from hrm.plan import SCHEDULES
from hrm.policy import DTYPE_BYTES
from hrm.units import format_bandwidth, format_bytes, parse_bandwidth, parse_bytes

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
    dataset = p.add_mutually_exclusive_group()
    dataset.add_argument(
        "--dataset-tokens", type=float, help="tokens to generate in all: time and cost of the job"
    )
    dataset.add_argument(
        "--prompts", help="JSONL prompts file: time and cost of its prompts x --gen-len tokens"
    )
    p.add_argument("--prompt-len", type=float, required=True, help="mean prompt length (tokens)")
    p.add_argument("--max-prompt-len", type=int, help="longest prompt (default: the mean)")
    p.add_argument("--padding", action="store_true", help="pad every prompt to the longest")
    p.add_argument("--gen-len", type=int, required=True, help="tokens generated per sequence")
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", help="write the best plan here (for hrm run --plan)")
    p.add_argument("--sweep", choices=SWEEPS, help="best throughput as this resource changes")
    p.add_argument("--sweep-values", help="comma-separated sizes or bandwidths (default 1/4x-4x)")
    p.add_argument(
        "--plot",
        help="chart PNG: the sweep (default sweep-RESOURCE-MODEL-HARDWARE.png), or with several "
        "options throughput against cost per token",
    )
    p.set_defaults(run=run)


def _workload(args):
    from hrm.workload import Workload

    if not math.isfinite(args.prompt_len) or args.prompt_len <= 0:
        raise HrmError(f"--prompt-len must be positive, got {args.prompt_len:g}")
    longest = args.max_prompt_len if args.max_prompt_len is not None else math.ceil(args.prompt_len)
    if longest <= 0:
        raise HrmError(f"--max-prompt-len must be positive, got {longest}")
    if args.gen_len <= 0:
        raise HrmError(f"--gen-len must be positive, got {args.gen_len}")
    return Workload(
        prompt_len_mean=args.prompt_len,
        prompt_len_max=longest,
        gen_len=args.gen_len,
        padding=args.padding,
    )


def _hardware(args, name: str | None = None):
    """The named machine (default --hardware) with --cpu-mem, --gpu-mem and --pcie applied."""
    from hrm.hardware import resolve_hardware

    hardware = resolve_hardware(name or args.hardware)
    return hardware.with_resources(
        cpu_memory_bytes=parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None,
        gpu_memory_bytes=parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
        link_bytes_per_s=parse_bandwidth(args.pcie, "--pcie") if args.pcie else None,
    )


def run(args: argparse.Namespace) -> int:
    from hrm.arch import resolve_model
    from hrm.io import check_writable

    workload = _workload(args)
    if args.top < 1:
        raise HrmError(f"--top must be at least 1, got {args.top}")
    names = [name.strip() for name in args.hardware.split(",")]
    if not any(names):
        raise HrmError("--hardware: give at least one machine (a bundled name or a .yaml)")
    if not all(names):
        raise HrmError(f"--hardware {args.hardware!r}: an empty name in the list; remove it")
    comparing = len(names) > 1 or any(
        x is not None for x in (args.gpus, args.price, args.dataset_tokens, args.prompts)
    )
    if args.output:
        check_writable(args.output)
    if comparing and (args.output or args.sweep):
        raise HrmError(
            "-o and --sweep take one machine; leave them out when comparing options "
            "(--gpus, --price, --dataset-tokens, --prompts or several --hardware)"
        )
    if args.plot and not (args.sweep or comparing):
        raise HrmError("--plot draws a sweep (--sweep) or a comparison (--price with --hardware)")
    if args.sweep and args.output:
        raise HrmError("-o writes one plan; leave it out with --sweep (use --plot for the chart)")
    arch = resolve_model(args.model)
    if comparing:
        return _run_comparison(args, arch, names, workload)
    hardware = _hardware(args)
    dtype = args.dtype or hardware.half_dtype
    options = {"schedule": args.schedule, "weight_dtype": dtype, "kv_dtype": args.kv_dtype or dtype}
    if args.sweep:
        return _run_sweep(args, arch, hardware, workload, options)
    from planner import predict
    from planner.baselines import baselines
    from planner.cost import Setting
    from planner.search import search

    named = None
    if args.policy is not None:
        from hrm.policy import parse_policy_text

        policy = parse_policy_text(
            args.policy, weight_dtype=options["weight_dtype"], kv_dtype=options["kv_dtype"]
        )
        named = predict(arch, hardware, workload, policy, args.schedule)
    result = search(
        arch, hardware, workload, top_k=args.top, max_batch_size=args.max_batch_size, **options
    )
    setting = Setting(arch=arch, hardware=hardware, workload=workload, **options)
    base = baselines(setting)
    if args.output:
        result.best.save(args.output)
    if args.json:
        data = plan_json(result, base, args.output)
        if named is not None:
            data["named_policy"] = {**named.to_dict(), "shortfall": shortfall(named)}
        print(json.dumps(data, indent=2))
    else:
        print(format_plan(result, base))
        if named is not None:
            print(format_named(named, result.best))
        if args.output:
            print(f"wrote {args.output}")
    return 0


def shortfall(plan) -> dict[str, float]:
    """Bytes by which each memory the plan overflows is short (empty when it fits)."""
    mem = plan.memory
    short = {
        "gpu": mem.gpu_bytes - mem.gpu_capacity_bytes if mem.gpu_bytes else 0.0,
        "cpu": mem.cpu_bytes - mem.cpu_capacity_bytes,
    }
    return {device: b for device, b in short.items() if b > 0}


def format_named(plan, best) -> str:
    """The named policy with the same breakdown as the best, marked when it does not fit."""
    ratio = plan.predicted.throughput_tok_s / best.predicted.throughput_tok_s
    short = shortfall(plan)
    fits = (
        "fits"
        if not short
        else "DOES NOT FIT: "
        + ", ".join(f"{d.upper()} memory {format_bytes(b, 3)} short" for d, b in short.items())
    )
    return "\n".join(
        ["", f"named policy ({fits}): {ratio:.2f}x the best's throughput", *_breakdown(plan)]
    )


def _breakdown(plan) -> list[str]:
    """Policy, prediction, busy queues, memory per device and what binds, one line each."""
    pred, mem = plan.predicted, plan.memory
    lines = [
        f"  policy      {_placement(plan.policy)}",
        f"  predicted   {pred.throughput_tok_s:.1f} tok/s: prefill {pred.prefill_s:.1f} s + decode "
        f"{pred.decode_s:.1f} s for {pred.generated_tokens} tokens",
        "  busy        "
        + "  ".join(f"{r.upper()} {_percent(f)}" for r, f in plan.busy_fraction.items()),
    ]
    if mem.gpu_capacity_bytes > 0:
        lines.append(_memory_line("GPU", mem.gpu_bytes, mem.gpu_capacity_bytes, mem.gpu))
    lines.append(_memory_line("CPU", mem.cpu_bytes, mem.cpu_capacity_bytes, mem.cpu))
    lines.append(f"  binds       {plan.bottleneck}; memory: {plan.binding_memory}")
    return lines


def plan_json(result, base, output: str | None) -> dict:
    best = result.best
    return {
        **best.to_dict(),
        "busy_fraction": best.busy_fraction,
        "top": [p.to_dict() for p in result.top],
        "baselines": [b.to_dict() for b in base],
        "search": {"status": result.status, **vars(result.stats)},
        "output": output,
    }


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def _placement(policy) -> str:
    return (
        f"N={policy.batch_size} mu={policy.micro_batch_size} "
        f"attention {'GPU' if policy.attention_on_gpu else 'CPU'} "
        f"FFN {'GPU' if policy.ffn_on_gpu else 'CPU'} "
        f"weights-on-GPU {_percent(policy.weights_gpu_fraction)} "
        f"KV-on-GPU {_percent(policy.kv_gpu_fraction)}"
    )


def _buffers(parts: dict[str, float]) -> str:
    shown = [f"{name} {format_bytes(b, 3)}" for name, b in parts.items() if b >= 1e6]
    return ", ".join(shown)


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
        f"{best.model} on {best.hardware}: prompts {wl.prompt_len_mean:g} (max {wl.prompt_len_max}"
        f"{padded}), {wl.gen_len} new tokens, {best.schedule}, {pol.weight_dtype} weights, "
        f"{pol.kv_dtype} KV",
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
            f"{_percent(q.weights_gpu_fraction):>6} {_percent(q.kv_gpu_fraction):>7} "
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
    title = (
        f"{arch.name} on {hardware.name}: prompts {workload.prompt_len_mean:g}, "
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
            lines.append(f"  {unit(p.value, 3):>12}  does not fit")
            continue
        q = p.plan.policy
        lines.append(
            f"  {unit(p.value, 3):>12}  {p.plan.predicted.throughput_tok_s:9.1f} tok/s  "
            f"N={q.batch_size} mu={q.micro_batch_size}  binds: {p.plan.bottleneck}"
        )
    lines.append(f"wrote {plot_path}")
    print("\n".join(lines))
    return 0


def _gpu_counts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    counts = []
    for part in (p.strip() for p in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise HrmError(f"--gpus: expected positive GPU counts like 1,2,4, got {text!r}")
        counts.append(int(part))
    return sorted(set(counts))


def _dataset_tokens(args) -> float | None:
    """--dataset-tokens, or the prompts of --prompts times --gen-len."""
    if args.dataset_tokens is not None:
        if not math.isfinite(args.dataset_tokens) or args.dataset_tokens <= 0:
            raise HrmError(f"--dataset-tokens must be positive, got {args.dataset_tokens:g}")
        return args.dataset_tokens
    if args.prompts is None:
        return None
    from pathlib import Path

    from hrm.io import read_prompts_file

    prompts, _ = read_prompts_file(Path(args.prompts))
    count = len(prompts)
    return float(count * args.gen_len)


def _run_comparison(args, arch, names: list[str], workload) -> int:
    """Several machines and/or GPU counts side by side, ordered by cost (else speed)."""
    from hrm.io import check_image_path
    from planner.compare import parse_prices, plan_options, plot_options

    counts = _gpu_counts(args.gpus)
    prices = parse_prices(args.price, names) if args.price else None
    tokens = _dataset_tokens(args)
    if args.plot:
        check_image_path(args.plot, "--plot")
    machines = {name: _hardware(args, name) for name in names}
    options = plan_options(
        arch,
        machines,
        workload,
        gpu_counts=counts,
        prices=prices,
        schedule=args.schedule,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
    )
    priced = any(o.cost_per_million_tokens is not None for o in options)

    def order(o):
        if not o.plan:
            return (2, 0.0)
        cost = o.cost_per_million_tokens
        return (0, cost) if priced and cost is not None else (1, -o.throughput_tok_s)

    options.sort(key=order)
    fitting = [o for o in options if o.plan]
    fastest = max(fitting, key=lambda o: o.throughput_tok_s).label if fitting else None
    costed = [o for o in fitting if o.cost_per_million_tokens is not None]
    cheapest = min(costed, key=lambda o: o.cost_per_million_tokens).label if costed else None
    title = (
        f"{arch.name}: prompts {workload.prompt_len_mean:g} (max {workload.prompt_len_max}), "
        f"{workload.gen_len} new tokens, {args.schedule}"
    )
    if args.plot:
        plot_options(options, args.plot, title)
    if args.json:
        print(
            json.dumps(
                {
                    "model": arch.name,
                    "workload": workload.to_dict(),
                    "options": [o.to_dict(tokens) for o in options],
                    "fastest": fastest,
                    "cheapest": cheapest,
                    "plot": args.plot,
                },
                indent=2,
            )
        )
        return 0
    print(format_comparison(options, title, tokens, fastest=fastest, cheapest=cheapest))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def format_comparison(options, title: str, tokens, *, fastest, cheapest) -> str:
    one_gpu = {o.machine: o.throughput_tok_s for o in options if o.gpus == 1 and o.plan}
    width = max(22, *(len(o.label) + 2 for o in options))
    header = (
        f"  {'option':<{width}}{'N':>6} {'mu':>5} {'tok/s':>9} {'scaling':>8} {'all-red':>8} "
        f"{'$/h':>6} {'$/M tok':>8}"
    )
    if tokens is not None:
        header += f" {'job h':>8} {'job $':>8}"
    lines = [title, header]
    for o in options:
        if o.plan is None:
            lines.append(f"  {o.label:<{width}}does not fit: {o.why_not}")
            continue
        q = o.plan.policy
        base = one_gpu.get(o.machine)
        scaling = f"{o.throughput_tok_s / base:.2f}x" if base else "-"
        row = (
            f"  {o.label:<{width}}{q.batch_size:>6} {q.micro_batch_size:>5} "
            f"{o.throughput_tok_s:>9.1f} {scaling:>8} {_percent(o.all_reduce_share):>8} "
            f"{_money(o.price_per_hour):>6} {_money(o.cost_per_million_tokens):>8}"
        )
        if tokens is not None:
            hours = o.dataset_seconds(tokens) / 3600
            row += f" {hours:>8.2f} {_money(o.dataset_cost(tokens)):>8}"
        marks = [
            m for m, label in (("fastest", fastest), ("cheapest", cheapest)) if label == o.label
        ]
        row += f"  binds: {o.plan.bottleneck}" + (f"  <- {', '.join(marks)}" if marks else "")
        lines.append(row)
    if tokens is not None:
        lines.append(f"  job: {tokens:.4g} generated tokens")
    return "\n".join(lines)


def _money(x) -> str:
    return "-" if x is None else f"{x:.2f}"
