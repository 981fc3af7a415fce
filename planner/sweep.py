"""How the best throughput moves as one resource changes: what to buy (`hrm plan --sweep`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.io import save_figure
from hrm.plan import Plan
from hrm.units import format_bandwidth, format_bytes
from hrm.workload import Workload
from planner.search import search

RESOURCES = ("cpu-mem", "gpu-mem", "pcie")
DEFAULT_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    value: float  # bytes (memory, per GPU for gpu-mem) or bytes/s (PCIe, per GPU)
    plan: Plan | None  # None: nothing fits
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Sweep:
    resource: str
    current: float  # the profile's own value
    points: tuple[SweepPoint, ...]

    def label(self, value: float) -> str:
        return format_bandwidth(value, 3) if self.resource == "pcie" else format_bytes(value, 3)

    def to_dict(self) -> dict:
        return {
            "resource": self.resource,
            "current": self.current,
            "points": [
                {
                    "value": p.value,
                    "throughput_tok_s": p.plan.predicted.throughput_tok_s if p.plan else None,
                    "policy": p.plan.policy.to_dict() if p.plan else None,
                    "bottleneck": p.plan.bottleneck if p.plan else None,
                    "reason": p.reason or None,
                }
                for p in self.points
            ],
        }


def current_value(hardware: HardwareProfile, resource: str) -> float:
    if resource == "cpu-mem":
        return hardware.cpu.memory_bytes
    if hardware.gpu is None or hardware.link is None:
        raise HrmError(f"{hardware.name} has no GPU: only --sweep cpu-mem applies")
    return hardware.gpu.memory_bytes if resource == "gpu-mem" else hardware.link.h2d_bytes_per_s


def with_value(hardware: HardwareProfile, resource: str, value: float) -> HardwareProfile:
    key = {"cpu-mem": "cpu_memory_bytes", "gpu-mem": "gpu_memory_bytes", "pcie": "link_bytes_per_s"}
    return hardware.with_resources(**{key[resource]: value})


def sweep(
    arch: ModelArch,
    hardware: HardwareProfile,
    workload: Workload,
    *,
    resource: str,
    values: list[float] | None = None,
    **search_options,
) -> Sweep:
    """The best plan at each value of `resource` (default: 1/4x to 4x the profile's)."""
    if resource not in RESOURCES:
        raise HrmError(f"unknown sweep {resource!r}: use one of {', '.join(RESOURCES)}")
    current = current_value(hardware, resource)
    values = sorted(values or [current * f for f in DEFAULT_FACTORS])
    points = []
    for value in values:
        try:
            result = search(arch, with_value(hardware, resource, value), workload, **search_options)
            points.append(SweepPoint(value=value, plan=result.best))
        except HrmError as exc:  # this value fits no policy: a point on the chart, not an error
            points.append(SweepPoint(value=value, plan=None, reason=str(exc)))
    return Sweep(resource=resource, current=current, points=tuple(points))


def plot_sweep(result: Sweep, path: str | Path, title: str) -> Path:
    """Best throughput against the resource, log x; the profile's own value marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    xs = [p.value for p in result.points if p.plan]
    ys = [p.plan.predicted.throughput_tok_s for p in result.points if p.plan]
    ax.plot(xs, ys, "o-", color="tab:blue")
    ax.axvline(
        result.current, color="gray", ls="--", label=f"profile: {result.label(result.current)}"
    )
    ax.set_xscale("log")
    ticks = [p.value for p in result.points]
    ax.set_xticks(ticks, [result.label(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(
        {
            "cpu-mem": "CPU memory",
            "gpu-mem": "GPU memory (per GPU)",
            "pcie": "PCIe host-to-device (per GPU)",
        }[result.resource]
    )
    ax.set_ylabel("best predicted throughput (tok/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out
