"""The expert-GEMM sweep: achieved FLOP/s against tokens, for one dtype on one device.

The expert GEMM is x[T, H] times w1[I, H]^T (nn.Linear's layout, as checkpoints store it and the
executor runs it; T = tokens, H = hidden size, I = expert width). The weight keeps the model's
size unless memory forbids: a scaled-down weight fits in the last-level cache and overstates the
small-token (decode) rates, which are bound by reading the weight from memory.

Each of the executor's CPU paths is timed (hrm.rules.gemm_paths): native, and for 16-bit dtypes
the weight widened to float32 slice by slice (`path="widened"`) or packed once for oneDNN
(`path="packed"`; the packing is done before the clock starts, as a run packs at load). Enough
weight copies are rotated, on every path alike, that they stream from memory as a model's many
experts do, even when one matrix would fit in the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from hrm.arch import ModelArch
from hrm.hardware.parts import Curve, path_key
from hrm.policy import FLOAT_DTYPES
from hrm.profiling.timing import Clock, Timing, estimated_duration_s, time_calls
from hrm.rules.gemm_paths import (
    WIDEN_SLICE_ELEMENTS,
    native_linear,
    pack_weight,
    packed_linear,
    widened_linear,
)
from hrm.rules.host_memory import release_freed_host_memory

SWEPT_DTYPES = FLOAT_DTYPES  # the GEMM sweep times every dtype weights are computed in
_ALIGN = 64  # scaled sizes stay multiples of 64, as real layer sizes are
# The packed path times at most this many packed copies: each is a copy made before the clock
# starts (a 64 x 96 test weight streamed past a 480 MiB cache is 80,000 of them, 1.2 GB and 6 s
# of packing). 512 copies of a real expert (2 MB and up) still stream past such a cache; a tiny
# test model's are read from it.
PACKED_COPIES = 512


@dataclass(frozen=True, kw_only=True)
class GemmShape:
    model: str
    hidden: int
    intermediate: int
    scale: float = 1.0  # fraction of the model's hidden and intermediate sizes used

    def flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.intermediate

    def buffer_bytes(self, max_tokens: int, dtype_bytes: int) -> float:
        """Weight, input and output of the largest point."""
        return dtype_bytes * (
            self.hidden * self.intermediate + max_tokens * (self.hidden + self.intermediate)
        )

    def describe(self) -> str:
        size = "full size" if self.scale == 1.0 else f"scaled to {self.scale:g} of each size"
        return (
            f"x[tokens, {self.hidden}] @ w1[{self.intermediate}, {self.hidden}]^T "
            f"({self.model} expert, {size})"
        )


def fit_shape(arch: ModelArch, *, max_tokens: int, memory_budget_bytes: float) -> GemmShape:
    """The model's expert shape, halved (in both sizes) until the fp32 buffers fit the budget."""
    scale = 1.0
    while True:
        shape = GemmShape(
            model=arch.name,
            hidden=max(_ALIGN, round(arch.hidden_size * scale / _ALIGN) * _ALIGN),
            intermediate=max(_ALIGN, round(arch.intermediate_size * scale / _ALIGN) * _ALIGN),
            scale=scale,
        )
        if shape.buffer_bytes(max_tokens, 4) <= memory_budget_bytes or shape.hidden == _ALIGN:
            return shape
        scale /= 2


@dataclass(frozen=True, kw_only=True)
class MatmulSweep:
    dtype: str
    shape: GemmShape
    points: tuple[tuple[int, Timing], ...]  # (tokens, timing of one GEMM)
    stopped: str | None = None  # why the sweep ended before the last point of the grid

    def rates(self) -> list[tuple[int, float]]:
        return [(tokens, t.rate(self.shape.flops(tokens))) for tokens, t in self.points]

    def curve(self) -> Curve:
        return Curve(points=tuple((float(tokens), rate) for tokens, rate in self.rates()))

    @property
    def peak_flops_per_s(self) -> float:
        """Peak = the best median rate achieved over the sweep."""
        return max(rate for _, rate in self.rates())


def sweep_matmul(**kwargs) -> MatmulSweep:
    """_sweep_matmul, then the freed pages of its weights handed back to the OS
    (release_freed_host_memory): sweeps of ever other shapes and paths would otherwise pile
    up their holes in the kept heap."""
    sweep = _sweep_matmul(**kwargs)
    release_freed_host_memory()
    return sweep


def _sweep_matmul(
    *,
    dtype: str,
    shape: GemmShape,
    tokens_grid: tuple[int, ...],
    device: str,
    clock: Clock,
    repeats: int,
    min_sample_s: float,
    budget_s: float,
    tick: Callable[[], None],
    path: str = "native",
    streamed_bytes: float = 0.0,
    weights: list | None = None,
) -> MatmulSweep:
    """Time the GEMM at each token count; stop before a point that would overrun `budget_s`.

    The samples are taken in rounds, one of every point per round after the first pass (which
    warms each point up and takes its first sample), so that a point's samples are spread over
    the whole sweep rather than one window of `repeats` back-to-back samples: a VM whose speed
    drifts over seconds then moves every point alike, and the median outvotes a slow moment
    (docs/decisions.md, 2026-12-03).

    The next point's call time is extrapolated linearly in tokens from the last one, which
    overestimates it (efficiency grows with tokens), and the later rounds' samples of the points
    already taken are counted in, so the budget holds. `tick` is called once per grid point,
    measured or not, to drive the progress bar. Every path runs the executor's own functions
    (hrm.rules.gemm_paths), unpadded: native (reported as `dtype`), or a 16-bit dtype's widened
    or packed path (reported as `<dtype>_widened`, `<dtype>_packed`; packed reorders the weights
    before the first sample, as a run does at load). Each call takes the next of enough weight
    copies to stream at least `streamed_bytes` (twice the last-level cache, say) from memory, as
    a model's many experts do; or rotates the given `weights` (each [I, H] in `dtype`: a model's
    own experts).
    """
    import torch

    # T = tokens, H = hidden, I = expert width
    on = {"dtype": getattr(torch, dtype), "device": device}
    if weights is None:
        weights = rotating_weights(shape, on, streamed_bytes)  # each [I, H]
    inputs = torch.randn(max(tokens_grid), shape.hidden, **on)  # [T, H]
    scratch = torch.empty(WIDEN_SLICE_ELEMENTS, dtype=torch.float32) if path == "widened" else None
    label = path_key(dtype, path)
    weights = [pack_weight(w) for w in weights[:PACKED_COPIES]] if path == "packed" else weights
    taken: dict[int, tuple[Callable[[], object], Timing]] = {}  # tokens -> (GEMM, first sample)
    owed_s = 0.0  # what the later rounds will spend on the points taken so far
    stopped = None
    started = time.perf_counter()
    for tokens in tokens_grid:
        if stopped is None and taken:
            last_tokens, (_, last) = next(reversed(taken.items()))
            predicted_s = estimated_duration_s(
                last.median_s * tokens / last_tokens, repeats=repeats, min_sample_s=min_sample_s
            )
            spent_s = time.perf_counter() - started
            if spent_s + owed_s + predicted_s > budget_s:
                stopped = (
                    f"{label} sweep on {device} stopped before {tokens} tokens: {spent_s:.0f} s "
                    f"spent and {owed_s:.1f} s owed to the later rounds, and that point would take "
                    f"about {predicted_s:.0f} s more, past the {budget_s:.0f} s budget"
                )
        if stopped is None:
            gemm = partial(_rotating_gemm, inputs[:tokens], weights, path, scratch, [0])
            try:
                first = time_calls(gemm, clock=clock, repeats=1, min_sample_s=min_sample_s)
                taken[tokens] = (gemm, first)
                owed_s += (repeats - 1) * first.calls_per_sample * first.median_s
            except RuntimeError as exc:  # the device has no kernel for this dtype
                stopped = f"{dtype} matmul does not run on {device}: {str(exc).splitlines()[0]}"
        tick()
    samples = {tokens: [first.samples_s[0]] for tokens, (_, first) in taken.items()}
    for _ in range(repeats - 1):  # the later rounds: one sample of every point per round
        for tokens, (gemm, first) in taken.items():
            calls = first.calls_per_sample
            samples[tokens].append(clock(gemm, calls) / calls)
    points = tuple(
        (tokens, Timing(samples_s=tuple(samples[tokens]), calls_per_sample=first.calls_per_sample))
        for tokens, (_, first) in taken.items()
    )
    return MatmulSweep(dtype=label, shape=shape, points=points, stopped=stopped)


def rotating_weights(shape: GemmShape, on: dict, streamed_bytes: float) -> list:
    """Copies of one random [I, H] weight, enough that together they span `streamed_bytes`."""
    import torch

    # random rows tiled: the values do not change a dense GEMM's speed, and randn of a whole
    # Mixtral expert alone takes longer than the executor's probe may
    block = torch.randn(min(_ALIGN, shape.intermediate), shape.hidden, **on)  # [64, H]
    tiles = -(-shape.intermediate // block.shape[0])
    weight = block.repeat(tiles, 1)[: shape.intermediate].contiguous()  # [I, H]
    copies = max(1, math.ceil(streamed_bytes / (weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def _rotating_gemm(x, weights: list, path: str, scratch, turn: list[int]):
    """The executor's GEMM (hrm.rules.gemm_paths) along `path` on the next of `weights`
    (widened: into the scratch buffer; packed: weights already packed)."""
    w = weights[turn[0] % len(weights)]
    turn[0] += 1
    if path == "widened":
        return widened_linear(x, w, scratch)
    return packed_linear(x, w) if path == "packed" else native_linear(x, w)
