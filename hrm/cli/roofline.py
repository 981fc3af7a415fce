"""`hrm roofline`: draw the hierarchical roofline of a model on a machine, and print its numbers."""

from __future__ import annotations

import argparse
import json

from hrm.errors import HrmError
from hrm.policy import DTYPE_BYTES
from hrm.units import format_bandwidth, format_flops

DEFAULT_BATCHES = "16,64,256,1024,4096"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "roofline",
        help="draw the hierarchical roofline chart (CPU, GPU and PCIe roofs, P1/P2)",
        description="Draw the hierarchical roofline of MODEL on HARDWARE: CPU and GPU roofs, the "
        "PCIe cross-level roof, decode attention per KV dtype and the expert FFN per batch size, "
        "with the turning points P1 and P2.",
    )
    p.add_argument(
        "--model", default="mixtral-8x7b", help="bundled name, config.json or checkpoint dir"
    )
    p.add_argument("--hardware", default="l4", help="bundled profile name or a profile .yaml")
    p.add_argument(
        "--batch", default=DEFAULT_BATCHES, help=f"batch sizes, comma-separated ({DEFAULT_BATCHES})"
    )
    p.add_argument("--context", type=int, default=512, help="decode context length (512)")
    p.add_argument(
        "--kv-dtypes", help="KV cache dtypes, comma-separated (default: the --dtype, int8, int4)"
    )
    p.add_argument(
        "--dtype",
        help="weight and compute dtype (default: the machine's faster of bfloat16 and float16)",
    )
    p.add_argument(
        "--micro-batch", type=int, default=64, help="GPU micro-batch size for the FFN kernel (64)"
    )
    p.add_argument(
        "--prompt-len",
        type=int,
        default=98,
        help="mean prompt of the workload whose MoE-Lens stage-1 bound is drawn (98)",
    )
    p.add_argument("--gen-len", type=int, default=32, help="its new tokens a request (32)")
    p.add_argument("-o", "--output", help="PNG to write (default roofline-MODEL-HARDWARE.png)")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    p.set_defaults(run=run)


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HrmError(
            f"{flag}: expected comma-separated positive integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise HrmError(f"{flag}: expected comma-separated positive integers, got {text!r}")
    return sorted(set(values))


def _dtypes(text: str, flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in DTYPE_BYTES]
    if not values or bad:
        raise HrmError(
            f"{flag}: unknown dtype {bad[0] if bad else text!r}; use {', '.join(DTYPE_BYTES)}"
        )
    return values


def run(args: argparse.Namespace) -> int:
    from hrm.arch import resolve_model
    from hrm.hardware import resolve_hardware
    from hrm.io import check_image_path
    from hrm.roofline.plots import plot_roofline
    from hrm.roofline.report import build_roofline_report

    batches = _positive_ints(args.batch, "--batch")
    if min(args.context, args.micro_batch, args.prompt_len, args.gen_len) <= 0:
        raise HrmError("--context, --micro-batch, --prompt-len and --gen-len must be positive")
    arch = resolve_model(args.model)
    arch.check_positions(args.context, 0, "--context", fix="give a shorter --context")
    hardware = resolve_hardware(args.hardware)
    dtype = args.dtype or hardware.half_dtype
    if _dtypes(dtype, "--dtype") != [dtype]:
        raise HrmError(f"--dtype: expected one dtype, got {dtype!r}")
    kv_dtypes = _dtypes(args.kv_dtypes or f"{dtype},int8,int4", "--kv-dtypes")
    output = check_image_path(args.output or f"roofline-{arch.name}-{hardware.name}.png", "-o")
    report = build_roofline_report(
        arch,
        hardware,
        batches=batches,
        context=args.context,
        kv_dtypes=kv_dtypes,
        dtype=dtype,
        micro_batch=args.micro_batch,
    )
    bound = _bound(args, arch, hardware, dtype)
    flops = bound.tokens_per_s * 2.0 * arch.active_params  # the bound as the FLOP/s it carries
    plot_roofline(report, output, (flops, f"MoE-Lens stage-1 bound, p {args.prompt_len} g "
                                          f"{args.gen_len}"))  # fmt: skip
    if args.json:
        data = {**report.to_dict(), "stage1_bound": bound.to_dict(), "output": str(output)}
        print(json.dumps(data, indent=2))
    else:
        print(format_report(report))
        print(f"  {bound.describe()} (prompts {args.prompt_len}, {args.gen_len} new tokens)")
        print(f"wrote {output}")
    return 0


def _bound(args, arch, hardware, dtype):
    """MoE-Lens's stage-1 bound for --prompt-len and --gen-len (planner/bound.py)."""
    from hrm.workload import Workload
    from planner.bound import stage1_bound

    workload = Workload(prompt_len_mean=args.prompt_len, prompt_len_max=args.prompt_len,
                        gen_len=args.gen_len)  # fmt: skip
    return stage1_bound(arch, hardware, workload, dtype, hardware.compute_dtype(dtype))


def format_report(report) -> str:
    lines = [
        f"{report.model} on {report.hardware} ({report.dtype}, decode context {report.context})"
    ]
    lines.append(
        f"  CPU  {format_flops(report.cpu_peak_flops_per_s)}, "
        f"{format_bandwidth(report.cpu_bandwidth_bytes_per_s)}"
    )
    if report.gpu_peak_flops_per_s is not None:
        lines.append(
            f"  GPU  {format_flops(report.gpu_peak_flops_per_s)}, "
            f"{format_bandwidth(report.gpu_bandwidth_bytes_per_s)}"
        )
        lines.append(f"  PCIe {format_bandwidth(report.link_bytes_per_s)} host-to-device")
        t = report.turning
        lines.append(
            f"  P1 = {t.p1:.3g} FLOP/B (left: compute on the CPU)" if t.p1 else "  P1: none"
        )
        lines.append(f"  P2 = {t.p2:.3g} FLOP/B (right: GPU roofs bind)" if t.p2 else "  P2: none")
        if report.ffn_balance_batch:
            lines.append(
                f"  expert FFN balance point (Eq 11) at N = {report.ffn_balance_batch:.0f} "
                f"tokens for micro-batch {report.micro_batch}"
            )
    else:
        lines.append("  no GPU: CPU roofs only")
    lines.append(f"  {'op':<32} {'FLOP/B':>9} {'CPU attains':>14} {'GPU (streamed)':>15}  better")
    shown = set()
    for p in report.points:
        if p.op == "attention":  # decode attention's intensity does not depend on the batch
            if p.kv_dtype in shown:
                continue
            shown.add(p.kv_dtype)
        gpu = format_flops(p.gpu_streamed_flops_per_s, 3) if p.gpu_streamed_flops_per_s else "-"
        label = f"decode attention, KV {p.kv_dtype}" if p.op == "attention" else p.label
        lines.append(
            f"  {label:<32} {p.cpu_intensity:>9.3g} {format_flops(p.cpu_flops_per_s, 3):>14} "
            f"{gpu:>15}  {p.better_on}"
        )
    return "\n".join(lines)
