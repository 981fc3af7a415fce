"""`hrm plan` with several machines, GPU counts or prices: the best plan of each option side by
side, ordered by cost per token (else speed), with the job's hours and cost when sized."""

from __future__ import annotations

import json

from hrm.cli.plan_job import hardware_of
from hrm.errors import HrmError
from hrm.units import format_percent


def gpu_counts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    counts = []
    for part in (p.strip() for p in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise HrmError(f"--gpus: expected positive GPU counts like 1,2,4, got {text!r}")
        counts.append(int(part))
    return sorted(set(counts))


def run_comparison(args, arch, names: list[str], workload, job, max_batch) -> int:
    """Several machines and/or GPU counts side by side, ordered by cost (else speed)."""
    from hrm.io import check_image_path
    from planner.compare import parse_prices, plan_options, plot_options

    counts = gpu_counts(args.gpus)
    prices = parse_prices(args.price, names) if args.price else None
    tokens = job.tokens if job is not None else None
    if args.plot:
        check_image_path(args.plot, "--plot")
    machines = {name: hardware_of(args, name) for name in names}
    options = plan_options(
        arch,
        machines,
        workload,
        gpu_counts=counts,
        prices=prices,
        schedule=args.schedule,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        max_batch_size=max_batch,
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
    print(format_comparison(options, title, job, fastest=fastest, cheapest=cheapest))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def format_comparison(options, title: str, job, *, fastest, cheapest) -> str:
    tokens = job.tokens if job is not None else None
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
            lines.append(f"  {o.label:<{width}}{o.why_not}")
            continue
        q = o.plan.policy
        base = one_gpu.get(o.machine)
        scaling = f"{o.throughput_tok_s / base:.2f}x" if base else "-"
        row = (
            f"  {o.label:<{width}}{q.batch_size:>6} {q.micro_batch_size:>5} "
            f"{o.throughput_tok_s:>9.1f} {scaling:>8} {format_percent(o.all_reduce_share):>8} "
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
        what = f"{job.prompts} prompts, " if job.prompts is not None else ""
        lines.append(f"  job: {what}{tokens:.4g} generated tokens")
    return "\n".join(lines)


def _money(x) -> str:
    return "-" if x is None else f"{x:.2f}"
