"""Which GEMM path the CPU takes, per dtype and token count: chosen once, used by both sides.

A 16-bit GEMM on a CPU runs `native` (torch in bf16/fp16), `widened` (float32 after converting
the weight slice by slice) or `packed` (oneDNN over weights reordered once, at load;
hrm.rules.gemm_paths). On an AVX2 EPYC widened was 4-8x faster than native; on a Sapphire Rapids
with AMX-BF16 native was 2-10x faster than widened, and packed 1.3-1.6x faster than native at
decode's rows. Which of native and widened wins also moves with the token count, so that choice
is made per token bucket from measured curves: the profile's `<dtype>`, `<dtype>_widened` and
`<dtype>_packed` matmul curves, or the executor's short probe at the model's shapes. Packed is
all or nothing (a packed weight serves no other path): it is taken at every token count when,
over the curves' grid, it saves NOISE_FLOOR of the time of the best mix of the other two (the
geometric mean of its time over the mix's, each grid point weighing the same). The
executor runs `path_at(tokens)`; the planner prices exactly that path with `gemm_flops_per_s`.
A path pads its rows (hrm.rules.gemm_paths.padded_tokens) where its measured time at 16 rows is
clearly below its time at 12: the dip of sgemm at 9-15 rows on AVX2. Below SMALL_PAD_LIMIT rows
it pads a token count to a larger measured one where that shape's curve says the larger runs in
clearly less time: sgemm ran 2 and 3 rows as GEMVs on an AVX-512 EPYC, slower than 4 or 8.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hrm.errors import HrmError
from hrm.hardware.parts import HALF_DTYPES, Curve, gemm_shape_key, path_key
from hrm.rules.gemm_paths import TOKEN_PAD, padded_tokens
from hrm.schema import check_keys

PATHS = ("native", "widened", "packed")
NAMED = "--cpu-gemm "  # the source of a choice whose path the run named
MODES = ("auto", *PATHS)
PAD_CHECK_TOKENS = (12, 16)  # padding pays when 16 rows take less time than 12
SMALL_PAD_LIMIT = 8  # up to this many rows, a GEMM may pad to a larger measured row count
ANY_SHAPE = "*"  # small pads read off the w1-shape curve: shapes without a curve of their own
# A path is taken over native, and padding over none, only when it saves at least this share of
# the time: two profiles of one host differ by about 5%, so a smaller gain is timing noise.
NOISE_FLOOR = 0.1
NARROW = 128  # a GEMM with fewer inputs or outputs than this (a router) is read from its likes


class GemmRates(Protocol):
    """Measured or datasheet GEMM rates: a DeviceSpec, or a probe's measurement."""

    peak_flops_per_s: Mapping[str, float]
    matmul_curves: Mapping[str, Curve]  # at the expert's w1 shape
    gemm_shape_curves: Mapping[str, Mapping[str, Curve]]  # other shapes (DeviceSpec)
    matmul_shape: str | None  # the shape matmul_curves were timed at, where known


@dataclass(frozen=True, kw_only=True)
class MeasuredRates:
    """GemmRates from a probe: curves per rate key, peaks their best points."""

    matmul_curves: Mapping[str, Curve]
    gemm_shape_curves: Mapping[str, Mapping[str, Curve]] = field(default_factory=dict)
    matmul_shape: str | None = None  # the model's own: a probe times its expert w1

    @property
    def peak_flops_per_s(self) -> dict[str, float]:
        return {key: curve.best for key, curve in self.matmul_curves.items()}


def rate_key(rates: GemmRates, dtype: str, path: str) -> str:
    """The profile key of a path's rates: the dtype itself when native; `<dtype>_widened` when
    widened, or float32 where the profile has no widened rate (the widened GEMM is an fp32 one);
    `<dtype>_packed` when packed, or the native rate where the profile has no packed one;
    `<dtype>_fused` when the experts run fused (CpuGemmChoice.fused_experts: priced only where the
    profile timed it, hrm.rules.cpu_moe)."""
    if path == "native":
        return dtype
    if path == "fused":
        return path_key(dtype, path)
    key = path_key(dtype, path)
    if key in rates.peak_flops_per_s:
        return key
    return "float32" if path == "widened" else dtype


def rate_at(
    rates: GemmRates, key: str, tokens: float, shape: tuple[int, int] | None = None
) -> float:
    """FLOP/s at `tokens` rows: the curve at `shape` (d_in, d_out) (shape_curve), else the
    w1-shape curve, else the peak, else float32's."""
    curve = shape_curve(rates, key, shape)
    return curve.at(tokens) if curve is not None else peak_at(rates, key)


_SHAPE_MEMO: dict[tuple[int, int], tuple[tuple, dict]] = {}  # ids -> (held curves, read)


def shape_curve(rates: GemmRates, key: str, shape: tuple[int, int] | None) -> Curve | None:
    """`key`'s curve at `shape`: measured there; else read between the two measured shapes
    nearest in weight size (d_in * d_out), among those of its input width where there are any,
    each row count's rate a power law in the size between them (log-log, as Curve reads rows),
    held flat beyond the smallest and largest; else the w1-shape curve. The measured shapes are
    the profile's (its model's q, k/v, o, router, w2, LM head, w1 at matmul_shape, and the
    generic shapes hrm profile adds): a profile of Mixtral 8x7B prices a hidden-1024 model's
    GEMMs from its 1024-wide shapes, not from its 58M-weight expert."""
    fallback = rates.matmul_curves.get(key)
    if shape is None:
        return fallback
    # read once per set of curves (a search prices a shape thousands of times); the memo holds
    # the curves it is keyed by, so their ids are not reused while it lives
    held = (rates.gemm_shape_curves, rates.matmul_curves)
    _, memo = _SHAPE_MEMO.setdefault(tuple(map(id, held)), (held, {}))
    at = (key, shape, rates.matmul_shape)
    if at not in memo:
        memo[at] = _read_between(rates, key, shape)
    return memo[at] or fallback


def _read_between(rates: GemmRates, key: str, shape: tuple[int, int]) -> Curve | None:
    """shape_curve's measured or interpolated curve; None where `key` has no shape measured."""
    by_shape = {name: curves[key] for name, curves in rates.gemm_shape_curves.items()
                if key in curves}  # fmt: skip
    if rates.matmul_shape is not None and key in rates.matmul_curves:
        by_shape.setdefault(rates.matmul_shape, rates.matmul_curves[key])
    name = gemm_shape_key(*shape)
    if name in by_shape or not by_shape:
        return by_shape.get(name)
    dims = {other: tuple(map(int, other.split("x"))) for other in by_shape}
    # a router's few outputs run unlike a matrix of the same size: narrow from narrow; and a
    # matrix from those of its own input width where there are some (packed gained 1.2-1.8x
    # native at d_in 1024 and 1.1-1.3x at 4096, at like sizes)
    alike = [o for o, d in dims.items() if (min(d) < NARROW) == (min(shape) < NARROW)] or dims
    alike = [o for o in alike if dims[o][0] == shape[0]] or alike
    sizes: dict[float, list[Curve]] = {}
    for other in alike:
        d_in, d_out = dims[other]
        sizes.setdefault(math.log(d_in * d_out), []).append(by_shape[other])
    logs = sorted(sizes)
    x = min(max(math.log(shape[0] * shape[1]), logs[0]), logs[-1])
    i = bisect.bisect_left(logs, x)  # logs[i] >= x, and i > 0 where logs[i] > x
    lo, hi = (logs[i - 1] if logs[i] > x else x), logs[i]
    w = (x - lo) / (hi - lo) if hi > lo else 0.0
    curves = [(c, (1 - w) / len(sizes[lo])) for c in sizes[lo]]
    curves += [(c, w / len(sizes[hi])) for c in sizes[hi]] if hi > lo else []
    rows = sorted({r for c, _ in curves for r, _ in c.points})
    points = [(r, math.exp(sum(f * math.log(c.at(r)) for c, f in curves))) for r in rows]
    return Curve(points=tuple(points))


def peak_at(rates: GemmRates, key: str) -> float:
    """The peak FLOP/s of a rate key, else float32's."""
    peak = rates.peak_flops_per_s.get(key, rates.peak_flops_per_s.get("float32"))
    if peak is None:
        raise HrmError(f"no FLOP rate for {key} or float32 in the CPU profile")
    return peak


def pays_to_pad(curve: Curve | None) -> bool:
    """Measured: 16 rows take clearly less time than 12 (t = rows / rate); False without both
    points."""
    if curve is None:
        return False
    rates = dict(curve.points)
    small, padded = PAD_CHECK_TOKENS
    if small not in rates or padded not in rates:
        return False
    return padded / rates[padded] < (1 - NOISE_FLOOR) * small / rates[small]


def has_choice_curves(rates: GemmRates, dtype: str, paths: tuple[str, ...] = ()) -> bool:
    """Whether the curves hold what the choice needs: each path's curve with the padding points
    (native and widened for a 16-bit dtype, and `paths` besides: what the host also runs)."""
    half = ("widened", *paths) if dtype in HALF_DTYPES else ()
    keys = [dtype] + [path_key(dtype, path) for path in dict.fromkeys(half) if path != "native"]
    return all(
        key in rates.matmul_curves
        and set(PAD_CHECK_TOKENS) <= {x for x, _ in rates.matmul_curves[key].points}
        for key in keys
    )


@dataclass(frozen=True, kw_only=True)
class CpuGemmChoice:
    """The path each CPU GEMM of `dtype` takes by its token count, and which paths pad."""

    dtype: str
    buckets: tuple[tuple[float, str], ...]  # (first token count, path), ascending from 0
    padded: tuple[str, ...] = ()
    # path -> shape key (or ANY_SHAPE) -> {tokens: rows run} up to SMALL_PAD_LIMIT
    small_pads: Mapping[str, Mapping[str, Mapping[int, int]]] = field(default_factory=dict)
    source: str
    # how the routed experts run (hrm.rules.cpu_moe): `loop`, each expert its GEMMs along the
    # buckets' paths, or `fused`, each of their GEMMs one call over all of them
    experts: str = "loop"
    # how the other matrices run: `paths`, along the buckets' paths, or `fused`, on the experts'
    # kernel as one expert of all the rows (executor/fused_moe.py fused_linears)
    linears: str = "paths"
    # where fused experts' GLU runs: `apart`, torch's ops between the two calls, or `tiles`, in
    # the gate-up call's tiles (executor/fused_moe.py grouped_swiglu): no pass of its own
    glu: str = "apart"
    # id(rates) -> (rates, {(tokens, shape): FLOP/s}): a search asks for the same few row counts
    # hundreds of thousands of times; holding `rates` keeps its id from being reused
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    _unpacked: list = field(default_factory=list, init=False, compare=False, repr=False)
    _fused: list = field(default_factory=list, init=False, compare=False, repr=False)

    def path_at(self, tokens: float) -> str:
        return _path_of(self.buckets, tokens)

    @property
    def named(self) -> bool:
        """The path was named (--cpu-gemm PATH), not chosen: every matrix keeps to it."""
        return self.source.startswith(NAMED)

    def pads(self, path: str) -> bool:
        return path in self.padded

    def rows_at(self, tokens: float, shape: tuple[int, int] | None = None) -> float:
        """The rows the GEMM (d_in, d_out) runs at: padded where the chosen path pads."""
        return _rows_run(self.small_pads, self.padded, self.path_at(tokens), tokens, shape)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(path for _, path in self.buckets))

    def unpacked(self) -> CpuGemmChoice:
        """This choice with `packed` run native: the GEMMs of a run whose layers a store hands
        over a page at a time, where nothing is packed (executor/runtime.py builds that model
        with packs=False: a page is never reordered for oneDNN). Kept, with its rates' memo,
        for the next call."""
        if "packed" not in self.paths and self.experts == "loop" and self.linears == "paths":
            return self
        if not self._unpacked:
            buckets: list[tuple[float, str]] = []
            for start, path in self.buckets:
                path = "native" if path == "packed" else path
                if not buckets or buckets[-1][1] != path:
                    buckets.append((start, path))
            self._unpacked.append(dataclasses.replace(
                self, buckets=tuple(buckets), source=f"{self.source}, pages unpacked",
                experts="loop", linears="paths", glu="apart",
            ))  # fmt: skip
        return self._unpacked[0]

    def fused_experts(self) -> CpuGemmChoice:
        """The choice the routed experts' GEMMs are priced by where they run fused: every row
        count on the `fused` rate key (`<dtype>_fused`, hrm profile's curves of the kernel),
        unpadded. Kept, with its rates' memo, for the next call."""
        if not self._fused:
            self._fused.append(dataclasses.replace(
                self, buckets=((0.0, "fused"),), padded=(), small_pads={},
                source=f"{self.source}, experts fused",
            ))  # fmt: skip
        return self._fused[0]

    def describe(self) -> str:
        parts = []
        for i, (start, path) in enumerate(self.buckets):
            first = max(1, math.ceil(start))
            end = self.buckets[i + 1][0] if i + 1 < len(self.buckets) else None
            span = f"{first}+" if end is None else f"{first}-{math.ceil(end) - 1}"
            small = self.small_pads.get(path, {}).get(ANY_SHAPE, {})
            notes = ["padded"] if self.pads(path) else []
            if small:
                notes.append("rows " + ", ".join(f"{t}->{r}" for t, r in sorted(small.items())))
            parts.append(f"{path} at {span} tokens" + (f" ({'; '.join(notes)})" if notes else ""))
        fused = [n for n in ("experts", "linears") if getattr(self, n) == "fused"]
        experts = f"; {' and '.join(fused)} fused" if fused else ""
        return f"{self.dtype}: " + ", ".join(parts) + f"{experts} [{self.source}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "buckets": [[start, path] for start, path in self.buckets],
            "padded": list(self.padded),
            "small_pads": {
                path: {shape: {str(t): r for t, r in pads.items()} for shape, pads in by.items()}
                for path, by in self.small_pads.items()
            },
            "source": self.source,
            "experts": self.experts,
            "linears": self.linears,
            "glu": self.glu,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "cpu_gemm") -> CpuGemmChoice:
        """The choice as to_dict wrote it (a RunRecord's environment); an extra key (the run's
        `calls`) is not the choice's and is left to the caller."""
        # records made before small_pads, experts or linears existed ran without them (the loop)
        optional = {"calls", "experts", "linears", "glu", "small_pads"}
        required = {f.name for f in dataclasses.fields(cls) if f.init} - optional
        data = check_keys(data, where=where, required=required, optional=optional)
        experts, linears = data.get("experts", "loop"), data.get("linears", "paths")
        if experts not in ("loop", "fused"):
            raise HrmError(f"{where}: experts must be loop or fused, not {experts!r}")
        if linears not in ("paths", "fused"):
            raise HrmError(f"{where}: linears must be paths or fused, not {linears!r}")
        if data.get("glu", "apart") not in ("apart", "tiles"):
            raise HrmError(f"{where}: glu must be apart or tiles, not {data['glu']!r}")
        buckets = data["buckets"]
        if (
            not isinstance(buckets, list)
            or not buckets
            or any(not isinstance(b, list) or len(b) != 2 or b[1] not in PATHS for b in buckets)
        ):
            raise HrmError(f"{where}: buckets must be a list of [first token count, path] pairs")
        return cls(
            dtype=str(data["dtype"]),
            buckets=tuple((float(start), path) for start, path in buckets),
            padded=tuple(data["padded"]),
            small_pads=_small_pads_from(data.get("small_pads", {}), where),
            source=str(data["source"]),
            experts=experts,
            linears=linears,
            glu=data.get("glu", "apart"),
        )


def choose_cpu_gemm(
    rates: GemmRates,
    dtype: str,
    mode: str = "auto",
    *,
    source: str = "profile",
    shape: tuple[int, int] | None = None,
) -> CpuGemmChoice:
    """The fastest path at each token count of the curves' grid, from `rates` (native unless
    another saves NOISE_FLOOR of its time; packed at every count or none, and only where the
    rates hold its curve); mode native, widened or packed forces one path (padding still as
    measured). Float32 has one path, native. `shape`: the run's expert w1 (d_in, d_out), whose
    curves (shape_curve) decide; packed ran 1.3-1.8x native at hidden 1024 and 1.07-1.11x at
    Mixtral 8x7B's expert on the AMX VM, so a profile's own w1 does not speak for every model."""
    if mode not in MODES:
        raise HrmError(f"--cpu-gemm: unknown path {mode!r}; use one of {', '.join(MODES)}")
    paths = PATHS if dtype in HALF_DTYPES else ("native",)
    keys = {path: rate_key(rates, dtype, path) for path in paths}
    # padding is the kernel's row blocking: read off the w1 curve, whose grid has 12 rows
    padded = tuple(p for p in paths if pays_to_pad(rates.matmul_curves.get(keys[p])))
    small = {path: small_pads_by_shape(rates, keys[path]) for path in paths}
    if mode != "auto" and dtype not in HALF_DTYPES:
        source = f"{dtype} runs natively; --cpu-gemm {mode} applies to 16-bit dtypes"
        mode = "auto"
    if mode != "auto":
        return CpuGemmChoice(
            dtype=dtype,
            buckets=((0.0, mode),),
            padded=padded,
            small_pads={mode: small[mode]},
            source=f"{NAMED}{mode}",
        )

    def seconds_per_row(path: str, tokens: float) -> float:
        # t(T) = rows_run / rate(rows_run), per useful row
        rows = _rows_run(small, padded, path, tokens, None)
        return rows / rate_at(rates, keys[path], rows, shape) / tokens

    curves = [shape_curve(rates, k, shape) for k in keys.values() if k in rates.matmul_curves]
    grid = sorted({x for curve in curves for x, _ in curve.points}) or [1.0]
    buckets = _mixed_buckets(grid, [p for p in paths if p != "packed"], seconds_per_row)
    if "packed" in paths and path_key(dtype, "packed") in rates.matmul_curves:
        # each grid point weighs the same: the geometric mean of packed's time over the mix's
        ratios = [seconds_per_row("packed", t) / seconds_per_row(_path_of(buckets, t), t)
                  for t in grid]  # fmt: skip
        if math.exp(sum(map(math.log, ratios)) / len(ratios)) < 1 - NOISE_FLOOR:
            buckets = [(0.0, "packed")]
    taken = {path for _, path in buckets}
    small = {path: pads for path, pads in small.items() if path in taken}
    return CpuGemmChoice(
        dtype=dtype, buckets=tuple(buckets), padded=padded, small_pads=small, source=source
    )


def _mixed_buckets(grid, paths, seconds_per_row) -> list[tuple[float, str]]:
    """The fastest of `paths` at each grid point (native unless another saves NOISE_FLOOR of its
    time), as buckets that each start half way (in log tokens) from the previous point."""
    buckets: list[tuple[float, str]] = []
    for i, tokens in enumerate(grid):
        native = seconds_per_row("native", tokens)
        best = min(paths, key=lambda p: seconds_per_row(p, tokens))
        if seconds_per_row(best, tokens) > (1 - NOISE_FLOOR) * native:
            best = "native"  # within noise of native: the plain path
        if not buckets or buckets[-1][1] != best:
            start = 0.0 if i == 0 else math.sqrt(grid[i - 1] * tokens)
            buckets.append((start, best))
    return buckets


def _path_of(buckets, tokens: float) -> str:
    """The path of the bucket `tokens` falls in."""
    return buckets[bisect.bisect_right([start for start, _ in buckets], tokens) - 1][1]


def small_row_pads(curve: Curve | None) -> dict[int, int]:
    """{tokens: rows} for measured row counts below SMALL_PAD_LIMIT that run in clearly less time
    zero-padded to a larger measured count (t = rows / rate): the fastest such count, the
    smallest within NOISE_FLOOR of it, where it saves at least NOISE_FLOOR of the time. Only
    measured points count: padding is measured, not assumed."""
    if curve is None:
        return {}
    measured = {
        int(x): x / rate for x, rate in curve.points if x <= SMALL_PAD_LIMIT and x == int(x)
    }
    pads = {}
    for tokens, own in measured.items():
        faster = {r: t for r, t in measured.items() if r > tokens and t < (1 - NOISE_FLOOR) * own}
        if faster:
            best = min(faster.values())
            pads[tokens] = min(r for r, t in faster.items() if t <= (1 + NOISE_FLOOR) * best)
    return pads


def small_pads_by_shape(rates: GemmRates, key: str) -> dict[str, dict[int, int]]:
    """small_row_pads of a rate key at the w1 shape (ANY_SHAPE) and at each shape measured in
    it: a shape's own curve decides its padding, as its own curve prices it (rate_at)."""
    shapes = rates.gemm_shape_curves
    return {
        ANY_SHAPE: small_row_pads(rates.matmul_curves.get(key)),
        **{name: small_row_pads(curves[key]) for name, curves in shapes.items() if key in curves},
    }


def _rows_run(small_pads, padded, path: str, tokens: float, shape) -> float:
    """The rows a GEMM of `tokens` rows runs at on `path`: below SMALL_PAD_LIMIT its shape's
    small pad (a fractional count, the planner's, at its next whole count), above it the next
    multiple of TOKEN_PAD where the path pads."""
    if tokens <= SMALL_PAD_LIMIT:
        by_shape = small_pads.get(path)
        if not by_shape:
            return float(tokens)
        key = gemm_shape_key(*shape) if shape is not None else ANY_SHAPE
        pads = by_shape.get(key, by_shape.get(ANY_SHAPE, {}))
        return float(pads.get(math.ceil(tokens), tokens))
    return padded_tokens(tokens) if path in padded else tokens


def _small_pads_from(data: Any, where: str) -> dict[str, dict[str, dict[int, int]]]:
    """small_pads as to_dict wrote it: {path: {shape: {tokens: rows}}}."""
    try:
        return {
            str(path): {
                str(shape): {int(t): int(r) for t, r in pads.items()}
                for shape, pads in shapes.items()
            }
            for path, shapes in data.items()
        }
    except (AttributeError, TypeError, ValueError):
        raise HrmError(
            f"{where}: small_pads must map each path to shapes to {{tokens: rows}}"
        ) from None


def gemm_flops_per_s(
    rates: GemmRates, choice: CpuGemmChoice, tokens: float, shape: tuple[int, int] | None = None
) -> float:
    """Useful FLOP/s of a GEMM at `tokens` rows along the chosen path: the path's rate at the rows
    it runs (padded or not) at its shape, times the useful share of those rows."""
    memo = choice._memo.setdefault(id(rates), (rates, {}))[1]
    if (tokens, shape) not in memo:
        path = choice.path_at(tokens)
        rows = choice.rows_at(tokens, shape)
        key = rate_key(rates, choice.dtype, path)
        memo[tokens, shape] = rate_at(rates, key, rows, shape) * tokens / rows
    return memo[tokens, shape]


def gemm_flops_per_s_each(
    rates: GemmRates, choice: CpuGemmChoice, tokens, shape: tuple[int, int] | None = None
) -> np.ndarray:
    """gemm_flops_per_s at each of an array of token counts (a binomial's counts of rows per
    expert: a search asks for hundreds of thousands), the curves read in one interpolation a
    path; small counts, with their pads, one by one."""
    t = np.asarray(tokens, dtype=float)
    out = np.empty_like(t)
    small = t <= SMALL_PAD_LIMIT
    for i in np.flatnonzero(small):
        out.flat[i] = gemm_flops_per_s(rates, choice, float(t.flat[i]), shape)
    starts = np.array([start for start, _ in choice.buckets])
    bucket = np.searchsorted(starts, t, side="right") - 1
    for b, (_, path) in enumerate(choice.buckets):
        mask = (bucket == b) & ~small
        if not mask.any():
            continue
        x = t[mask]  # above SMALL_PAD_LIMIT: padded to the next multiple where the path pads
        rows = np.ceil(x / TOKEN_PAD) * TOKEN_PAD if path in choice.padded else x
        key = rate_key(rates, choice.dtype, path)
        curve = shape_curve(rates, key, shape)
        rate = curve.at_each(rows) if curve is not None else peak_at(rates, key)
        out[mask] = rate * x / rows
    return out


def gemm_peak_flops_per_s(rates: GemmRates, choice: CpuGemmChoice) -> float:
    """The CPU's compute roof for `choice.dtype`: the best peak among the paths it takes."""
    return max(peak_at(rates, rate_key(rates, choice.dtype, path)) for path in choice.paths)
