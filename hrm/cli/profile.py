"""`hrm profile`: measure this machine's ceilings and write a hardware profile the planner uses."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from hrm import units
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.io import check_writable

DEFAULT_MODEL = "mixtral-8x7b"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure this machine (matmul FLOP/s, memory and PCIe bandwidth) into a profile",
        description=(
            "Measure matmul FLOP/s per dtype at the model's expert-GEMM shapes, memory bandwidth, "
            "memory, and with a GPU its memory bandwidth and the host<->device link; write a "
            "hardware profile (source: measured) that --hardware accepts."
        ),
    )
    parser.add_argument(
        "-o", "--output", required=True, metavar="FILE.yaml", help="profile to write"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a shorter sweep (minutes on a 2-core machine)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="cpu: a CPU-only profile; cuda: CPU, GPU and link (default: cuda when available)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=(
            "model whose expert GEMM shape is timed: bundled name or config.json "
            f"(default {DEFAULT_MODEL})"
        ),
    )
    parser.add_argument(
        "--compare", metavar="NAME", help="also print the measurement beside this profile (e.g. t4)"
    )
    parser.add_argument(
        "--disk",
        metavar="DIR",
        help="also time sequential reads (O_DIRECT, 4 KiB to 64 MiB) of the storage under DIR, "
        "for a disk tier: a probe file is written there and removed",
    )
    parser.add_argument(
        "--disk-buffered",
        action="store_true",
        help="with --disk, where the filesystem refuses O_DIRECT: time buffered reads instead",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from hrm.arch import resolve_model
    from hrm.profiling import PRESETS, measure_profile

    # Everything a user can get wrong fails here, before minutes of measuring.
    output = check_writable(args.output)
    if output.suffix not in (".yaml", ".yml"):
        raise HrmError(f"{output}: the profile is YAML; name the output FILE.yaml")
    arch = resolve_model(args.model)
    reference = resolve_hardware(args.compare) if args.compare else None
    if args.disk_buffered and not args.disk:
        raise HrmError("--disk-buffered needs --disk DIR")
    if args.disk and not Path(args.disk).is_dir():
        raise HrmError(f"--disk {args.disk}: no such directory; give one on the device to time")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def warn(message: str) -> None:
        print(f"hrm profile: warning: {message}", file=sys.stderr)

    profile = measure_profile(
        plan=PRESETS["quick" if args.quick else "full"],
        device=device,
        arch=arch,
        name=output.stem,
        command=_command_line(args),
        quiet=args.quiet,
        warn=warn,
    )
    profile = with_launch_overhead(profile, arch, quick=args.quick)
    if profile.gpu is None:  # the CPU standing in for GPUs: tp ranks are processes here
        from hrm.profiling.collective import with_all_reduce

        profile = with_all_reduce(profile, quick=args.quick, warn=warn)
    if args.disk:
        from hrm.profiling.disk import measure_disk

        disk = measure_disk(args.disk, direct=not args.disk_buffered,
                            file_bytes=(64 if args.quick else 256) * 2**20)  # fmt: skip
        profile = dataclasses.replace(profile, disk=disk)
    profile.save(output)
    print(format_summary(profile, output))
    if reference is not None:
        print(format_comparison(profile, reference))
    return 0


# the fused kernel's curves stop here: a prefill's experts see a few hundred rows each, and a
# Mixtral 8x7B-sized call of GROUP experts at 1024 rows would take seconds a sample
FUSED_MAX_ROWS = 256


def with_launch_overhead(
    profile: HardwareProfile, arch, *, quick: bool = False, timed=None
) -> HardwareProfile:
    """The profile with what only the executor's own code shows: on the CPU, per dtype, its
    attention stages' rates (executor/attention.py), its FFN's element passes per second and its
    fixed costs per layer, expert and step (executor/cpu_overhead.py, at the model's shapes); on
    a GPU its fixed costs (executor/overhead.py) and the grouped expert FFN's rate by rows.
    timed: the CPU's fixed costs' preset (default quick's or full's; its dtypes' elementwise
    rates are timed too). Each measurement hands back the pages it freed (released)."""
    from executor import cpu_overhead
    from executor.overhead import (
        measure_elementwise_rate,
        measure_expert_ffn_curve,
        measure_launch_overhead,
    )
    from executor.quant import measure_dequantize_rate
    from hrm.formats import WEIGHT_FORMATS
    from hrm.hardware.parts import Curve
    from hrm.policy import FLOAT_DTYPES
    from hrm.profiling import PRESETS, SWEPT_DTYPES
    from hrm.roofline.ops import expert_gemm_shapes
    from hrm.rules.cpu_gemm import choose_cpu_gemm
    from hrm.rules.host_memory import release_freed_host_memory, released

    # the dtypes the profile's CPU sweep ran (hrm validate's own profile sweeps those it runs)
    dtypes = [d for d in FLOAT_DTYPES if d in profile.cpu.matmul_curves]
    paths = {d: choose_cpu_gemm(profile.cpu, d, shape=expert_gemm_shapes(arch)[0]) for d in dtypes}
    preset = "quick" if quick else "full"
    timed = timed or cpu_overhead.PRESETS[preset]  # --quick: bfloat16 alone (others take its)
    release_freed_host_memory()  # what the sweeps left in the kept heap: these build models
    measure_dequantize_rate = released(measure_dequantize_rate)
    measure_elementwise_rate = released(measure_elementwise_rate)
    measure_cpu_overhead = released(cpu_overhead.measure_cpu_overhead)
    elementwise = {
        d: measure_elementwise_rate(arch, d, repeats=timed.elementwise_repeats, cpu_gemm=paths[d])
        for d in timed.dtypes
    }
    cpu = dataclasses.replace(
        profile.cpu,
        launch_overhead={
            d: measure_cpu_overhead(
                arch,
                d,
                cpu_gemm=paths[d],
                elementwise_rate=elementwise[d],
                preset=timed,
            )
            for d in timed.dtypes
        },
        **_attention_curves(arch, dtypes, quick),
        elementwise_rate=elementwise,
        dequantize_rates={f: measure_dequantize_rate(arch, f) for f in WEIGHT_FORMATS},
    )
    cpu = released(with_fused_curves)(cpu, arch, PRESETS[preset]) if "bfloat16" in dtypes else cpu
    gpu = profile.gpu
    if gpu is not None:
        plan = PRESETS[preset]
        sample = {"min_sample_s": plan.gpu_gemm_sample_s, "repeats": plan.repeats}
        curves = {
            d: Curve(points=tuple(measure_expert_ffn_curve(arch, d, "cuda", **sample)))
            for d in SWEPT_DTYPES
            if d in gpu.matmul_curves  # the dtypes this GPU ran
        }
        gpu = dataclasses.replace(
            gpu,
            launch_overhead={"float32": measure_launch_overhead(arch, device="cuda")},
            expert_ffn_curves=curves,
            dequantize_rates={f: measure_dequantize_rate(arch, f, "cuda") for f in WEIGHT_FORMATS},
        )
    return dataclasses.replace(profile, cpu=cpu, gpu=gpu)


def _attention_curves(arch, dtypes: list[str], quick: bool) -> dict:
    """The CPU's attention stages' curves per dtype (executor/attention.py): decode over the
    model's cache and over a latent one (latent_reference), prefill; each measurement hands back
    the pages it freed (released)."""
    from executor.attention import (
        decode_kernel,
        latent_reference,
        measure_attention_curve,
        measure_prefill_attention_curve,
    )
    from hrm.formats import WEIGHT_FORMATS
    from hrm.rules.host_memory import released

    decode, prefill = released(measure_attention_curve), released(measure_prefill_attention_curve)
    # each by the kernel a default run takes (native where a bf16 run is fused on an AMX host)
    attention = {d: decode(arch, d, quick=quick, kernel=decode_kernel(arch, d)) for d in dtypes}
    latent = attention if arch.kv_lora_rank else {
        d: decode(latent_reference(arch), d, quick=quick) for d in dtypes}  # fmt: skip
    # a compact KV cache, read by bfloat16 layers (keyed by its format); 30 s on a 2-core VM,
    # so the full sweep only: a quick profile prices it by its bytes
    native = decode_kernel(arch, "bfloat16")
    compact = {f: decode(arch, "bfloat16", kv_format=f, kernel=native)
               for f in ([] if quick else WEIGHT_FORMATS)}  # fmt: skip
    return {
        "attention_curves": attention | compact,
        "latent_attention_curves": latent,
        "prefill_attention_curves": {d: prefill(arch, d, quick=quick) for d in dtypes},
    }


def with_fused_curves(cpu, arch, plan):
    """The CPU with the fused expert kernel's curves (executor/fused_moe.py) beside its GEMM
    shapes' (`bfloat16_fused`), at the model's two fused calls where its widths allow and at the
    generic shapes, over the preset's shape grid up to FUSED_MAX_ROWS rows an expert: what a
    fused run is priced by (hrm.rules.cpu_moe). Unchanged where the kernel cannot run here."""
    from executor.fused_moe import fused_curves, host_missing
    from hrm.hardware.parts import FUSED_KEYS
    from hrm.profiling import GENERIC_SHAPES
    from hrm.profiling.cpu import host_facts
    from hrm.roofline.ops import fused_expert_gemm_shapes
    from hrm.rules.cpu_moe import BLOCK

    if host_missing() is not None:
        return cpu
    own = fused_expert_gemm_shapes(arch)
    shapes = [s for s in (*own, *GENERIC_SHAPES) if s[0] % 2 == 0 and s[1] % BLOCK == 0]
    cache = host_facts().last_level_cache_bytes or 64e6
    rows = tuple(r for r in plan.shape_tokens_grid if r <= FUSED_MAX_ROWS)
    curves = fused_curves(dict.fromkeys(shapes), rows=rows, streamed_bytes=2 * cache,
                          repeats=plan.repeats, min_sample_s=plan.min_sample_s)  # fmt: skip
    merged = {name: dict(by_key) for name, by_key in cpu.gemm_shape_curves.items()}
    for name, curve in curves.items():
        merged.setdefault(name, {})[FUSED_KEYS["bfloat16"]] = curve
    return dataclasses.replace(cpu, gemm_shape_curves=merged)


def _command_line(args: argparse.Namespace) -> str:
    """The measuring options as a command, for the provenance (not sys.argv: tests call main)."""
    words = ["hrm", "profile"]
    if args.quick:
        words.append("--quick")
    if args.device:
        words += ["--device", args.device]
    if args.model != DEFAULT_MODEL:
        words += ["--model", args.model]
    if args.disk:
        words += ["--disk", args.disk] + (["--disk-buffered"] if args.disk_buffered else [])
    return " ".join(words + ["-o", args.output])


def format_summary(profile: HardwareProfile, path: Path) -> str:
    lines = [f"wrote {path} ({profile.description})"]
    for label, device in (("cpu", profile.cpu), ("gpu", profile.gpu)):
        if device is None:
            continue
        memory = units.format_bytes(device.memory_bytes)
        if device.available_memory_bytes is not None:
            memory += f" ({units.format_bytes(device.available_memory_bytes)} available)"
        flops = ", ".join(
            f"{d} {units.format_flops(r)}" for d, r in device.peak_flops_per_s.items()
        )
        lines.append(
            f"  {label}: memory {memory}, bandwidth "
            f"{units.format_bandwidth(device.memory_bandwidth_bytes_per_s)}; peak {flops}"
        )
        for dtype, o in device.launch_overhead.items():
            figure = {  # with the range of its fits over the rounds where there were several
                k: f"{1e6 * getattr(o, k):.0f}"
                + (f" (rounds span {1e6 * o.spread[k]:.0f})" if k in o.spread else "")
                for k in ("per_layer_s", "per_expert_s", "per_step_s")
            }
            lines.append(
                f"  {label}: executor overhead ({dtype}) {figure['per_layer_s']} us per layer "
                f"+ {figure['per_expert_s']} us per expert touched, "
                f"{figure['per_step_s']} us per step"
            )
        if device.elementwise_rate:
            rates = ", ".join(f"{d} {r / 1e9:.2f}" for d, r in device.elementwise_rate.items())
            lines.append(
                f"  {label}: elementwise (the expert FFN beyond its GEMMs) {rates} G elements/s"
            )
    if profile.link is not None:
        both = profile.link.bidirectional_bytes_per_s
        lines.append(
            f"  link: h2d {units.format_bandwidth(profile.link.h2d_bytes_per_s)}, "
            f"d2h {units.format_bandwidth(profile.link.d2h_bytes_per_s)}"
            + (f", both at once {units.format_bandwidth(both)}" if both else "")
        )
    if profile.interconnect is not None:
        ring = profile.interconnect
        lines.append(
            f"  all-reduce ({ring.kind}): {1e6 * ring.latency_s:.0f} us a ring step, "
            f"{units.format_bandwidth(ring.bytes_per_s)}"
        )
    if profile.disk is not None and profile.disk.read_curve is not None:
        reads = ", ".join(f"{units.format_bytes(x)} {units.format_bandwidth(y)}"
                          for x, y in profile.disk.read_curve.points)  # fmt: skip
        how = "O_DIRECT" if profile.disk.direct else "buffered, cache dropped"
        lines.append(f"  disk {profile.disk.path} ({how}): reads of {reads}")
    return "\n".join(lines)


def format_comparison(measured: HardwareProfile, reference: HardwareProfile) -> str:
    """A table: each figure as measured, as in the reference profile, and their ratio."""
    mine, theirs = _figures(measured), _figures(reference)
    title = f"{reference.name} ({reference.source})"
    lines = [f"{'':24} {'measured':>16} {title:>24} {'ratio':>8}"]
    for name in dict.fromkeys([*mine, *theirs]):
        (ours, fmt), (other, _) = mine.get(name, (None, None)), theirs.get(name, (None, None))
        fmt = fmt or theirs[name][1]
        ratio = f"{ours / other:.3g}x" if ours and other else "-"
        ours_text = fmt(ours) if ours else "-"
        other_text = fmt(other) if other else "-"
        lines.append(f"{name:24} {ours_text:>16} {other_text:>24} {ratio:>8}")
    return "\n".join(lines)


def _figures(profile: HardwareProfile) -> dict[str, tuple[float, Callable[[float], str]]]:
    """The profile's headline figures by name, each with the function that prints it."""
    figures: dict[str, tuple[float, Callable[[float], str]]] = {}
    for label, device in (("cpu", profile.cpu), ("gpu", profile.gpu)):
        if device is None:
            continue
        figures[f"{label} memory"] = (device.memory_bytes, units.format_bytes)
        figures[f"{label} memory bandwidth"] = (
            device.memory_bandwidth_bytes_per_s,
            units.format_bandwidth,
        )
        for dtype, rate in device.peak_flops_per_s.items():
            figures[f"{label} {dtype}"] = (rate, units.format_flops)
    if profile.link is not None:
        figures["link h2d"] = (profile.link.h2d_bytes_per_s, units.format_bandwidth)
        figures["link d2h"] = (profile.link.d2h_bytes_per_s, units.format_bandwidth)
    return figures
