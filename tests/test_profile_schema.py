"""The profile schema's measured-only fields: optional, round-tripping, and CPU-only profiles."""

from __future__ import annotations

import pytest

from hrm.errors import HrmError
from hrm.hardware import BUNDLED_DIR, HardwareProfile, resolve_hardware


def _measured_dict() -> dict:
    return {
        "name": "box",
        "source": "measured",
        "gpu": {
            "name": "GPU",
            "memory": "80 GB",
            "available_memory": "79.5 GB",
            "memory_bandwidth": "2 TB/s",
            "flops": {"bfloat16": "300 TFLOP/s"},
        },
        "cpu": {
            "name": "CPU",
            "cores": 8,
            "memory": "64 GB",
            "available_memory": "60 GB",
            "memory_bandwidth": "50 GB/s",
            "flops": {"float32": "1 TFLOP/s"},
        },
        "link": {"h2d": "25 GB/s", "d2h": "26 GB/s", "bidirectional": "40 GB/s"},
    }


def test_available_memory_and_bidirectional_round_trip():
    profile = HardwareProfile.from_dict(_measured_dict())
    assert profile.cpu.available_memory_bytes == 60e9
    assert profile.gpu.available_memory_bytes == 79.5e9
    assert profile.link.bidirectional_bytes_per_s == 40e9
    again = HardwareProfile.from_dict(profile.to_dict())
    assert again == profile


def test_datasheet_profiles_leave_the_new_fields_unset():
    t4 = resolve_hardware("t4")
    assert t4.cpu.available_memory_bytes is None
    assert t4.link.bidirectional_bytes_per_s is None
    assert "available_memory" not in t4.to_dict()["cpu"]
    assert "bidirectional" not in t4.to_dict()["link"]


def test_changing_a_memory_drops_its_measured_available_figure():
    profile = HardwareProfile.from_dict(_measured_dict())
    smaller = profile.with_resources(cpu_memory_bytes=32e9, gpu_memory_bytes=40e9)
    assert smaller.cpu.available_memory_bytes is None
    assert smaller.gpu.available_memory_bytes is None


def test_bad_available_memory_is_named():
    data = _measured_dict()
    data["cpu"]["available_memory"] = "lots"
    with pytest.raises(HrmError, match="cpu: available_memory"):
        HardwareProfile.from_dict(data)


def test_bundled_ci_cpu_profile_loads_as_a_cpu_only_measured_profile():
    profile = resolve_hardware("ci-cpu")
    assert profile == HardwareProfile.load(BUNDLED_DIR / "ci-cpu.yaml")
    assert profile.source == "measured"
    assert not profile.has_gpu and profile.link is None
    assert profile.cpu.available_memory_bytes is not None
    assert 1e9 <= profile.cpu.memory_bandwidth_bytes_per_s <= 1e13
    assert 1e9 <= profile.cpu.flops_per_s("float32") <= 1e16
    curve = profile.cpu.matmul_curves["float32"]
    assert curve.best == profile.cpu.flops_per_s("float32")
    assert profile.provenance["command"].startswith("hrm profile")
