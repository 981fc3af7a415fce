"""HardwareProfile: what a machine can do, as the roofline model and the planner see it.

A profile is a YAML file (bundled in hardware_profiles/ or anywhere on disk) with a `cpu`, an
optional `gpu` (absent = a CPU-only machine) and, with a GPU, the `link` between them. Files use
decimal units ("24 GB", "300 GB/s", "121 TFLOP/s"); the dataclasses hold SI base units. GPU
figures are per GPU, with `count` GPUs joined by tensor parallelism (reference, section 4), and
the link figures are per GPU too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hrm.errors import HrmError
from hrm.formats import is_compact
from hrm.hardware.files import (
    _device_from_dict,
    _device_to_dict,
    _disk_from_dict,
    _disk_to_dict,
    _interconnect_from_dict,
    _interconnect_to_dict,
    _link_from_dict,
    _link_to_dict,
)
from hrm.hardware.parts import (
    DATASHEET_STEP_LATENCY_S,
    RATE_DTYPES,
    DeviceSpec,
    DiskSpec,
    Interconnect,
    LinkSpec,
)
from hrm.io import atomic_write_yaml, load_yaml
from hrm.policy import RUN_DTYPES
from hrm.schema import check_keys

BUNDLED_DIR = Path(__file__).resolve().parents[2] / "hardware_profiles"
SOURCES = ("datasheet", "measured")


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
    # The "GPU" is this host's CPU (hrm/hardware/stand_in.py): its queues share one set of cores
    # and one memory bus, so they do not overlap in the cost model.
    stand_in: bool = False
    disk: DiskSpec | None = None  # storage a disk tier reads weights from; None: not known

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

    def compute_dtype(self, weight_dtype: str) -> str:
        """What the layers compute `weight_dtype` weights in: a float dtype itself; a compact
        format (hrm/formats.py) in the GPU's faster 16-bit float (half_dtype), or in bfloat16
        where a CPU runs the layers, as the executor there does (executor.quant)."""
        if not is_compact(weight_dtype):
            return weight_dtype
        return self.half_dtype if self.gpu is not None and not self.stand_in else "bfloat16"

    def unrated(self, weight_dtype: str) -> str | None:
        """Why `weight_dtype` weights cannot be planned here (None: they can): the executor runs
        no such dtype (float8) and the profile rates none, so every time would be another
        dtype's. A dtype the executor runs falls back to the float32 rate (flops_per_s)."""
        device = self.gpu or self.cpu
        if weight_dtype in RUN_DTYPES or weight_dtype in device.peak_flops_per_s:
            return None
        return (
            f"{self.name}'s {device.name} has no {weight_dtype} rate in its profile (it rates "
            f"{', '.join(d for d in device.peak_flops_per_s if d in RATE_DTYPES)}) and the "
            f"executor runs no {weight_dtype} "
            f"weights; plan with --dtype {', '.join(RUN_DTYPES)}"
        )

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

    @property
    def peer_step_latency_s(self) -> float:
        """Each ring step's latency between GPUs: the interconnect's, else PCIe's datasheet
        figure; 0 for a CPU standing in without a measured one (priced by bytes alone)."""
        if self.interconnect is not None:
            return self.interconnect.latency_s
        return 0.0 if self.stand_in else DATASHEET_STEP_LATENCY_S["pcie"]

    def with_gpu_count(self, count: int) -> HardwareProfile:
        """The same machine using `count` of its GPUs (tensor parallel across them). A count
        above the profile's is a what-if: that many of its GPU, each with a link like its own
        and joined by its interconnect (PCIe peer to peer when it names none), on the same
        host."""
        if self.gpu is None:
            raise HrmError(f"{self.name} has no GPU: plan it without --gpus")
        if count < 1:
            raise HrmError(f"--gpus {count}: give a positive GPU count")
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
                "disk",
            },
        )
        name = str(data["name"])
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, Mapping):
            raise HrmError(f"{where}: provenance must be a mapping")
        stand_in = data.get("stand_in") is True
        gpu = (
            _device_from_dict(data["gpu"], f"{where}: gpu", stand_in=stand_in)
            if data.get("gpu") is not None
            else None
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
            interconnect = _interconnect_from_dict(data["interconnect"], f"{where}: interconnect")
            _check_interconnect(interconnect, gpu, stand_in, where)
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
            stand_in=stand_in,
            disk=_disk_from_dict(data["disk"], f"{where}: disk") if data.get("disk") else None,
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
            out["interconnect"] = _interconnect_to_dict(self.interconnect)
        if self.price_per_hour is not None:
            out["price_per_hour"] = self.price_per_hour
        if self.stand_in:
            out["stand_in"] = True
        if self.disk is not None:
            out["disk"] = _disk_to_dict(self.disk)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        return cls.from_dict(load_yaml(path), where=str(path))

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_yaml(path, self.to_dict())


def _check_interconnect(
    interconnect: Interconnect, gpu: DeviceSpec | None, stand_in: bool, where: str
) -> None:
    """GPUs' links need GPUs; gloo (processes on one host) belongs to a CPU-only host and the
    CPU standing in for its GPUs."""
    if interconnect.kind == "gloo" and gpu is not None and not stand_in:
        raise HrmError(
            f"{where}: a gloo interconnect is a CPU-only host's (its processes'); "
            "a profile with a gpu names pcie or nvlink"
        )
    if interconnect.kind != "gloo" and gpu is None:
        raise HrmError(f"{where}: has a {interconnect.kind} 'interconnect' section but no 'gpu'")


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
