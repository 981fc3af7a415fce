"""The hierarchical roofline model (reference, section 1): roofs, turning points, op times.

Pure functions that return breakdowns, not scalars: which roof binds is part of
every answer. Levels: i = GPU (higher), j = CPU (lower); the link is PCIe from j to i.
"""

from __future__ import annotations

from dataclasses import dataclass

from hrm.arch import ModelArch
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import DeviceSpec
from hrm.roofline.ops import Op, expert_ffn_op, layer_ops, lm_head_op
from hrm.rules.cpu_gemm import CpuGemmChoice, choose_cpu_gemm, gemm_peak_flops_per_s


def attainable_flops_per_s(
    device: DeviceSpec, dtype: str, intensity: float, *, peak_flops_per_s: float | None = None
) -> float:
    """P = min(P_peak, B_peak * I)  (paper Eq 4-5); peak_flops_per_s replaces the device's peak
    for `dtype` (the CPU's, along the GEMM path hrm.rules.cpu_gemm chooses:
    cpu_peak_flops_per_s)."""
    peak = device.flops_per_s(dtype) if peak_flops_per_s is None else peak_flops_per_s
    return min(peak, device.total_memory_bandwidth_bytes_per_s * intensity)


def cpu_peak_flops_per_s(cpu: DeviceSpec, dtype: str) -> float:
    """The CPU's compute roof for `dtype`: the best peak of the GEMM paths the choice takes."""
    return gemm_peak_flops_per_s(cpu, choose_cpu_gemm(cpu, dtype))


def cross_level_flops_per_s(
    hardware: HardwareProfile, dtype: str, *, gpu_intensity: float, cpu_intensity: float
) -> float:
    """Task on the GPU with its data fetched from the CPU:
    P = min(P_peak^i, B_peak^i * I^i, B_peak^{j,i} * I^j)  (paper Eq 7)."""
    if hardware.gpu is None:
        raise ValueError("the cross-level roof needs a GPU")
    return min(
        attainable_flops_per_s(hardware.gpu, dtype, gpu_intensity),
        hardware.h2d_bytes_per_s * cpu_intensity,
    )


@dataclass(frozen=True, kw_only=True)
class TurningPoints:
    """Intensities (FLOP/B, against CPU-resident data) where the binding roof changes.

    p1: left of it, computing on the CPU beats shipping data to the GPU (paper Eq 9).
    p2: right of it, the GPU's own roofs bind instead of the link (paper Eq 10).
    Either is None when the roofs never cross (e.g. a link faster than CPU memory).
    """

    p1: float | None
    p2: float | None


def turning_points(hardware: HardwareProfile, dtype: str) -> TurningPoints | None:
    """For a task whose bytes are the same at both levels (I^i = I^j); None without a GPU."""
    if hardware.gpu is None:
        return None
    link = hardware.h2d_bytes_per_s
    cpu, gpu = hardware.cpu, hardware.gpu
    # P1: B_link * I = min(P_cpu, B_cpu * I)  =>  I = P_cpu / B_link, valid when B_cpu >= B_link
    cpu_peak = cpu_peak_flops_per_s(cpu, dtype)
    p1 = cpu_peak / link if cpu.total_memory_bandwidth_bytes_per_s >= link else None
    # P2: B_link * I = min(P_gpu, B_gpu * I)  =>  I = P_gpu / B_link, valid when B_gpu >= B_link
    p2 = gpu.flops_per_s(dtype) / link if gpu.total_memory_bandwidth_bytes_per_s >= link else None
    return TurningPoints(p1=p1, p2=p2)


def ffn_balance_batch(
    arch: ModelArch, hardware: HardwareProfile, *, micro_batch: int, weight_dtype: str = "bfloat16"
) -> float | None:
    """Batch N at the balance point of the expert FFN (paper Eq 11):
    B_gpu * I^gpu(mu) = B_link * I^cpu(N).  Above it, streaming weights no longer binds the GPU
    kernel's memory roof. None without a GPU."""
    if hardware.gpu is None:
        return None
    micro = expert_ffn_op(arch, tokens=micro_batch, weight_dtype=weight_dtype)
    target = hardware.gpu.total_memory_bandwidth_bytes_per_s * micro.intensity
    link = hardware.h2d_bytes_per_s

    def gap(n: float) -> float:
        return link * expert_ffn_op(arch, tokens=n, weight_dtype=weight_dtype).intensity - target

    lo, hi = float(micro_batch), float(micro_batch)
    while gap(hi) < 0:
        hi *= 2
        if hi > 1e9:
            return None
    for _ in range(60):  # bisection: the FFN intensity grows monotonically with N
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return hi


@dataclass(frozen=True, kw_only=True)
class OpTime:
    """Time of one op on one device: each roof's time and which one binds."""

    name: str
    compute_s: float
    memory_s: float
    link_s: float = 0.0
    overlap: str = "max"  # "max": the queues overlap; "sum": they serialise

    @property
    def time_s(self) -> float:
        parts = (self.compute_s, self.memory_s, self.link_s)
        return max(parts) if self.overlap == "max" else sum(parts)

    @property
    def binding(self) -> str:
        roofs = {"compute": self.compute_s, "memory": self.memory_s, "link": self.link_s}
        return max(roofs, key=roofs.get)


def op_time(
    op: Op,
    device: DeviceSpec,
    dtype: str,
    *,
    local_bytes: float | None = None,
    link_bytes: float = 0.0,
    link_bytes_per_s: float = 0.0,
    overlap: str = "max",
    peak_flops_per_s: float | None = None,
) -> OpTime:
    """T = max(flops / P_peak, bytes / B_peak, link bytes / B_link)  (paper Eq 13-14);
    peak_flops_per_s as in attainable_flops_per_s."""
    local = op.bytes if local_bytes is None else local_bytes
    peak = device.flops_per_s(dtype) if peak_flops_per_s is None else peak_flops_per_s
    return OpTime(
        name=op.name,
        compute_s=op.flops / peak,
        memory_s=local / device.total_memory_bandwidth_bytes_per_s,
        link_s=link_bytes / link_bytes_per_s if link_bytes else 0.0,
        overlap=overlap,
    )


@dataclass(frozen=True, kw_only=True)
class RunBound:
    """Lower bound on a whole run's time on one device holding everything in its own memory."""

    prefill_s: float
    decode_s: float
    generated_tokens: int
    binding: dict[str, float]  # seconds each roof binds, summed over ops

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / (self.prefill_s + self.decode_s)


def run_time_bound(
    arch: ModelArch,
    device: DeviceSpec,
    *,
    batch: int,
    prompt_len: float,
    gen_len: int,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    cpu_gemm: CpuGemmChoice | None = None,
) -> RunBound:
    """Roofline bound of prefill plus every decode step, each op at max(compute, memory).

    The first token comes from prefill; decode step t (1..gen_len-1) attends over
    prompt_len + t keys, so the context grows step by step. cpu_gemm: the device is a CPU whose
    GEMMs take that choice's paths, so its roof is their best peak (bytes still in `dtype`).
    """
    kv_dtype = kv_dtype or dtype
    peak = gemm_peak_flops_per_s(device, cpu_gemm) if cpu_gemm else device.flops_per_s(dtype)
    binding: dict[str, float] = {"compute": 0.0, "memory": 0.0}

    def step_time(new_tokens: float, context: float) -> float:
        ops = [
            op.scaled(layers)
            for kind, layers in arch.layer_kinds()
            for op in layer_ops(
                kind,
                batch=batch,
                new_tokens=new_tokens,
                context=context,
                weight_dtype=dtype,
                kv_dtype=kv_dtype,
            )
        ]
        ops.append(lm_head_op(arch, batch=batch, weight_dtype=dtype))
        total = 0.0
        for op in ops:
            t = op_time(op, device, dtype, peak_flops_per_s=peak)
            binding[t.binding] += t.time_s
            total += t.time_s
        return total

    prefill = step_time(prompt_len, prompt_len)
    decode = sum(step_time(1, prompt_len + t) for t in range(1, gen_len))
    return RunBound(
        prefill_s=prefill, decode_s=decode, generated_tokens=batch * gen_len, binding=binding
    )
