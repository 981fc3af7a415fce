"""One op's time on one device: the roofline of its FLOPs and bytes at the rate the profile
measured for its shape and row count, plus its elementwise passes (paper Eq 13-14)."""

from __future__ import annotations

import math

import numpy as np

from hrm.arch import ModelArch
from hrm.hardware.parts import DeviceSpec
from hrm.roofline.ops import (
    Op,
    expected_distinct_experts,
    expert_ffn_op,
    ffn_output_elements,
    routed_expert_op,
)
from hrm.rules.cpu_gemm import CpuGemmChoice, gemm_flops_per_s, gemm_flops_per_s_each
from hrm.rules.cpu_moe import fused_timed


def op_seconds(
    op: Op, device: DeviceSpec, dtype: str, rows, *, cpu_gemm: CpuGemmChoice | None = None
) -> np.ndarray:
    """T_op = max(FLOPs / P(rows), bytes / B) + N_elementwise / R_elementwise  (paper Eq 13-14,
    plus the op's elementwise passes, which run after its GEMMs), P from the profile's GEMM curve
    at `rows` rows when it has one, else the peak; on the CPU (cpu_gemm given) P is the rate of
    the path the executor takes at those rows, padded as it pads (hrm.rules.cpu_gemm), and an op of
    several GEMMs takes sum_j FLOPs_j / P_j(rows), each at its own shape's curve. `rows` and the
    op's sizes may be arrays (one entry per row count). R: the measured
    elementwise rate in `dtype`, else the memory bandwidth over the element size."""

    def rate(fn) -> np.ndarray:  # one lookup per row count: `rows` may be an array of them
        at = np.asarray(rows, dtype=float)
        if at.size < 8:
            return np.fromiter(map(fn, at.flat), float, at.size).reshape(at.shape)
        once, where = np.unique(at, return_inverse=True)  # a decode's steps share their rows
        return np.fromiter(map(fn, once), float, once.size)[where].reshape(at.shape)

    if cpu_gemm is None:
        compute = np.asarray(op.flops) / rate(lambda r: device.matmul_flops_per_s(dtype, r))
    elif op.gemm_shapes:
        compute = sum(
            flops / gemm_flops_per_s_each(device, cpu_gemm, rows, shape)
            for shape, flops in op.gemm_flops()
        )
    else:
        compute = np.asarray(op.flops) / rate(lambda r: gemm_flops_per_s(device, cpu_gemm, r))
    roofline = np.maximum(compute, np.asarray(op.bytes) / device.total_memory_bandwidth_bytes_per_s)
    if not np.any(op.elementwise_elements):
        return roofline
    return roofline + np.asarray(op.elementwise_elements) / device.elementwise_elements_per_s(dtype)


def expert_ffn_seconds(
    arch: ModelArch,
    device: DeviceSpec,
    dtype: str,
    *,
    tokens: float,
    group_tokens: float,
    weight_dtype: str,
    cpu_gemm: CpuGemmChoice | None = None,
    memo: dict | None = None,
) -> float:
    """The routed FFN over `tokens` tokens, run in groups of `group_tokens` (a prefill chunk, a
    decode micro-batch).

    Where the profile measured the executor's whole grouped FFN on this device
    (expert_ffn_curves, executor/overhead.py, real routing included):
    T = FLOPs / P_ffn(rows), rows = G*k over the experts touched.
    Else each expert runs its own GEMMs at the rows routed to it, as the executor's loop does, so
    the expected time is the expectation of the sum over experts (linearity; uniform routing):
      T = (T/G) * E * sum_n P(n) * T_expert(n) + output passes,  n ~ Binomial(G, k/E),
    with T_expert(n) the roofline of routed_expert_op at n rows (op_seconds). Pricing the mean
    count instead misses that the rate curve is not linear in rows: padded fp32 GEMMs at a
    decode batch of 64 (16 rows per expert on average, 43% of the experts above 16 and padded
    to 32) cost 18% less than at the mean (docs/decisions.md, 2026-12-03). A fractional G
    interpolates between the integer counts on either side. `memo` keeps each group's expert
    seconds for the next call on the same device (a search asks for the same prefill chunk at
    every batch size)."""
    if tokens <= 0 or group_tokens <= 0:
        return 0.0
    curve = device.expert_ffn_curves.get(dtype)
    if curve is not None:
        group = group_tokens
        op = expert_ffn_op(arch, tokens=tokens, weight_dtype=weight_dtype, group_tokens=group)
        rows = group * arch.experts_per_token / expected_distinct_experts(arch, group)
        return op.flops / (curve.at(float(rows)) * device.count)
    memo = {} if memo is None else memo
    if group_tokens not in memo:

        def experts(group: int) -> float:  # kept by whole group too: groups b x active_t share
            if ("experts", group) not in memo:
                memo["experts", group] = _experts_seconds(
                    arch, device, dtype, group, weight_dtype, cpu_gemm
                )
            return memo["experts", group]

        memo[group_tokens] = _group_seconds(group_tokens, experts)
    output = ffn_output_elements(arch, tokens) / device.elementwise_elements_per_s(dtype)
    return tokens / group_tokens * memo[group_tokens] + output


def _group_seconds(group_tokens: float, experts) -> float:
    """One group's experts (`experts`: of a whole group); a fractional group between the whole
    groups on either side."""
    low = max(1, math.floor(group_tokens))
    share = min(1.0, max(0.0, group_tokens - low))
    seconds = (1 - share) * experts(low)
    if share:
        seconds += share * experts(low + 1)
    return seconds


def _experts_seconds(
    arch: ModelArch,
    device: DeviceSpec,
    dtype: str,
    group: int,
    weight_dtype: str,
    cpu_gemm: CpuGemmChoice | None,
) -> float:
    """E * sum_n P(n) * T_expert(n) for one group of `group` tokens: n ~ Binomial(group, k/E),
    n = 0 costs nothing."""
    counts, weights = _binomial(group, arch.experts_per_token / arch.num_experts)
    fused = runs_fused(device, dtype, cpu_gemm)
    tiles = fused and cpu_gemm.glu == "tiles"  # the SwiGLU in the kernel's tiles: no pass
    expert = routed_expert_op(arch, rows=counts, weight_dtype=weight_dtype, fused=fused,
                              glu_in_tiles=tiles)  # fmt: skip
    if fused:  # each expert at its rows on the kernel's curves (hrm profile)
        cpu_gemm = cpu_gemm.fused_experts()
    seconds = op_seconds(expert, device, dtype, counts, cpu_gemm=cpu_gemm)
    return arch.num_experts * float(weights @ seconds)


def runs_fused(device: DeviceSpec, dtype: str, cpu_gemm: CpuGemmChoice | None) -> bool:
    """The CPU's routed experts priced fused: the run fuses them and the profile timed the
    kernel (hrm.rules.cpu_moe; else the loop's price, the closest measured)."""
    return cpu_gemm is not None and cpu_gemm.experts == "fused" and fused_timed(device, dtype)


def linears_choice(device: DeviceSpec, dtype: str, cpu_gemm: CpuGemmChoice | None):
    """The choice the CPU's other matrices are priced by: on the kernel's curves at their own
    shapes where the run put them on it and the profile timed it, else along the paths."""
    on_kernel = cpu_gemm is not None and cpu_gemm.linears == "fused"
    return cpu_gemm.fused_experts() if on_kernel and fused_timed(device, dtype) else cpu_gemm


def _binomial(trials: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """(counts, P(count)) of Binomial(trials, p) over 1..trials within 8 standard deviations of
    the mean (all but about 1e-15 of the mass; 0 left out)."""
    if p >= 1:  # every expert takes every token
        return np.array([trials]), np.array([1.0])
    reach = 8 * math.sqrt(trials * p * (1 - p)) + 1
    lo, hi = max(1, math.floor(trials * p - reach)), min(trials, math.ceil(trials * p + reach))
    counts = np.arange(lo, hi + 1)
    # log P(lo) from math.lgamma, then each next count by the ratio P(n+1)/P(n) =
    # (trials - n) / (n + 1) * p / (1 - p): no scipy.special, whose import alone was a seventh
    # of `hrm plan`'s time
    first = (math.lgamma(trials + 1) - math.lgamma(lo + 1) - math.lgamma(trials - lo + 1)
             + lo * math.log(p) + (trials - lo) * math.log1p(-p))  # fmt: skip
    steps = np.log(trials - counts[:-1]) - np.log(counts[:-1] + 1) + math.log(p / (1 - p))
    return counts, np.exp(first + np.concatenate([[0.0], np.cumsum(steps)]))
