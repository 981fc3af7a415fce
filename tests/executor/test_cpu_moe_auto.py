"""`--cpu-moe auto`: the fused experts wherever they can run, the loop elsewhere, never a
refusal; the profile times the kernel only where it runs. These run on every host: where the
kernel is missing (an AVX2 CPU, no compiler) they check that auto falls back and that
`--cpu-moe fused` names what the host lacks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from executor import fused_moe
from hrm.cli.profile import with_fused_curves
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import gemm_shape_key
from hrm.profiling import PRESETS
from hrm.rules.cpu_moe import fused_timed
from tests.planner.tiny_setup import cpu_device, tiny_arch

HOST_MISSING = fused_moe.host_missing()


def test_auto_takes_the_loop_where_fused_cannot_run():
    arch = tiny_arch()  # 64 x 128: the model allows it
    assert not fused_moe.fused_experts(arch, "bfloat16", "auto", held=False)
    assert not fused_moe.fused_experts(arch, "float32", "auto", held=True)
    narrow = dataclasses.replace(arch, intermediate_size=96)
    assert not fused_moe.fused_experts(narrow, "bfloat16", "auto", held=True)
    assert not fused_moe.fused_experts(arch, "bfloat16", "loop", held=True)
    # where this host has the kernel, auto takes it; where not, the loop
    assert fused_moe.fused_experts(arch, "bfloat16", "auto", held=True) == (HOST_MISSING is None)


@pytest.mark.skipif(HOST_MISSING is None, reason="this host runs the fused kernel")
def test_fused_names_what_this_host_lacks():
    with pytest.raises(Exception, match="--cpu-moe fused: this run lacks") as caught:
        fused_moe.fused_experts(tiny_arch(), "bfloat16", "fused", held=True)
    assert HOST_MISSING in str(caught.value)


def test_an_auto_run_records_the_loop_where_it_ran_it(checkpoints, run_cli, tmp_path):
    """conftest's Mixtral has experts 96 wide: auto runs the loop and says so."""
    out = tmp_path / "out.jsonl"
    status, stdout, err = run_cli(
        "run", "--checkpoint", checkpoints["mixtral-single"], "--prompt-len", "4", "--batch",
        "2", "--gen-len", "2", "--cpu-moe", "auto", "--output", out, "--json", "--quiet",
    )  # fmt: skip
    assert status == 0, err
    assert json.loads(stdout)["environment"]["cpu_gemm"]["experts"] == "loop"
    assert len(out.read_text().splitlines()) == 2


def test_the_profile_times_the_kernel_only_where_it_runs(tmp_path):
    """Where it runs: bfloat16_fused curves at the model's two fused calls (64 x 256 and
    128 x 64 for the tiny arch) and the generic shapes, kept through save and load. Elsewhere
    the CPU is unchanged."""
    cpu = cpu_device()
    quick = dataclasses.replace(PRESETS["quick"], shape_tokens_grid=(1, 4), repeats=2,
                                min_sample_s=0.001)  # fmt: skip
    timed = with_fused_curves(cpu, tiny_arch(), quick)
    if HOST_MISSING is not None:
        assert timed == cpu and not fused_timed(timed, "bfloat16")
        return
    assert fused_timed(timed, "bfloat16")
    for shape in ((64, 256), (128, 64), (1024, 512)):
        curve = timed.gemm_shape_curves[gemm_shape_key(*shape)]["bfloat16_fused"]
        assert [x for x, _ in curve.points] == [1.0, 4.0] and curve.best > 0
    profile = HardwareProfile(name="t", source="measured", cpu=timed)
    profile.save(tmp_path / "p.yaml")
    assert fused_timed(HardwareProfile.load(tmp_path / "p.yaml").cpu, "bfloat16")
