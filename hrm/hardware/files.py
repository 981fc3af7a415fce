"""A profile's parts in their file form (YAML or JSON): reading them, checked, with the units
of hrm.units, and writing them back; `upgrade` is the one place that reads older formats."""

from __future__ import annotations

import dataclasses
from typing import Any

from hrm import units
from hrm.errors import HrmError
from hrm.formats import WEIGHT_FORMATS
from hrm.hardware.parts import (
    CPU_PATH_KEYS,
    INTERCONNECTS,
    RATE_DTYPES,
    Curve,
    DeviceSpec,
    DiskSpec,
    Interconnect,
    LaunchOverhead,
    LinkSpec,
)
from hrm.schema import check_keys, positive_float, positive_int

_DEVICE_KEYS = {"name", "memory", "memory_bandwidth", "flops"}
_DEVICE_OPTIONAL = {
    "count",
    "cores",
    "matmul_curves",
    "available_memory",
    "launch_overhead",
    "sustained_flops",
    "attention_curves",
    "latent_attention_curves",
    "prefill_attention_curves",
    "elementwise_rate",
    "expert_ffn_curves",
    "gemm_shape_curves",
    "matmul_shape",
    "copy_bandwidth",
    "dequantize_rates",
}
# what hrm profile measures with the executor's own code on one kind of device only
_CPU_ONLY = (
    "attention_curves",
    "latent_attention_curves",
    "prefill_attention_curves",
    "elementwise_rate",
    "gemm_shape_curves",
    "matmul_shape",
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


def _device_from_dict(
    data: Any, where: str, is_cpu: bool = False, stand_in: bool = False
) -> DeviceSpec:
    """A device section; `stand_in`: the GPU of a stand-in profile (a plan stores one), which is
    the CPU with a CPU's measurements, one per tensor-parallel rank."""
    data = upgrade(data, where)
    data = check_keys(data, where=where, required=_DEVICE_KEYS, optional=_DEVICE_OPTIONAL)
    measured_as_cpu = is_cpu or stand_in
    # only a CPU widens or packs 16-bit weights (the executor's CPU paths): only a CPU has those
    paths = {key for keys in CPU_PATH_KEYS.values() for key in keys.values()}
    rate_keys = set(RATE_DTYPES) | (paths if measured_as_cpu else set())
    flops = check_keys(data["flops"], where=f"{where}: flops", required=set(), optional=rate_keys)
    if not flops:
        raise HrmError(f"{where}: flops must name at least one dtype ({', '.join(RATE_DTYPES)})")
    curves_in = _by_dtype(data, "matmul_curves", where, rate_keys)
    count = positive_int(data.get("count", 1), where=f"{where}: count")
    if is_cpu and count != 1:
        raise HrmError(f"{where}: count must be 1 for the cpu (give the total cores and memory)")
    cores, shape = data.get("cores"), data.get("matmul_shape")
    available = data.get("available_memory")
    _check_measured_on(data, where, measured_as_cpu)
    overhead = _overheads_from_dict(data.get("launch_overhead"), f"{where}: launch_overhead")
    elementwise = _by_dtype(data, "elementwise_rate", where, set(RATE_DTYPES))
    copy = data.get("copy_bandwidth")
    sustained = _by_dtype(data, "sustained_flops", where, set(RATE_DTYPES))
    return DeviceSpec(
        gemm_shape_curves=_shape_curves_from_dict(
            data.get("gemm_shape_curves") or {}, f"{where}: gemm_shape_curves", rate_keys
        ),
        matmul_shape=_shape_name(shape, f"{where}: matmul_shape") if shape else None,
        launch_overhead=overhead,
        expert_ffn_curves=_dtype_curves(
            data.get("expert_ffn_curves"), f"{where}: expert_ffn_curves", units.parse_flops
        ),
        elementwise_rate={
            dtype: positive_float(rate, where=f"{where}: elementwise_rate: {dtype}")
            for dtype, rate in elementwise.items()
        },
        dequantize_rates={
            fmt: positive_float(rate, where=f"{where}: dequantize_rates: {fmt}")
            for fmt, rate in _by_dtype(data, "dequantize_rates", where, set(WEIGHT_FORMATS)).items()
        },
        **_attention_curves(data, where),
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


def _check_measured_on(data: Any, where: str, measured_as_cpu: bool) -> None:
    """What hrm profile measures on one kind of device only is refused on the other."""
    for keys, only_for in ((_CPU_ONLY, "cpu"), (_GPU_ONLY, "gpu")):
        for key in keys:
            if data.get(key) is not None and measured_as_cpu != (only_for == "cpu"):
                raise HrmError(f"{where}: {key} is measured for the {only_for} only")


# a CPU's attention curves, each a mapping of dtype (or compact format) to its curve, and how
# each's rates read: decode's and latent decode's bytes -> bytes/s, prefill's FLOPs -> FLOP/s
_ATTENTION_RATES = {"attention_curves": units.parse_bandwidth,
                    "latent_attention_curves": units.parse_bandwidth,
                    "prefill_attention_curves": units.parse_flops}  # fmt: skip


def _attention_curves(data: dict, where: str) -> dict[str, dict[str, Curve]]:
    """The DeviceSpec fields of _ATTENTION_RATES, read from a device's mapping."""
    return {
        key: _dtype_curves(data.get(key), f"{where}: {key}", parse)
        for key, parse in _ATTENTION_RATES.items()
    }


def _dtype_curves(data: Any, where: str, parse_rate) -> dict[str, Curve]:
    """A mapping of dtype -> [size, rate] pairs (absent: empty), checked and parsed."""
    keys = set(RATE_DTYPES) | set(WEIGHT_FORMATS)  # a compact KV cache's attention too
    curves = check_keys(data or {}, where=where, required=set(), optional=keys)
    return {
        dtype: _curve_from_list(points, f"{where}: {dtype}", parse_rate)
        for dtype, points in curves.items()
    }


def _shape_name(shape: Any, where: str) -> str:
    """A gemm_shape_key, checked: d_in x d_out, both positive."""
    d_in, _, d_out = str(shape).partition("x")
    if not (d_in.isdigit() and d_out.isdigit() and int(d_in) > 0 and int(d_out) > 0):
        raise HrmError(f"{where}: {shape!r} is not a shape; write d_in x d_out, like 4096x1024")
    return str(shape)


def _shape_curves_from_dict(data: Any, where: str, rate_keys: set[str]) -> dict:
    if not isinstance(data, dict):
        raise HrmError(f"{where}: must be a mapping of shapes (like 4096x1024) to curves")
    out = {}
    for shape, curves in data.items():
        _shape_name(shape, where)
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
    if device.matmul_shape is not None:
        out["matmul_shape"] = device.matmul_shape
    if device.launch_overhead:
        out["launch_overhead"] = {
            d: _overhead_to_dict(o) for d, o in device.launch_overhead.items()
        }
    for key in _ATTENTION_RATES:
        if curves := getattr(device, key):
            out[key] = {d: _curve_to_list(c) for d, c in curves.items()}
    if device.elementwise_rate:
        out["elementwise_rate"] = dict(device.elementwise_rate)
    if device.dequantize_rates:
        out["dequantize_rates"] = dict(device.dequantize_rates)
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
    fields = {f.name for f in dataclasses.fields(LaunchOverhead)} - {"spread"}
    data = check_keys(data, where=where, required=fields, optional={"spread"})
    spread = check_keys(
        data.get("spread") or {}, where=f"{where}: spread", required=set(), optional=fields
    )
    for name, value in [*((n, data[n]) for n in fields), *spread.items()]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise HrmError(f"{where}: {name} must be a non-negative number of seconds")
    return LaunchOverhead(
        **{name: float(data[name]) for name in fields},
        spread={name: float(v) for name, v in spread.items()},
    )


def _overhead_to_dict(overhead: LaunchOverhead) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(overhead).items() if k != "spread"}
    if overhead.spread:
        out["spread"] = dict(overhead.spread)
    return out


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
    """kind, bandwidth, and `latency`: seconds per ring step (optional for pcie and nvlink,
    whose datasheet figure stands in; a gloo one is always measured)."""
    data = check_keys(data, where=where, required={"kind", "bandwidth"}, optional={"latency"})
    if data["kind"] not in INTERCONNECTS:
        raise HrmError(
            f"{where}: kind must be one of {', '.join(INTERCONNECTS)}, got {data['kind']!r}"
        )
    latency = data.get("latency")
    if latency is not None and (
        isinstance(latency, bool) or not isinstance(latency, (int, float)) or not latency >= 0
    ):
        raise HrmError(f"{where}: latency must be a non-negative number of seconds per ring step")
    if latency is None and data["kind"] == "gloo":
        raise HrmError(f"{where}: a gloo interconnect needs its measured latency (seconds)")
    return Interconnect(
        kind=data["kind"],
        bytes_per_s=units.parse_bandwidth(data["bandwidth"], f"{where}: bandwidth"),
        step_latency_s=float(latency) if latency is not None else None,
    )


def _interconnect_to_dict(interconnect: Interconnect) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": interconnect.kind,
        "bandwidth": units.format_bandwidth(interconnect.bytes_per_s, None),
    }
    if interconnect.step_latency_s is not None:
        out["latency"] = interconnect.step_latency_s
    return out


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


def _disk_from_dict(data: Any, where: str) -> DiskSpec:
    data = check_keys(data, where=where, required={"read"},
                      optional={"read_curve", "path", "direct"})  # fmt: skip
    direct = data.get("direct", True)
    if not isinstance(direct, bool):
        raise HrmError(f"{where}: direct must be true or false, got {direct!r}")
    curve = data.get("read_curve")
    return DiskSpec(
        read_bytes_per_s=units.parse_bandwidth(data["read"], f"{where}: read"),
        read_curve=_curve_from_list(curve, f"{where}: read_curve", units.parse_bandwidth)
        if curve
        else None,
        path=None if data.get("path") is None else str(data["path"]),
        direct=direct,
    )


def _disk_to_dict(disk: DiskSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"read": units.format_bandwidth(disk.read_bytes_per_s, None)}
    if disk.read_curve:
        out["read_curve"] = _curve_to_list(disk.read_curve)
    if disk.path is not None:
        out["path"] = disk.path
    if not disk.direct:
        out["direct"] = False
    return out
