"""The routed FFN priced as the executor runs it: each expert's GEMMs at the rows routed to it,
in expectation over the routing (planner.op_time.expert_ffn_seconds)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hrm.hardware.parts import Curve
from hrm.roofline.ops import expected_distinct_experts, expert_ffn_op
from hrm.rules.cpu_gemm import CpuGemmChoice
from planner.op_time import expert_ffn_seconds, op_seconds

PADDED_NATIVE = CpuGemmChoice(
    dtype="float32", buckets=((0.0, "native"),), padded=("native",), source="test"
)


def device(make_cpu_profile, curve: Curve, elementwise: float = 1e9):
    """Compute bound (memory at 1e18 B/s), float32 GEMMs on `curve`."""
    cpu = make_cpu_profile(bandwidth=1e18).cpu
    return dataclasses.replace(
        cpu, matmul_curves={"float32": curve}, elementwise_rate={"float32": elementwise}
    )


def seconds(arch, cpu, tokens, group, cpu_gemm=None):
    return expert_ffn_seconds(
        arch, cpu, "float32", tokens=tokens, group_tokens=group, weight_dtype="float32",
        cpu_gemm=cpu_gemm,
    )  # fmt: skip


def test_two_tokens_over_four_experts_by_hand(arch, make_cpu_profile):
    """Top-2 of 4 experts: each expert takes each token with p = 1/2, so over 2 tokens it gets
    1 row with P = 1/2 and 2 rows with P = 1/4. One expert at n rows: 6*n*h*i FLOPs at the
    curve's rate for n rows (1e9 at 1, 4e9 at 2), plus n*(5i + 9h) element passes at 1e9/s;
    the output's 3*T*h passes once. The mean count (4/3 rows) would price neither."""
    h, i = arch.hidden_size, arch.intermediate_size  # 64, 128
    cpu = device(make_cpu_profile, Curve(points=((1.0, 1e9), (2.0, 4e9))))
    one = 6 * 1 * h * i / 1e9 + 1 * (5 * i + 9 * h) / 1e9
    two = 6 * 2 * h * i / 4e9 + 2 * (5 * i + 9 * h) / 1e9
    experts = 4 * (0.5 * one + 0.25 * two)
    assert seconds(arch, cpu, 2, 2) == pytest.approx(experts + 3 * 2 * h / 1e9)
    # 8 tokens in groups of 2: four groups, each as above, and the output of all 8
    assert seconds(arch, cpu, 8, 2) == pytest.approx(4 * experts + 3 * 8 * h / 1e9)


def test_a_rate_flat_in_rows_gives_the_mean_counts_price(arch, make_cpu_profile):
    """By linearity: when the rate does not depend on rows, the expectation is FLOPs / P plus
    the element passes, which is what the whole op at any row count costs."""
    cpu = device(make_cpu_profile, Curve(points=((1.0, 3e9), (1e6, 3e9))))
    for tokens, group in ((1, 1), (16, 16), (64, 16), (48, 48)):
        whole = expert_ffn_op(arch, tokens=tokens, weight_dtype="float32", group_tokens=group)
        assert seconds(arch, cpu, tokens, group) == pytest.approx(
            float(op_seconds(whole, cpu, "float32", 4.0)), rel=1e-9
        )


def test_padded_gemms_are_charged_at_each_experts_padded_rows(arch, make_cpu_profile):
    """The executor pads each expert's rows to a multiple of 16 above 8 (hrm.rules.gemm_paths). At a
    flat rate r the compute is E * sum_n P(n) * 6*pad(n)*h*i / r, n ~ Binomial(64, 1/2) here,
    P from math.comb: 0.45 of the experts land above 32 and pay for 48 rows. The mean count
    (32 rows) would charge 32."""
    h, i = arch.hidden_size, arch.intermediate_size
    rate = 1e10
    cpu = device(make_cpu_profile, Curve(points=((1.0, rate), (1e6, rate))), elementwise=1e30)
    g = 64

    def pad(n):
        return n if n <= 8 else -(-n // 16) * 16

    rows = sum(math.comb(g, n) * 0.5**g * pad(n) for n in range(1, g + 1))
    expected = 4 * 6 * rows * h * i / rate
    assert seconds(arch, cpu, g, g, PADDED_NATIVE) == pytest.approx(expected, rel=1e-9)
    mean_rows = g * 2 / expected_distinct_experts(arch, g)
    assert mean_rows == pytest.approx(32.0)
    assert expected > 1.15 * 4 * 6 * 32 * h * i / rate


def test_a_fractional_group_interpolates_between_its_integer_neighbours(arch, make_cpu_profile):
    cpu = device(make_cpu_profile, Curve(points=((1.0, 1e9), (8.0, 8e9))))
    output = 3 * 10 * arch.hidden_size / 1e9

    def per_group(g):
        return seconds(arch, cpu, g, g) - 3 * g * arch.hidden_size / 1e9

    mixed = 0.75 * per_group(4) + 0.25 * per_group(5)
    assert seconds(arch, cpu, 10, 4.25) == pytest.approx(10 / 4.25 * mixed + output)
    assert seconds(arch, cpu, 0, 4) == 0.0
