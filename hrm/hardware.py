"""HardwareProfile: what a machine can do, as the roofline model and the planner see it.

A profile is a YAML file (bundled in hardware_profiles/ or anywhere on disk) with a `cpu`, an
optional `gpu` (absent = a CPU-only machine) and, with a GPU, the `link` between them. Files use
decimal units ("24 GB", "300 GB/s", "121 TFLOP/s"); the dataclasses hold SI base units. GPU
figures are per GPU, with `count` GPUs joined by tensor parallelism (reference, section 4), and
the link figures are per GPU too.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hrm import units
from hrm.errors import HrmError
from hrm.io import atomic_write_yaml, load_yaml
from hrm.schema import check_keys, positive_int

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "hardware_profiles"
SOURCES = ("datasheet", "measured")
DTYPES = ("float32", "bfloat16", "float16", "int8", "float8")


@dataclass(frozen=True, kw_only=True)
class Curve:
    """Achieved rate against size, interpolated linearly in log(size); flat beyond the ends.

    Matmul curves: x = tokens (rows of the GEMM), y = FLOP/s.  Link curves: x = bytes per
    transfer, y = bytes/s.  Measured curves let the planner charge achieved, not peak, rates.
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
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)

    @property
    def best(self) -> float:
        return max(y for _, y in self.points)


# 16-bit float dtypes a CPU may compute in float32 after widening (hrm.cpu_gemm).
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
    launch_overhead: LaunchOverhead | None = None  # measured by hrm profile (CPU); None: not known
    # What long GEMMs sustain (a published measurement, cited in the file): the planner's rate
    # where no curve was measured; the peak stays the roofline's top roof.
    sustained_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    # CPU only: the executor's decode-attention kernel, K/V bytes read per call -> bytes/s
    # (measured by hrm profile); None: attention is priced by FLOPs and memory bandwidth
    attention_curve: Curve | None = None

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s of all `count` devices for `dtype`; falls back to float32 when absent.
        (A CPU's 16-bit GEMMs take the path hrm.cpu_gemm chooses; price those with it.)"""
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

    @property
    def total_memory_bytes(self) -> float:
        return self.memory_bytes * self.count

    @property
    def total_memory_bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.count


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


INTERCONNECTS = ("pcie", "nvlink")


@dataclass(frozen=True, kw_only=True)
class Interconnect:
    """GPU-to-GPU links for tensor parallelism's all-reduces: per GPU, each direction."""

    kind: str  # pcie (peer-to-peer through the host bridge) or nvlink
    bytes_per_s: float

    def h2d_at(self, nbytes: float) -> float:
        return self.h2d_curve.at(nbytes) if self.h2d_curve else self.h2d_bytes_per_s

    def d2h_at(self, nbytes: float) -> float:
        return self.d2h_curve.at(nbytes) if self.d2h_curve else self.d2h_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    source: str
    description: str = ""
    provenance: Mapping[str, Any] = field(default_factory=dict)
    cpu: DeviceSpec
    gpu: DeviceSpec | None = None
    link: LinkSpec | None = None
    # GPU-to-GPU links; None: PCIe peer-to-peer at the link's h2d rate (through the host)
    interconnect: Interconnect | None = None
    price_per_hour: float | None = None  # USD per machine-hour, for cost per token (optional)
    # The "GPU" is this host's CPU (hrm/stand_in.py): its queues share one set of cores and one
    # memory bus, so they do not overlap in the cost model.
    stand_in: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise HrmError(
                f"{self.name}: source must be one of {', '.join(SOURCES)}, got {self.source!r}"
            )
        if (self.gpu is None) != (self.link is None):
            raise HrmError(
                f"{self.name}: a profile with a gpu needs a link, and one without a gpu none"
            )

    @property
    def half_dtype(self) -> str:
        """The 16-bit dtype this machine computes fastest: float16 on GPUs without bf16 units
        (T4), else bfloat16."""
        device = self.gpu or self.cpu
        rates = device.peak_flops_per_s
        return "float16" if rates.get("float16", 0) > rates.get("bfloat16", 0) else "bfloat16"

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def gpu_count(self) -> int:
        return self.gpu.count if self.gpu else 0

    @property
    def link_lanes(self) -> int:
        """Links' worth of host bandwidth the GPUs get together: one each, or one in all when
        they share a root complex."""
        if self.link is None:
            return 0
        return 1 if self.link.shared else self.gpu_count

    @property
    def h2d_bytes_per_s(self) -> float:
        """Aggregate host-to-device bandwidth over the GPUs' links."""
        return self.link.h2d_bytes_per_s * self.link_lanes if self.link else 0.0

    @property
    def d2h_bytes_per_s(self) -> float:
        return self.link.d2h_bytes_per_s * self.link_lanes if self.link else 0.0

    @property
    def peer_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth per GPU and direction: the interconnect's, else PCIe peer to
        peer at the link's h2d rate."""
        if self.interconnect is not None:
            return self.interconnect.bytes_per_s
        return self.link.h2d_bytes_per_s if self.link else 0.0

    def with_gpu_count(self, count: int) -> HardwareProfile:
        """The same machine using `count` of its GPUs (tensor parallel across them)."""
        if self.gpu is None:
            raise HrmError(f"{self.name} has no GPU: plan it without --gpus")
        if not 1 <= count <= self.gpu.count:
            raise HrmError(
                f"--gpus {count}: {self.name} has {self.gpu.count} GPU"
                f"{'s' if self.gpu.count != 1 else ''}; give counts from 1 to {self.gpu.count}"
            )
        if count == self.gpu.count:
            return self
        return dataclasses.replace(
            self,
            name=f"{self.name}@{count}gpu",
            gpu=dataclasses.replace(self.gpu, count=count),
        )

    def with_resources(
        self,
        *,
        gpu_memory_bytes: float | None = None,
        cpu_memory_bytes: float | None = None,
        link_bytes_per_s: float | None = None,
    ) -> HardwareProfile:
        """The same machine with one resource changed (for --gpu-mem, --cpu-mem and sweeps).

        Changing a memory drops its measured available figure, and changing the link bandwidth
        drops the measured link curves: both would contradict the new figure.
        """
        gpu, cpu, link = self.gpu, self.cpu, self.link
        if gpu_memory_bytes is not None:
            if gpu is None:
                raise HrmError(f"{self.name}: has no GPU, so its GPU memory cannot be set")
            gpu = dataclasses.replace(
                gpu, memory_bytes=gpu_memory_bytes, available_memory_bytes=None
            )
        if cpu_memory_bytes is not None:
            cpu = dataclasses.replace(
                cpu, memory_bytes=cpu_memory_bytes, available_memory_bytes=None
            )
        if link_bytes_per_s is not None:
            if link is None:
                raise HrmError(f"{self.name}: has no GPU, so its PCIe bandwidth cannot be set")
            link = LinkSpec(
                h2d_bytes_per_s=link_bytes_per_s,
                d2h_bytes_per_s=link_bytes_per_s,
                shared=link.shared,
            )
        return dataclasses.replace(self, gpu=gpu, cpu=cpu, link=link)

    # -- files ---------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> HardwareProfile:
        data = check_keys(
            data,
            where=where,
            required={"name", "source", "cpu"},
            optional={
                "description",
                "provenance",
                "gpu",
                "link",
                "interconnect",
                "price_per_hour",
                "stand_in",
            },
        )
        name = str(data["name"])
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, Mapping):
            raise HrmError(f"{where}: provenance must be a mapping")
        gpu = (
            _device_from_dict(data["gpu"], f"{where}: gpu") if data.get("gpu") is not None else None
        )
        link = (
            _link_from_dict(data["link"], f"{where}: link")
            if data.get("link") is not None
            else None
        )
        if gpu is not None and link is None:
            raise HrmError(f"{where}: a profile with a gpu needs a 'link' section (h2d, d2h)")
        if gpu is None and link is not None:
            raise HrmError(
                f"{where}: has a 'link' section but no 'gpu'; remove one or add the other"
            )
        source = data["source"]
        if source not in SOURCES:
            raise HrmError(f"{where}: source must be one of {', '.join(SOURCES)}, got {source!r}")
        interconnect = None
        if data.get("interconnect") is not None:
            if gpu is None:
                raise HrmError(f"{where}: has an 'interconnect' section but no 'gpu'")
            interconnect = _interconnect_from_dict(data["interconnect"], f"{where}: interconnect")
        price = data.get("price_per_hour")
        if price is not None and (
            isinstance(price, bool) or not isinstance(price, (int, float)) or not price > 0
        ):
            raise HrmError(
                f"{where}: price_per_hour must be a positive number (USD), got {price!r}"
            )
        return cls(
            name=name,
            source=source,
            description=str(data.get("description") or ""),
            provenance=dict(provenance),
            cpu=_device_from_dict(data["cpu"], f"{where}: cpu", is_cpu=True),
            gpu=gpu,
            link=link,
            interconnect=interconnect,
            price_per_hour=float(price) if price is not None else None,
            stand_in=data.get("stand_in") is True,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "source": self.source}
        if self.description:
            out["description"] = self.description
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        if self.gpu is not None:
            out["gpu"] = _device_to_dict(self.gpu)
        out["cpu"] = _device_to_dict(self.cpu)
        if self.link is not None:
            out["link"] = _link_to_dict(self.link)
        if self.interconnect is not None:
            out["interconnect"] = {
                "kind": self.interconnect.kind,
                "bandwidth": units.format_bandwidth(self.interconnect.bytes_per_s, None),
            }
        if self.price_per_hour is not None:
            out["price_per_hour"] = self.price_per_hour
        if self.stand_in:
            out["stand_in"] = True
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        return cls.from_dict(load_yaml(path), where=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_yaml(path, self.to_dict())


def bundled_profile_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def resolve_hardware(name_or_path: str) -> HardwareProfile:
    """`--hardware NAME` (a bundled profile) or `--hardware path/to/file.yaml`."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        return HardwareProfile.load(path)
    bundled = BUNDLED_DIR / f"{name_or_path}.yaml"
    if bundled.is_file():
        return HardwareProfile.load(bundled)
    known = ", ".join(bundled_profile_names())
    raise HrmError(
        f"unknown hardware profile {name_or_path!r}: use one of {known} or a path to a .yaml file"
    )


# -- (de)serialisation helpers ------------------------------------------------------------------

_DEVICE_KEYS = {"name", "memory", "memory_bandwidth", "flops"}
_DEVICE_OPTIONAL = {
    "count",
    "cores",
    "matmul_curves",
    "available_memory",
    "launch_overhead",
    "sustained_flops",
    "attention_curve",
}


def _device_from_dict(data: Any, where: str, is_cpu: bool = False) -> DeviceSpec:
    data = check_keys(data, where=where, required=_DEVICE_KEYS, optional=_DEVICE_OPTIONAL)
    # only a CPU widens 16-bit weights (the executor's CPU path), so only a CPU has those rates
    rate_keys = set(DTYPES) | (set(WIDENED_KEYS.values()) if is_cpu else set())
    flops = check_keys(data["flops"], where=f"{where}: flops", required=set(), optional=rate_keys)
    if not flops:
        raise HrmError(f"{where}: flops must name at least one dtype ({', '.join(DTYPES)})")
    curves_in = data.get("matmul_curves") or {}
    curves_in = check_keys(
        curves_in, where=f"{where}: matmul_curves", required=set(), optional=rate_keys
    )
    count = positive_int(data.get("count", 1), where=f"{where}: count")
    if is_cpu and count != 1:
        raise HrmError(f"{where}: count must be 1 for the cpu (give the total cores and memory)")
    cores = data.get("cores")
    available = data.get("available_memory")
    overhead = data.get("launch_overhead")
    if overhead is not None:
        if not is_cpu:
            raise HrmError(f"{where}: launch_overhead is measured for the cpu only")
        overhead = _overhead_from_dict(overhead, f"{where}: launch_overhead")
    attention = data.get("attention_curve")
    if attention is not None and not is_cpu:
        raise HrmError(f"{where}: attention_curve is measured for the cpu only")
    sustained = check_keys(
        data.get("sustained_flops") or {},
        where=f"{where}: sustained_flops",
        required=set(),
        optional=set(DTYPES),
    )
    return DeviceSpec(
        launch_overhead=overhead,
        attention_curve=_curve_from_list(
            attention, f"{where}: attention_curve", units.parse_bandwidth
        )
        if attention is not None
        else None,
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
    out["flops"] = {d: units.format_flops(r, None) for d, r in device.peak_flops_per_s.items()}
    if device.sustained_flops_per_s:
        out["sustained_flops"] = {
            d: units.format_flops(r, None) for d, r in device.sustained_flops_per_s.items()
        }
    if device.matmul_curves:
        out["matmul_curves"] = {d: _curve_to_list(c) for d, c in device.matmul_curves.items()}
    if device.launch_overhead is not None:
        out["launch_overhead"] = dataclasses.asdict(device.launch_overhead)
    if device.attention_curve is not None:
        out["attention_curve"] = _curve_to_list(device.attention_curve)
    return out


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
