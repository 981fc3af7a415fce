"""The parts of a hardware profile: devices, the CPU-GPU link, GPU interconnects and measured
curves, with their YAML form (decimal units in files, SI base units in the dataclasses).
hrm/hardware/__init__.py assembles them into a HardwareProfile.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hrm import units
from hrm.errors import HrmError
from hrm.policy import DTYPE_BYTES
from hrm.schema import check_keys, positive_float, positive_int

RATE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8")


@dataclass(frozen=True, kw_only=True)
class Curve:
    """Achieved rate against size, interpolated as a power law between measured points (log
    rate linear in log size); flat beyond the ends.

    Matmul curves: x = tokens (rows of the GEMM), y = FLOP/s.  Link curves: x = bytes per
    transfer, y = bytes/s.  Measured curves let the planner charge achieved, not peak, rates.
    Why log-log: a bound regime is a power law, rate ~ size where a fixed cost (a weight read, a
    latency) dominates and rate ~ const where the roof does, and log-log interpolation is exact on
    both. Linear in log(size) overstated the rate between such points: 22% at 2.25 rows between
    measured 1 and 4 (docs/decisions.md, 2026-12-02).
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if not self.points or xs != sorted(xs) or len(set(xs)) != len(xs):
            raise HrmError("curve: points must be non-empty with strictly increasing sizes")
        if any(x <= 0 or y <= 0 for x, y in self.points):
            raise HrmError("curve: sizes and rates must be positive")

    def at(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        if x <= xs[0]:
            return self.points[0][1]
        if x >= xs[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(xs, x)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        if x == x0:
            return y0
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))

    def at_each(self, x):
        """`at` for a numpy array of sizes, elementwise (the cost model's per-step lookups)."""
        import numpy as np

        xs = np.log([p[0] for p in self.points])
        ys = np.log([p[1] for p in self.points])
        return np.exp(np.interp(np.log(np.maximum(x, 1e-30)), xs, ys))

    @property
    def best(self) -> float:
        return max(y for _, y in self.points)


# 16-bit float dtypes a CPU may compute in float32 after widening (hrm.rules.cpu_gemm).
HALF_DTYPES = ("bfloat16", "float16")
# hrm profile times that path on a CPU and stores its rates beside the dtypes under these keys.
WIDENED_KEYS = {dtype: f"{dtype}_widened" for dtype in HALF_DTYPES}


@dataclass(frozen=True, kw_only=True)
class LaunchOverhead:
    """The executor's fixed cost on this device beyond FLOPs and bytes (measured, seconds):
    per layer and micro-batch, per expert that micro-batch touches, and per decode step."""

    per_layer_s: float
    per_expert_s: float
    per_step_s: float


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One kind of processor with its local memory. For a GPU the figures are per GPU."""

    name: str
    count: int = 1
    cores: int | None = None
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    peak_flops_per_s: Mapping[str, float]
    matmul_curves: Mapping[str, Curve] = field(default_factory=dict)
    # Free memory when a measured profile was taken (MemAvailable, cudaMemGetInfo); None if unknown.
    available_memory_bytes: float | None = None
    # per dtype the executor ran in, measured by hrm profile (an older profile's one figure was
    # measured in float32: `upgrade`); see launch_overhead_for
    launch_overhead: Mapping[str, LaunchOverhead] = field(default_factory=dict)
    # What long GEMMs sustain (a published measurement, cited in the file): the planner's rate
    # where no curve was measured; the peak stays the roofline's top roof.
    sustained_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    # CPU only: the executor's decode-attention stage, K/V bytes read per call -> bytes/s, per
    # KV dtype (measured by hrm profile); a dtype absent here is priced by FLOPs and memory
    # bandwidth. Per dtype because the rate is: float32 read K/V 1.5x as fast as bfloat16
    # (bench_prediction_by_op, 2026-12-03)
    attention_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: the executor's prefill attention stage, FLOPs per call (hrm.roofline.ops.
    # prefill_attention_flops) -> FLOP/s, per dtype (measured by hrm profile); a dtype absent
    # here is priced at the GEMM curve with the causal FLOP count
    prefill_attention_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: bytes a host memcpy copies per second, each byte read once and written once
    # (STREAM's copy figure counts twice this), measured by hrm profile; what the CPU standing in
    # for a GPU moves its pages at (hrm/hardware/stand_in.py). None: not measured
    copy_bandwidth_bytes_per_s: float | None = None
    # CPU only: elements read or written per second by the executor's elementwise kernels, per
    # dtype (measured by hrm profile); absent: memory bandwidth / element size
    elementwise_rate: Mapping[str, float] = field(default_factory=dict)
    # GPU only: the executor's whole grouped expert FFN, FLOP/s against rows per expert, per
    # dtype (measured by hrm profile); absent: the GEMM curve plus the elementwise passes
    expert_ffn_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: GEMM FLOP/s against rows at each other shape the executor runs, keyed by
    # gemm_shape_key ("d_in x d_out") then by rate key (measured by hrm profile); a shape absent
    # here is priced at matmul_curves, timed at the expert's w1 shape
    gemm_shape_curves: Mapping[str, Mapping[str, Curve]] = field(default_factory=dict)

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s of all `count` devices for `dtype`; falls back to float32 when absent.
        (A CPU's 16-bit GEMMs take the path hrm.rules.cpu_gemm chooses; price those with it.)"""
        rate = self.peak_flops_per_s.get(dtype, self.peak_flops_per_s.get("float32"))
        if rate is None:
            raise HrmError(f"{self.name}: no FLOP rate for {dtype} or float32 in the profile")
        return rate * self.count

    def matmul_flops_per_s(self, dtype: str, tokens: float) -> float:
        """Achieved GEMM FLOP/s of all devices at `tokens` rows: the measured curve, else the
        sustained rate, else the peak."""
        curve = self.matmul_curves.get(dtype)
        if curve:
            return curve.at(tokens) * self.count
        if dtype in self.sustained_flops_per_s:
            return self.sustained_flops_per_s[dtype] * self.count
        return self.flops_per_s(dtype)

    def launch_overhead_for(self, dtype: str) -> LaunchOverhead | None:
        """The fixed costs measured in `dtype`, else in another (_measured_in), else None."""
        return _measured_in(self.launch_overhead, dtype)

    def elementwise_elements_per_s(self, dtype: str) -> float:
        """Rate of elementwise passes in `dtype`: measured in it or another (_measured_in), else
        each element from memory once."""
        measured = _measured_in(self.elementwise_rate, dtype)
        if measured is not None:
            return measured * self.count
        return self.total_memory_bandwidth_bytes_per_s / DTYPE_BYTES[dtype]

    @property
    def total_memory_bytes(self) -> float:
        return self.memory_bytes * self.count

    @property
    def total_memory_bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.count


def _measured_in(by_dtype: Mapping[str, Any], dtype: str) -> Any:
    """A per-dtype figure that only some dtypes have: `dtype`'s, else float32's (a profile
    older than per-dtype figures has only that), else any dtype's (a quick profile times
    bfloat16 alone), else None."""
    if dtype in by_dtype:
        return by_dtype[dtype]
    if "float32" in by_dtype:
        return by_dtype["float32"]
    return next(iter(by_dtype.values()), None)


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """The CPU <-> GPU link (PCIe), per GPU; both directions can run at once."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_curve: Curve | None = None
    d2h_curve: Curve | None = None
    # Bytes per second moved in both directions together when h2d and d2h run at once (measured).
    bidirectional_bytes_per_s: float | None = None
    # The GPUs' links share one host root complex (a PCIe switch): together they move no more
    # than one link's bandwidth. Default False: each GPU on a root port of its own.
    shared: bool = False
    # Host memory the driver lets a process pin (container or OS limit); None: enough for the
    # weights. Weights beyond it stay pageable behind a pinned staging ring (planner/cost.py).
    pinnable_bytes: float | None = None


def gemm_shape_key(d_in: int, d_out: int) -> str:
    """The profile's name of a GEMM shape x[T, d_in] @ w[d_out, d_in]^T."""
    return f"{d_in}x{d_out}"


INTERCONNECTS = ("pcie", "nvlink")


@dataclass(frozen=True, kw_only=True)
class Interconnect:
    """GPU-to-GPU links for tensor parallelism's all-reduces: per GPU, each direction."""

    kind: str  # pcie (peer-to-peer through the host bridge) or nvlink
    bytes_per_s: float


_DEVICE_KEYS = {"name", "memory", "memory_bandwidth", "flops"}
_DEVICE_OPTIONAL = {
    "count",
    "cores",
    "matmul_curves",
    "available_memory",
    "launch_overhead",
    "sustained_flops",
    "attention_curves",
    "prefill_attention_curves",
    "elementwise_rate",
    "expert_ffn_curves",
    "gemm_shape_curves",
    "copy_bandwidth",
}
# what hrm profile measures with the executor's own code on one kind of device only
_CPU_ONLY = (
    "attention_curves",
    "prefill_attention_curves",
    "elementwise_rate",
    "gemm_shape_curves",
    "copy_bandwidth",
)
_GPU_ONLY = ("expert_ffn_curves",)


def _by_dtype(data, key: str, where: str, keys: set[str]) -> dict:
    """The optional mapping `key` of a device, keyed by the dtypes (or rate keys) in `keys`."""
    return check_keys(data.get(key) or {}, where=f"{where}: {key}", required=set(), optional=keys)


def upgrade(data: Any, where: str) -> Any:
    """A device section written by an older hrm profile, in today's keys (the one place that
    reads old formats): one `attention_curve`, measured in bfloat16, becomes attention_curves
    {bfloat16: ...}; an unkeyed `launch_overhead`, measured in float32, becomes {float32: ...}."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    if data.get("attention_curve") is not None:
        if data.get("attention_curves"):
            raise HrmError(f"{where}: give attention_curves only (attention_curve is its old name)")
        data["attention_curves"] = {"bfloat16": data["attention_curve"]}
    data.pop("attention_curve", None)
    overhead = data.get("launch_overhead")
    if isinstance(overhead, dict) and "per_layer_s" in overhead:
        data["launch_overhead"] = {"float32": overhead}
    return data


def _device_from_dict(data: Any, where: str, is_cpu: bool = False) -> DeviceSpec:
    data = upgrade(data, where)
    data = check_keys(data, where=where, required=_DEVICE_KEYS, optional=_DEVICE_OPTIONAL)
    # only a CPU widens 16-bit weights (the executor's CPU path), so only a CPU has those rates
    rate_keys = set(RATE_DTYPES) | (set(WIDENED_KEYS.values()) if is_cpu else set())
    flops = check_keys(data["flops"], where=f"{where}: flops", required=set(), optional=rate_keys)
    if not flops:
        raise HrmError(f"{where}: flops must name at least one dtype ({', '.join(RATE_DTYPES)})")
    curves_in = _by_dtype(data, "matmul_curves", where, rate_keys)
    count = positive_int(data.get("count", 1), where=f"{where}: count")
    if is_cpu and count != 1:
        raise HrmError(f"{where}: count must be 1 for the cpu (give the total cores and memory)")
    cores = data.get("cores")
    available = data.get("available_memory")
    for keys, only_for in ((_CPU_ONLY, "cpu"), (_GPU_ONLY, "gpu")):
        for key in keys:
            if data.get(key) is not None and is_cpu != (only_for == "cpu"):
                raise HrmError(f"{where}: {key} is measured for the {only_for} only")
    overhead = _overheads_from_dict(data.get("launch_overhead"), f"{where}: launch_overhead")
    attention = data.get("attention_curves") or {}
    elementwise = _by_dtype(data, "elementwise_rate", where, set(RATE_DTYPES))
    copy = data.get("copy_bandwidth")
    sustained = _by_dtype(data, "sustained_flops", where, set(RATE_DTYPES))
    return DeviceSpec(
        gemm_shape_curves=_shape_curves_from_dict(
            data.get("gemm_shape_curves") or {}, f"{where}: gemm_shape_curves", rate_keys
        ),
        launch_overhead=overhead,
        expert_ffn_curves=_dtype_curves(
            data.get("expert_ffn_curves"), f"{where}: expert_ffn_curves", units.parse_flops
        ),
        elementwise_rate={
            dtype: positive_float(rate, where=f"{where}: elementwise_rate: {dtype}")
            for dtype, rate in elementwise.items()
        },
        attention_curves=_dtype_curves(
            attention, f"{where}: attention_curves", units.parse_bandwidth
        ),
        prefill_attention_curves=_dtype_curves(
            data.get("prefill_attention_curves"),
            f"{where}: prefill_attention_curves",
            units.parse_flops,
        ),
        sustained_flops_per_s={
            dtype: units.parse_flops(rate, f"{where}: sustained_flops: {dtype}")
            for dtype, rate in sustained.items()
        },
        name=str(data["name"]),
        count=count,
        cores=positive_int(cores, where=f"{where}: cores") if cores is not None else None,
        memory_bytes=units.parse_bytes(data["memory"], f"{where}: memory"),
        memory_bandwidth_bytes_per_s=units.parse_bandwidth(
            data["memory_bandwidth"], f"{where}: memory_bandwidth"
        ),
        copy_bandwidth_bytes_per_s=units.parse_bandwidth(copy, f"{where}: copy_bandwidth")
        if copy is not None
        else None,
        peak_flops_per_s={
            dtype: units.parse_flops(rate, f"{where}: flops: {dtype}")
            for dtype, rate in flops.items()
        },
        matmul_curves={
            dtype: _curve_from_list(points, f"{where}: matmul_curves: {dtype}", units.parse_flops)
            for dtype, points in curves_in.items()
        },
        available_memory_bytes=units.parse_bytes(available, f"{where}: available_memory")
        if available is not None
        else None,
    )


def _dtype_curves(data: Any, where: str, parse_rate) -> dict[str, Curve]:
    """A mapping of dtype -> [size, rate] pairs (absent: empty), checked and parsed."""
    curves = check_keys(data or {}, where=where, required=set(), optional=set(RATE_DTYPES))
    return {
        dtype: _curve_from_list(points, f"{where}: {dtype}", parse_rate)
        for dtype, points in curves.items()
    }


def _shape_curves_from_dict(data: Any, where: str, rate_keys: set[str]) -> dict:
    if not isinstance(data, dict):
        raise HrmError(f"{where}: must be a mapping of shapes (like 4096x1024) to curves")
    out = {}
    for shape, curves in data.items():
        d_in, _, d_out = str(shape).partition("x")
        if not (d_in.isdigit() and d_out.isdigit() and int(d_in) > 0 and int(d_out) > 0):
            raise HrmError(f"{where}: {shape!r} is not a shape; write d_in x d_out, like 4096x1024")
        curves = check_keys(curves, where=f"{where}: {shape}", required=set(), optional=rate_keys)
        out[str(shape)] = {
            key: _curve_from_list(points, f"{where}: {shape}: {key}", units.parse_flops)
            for key, points in curves.items()
        }
    return out


def _device_to_dict(device: DeviceSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": device.name}
    if device.count != 1:
        out["count"] = device.count
    if device.cores is not None:
        out["cores"] = device.cores
    out["memory"] = units.format_bytes(device.memory_bytes, None)
    if device.available_memory_bytes is not None:
        out["available_memory"] = units.format_bytes(device.available_memory_bytes, None)
    out["memory_bandwidth"] = units.format_bandwidth(device.memory_bandwidth_bytes_per_s, None)
    if device.copy_bandwidth_bytes_per_s is not None:
        out["copy_bandwidth"] = units.format_bandwidth(device.copy_bandwidth_bytes_per_s, None)
    out["flops"] = {d: units.format_flops(r, None) for d, r in device.peak_flops_per_s.items()}
    if device.sustained_flops_per_s:
        out["sustained_flops"] = {
            d: units.format_flops(r, None) for d, r in device.sustained_flops_per_s.items()
        }
    if device.matmul_curves:
        out["matmul_curves"] = {d: _curve_to_list(c) for d, c in device.matmul_curves.items()}
    if device.gemm_shape_curves:
        out["gemm_shape_curves"] = {
            shape: {key: _curve_to_list(c) for key, c in curves.items()}
            for shape, curves in device.gemm_shape_curves.items()
        }
    if device.launch_overhead:
        out["launch_overhead"] = {
            d: dataclasses.asdict(o) for d, o in device.launch_overhead.items()
        }
    if device.attention_curves:
        out["attention_curves"] = {d: _curve_to_list(c) for d, c in device.attention_curves.items()}
    if device.prefill_attention_curves:
        out["prefill_attention_curves"] = {
            d: _curve_to_list(c) for d, c in device.prefill_attention_curves.items()
        }
    if device.elementwise_rate:
        out["elementwise_rate"] = dict(device.elementwise_rate)
    if device.expert_ffn_curves:
        out["expert_ffn_curves"] = {
            d: _curve_to_list(c) for d, c in device.expert_ffn_curves.items()
        }
    return out


def _overheads_from_dict(data: Any, where: str) -> dict[str, LaunchOverhead]:
    """dtype -> LaunchOverhead."""
    if data is None:
        return {}
    data = check_keys(data, where=where, required=set(), optional=set(RATE_DTYPES))
    return {d: _overhead_from_dict(o, f"{where}: {d}") for d, o in data.items()}


def _overhead_from_dict(data: Any, where: str) -> LaunchOverhead:
    fields = {f.name for f in dataclasses.fields(LaunchOverhead)}
    data = check_keys(data, where=where, required=fields)
    for name in fields:
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise HrmError(f"{where}: {name} must be a non-negative number of seconds")
    return LaunchOverhead(**{name: float(data[name]) for name in fields})


def _link_from_dict(data: Any, where: str) -> LinkSpec:
    data = check_keys(
        data,
        where=where,
        required={"h2d", "d2h"},
        optional={"h2d_curve", "d2h_curve", "bidirectional", "shared", "pinnable"},
    )
    shared = data.get("shared", False)
    if not isinstance(shared, bool):
        raise HrmError(f"{where}: shared must be true or false, got {shared!r}")
    return LinkSpec(
        shared=shared,
        h2d_bytes_per_s=units.parse_bandwidth(data["h2d"], f"{where}: h2d"),
        d2h_bytes_per_s=units.parse_bandwidth(data["d2h"], f"{where}: d2h"),
        h2d_curve=_curve_from_list(data["h2d_curve"], f"{where}: h2d_curve", units.parse_bandwidth)
        if data.get("h2d_curve")
        else None,
        d2h_curve=_curve_from_list(data["d2h_curve"], f"{where}: d2h_curve", units.parse_bandwidth)
        if data.get("d2h_curve")
        else None,
        bidirectional_bytes_per_s=units.parse_bandwidth(
            data["bidirectional"], f"{where}: bidirectional"
        )
        if data.get("bidirectional") is not None
        else None,
        pinnable_bytes=units.parse_bytes(data["pinnable"], f"{where}: pinnable")
        if data.get("pinnable") is not None
        else None,
    )


def _link_to_dict(link: LinkSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "h2d": units.format_bandwidth(link.h2d_bytes_per_s, None),
        "d2h": units.format_bandwidth(link.d2h_bytes_per_s, None),
    }
    if link.h2d_curve:
        out["h2d_curve"] = _curve_to_list(link.h2d_curve)
    if link.d2h_curve:
        out["d2h_curve"] = _curve_to_list(link.d2h_curve)
    if link.bidirectional_bytes_per_s is not None:
        out["bidirectional"] = units.format_bandwidth(link.bidirectional_bytes_per_s, None)
    if link.shared:
        out["shared"] = True
    if link.pinnable_bytes is not None:
        out["pinnable"] = units.format_bytes(link.pinnable_bytes, None)
    return out


def _interconnect_from_dict(data: Any, where: str) -> Interconnect:
    data = check_keys(data, where=where, required={"kind", "bandwidth"})
    if data["kind"] not in INTERCONNECTS:
        raise HrmError(
            f"{where}: kind must be one of {', '.join(INTERCONNECTS)}, got {data['kind']!r}"
        )
    return Interconnect(
        kind=data["kind"],
        bytes_per_s=units.parse_bandwidth(data["bandwidth"], f"{where}: bandwidth"),
    )


def _curve_from_list(points: Any, where: str, parse_rate) -> Curve:
    if not isinstance(points, list) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in points
    ):
        raise HrmError(f"{where}: expected a list of [size, rate] pairs")
    parsed = tuple(
        (units.parse_bytes(x, f"{where}: size"), parse_rate(y, f"{where}: rate")) for x, y in points
    )
    try:
        return Curve(points=parsed)
    except HrmError as exc:
        raise HrmError(f"{where}: {exc}") from None


def _curve_to_list(curve: Curve) -> list[list[float]]:
    return [[float(x), float(y)] for x, y in curve.points]
