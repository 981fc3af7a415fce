"""The CPU GEMM path of a run on this host: from the run's profile when it measured this host,
else from this host's probe of about a second at the model's own expert shape, taken once per
host and kept, so that the path (and so every greedy answer) is the same in every run and rank.

The probe is `hrm profile`'s sweep (hrm.profiling.matmul) on each path this host runs, cut
short: a few token counts including the padding check (12 and 16), over the model's own expert
weights (enough of them to stream twice the last-level cache, or all), one budget for all paths,
each swept twice, in turn and in reverse, so that a slow moment does not pick the path. Timing
the run's own weights costs no memory but the packed path's copies, and is exactly the
executor's situation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import HALF_DTYPES, Curve, path_key
from hrm.io import atomic_write_json
from hrm.policy import dtype_bytes
from hrm.profiling import cpu
from hrm.profiling.matmul import GemmShape, sweep_matmul
from hrm.profiling.timing import perf_counter_clock
from hrm.roofline.ops import expert_gemm_shapes
from hrm.rules.cpu_gemm import CpuGemmChoice, MeasuredRates, choose_cpu_gemm, has_choice_curves
from hrm.rules.gemm_paths import host_paths, packing_missing
from hrm.units import format_bytes

PROBE_TOKENS = (1, 12, 16, 64, 256)
PROBE_BUDGET_S = 1.0


def bundled_profile_of_this_host() -> HardwareProfile | None:
    """A bundled CPU-only profile measured on this very host's kind of CPU (host_differs finds
    nothing), or None: what predicts a run here when the user names no profile."""
    from hrm.hardware import bundled_profile_names, resolve_hardware

    for name in bundled_profile_names():
        profile = resolve_hardware(name)
        if not profile.has_gpu and profile.source == "measured" and host_differs(profile) is None:
            return profile
    return None


def host_differs(profile: HardwareProfile) -> str | None:
    """Why `profile` does not describe this host's CPU (None when it does): a datasheet, or a
    measurement of another CPU model, set of matrix features or last-level cache size. VMs
    hide the model: two AMX Xeon VMs both named "Intel(R) Xeon(R) Processor" with the same
    flags had a 480 MiB and a 105 MiB L3 (docs/decisions.md, 2026-12-03)."""
    if profile.source != "measured":
        return f"{profile.name} is a datasheet profile, not a measurement of this host"
    facts = cpu.host_facts()
    theirs_model = profile.provenance.get("cpu_model")
    theirs_features = profile.provenance.get("cpu_matrix_features")
    if theirs_model != facts.cpu_model:
        return f"{profile.name} was measured on {theirs_model!r}; this host is {facts.cpu_model!r}"
    if theirs_features is None:
        return (
            f"{profile.name} does not record its CPU's matrix features (profiled before they were)"
        )
    if tuple(theirs_features) != facts.matrix_features:
        return (
            f"{profile.name} was measured on a CPU with {', '.join(theirs_features) or 'none'}; "
            f"this host has {', '.join(facts.matrix_features) or 'none'}"
        )
    theirs_cache = recorded_cache_bytes(profile)
    ours_cache = facts.last_level_cache_bytes
    if theirs_cache and ours_cache and theirs_cache != ours_cache:
        return (
            f"{profile.name} was measured on a CPU with a {format_bytes(theirs_cache)} "
            f"last-level cache; this host's is {format_bytes(ours_cache)}"
        )
    return None


def recorded_cache_bytes(profile: HardwareProfile) -> float | None:
    """The last-level cache size the profile's host had, or None where it was not recorded."""
    size = profile.provenance.get("cpu_last_level_cache_bytes")
    return float(size) if isinstance(size, (int, float)) else None


def probe_cpu_gemm(
    arch: ModelArch,
    dtype: str,
    weights: Sequence,
    *,
    mode: str = "auto",
    budget_s: float = PROBE_BUDGET_S,
) -> CpuGemmChoice:
    """The choice from this host's probe of `dtype` at the model's expert shape: measured once
    per host (CPU model, matrix features, cache, torch) and kept (host_probe_cache), so that every
    run and every rank takes the same path: a probe per process let timing noise pick the GEMM
    and greedy answers differed from run to run. The first process to ask times the paths over
    `weights` (the model's expert w1s, [I, H] in `dtype`) while the others wait for its file."""
    import fcntl

    shape = GemmShape(model=arch.name, hidden=arch.hidden_size, intermediate=arch.intermediate_size)
    path = host_probe_cache(dtype, shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        cached = _read_probe(path)
        wanted = {path_key(dtype, p) for p in host_paths(dtype)}
        # none kept, or kept before a path this host runs existed (packed): taken again
        if cached is None or not wanted <= set(cached["curves"]):
            cached = _probe(shape, dtype, weights, budget_s)
            atomic_write_json(path, cached)
    rates = MeasuredRates(
        matmul_curves={k: Curve(points=tuple(map(tuple, v))) for k, v in cached["curves"].items()}
    )
    source = f"probe, {cached['summary']} at {shape.describe()}; kept in {path}"
    return choose_cpu_gemm(rates, dtype, mode, source=source)


def host_probe_cache(dtype: str, shape: GemmShape) -> Path:
    """Where this host's probe of `dtype` at `shape` is kept: $HRM_CACHE_DIR (else
    $XDG_CACHE_HOME/hrm, else ~/.cache/hrm), named by what makes the probe this host's."""
    import torch

    facts = cpu.host_facts()
    key = [facts.cpu_model, facts.matrix_features, facts.last_level_cache_bytes,
           torch.__version__, dtype, shape.hidden, shape.intermediate]  # fmt: skip
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    env = os.environ
    base = env.get("HRM_CACHE_DIR") or Path(
        env.get("XDG_CACHE_HOME") or Path.home() / ".cache", "hrm"
    )
    return Path(base, f"cpu-gemm-{dtype}-{shape.hidden}x{shape.intermediate}-{digest}.json")


def _read_probe(path: Path) -> dict | None:
    """A kept probe, or None where there is none (or it cannot be read: it is taken again)."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data.get("curves"), dict) and data["curves"] else None
    except (OSError, ValueError, AttributeError):
        return None


def _probe(shape: GemmShape, dtype: str, weights: Sequence, budget_s: float) -> dict:
    """Each path this host runs `dtype` along, timed over the model's experts twice, in turn and
    in reverse: the curves (each point the faster of its two) and what was timed (packed: over
    packed copies, made before the clock starts)."""
    facts = cpu.host_facts()
    per_weight = shape.hidden * shape.intermediate * dtype_bytes(dtype)
    wanted = math.ceil(2 * (facts.last_level_cache_bytes or 0.0) / per_weight)
    rotated = list(weights[: max(1, wanted)])
    for w in rotated:  # page the weights in first: a page fault is not a GEMM's cost
        w.flatten()[:: max(1, 4096 // w.element_size())].sum()
    paths = host_paths(dtype)
    started = time.perf_counter()
    rates: dict[str, dict[float, float]] = {}  # rate key -> {tokens: best FLOP/s}
    # each path swept early and late (the order reversed): a slow moment of the VM does not
    # fall on one path alone, and each point keeps its faster sweep
    for order in (paths, paths[::-1]):
        for path in order:
            sweep = sweep_matmul(
                dtype=dtype, shape=shape, tokens_grid=PROBE_TOKENS, device="cpu",
                clock=perf_counter_clock, repeats=3, min_sample_s=0.005,
                budget_s=budget_s / (2 * len(paths)), tick=lambda: None, path=path,
                weights=rotated,
            )  # fmt: skip
            best = rates.setdefault(sweep.dtype, {})
            for tokens, rate in sweep.curve().points:
                best[tokens] = max(rate, best.get(tokens, 0.0))
    elapsed = time.perf_counter() - started
    return {
        "host": {"cpu_model": facts.cpu_model, "matrix_features": list(facts.matrix_features)},
        "summary": f"{elapsed:.1f} s over {len(rotated)} of the model's experts",
        "curves": {key: [[t, r] for t, r in sorted(by.items())] for key, by in rates.items() if by},
    }


def cpu_gemm_chooser(
    arch: ModelArch,
    dtype: str,
    *,
    mode: str,
    hardware: HardwareProfile | None,
    warn: Callable[[str], None] = lambda message: None,
) -> Callable:
    """cpu_gemm_for_run as a function of the opened checkpoint (what executor.run.execute takes:
    a broken checkpoint then fails before a probe, which times its weights)."""

    def choose(checkpoint) -> CpuGemmChoice:
        weights = checkpoint.expert_gate_weights
        return cpu_gemm_for_run(arch, dtype, mode=mode, hardware=hardware, weights=weights,
                                warn=warn)  # fmt: skip

    return choose


def cpu_gemm_for_run(
    arch: ModelArch,
    dtype: str,
    *,
    mode: str,
    hardware: HardwareProfile | None,
    weights: Sequence,
    warn: Callable[[str], None],
) -> CpuGemmChoice:
    """The choice a CPU run takes: from `hardware` when it measured this host with the curves the
    choice needs, else from a probe over `weights` (the model's expert w1s); `warn` says once why
    the probe stood in."""
    paths = host_paths(dtype)
    if mode != "auto" and mode not in paths and dtype in HALF_DTYPES:
        missing = packing_missing(dtype)
        raise HrmError(f"--cpu-gemm {mode}: this CPU lacks {missing}; use auto, native or widened")
    reason = host_differs(hardware) if hardware is not None else "no --hardware profile"
    if reason is None and not has_choice_curves(hardware.cpu, dtype, paths):
        reason = (
            f"{hardware.name} lacks the {dtype} curves at 12 and 16 tokens of the GEMM paths "
            f"this host runs ({', '.join(paths)})"
        )
    if reason is None:
        return choose_cpu_gemm(hardware.cpu, dtype, mode, source=f"profile {hardware.name}",
                               shape=expert_gemm_shapes(arch)[0])  # fmt: skip
    choice = probe_cpu_gemm(arch, dtype, weights, mode=mode)
    if mode == "auto":
        warn(f"CPU GEMM path from this host's probe ({reason}): {choice.describe()}")
    return choice
