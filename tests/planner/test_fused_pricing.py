"""A CPU run whose routed experts ran fused (hrm.rules.cpu_moe) priced by the kernel's own
curves (`bfloat16_fused`, hrm profile), each expert at its rows on the two fused calls' shapes,
with no per-expert launch cost; the loop's price where the profile never timed the kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hrm.errors import HrmError
from hrm.hardware.parts import Curve, LaunchOverhead, gemm_shape_key
from hrm.roofline.ops import routed_expert_op
from hrm.rules.cpu_gemm import CpuGemmChoice
from hrm.rules.cpu_moe import fused_timed, model_missing
from planner.op_time import expert_ffn_seconds, linears_choice, op_seconds
from planner.overheads import launch_seconds

PACKED = CpuGemmChoice(dtype="bfloat16", buckets=((0.0, "packed"),), source="test")
FUSED = dataclasses.replace(PACKED, experts="fused")


def flat(rate: float) -> Curve:
    return Curve(points=((1.0, rate), (1e6, rate)))


def device(make_cpu_profile, arch, fused_rate: float | None):
    """Compute bound; packed GEMMs at 1e9 FLOP/s; the fused kernel at `fused_rate` on its two
    calls' shapes (none: never timed); element passes at 1e9/s."""
    h, i = arch.hidden_size, arch.intermediate_size
    cpu = make_cpu_profile(bandwidth=1e18).cpu
    shapes = {}
    if fused_rate is not None:
        shapes = {gemm_shape_key(h, 2 * i): {"bfloat16_fused": flat(fused_rate)},
                  gemm_shape_key(i, h): {"bfloat16_fused": flat(fused_rate)}}  # fmt: skip
    return dataclasses.replace(
        cpu,
        peak_flops_per_s={"float32": 1e9, "bfloat16": 1e9, "bfloat16_packed": 1e9},
        matmul_curves={"bfloat16_packed": flat(1e9)},
        gemm_shape_curves=shapes,
        elementwise_rate={"bfloat16": 1e9},
    )


def seconds(arch, cpu, choice, tokens=2, group=2) -> float:
    return expert_ffn_seconds(arch, cpu, "bfloat16", tokens=tokens, group_tokens=group,
                              weight_dtype="bfloat16", cpu_gemm=choice)  # fmt: skip


def test_a_fused_expert_is_priced_by_hand(arch, make_cpu_profile):
    """Top-2 of 4 experts over 2 tokens: an expert takes 1 row with P = 1/2 and 2 with P = 1/4.
    At n rows: 6*n*h*i FLOPs at the fused rate (4e9), plus n*(5i + 9h) element passes at 1e9/s;
    the output's 3*T*h passes once."""
    h, i = arch.hidden_size, arch.intermediate_size
    cpu = device(make_cpu_profile, arch, fused_rate=4e9)

    def expert(n: int) -> float:
        return 6 * n * h * i / 4e9 + n * (5 * i + 9 * h) / 1e9

    by_hand = 4 * (0.5 * expert(1) + 0.25 * expert(2)) + 3 * 2 * h / 1e9
    assert seconds(arch, cpu, FUSED) == pytest.approx(by_hand, rel=1e-9)
    # the loop on the same device pays the packed rate, 4x slower here
    assert seconds(arch, cpu, PACKED) > seconds(arch, cpu, FUSED) * 2


def test_without_the_kernels_curves_a_fused_run_is_priced_as_the_loop(arch, make_cpu_profile):
    cpu = device(make_cpu_profile, arch, fused_rate=None)
    assert not fused_timed(cpu, "bfloat16")
    assert seconds(arch, cpu, FUSED) == seconds(arch, cpu, PACKED)
    assert fused_timed(device(make_cpu_profile, arch, fused_rate=1e9), "bfloat16")
    assert not fused_timed(device(make_cpu_profile, arch, fused_rate=1e9), "float16")


def test_fused_experts_pay_no_per_expert_launch(arch):
    """per_layer + touched(b) * per_expert for the loop, per_layer alone fused."""
    overhead = LaunchOverhead(per_layer_s=1e-3, per_expert_s=1e-4, per_step_s=0.0)
    loop = launch_seconds(overhead, arch, 3, 8.0, 2.0)
    fused = launch_seconds(overhead, arch, 3, 8.0, 2.0, fused=True)
    assert np.allclose(fused, 1e-3)
    touched = 4 * (1 - (1 - 2 / 4) ** 2)  # 2 tokens over 4 experts, top-2
    assert loop[1] == pytest.approx(1e-3 + touched * 1e-4)


def test_the_choice_records_how_the_experts_ran():
    """to_dict / from_dict keep it; a record from before it was kept ran the loop; a page
    handed over unpacked runs the loop whatever the choice; a bad value is refused."""
    assert CpuGemmChoice.from_dict(FUSED.to_dict()) == FUSED
    old = {k: v for k, v in FUSED.to_dict().items() if k != "experts"}
    assert CpuGemmChoice.from_dict(old).experts == "loop"
    assert FUSED.unpacked().experts == "loop"
    assert FUSED.fused_experts().buckets == ((0.0, "fused"),)
    assert "experts fused" in FUSED.describe()
    with pytest.raises(HrmError, match="experts must be loop or fused"):
        CpuGemmChoice.from_dict({**FUSED.to_dict(), "experts": "grouped"})


def test_the_model_rule(arch):
    """bf16 experts of 64-multiple widths, biased or clamped too (gpt-oss); the tiny arch is
    64 x 128."""
    assert model_missing(arch, "bfloat16") is None
    assert "bfloat16 weights" in model_missing(arch, "float32")
    narrow = dataclasses.replace(arch, intermediate_size=96)
    assert "a multiple of 64 (it is 96)" in model_missing(narrow, "bfloat16")
    gpt_oss = dataclasses.replace(arch, expert_bias=True, swiglu_limit=7.0)
    assert model_missing(gpt_oss, "bfloat16") is None


def test_the_other_matrices_on_the_kernel_are_priced_by_its_curves(arch, make_cpu_profile):
    """A run that put its other matrices on the kernel (linears fused) has them priced at the
    kernel's curves at their own shapes where the profile timed it, else along the paths; the
    choice records it, a record from before it ran them along the paths, and a page handed
    over unpacked runs them along the paths too."""
    both = dataclasses.replace(FUSED, linears="fused")
    timed, untimed = (device(make_cpu_profile, arch, rate) for rate in (4e9, None))
    assert linears_choice(timed, "bfloat16", both).buckets == ((0.0, "fused"),)
    assert linears_choice(untimed, "bfloat16", both) is both
    assert linears_choice(timed, "bfloat16", FUSED) is FUSED
    h, i = arch.hidden_size, arch.intermediate_size
    op = routed_expert_op(arch, rows=1.0, weight_dtype="bfloat16", fused=True)  # its shapes
    priced = op_seconds(op, timed, "bfloat16", 1.0, cpu_gemm=linears_choice(timed, "bfloat16",
                                                                             both))  # fmt: skip
    assert priced == pytest.approx(6 * h * i / 4e9 + (5 * i + 9 * h) / 1e9, rel=1e-9)
    assert CpuGemmChoice.from_dict(both.to_dict()) == both
    old = {k: v for k, v in both.to_dict().items() if k != "linears"}
    assert CpuGemmChoice.from_dict(old).linears == "paths"
    assert both.unpacked().linears == "paths"
    assert "experts and linears fused" in both.describe()
    with pytest.raises(HrmError, match="linears must be paths or fused"):
        CpuGemmChoice.from_dict({**both.to_dict(), "linears": "kernel"})


def test_a_glu_in_the_kernels_tiles_has_no_pass_of_its_own(arch, make_cpu_profile):
    """A run whose fused gate-up call computes the SwiGLU in its tiles (glu tiles) is charged
    the experts' other elementwise passes only (9 h a row, not 5 i + 9 h); the choice records
    it, a record from before it had the GLU apart, and a bad value is one line."""
    timed = device(make_cpu_profile, arch, 4e9)
    tiles = dataclasses.replace(FUSED, glu="tiles")
    i = arch.intermediate_size
    apart, fused = (expert_ffn_seconds(arch, timed, "bfloat16", tokens=1.0, group_tokens=1,
                                       weight_dtype="bfloat16", cpu_gemm=c)
                    for c in (FUSED, tiles))  # fmt: skip
    rows = arch.experts_per_token  # one token's assignments
    assert apart - fused == pytest.approx(rows * 5 * i / 1e9, rel=1e-6)
    assert CpuGemmChoice.from_dict(tiles.to_dict()) == tiles
    old = {k: v for k, v in tiles.to_dict().items() if k != "glu"}
    assert CpuGemmChoice.from_dict(old).glu == "apart"
    with pytest.raises(HrmError, match="glu must be apart or tiles"):
        CpuGemmChoice.from_dict({**tiles.to_dict(), "glu": "fused"})
