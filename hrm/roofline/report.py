"""The data behind `hrm roofline`: roofs, turning points and where each op sits.

Kept apart from drawing (hrm/roofline/plots.py) and printing (hrm/cli/roofline.py) so that tests
and other tools can use the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hrm.arch import ModelArch
from hrm.hardware import HardwareProfile
from hrm.roofline import (
    TurningPoints,
    attainable_flops_per_s,
    cpu_peak_flops_per_s,
    cross_level_flops_per_s,
    ffn_balance_batch,
    turning_points,
)
from hrm.roofline.ops import attention_op, expert_ffn_op


@dataclass(frozen=True, kw_only=True)
class OpPoint:
    """One op at one setting: its intensity and what each placement attains."""

    label: str
    op: str  # "attention" or "expert_ffn"
    batch: int
    kv_dtype: str | None
    cpu_intensity: float  # FLOP per byte read from CPU memory
    gpu_intensity: float  # FLOP per byte read from GPU memory by one kernel launch
    cpu_flops_per_s: float  # running on the CPU next to its data
    gpu_streamed_flops_per_s: float | None  # running on the GPU with its data fetched over the link

    @property
    def better_on(self) -> str:
        if self.gpu_streamed_flops_per_s is None:
            return "cpu"
        return "gpu" if self.gpu_streamed_flops_per_s > self.cpu_flops_per_s else "cpu"


@dataclass(frozen=True, kw_only=True)
class RooflineReport:
    model: str
    hardware: str
    dtype: str
    context: int
    micro_batch: int
    cpu_peak_flops_per_s: float
    cpu_bandwidth_bytes_per_s: float
    gpu_peak_flops_per_s: float | None
    gpu_bandwidth_bytes_per_s: float | None
    link_bytes_per_s: float | None
    turning: TurningPoints | None
    ffn_balance_batch: float | None
    points: tuple[OpPoint, ...]

    def to_dict(self) -> dict:
        from dataclasses import asdict

        out = asdict(self)
        out["points"] = [{**asdict(p), "better_on": p.better_on} for p in self.points]
        return out


def build_roofline_report(
    arch: ModelArch,
    hardware: HardwareProfile,
    *,
    batches: list[int],
    context: int,
    kv_dtypes: list[str],
    dtype: str = "bfloat16",
    micro_batch: int = 64,
) -> RooflineReport:
    """Decode attention per KV dtype and expert FFN per batch size, on each roof."""
    points = []
    for kv_dtype in kv_dtypes:
        for batch in batches:
            op = attention_op(arch, batch=batch, new_tokens=1, context=context, kv_dtype=kv_dtype)
            points.append(
                _point(
                    hardware,
                    dtype,
                    f"attention b={batch} KV {kv_dtype}",
                    "attention",
                    batch,
                    kv_dtype,
                    op.intensity,
                    op.intensity,
                    op.intensity,
                )
            )
    for batch in batches:
        op = expert_ffn_op(arch, tokens=batch, weight_dtype=dtype)
        # On the GPU the kernel runs per micro-batch: its GPU-memory intensity is set by mu.
        micro = expert_ffn_op(arch, tokens=min(batch, micro_batch), weight_dtype=dtype)
        points.append(
            _point(
                hardware,
                dtype,
                f"expert FFN N={batch}",
                "expert_ffn",
                batch,
                None,
                op.intensity,
                micro.intensity,
                op.intensity,
            )
        )
    gpu = hardware.gpu
    return RooflineReport(
        model=arch.name,
        hardware=hardware.name,
        dtype=dtype,
        context=context,
        micro_batch=micro_batch,
        cpu_peak_flops_per_s=cpu_peak_flops_per_s(hardware.cpu, dtype),
        cpu_bandwidth_bytes_per_s=hardware.cpu.total_memory_bandwidth_bytes_per_s,
        gpu_peak_flops_per_s=gpu.flops_per_s(dtype) if gpu else None,
        gpu_bandwidth_bytes_per_s=gpu.total_memory_bandwidth_bytes_per_s if gpu else None,
        link_bytes_per_s=hardware.h2d_bytes_per_s if gpu else None,
        turning=turning_points(hardware, dtype),
        ffn_balance_batch=ffn_balance_batch(
            arch, hardware, micro_batch=micro_batch, weight_dtype=dtype
        ),
        points=tuple(points),
    )


def _point(hardware, dtype, label, op, batch, kv_dtype, cpu_i, gpu_i, link_i) -> OpPoint:
    streamed = (
        cross_level_flops_per_s(hardware, dtype, gpu_intensity=gpu_i, cpu_intensity=link_i)
        if hardware.gpu
        else None
    )
    return OpPoint(
        label=label,
        op=op,
        batch=batch,
        kv_dtype=kv_dtype,
        cpu_intensity=cpu_i,
        gpu_intensity=gpu_i,
        cpu_flops_per_s=attainable_flops_per_s(
            hardware.cpu, dtype, cpu_i, peak_flops_per_s=cpu_peak_flops_per_s(hardware.cpu, dtype)
        ),
        gpu_streamed_flops_per_s=streamed,
    )
