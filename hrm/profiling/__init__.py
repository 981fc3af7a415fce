"""`hrm profile`: measure this machine's ceilings and return them as a HardwareProfile.

The planner charges achieved, not datasheet, rates: peak FLOP/s per dtype is the best median an
expert-shaped GEMM reached, the matmul curves give the rate at each token count, and memory
bandwidth is the streaming-read rate a decode step sees. Free-form detail (every bandwidth kind,
spreads, load average, the command) goes in `provenance`. Nothing here imports torch at module
level: `import hrm` stays light (docs/architecture.md).
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from hrm import units
from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import HALF_DTYPES, Curve, DeviceSpec, LinkSpec, gemm_shape_key
from hrm.profiling import cpu, gpu
from hrm.profiling.matmul import SWEPT_DTYPES, GemmShape, MatmulSweep, fit_shape, sweep_matmul
from hrm.profiling.timing import Timing, perf_counter_clock
from hrm.progress import progress_bar
from hrm.roofline.ops import gemm_shapes
from hrm.rules.gemm_paths import host_paths
from hrm.rules.host_memory import keep_freed_host_memory, release_freed_host_memory

STORED_CPU_BANDWIDTH = "read"  # decode streams weights and KV cache: a read, not a copy
BUSY_WARNING_SHARE = 0.1  # other processes' share of CPU time above which figures are suspect
_MATMUL_MEMORY_FRACTION = 0.25  # of available memory, for one sweep's weight, input and output
# The rows one expert gets in decode (Binomial(batch, k/E): 1-3 at a batch of 8) and a small
# batch's dense GEMMs. A CPU's rate is not smooth there: float32 sgemm on an AVX-512 EPYC took
# 0.95, 1.91, 2.69 and 1.93 ms at 1, 2, 3 and 4 rows of 1024x3584 (two and three GEMVs, then a
# GEMM kernel), so a curve through 1 and 4 (or 16) priced 2-3 rows at half their time and
# fp32 decode at a batch of 8 was predicted 11-53% fast (docs/decisions.md, 2026-12-04).
SMALL_ROWS = (1, 2, 3, 4, 8)


@dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """How much to measure: the `quick` and `full` presets (tests build smaller ones)."""

    name: str
    tokens_grid: tuple[int, ...]
    repeats: int
    min_sample_s: float  # each timed sample spans at least this long
    matmul_budget_s: float  # per dtype and device; the sweep stops before overrunning it
    min_array_bytes: float  # CPU bandwidth arrays: at least this and 8x the last-level cache
    link_sizes_bytes: tuple[float, ...]
    both_directions_bytes: float
    device_copy_bytes: float
    # the other GEMM shapes of a forward pass (q, k/v, o, router, w2, LM head): a shorter grid
    # and budget per shape and rate key, as together they take a tenth of a decode step's FLOPs.
    # It reaches 4096 rows because prefill runs q, k/v and o at batch x prompt rows (2048-8192
    # in hrm validate's sweep), where a curve held flat from 256 rows understated bf16 by up to 2x;
    # and it has 64, where a power law from 16 to 256 rows understated the rate by 15-25% (a
    # decode batch of 64, a prefill of one 128-token prompt; docs/decisions.md, 2026-12-04)
    shape_tokens_grid: tuple[int, ...] = (*SMALL_ROWS, 16, 64, 256, 1024, 4096)
    shape_budget_s: float = 4.0
    # GPU GEMM points: the repeats of one point together span at least this long, so that a long
    # job's clocks (power and thermal limits reached), not a boost-clock burst, are what is timed
    gpu_sustain_s: float = 0.0
    # the dtypes the CPU's GEMMs are swept in (hrm validate's own profile: those it runs)
    cpu_dtypes: tuple[str, ...] = SWEPT_DTYPES

    @property
    def gpu_gemm_sample_s(self) -> float:
        """Each timed sample of a GPU GEMM point: long enough that the repeats span
        gpu_sustain_s."""
        return max(self.min_sample_s, self.gpu_sustain_s / self.repeats)


PRESETS = {
    "quick": SweepPlan(
        name="quick",
        tokens_grid=(*SMALL_ROWS, 12, 16, 64, 256, 1024),
        repeats=3,
        min_sample_s=0.05,
        matmul_budget_s=12.0,
        min_array_bytes=256e6,
        link_sizes_bytes=(1e6, 32e6, 1e9),
        both_directions_bytes=256e6,
        device_copy_bytes=1e9,
        gpu_sustain_s=0.3,
    ),
    "full": SweepPlan(
        name="full",
        tokens_grid=(*SMALL_ROWS[:-1], 6, 8, 12, *(2**i for i in range(4, 13))),
        repeats=5,
        min_sample_s=0.1,
        matmul_budget_s=110.0,
        min_array_bytes=512e6,
        link_sizes_bytes=(1e6, 4e6, 16e6, 64e6, 256e6, 1e9),
        both_directions_bytes=1e9,
        device_copy_bytes=2e9,
        gpu_sustain_s=1.0,
        shape_tokens_grid=(*SMALL_ROWS, *(2**i for i in range(4, 13))),
        shape_budget_s=12.0,
    ),
}
# timed besides the model's own shapes, so that other models' GEMMs are read from shapes of
# their size and input width (hrm.rules.cpu_gemm.shape_curve; docs/decisions.md, 2026-12-06)
GENERIC_SHAPES = ((1024, 512), (1024, 4096), (2048, 1024))
# the rate keys timed at the other shapes: each path of the dtypes CPU runs use (float16: w1's)
SHAPE_SWEPT = (
    ("float32", "native"),
    ("bfloat16", "native"),
    ("bfloat16", "widened"),
    ("bfloat16", "packed"),
)


def measure_profile(
    *,
    plan: SweepPlan,
    device: str,
    arch: ModelArch,
    name: str,
    command: str,
    quiet: bool,
    warn: Callable[[str], None],
) -> HardwareProfile:
    """Measure the CPU (and with device="cuda" the GPU and its link) and build the profile."""
    import torch

    if device == "cuda":
        gpu.require_cuda()
    kept = keep_freed_host_memory()  # as the executor runs: what is timed is what a run pays
    facts = cpu.host_facts()
    load_before = os.getloadavg()[0]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(facts.cores)
    cpu_sweeps = len(_cpu_sweeps(plan))  # native, then the executor's other paths
    ticks = len(plan.tokens_grid) * cpu_sweeps + len(cpu.BANDWIDTH_KINDS)
    ticks += len(plan.shape_tokens_grid) * len(_shape_sweeps(plan)) * len(_other_shapes(arch))
    if device == "cuda":
        ticks += len(plan.tokens_grid) * len(SWEPT_DTYPES) + 4 * len(plan.link_sizes_bytes)
    warnings: list[str] = []
    times_before = cpu.cpu_times()
    try:
        with progress_bar(total=ticks, desc="hrm profile", quiet=quiet) as bar:
            cpu_part, cpu_notes = _measure_cpu(plan, facts, arch, bar.update, warnings)
            gpu_part = _measure_gpu(plan, arch, bar.update, warnings) if device == "cuda" else None
    finally:
        torch.set_num_threads(threads_before)
    times_after = cpu.cpu_times()
    busy = cpu.measured_others_share(times_before, times_after)
    if busy is not None and busy > BUSY_WARNING_SHARE:
        warnings.append(
            f"other processes took {busy:.0%} of the CPU time while measuring: the figures are "
            "likely understated; measure again on a quiet machine"
        )
    for warning in warnings:
        warn(warning)
    provenance = _provenance(plan, facts, command, kept, load_before, busy) | cpu_notes
    gpu_spec = link = None
    if gpu_part is not None:
        gpu_spec, link, gpu_notes = gpu_part
        provenance.update(gpu_notes)
    if warnings:
        provenance["warnings"] = warnings
    description = f"measured by hrm profile ({plan.name}): {facts.cpu_model}, {facts.cores} cores"
    if gpu_spec is not None:
        description += f"; {gpu_spec.count}x {gpu_spec.name}"
    return HardwareProfile(
        name=name,
        source="measured",
        description=description,
        provenance=provenance,
        cpu=cpu_part,
        gpu=gpu_spec,
        link=link,
    )


def _provenance(plan: SweepPlan, facts, command: str, kept, load_before, busy) -> dict[str, Any]:
    """When, where, with what and how the profile was measured."""
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "os": platform.platform(),
        "cpu_model": facts.cpu_model,
        "cpu_matrix_features": list(facts.matrix_features),
        "cpu_last_level_cache_bytes": int(facts.last_level_cache_bytes or 0) or "unknown",
        "cores": facts.cores,
        "torch": str(torch.__version__),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "command": command,
        "sweep": plan.name,
        "host_memory_reused": kept,
        "load_average_1min": {
            "before": round(load_before, 2),
            "after": round(os.getloadavg()[0], 2),
        },
        "other_processes_cpu_share": round(busy, 3) if busy is not None else "unknown",
        "how_measured": (
            f"median of {plan.repeats} timed samples after one warm-up call, each sample at least "
            f"{plan.min_sample_s:g} s (a GEMM sweep's samples in rounds, one of each point per "
            "round); spreads are the slowest and fastest sample; CPU timed with "
            "time.perf_counter on all cores, GPU with CUDA events after a synchronize"
        ),
    }


def _measure_cpu(
    plan: SweepPlan,
    facts: cpu.HostFacts,
    arch: ModelArch,
    tick: Callable[[], None],
    warnings: list[str],
) -> tuple[DeviceSpec, dict[str, Any]]:
    available = facts.available_memory_bytes or facts.memory_bytes
    shape = fit_shape(
        arch,
        max_tokens=max(plan.tokens_grid),
        memory_budget_bytes=_MATMUL_MEMORY_FRACTION * available,
    )
    sweep = partial(
        sweep_matmul,
        shape=shape,
        tokens_grid=plan.tokens_grid,
        device="cpu",
        clock=perf_counter_clock,
        repeats=plan.repeats,
        min_sample_s=plan.min_sample_s,
        budget_s=plan.matmul_budget_s,
        tick=tick,
    )
    cache = facts.last_level_cache_bytes or 0.0
    # each of the executor's paths (native, then widened and packed for 16-bit weights), each
    # streaming weights from memory: twice the last-level cache, within the sweep's memory share
    streamed = min(2 * cache, _MATMUL_MEMORY_FRACTION * available)
    sweep = partial(sweep, streamed_bytes=streamed)
    sweeps = [sweep(dtype=dtype, path=path) for dtype, path in _cpu_sweeps(plan)]
    shape_curves, shape_notes = _measure_gemm_shapes(
        plan,
        arch,
        sweep,
        tick,
        scaled=shape.scale != 1.0,
        memory_budget_bytes=_MATMUL_MEMORY_FRACTION * available,
    )
    bandwidth, array_bytes = _measure_bandwidth(plan, cache, available, tick, warnings)
    stored_timing, stored_bytes = bandwidth[STORED_CPU_BANDWIDTH]
    copy_timing, copy_moved = bandwidth["copy"]
    spec = DeviceSpec(
        name=facts.cpu_model,
        cores=facts.cores,
        memory_bytes=facts.memory_bytes,
        available_memory_bytes=facts.available_memory_bytes,
        memory_bandwidth_bytes_per_s=stored_timing.rate(stored_bytes),
        # bytes copied, not moved: the STREAM count reads and writes each byte
        copy_bandwidth_bytes_per_s=copy_timing.rate(copy_moved) / 2,
        **_flops_fields(sweeps, "cpu", warnings),
        gemm_shape_curves=shape_curves,
        matmul_shape=gemm_shape_key(shape.hidden, shape.intermediate),
    )
    notes = {
        "cpu_gemm_shapes": shape_notes,
        "cpu_memory_bandwidth": {
            "stored_as_memory_bandwidth": STORED_CPU_BANDWIDTH,
            "array_bytes": units.format_bytes(array_bytes),
            "last_level_cache": units.format_bytes(cache) if cache else "unknown",
            **{
                kind: _rate_summary(t, moved, units.format_bandwidth)
                for kind, (t, moved) in bandwidth.items()
            },
        },
        "cpu_matmul": _matmul_notes(sweeps, threads=facts.cores),
    }
    if facts.available_memory_bytes is None:
        warnings.append(
            "available CPU memory is unknown (no /proc/meminfo); only the total is recorded"
        )
    return spec, notes


def _measure_gpu(
    plan: SweepPlan, arch: ModelArch, tick: Callable[[], None], warnings: list[str]
) -> tuple[DeviceSpec, LinkSpec, dict[str, Any]]:
    import torch

    facts = gpu.gpu_facts()
    state_before = gpu.clock_and_power()
    shape = fit_shape(
        arch,
        max_tokens=max(plan.tokens_grid),
        memory_budget_bytes=_MATMUL_MEMORY_FRACTION * facts.available_memory_bytes,
    )
    sweeps = [
        sweep_matmul(
            dtype=dtype,
            shape=shape,
            tokens_grid=plan.tokens_grid,
            device="cuda",
            clock=gpu.cuda_event_clock,
            repeats=plan.repeats,
            min_sample_s=plan.gpu_gemm_sample_s,
            budget_s=plan.matmul_budget_s,
            tick=tick,
        )
        for dtype in SWEPT_DTYPES
    ]
    state_after = gpu.clock_and_power()
    torch.cuda.empty_cache()
    copy_timing, copy_bytes = gpu.measure_device_bandwidth(
        copy_bytes=min(plan.device_copy_bytes, facts.available_memory_bytes / 4),
        repeats=plan.repeats,
        min_sample_s=plan.min_sample_s,
    )
    link_sweep = gpu.measure_link_sweep(
        sizes_bytes=plan.link_sizes_bytes,
        repeats=plan.repeats,
        min_sample_s=plan.min_sample_s,
        tick=tick,
    )
    both_timing, both_bytes = gpu.measure_both_directions(
        size_bytes=plan.both_directions_bytes, repeats=plan.repeats, min_sample_s=plan.min_sample_s
    )
    spec = DeviceSpec(
        name=facts.name,
        count=facts.count,
        memory_bytes=facts.memory_bytes,
        available_memory_bytes=facts.available_memory_bytes,
        memory_bandwidth_bytes_per_s=copy_timing.rate(copy_bytes),
        **_flops_fields(sweeps, "cuda", warnings),
    )
    pinned = {d: _link_curve(link_sweep[(d, "pinned")]) for d in gpu.DIRECTIONS}
    link = LinkSpec(
        h2d_bytes_per_s=pinned["h2d"].best,
        d2h_bytes_per_s=pinned["d2h"].best,
        h2d_curve=pinned["h2d"],
        d2h_curve=pinned["d2h"],
        bidirectional_bytes_per_s=both_timing.rate(both_bytes),
    )
    notes = {
        "gpu_matmul": {
            **_matmul_notes(sweeps, threads=None),
            "float32_allows_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "measured_on": f"GPU 0 of {facts.count}",
            "sustained_s_per_point": plan.gpu_gemm_sample_s * plan.repeats,
            # nvidia-smi's clocks and power before and after the GEMM sweeps (None: not exposed)
            "clock_and_power_before": state_before,
            "clock_and_power_after": state_after,
        },
        "gpu_memory_bandwidth": {
            "kind": "device-to-device copy, bytes read + written",
            "copy_bytes": units.format_bytes(copy_bytes / 2),
            **_rate_summary(copy_timing, copy_bytes, units.format_bandwidth),
        },
        "link": _link_notes(link_sweep, both_timing, both_bytes),
    }
    return spec, link, notes


def _link_notes(link_sweep, both_timing, both_bytes) -> dict[str, Any]:
    """The link's sweep per direction and memory kind, and both directions at once."""
    return {
        "stored": "pinned host memory; h2d and d2h are the best median over the sweep",
        "columns": "bytes per transfer, median, slowest, fastest",
        **{
            f"{direction}_{kind}": [
                [units.format_bytes(size), *_rate_summary(t, size, units.format_bandwidth).values()]
                for size, t in points
            ]
            for (direction, kind), points in link_sweep.items()
        },
        "both_directions": {
            "bytes_each_way": units.format_bytes(both_bytes / 2),
            **_rate_summary(both_timing, both_bytes, units.format_bandwidth),
        },
    }


def _measure_bandwidth(plan: SweepPlan, cache: float, available: float, tick, warnings) -> tuple:
    """cpu.measure_bandwidth over arrays of 8x the last-level cache (at most an eighth of the
    memory), and their size; their pages handed back after: the kept heap held the triad's
    9 GB under the executor's own measurements that follow."""
    array_bytes = min(max(plan.min_array_bytes, 8 * cache), available / 8)
    if array_bytes < 4 * cache:
        warnings.append(
            f"cpu bandwidth arrays of {units.format_bytes(array_bytes)} are under 4x the "
            f"{units.format_bytes(cache)} last-level cache: bandwidth may be overstated"
        )
    bandwidth = cpu.measure_bandwidth(
        array_bytes=array_bytes, repeats=plan.repeats, min_sample_s=plan.min_sample_s, tick=tick
    )
    release_freed_host_memory()
    return bandwidth, array_bytes


def _other_shapes(arch: ModelArch) -> list[tuple[int, int]]:
    """The forward pass's GEMM shapes other than w1's (timed by the main sweep), then
    GENERIC_SHAPES: what another model's GEMMs are read between (hrm.rules.cpu_gemm.shape_curve)."""
    w1 = (arch.hidden_size, arch.intermediate_size)
    return [s for s in dict.fromkeys((*gemm_shapes(arch), *GENERIC_SHAPES)) if s != w1]


def _measure_gemm_shapes(
    plan: SweepPlan,
    arch: ModelArch,
    sweep: Callable[..., MatmulSweep],
    tick: Callable[[], None],
    *,
    scaled: bool,
    memory_budget_bytes: float,
) -> tuple[dict[str, dict[str, Curve]], dict[str, Any]]:
    """Curves per shape and rate key (SHAPE_SWEPT) for gemm_shape_curves, and what was left out.
    Each shape's own weights rotate, so that they stream from memory as in a run. A shape the
    memory share cannot hold, or every shape when w1 had to be scaled down, keeps w1's curve."""
    curves: dict[str, dict[str, Curve]] = {}
    notes: dict[str, Any] = {"tokens": list(plan.shape_tokens_grid), "points_not_measured": []}
    for d_in, d_out in _other_shapes(arch):
        key = gemm_shape_key(d_in, d_out)
        # GemmShape's sizes are x's width and the weight's rows: here d_in and d_out
        shape = GemmShape(model=arch.name, hidden=d_in, intermediate=d_out)
        fits = shape.buffer_bytes(max(plan.shape_tokens_grid), 4) <= memory_budget_bytes
        if scaled or not fits:
            notes["points_not_measured"].append(
                f"{key}: " + ("w1 scaled down" if scaled else "too large")
            )
            for _ in range(len(_shape_sweeps(plan)) * len(plan.shape_tokens_grid)):
                tick()
            continue
        done = [
            sweep(
                dtype=dtype,
                path=path,
                shape=shape,
                tokens_grid=plan.shape_tokens_grid,
                budget_s=plan.shape_budget_s,
            )
            for dtype, path in _shape_sweeps(plan)
        ]
        curves[key] = {s.dtype: s.curve() for s in done if s.points}
        notes["points_not_measured"] += [f"{key}: {s.stopped}" for s in done if s.stopped]
    return curves, notes


def _cpu_sweeps(plan: SweepPlan) -> list[tuple[str, str]]:
    """(dtype, path) of the CPU's GEMM sweeps: each dtype native, then the 16-bit ones along
    the executor's widened path, and its packed one where this CPU packs that dtype."""
    native = [(d, "native") for d in plan.cpu_dtypes]
    half = [d for d in HALF_DTYPES if d in plan.cpu_dtypes]
    return native + [(d, p) for p in ("widened", "packed") for d in half if p in host_paths(d)]


def _shape_sweeps(plan: SweepPlan) -> list[tuple[str, str]]:
    return [(d, path) for d, path in SHAPE_SWEPT if d in plan.cpu_dtypes and path in host_paths(d)]


def _flops_fields(sweeps: list[MatmulSweep], device: str, warnings: list[str]) -> dict[str, Any]:
    """peak_flops_per_s and matmul_curves for the dtypes that ran; a warning for each other."""
    measured = [s for s in sweeps if s.points]
    for sweep in sweeps:
        if sweep.stopped:
            warnings.append(sweep.stopped)
        if not sweep.points:
            warnings.append(
                f"{sweep.dtype} matmul on {device} not measured: left out of the profile"
            )
    if not measured:
        raise HrmError(f"no matmul dtype could be measured on {device}; see the warnings above")
    return {
        "peak_flops_per_s": {s.dtype: s.peak_flops_per_s for s in measured},
        "matmul_curves": {s.dtype: s.curve() for s in measured},
    }


def _link_curve(points: list[tuple[float, Timing]]) -> Curve:
    return Curve(points=tuple((size, t.rate(size)) for size, t in points))


def _rate_summary(timing: Timing, work: float, fmt: Callable[[float], str]) -> dict[str, str]:
    slowest, fastest = timing.rate_range(work)
    return {"median": fmt(timing.rate(work)), "slowest": fmt(slowest), "fastest": fmt(fastest)}


def _matmul_notes(sweeps: list[MatmulSweep], threads: int | None) -> dict[str, Any]:
    notes: dict[str, Any] = {"shape": sweeps[0].shape.describe()}
    if threads is not None:
        notes["threads"] = threads
    notes["spread_columns"] = "tokens, median, slowest, fastest"
    notes["spread"] = {
        s.dtype: [
            [tokens, *_rate_summary(t, s.shape.flops(tokens), units.format_flops).values()]
            for tokens, t in s.points
        ]
        for s in sweeps
        if s.points
    }
    return notes
