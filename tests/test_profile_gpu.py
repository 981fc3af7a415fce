"""hrm profile's GPU and link measurements; skipped cleanly where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from hrm.cli import main
from hrm.hardware import HardwareProfile
from hrm.profiling import PRESETS, measure_profile
from hrm.profiling.gpu import cuda_event_clock
from tests.test_profile import TINY_ARCH, TINY_PLAN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_event_clock_waits_for_the_gpu_work_it_times():
    a = torch.randn(2048, 2048, device="cuda")
    one = cuda_event_clock(lambda: a @ a, 1)
    ten = cuda_event_clock(lambda: a @ a, 10)
    assert 0 < one < ten < 10


@pytest.fixture(scope="module")
def gpu_profile() -> HardwareProfile:
    return measure_profile(
        plan=TINY_PLAN,
        device="cuda",
        arch=TINY_ARCH,
        name="tiny-gpu",
        command="hrm profile (test)",
        quiet=True,
        warn=lambda message: None,
    )


def test_gpu_figures_are_plausible(gpu_profile):
    gpu, link = gpu_profile.gpu, gpu_profile.link
    assert gpu is not None and link is not None
    assert gpu.count == torch.cuda.device_count()
    assert 0 < gpu.available_memory_bytes <= gpu.memory_bytes
    assert 1e9 <= gpu.memory_bandwidth_bytes_per_s <= 1e13
    assert set(gpu.peak_flops_per_s) == {"float32", "bfloat16", "float16"}
    for dtype, rate in gpu.peak_flops_per_s.items():
        assert 1e9 <= rate <= 1e16, dtype
        assert gpu.matmul_curves[dtype].best == rate
    for rate in (link.h2d_bytes_per_s, link.d2h_bytes_per_s, link.bidirectional_bytes_per_s):
        assert 1e9 <= rate <= 1e13
    assert [x for x, _ in link.h2d_curve.points] == list(TINY_PLAN.link_sizes_bytes)
    assert link.h2d_curve.best == link.h2d_bytes_per_s


def test_gpu_provenance_keeps_pageable_and_both_direction_figures(gpu_profile):
    notes = gpu_profile.provenance["link"]
    assert {"h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable", "both_directions"} <= set(
        notes
    )
    assert gpu_profile.provenance["gpu_memory_bandwidth"]["kind"].startswith("device-to-device")


def test_gpu_profile_round_trips(gpu_profile, tmp_path):
    loaded = HardwareProfile.load(gpu_profile.save(tmp_path / "gpu.yaml"))
    assert loaded.to_dict() == gpu_profile.to_dict()


def test_cli_writes_a_gpu_profile(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(PRESETS, "quick", TINY_PLAN)
    output = tmp_path / "gpu.yaml"
    assert main(["profile", "--quick", "--quiet", "--device", "cuda", "-o", str(output)]) == 0
    assert "link: h2d" in capsys.readouterr().out
    gpu = HardwareProfile.load(output).gpu
    assert set(gpu.launch_overhead) == {"float32"}  # the executor's own decode, on the GPU
    assert set(gpu.expert_ffn_curves) == set(gpu.matmul_curves)  # its grouped FFN per dtype
