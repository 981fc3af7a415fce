"""The grouped expert FFN curve `hrm profile` takes on a GPU, run here on the CPU (the code is the
same but for the device): its points and how the planner reads them back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.overhead import measure_expert_ffn_curve, measure_launch_overhead
from hrm.hardware.parts import Curve
from hrm.roofline.ops import expected_distinct_experts, expert_ffn_op
from planner.op_time import expert_ffn_seconds
from tests.test_profile import TINY_ARCH

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_the_curve_is_rows_per_expert_against_the_ffns_flop_rate(device):
    tokens = (1, 8, 64)
    points = measure_expert_ffn_curve(
        TINY_ARCH, "float32", device, tokens=tokens, min_sample_s=0.01
    )
    k = TINY_ARCH.experts_per_token
    rows = [n * k / expected_distinct_experts(TINY_ARCH, n) for n in tokens]
    assert [r for r, _ in points] == pytest.approx(rows)
    assert rows[0] == pytest.approx(1.0)  # one token: each of its k experts gets one row
    assert all(rate > 0 for _, rate in points)
    curve = Curve(points=tuple(points))  # sorted and positive, as a profile requires
    # more rows per expert reuse each weight more: the rate rises from decode to a prefill chunk
    assert curve.at(rows[-1]) > curve.at(rows[0])


def test_the_planner_reads_back_the_time_that_was_measured():
    """T = FLOPs(T) / P(rows(T)) returns the measured seconds at a measured token count: the
    curve already holds the routing's spread, so no expectation over counts is taken."""
    rate = 3e11
    rows = 64 * TINY_ARCH.experts_per_token / expected_distinct_experts(TINY_ARCH, 64)
    device = dataclasses.replace(
        _any_device(), expert_ffn_curves={"float32": Curve(points=((1.0, 1e10), (rows, rate)))}
    )
    op = expert_ffn_op(TINY_ARCH, tokens=128, weight_dtype="float32", group_tokens=64)
    seconds = expert_ffn_seconds(
        TINY_ARCH, device, "float32", tokens=128, group_tokens=64, weight_dtype="float32"
    )
    assert seconds == pytest.approx(op.flops / rate)


def test_the_launch_overhead_is_measured_on_the_device_asked(monkeypatch):
    """The miniature's weights are made on the device named (stopped there: no GPU needed)."""
    import executor.overhead as overhead

    class Made(Exception):
        pass

    def on(arch, dtype, device="cpu"):
        raise Made(device)

    monkeypatch.setattr(overhead, "random_weights", on)
    with pytest.raises(Made, match="cuda"):
        measure_launch_overhead(TINY_ARCH, repeats=1, device="cuda")
    with pytest.raises(Made, match="cuda"):
        measure_expert_ffn_curve(TINY_ARCH, "bfloat16", "cuda")


def _any_device():
    from hrm.hardware import resolve_hardware

    return resolve_hardware("l4").gpu
