"""The CPU standing in for a GPU (hrm/hardware/stand_in.py): the profile, its queues adding up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hrm.errors import HrmError
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.policy import Policy
from planner import predict
from planner.evaluate import batch_model, policy_vector
from planner.setting import Setting
from tests.planner.tiny_setup import cpu_only_profile


def test_the_stand_in_profile_is_the_host_with_a_memcpy_link(tmp_path):
    host = cpu_only_profile(bandwidth=8e9)
    from hrm.hardware.stand_in import stand_in_profile

    s = stand_in_profile(host, gpu_memory_bytes=1e6)
    assert s.stand_in and s.gpu.memory_bytes == 1e6
    assert s.gpu.peak_flops_per_s == host.cpu.peak_flops_per_s
    # no measured copy: a copy reads and writes each byte, at the read bandwidth
    assert s.link.h2d_bytes_per_s == s.link.d2h_bytes_per_s == 4e9
    assert HardwareProfile.load(s.save(tmp_path / "s.yaml")) == s
    measured = dataclasses.replace(host.cpu, copy_bandwidth_bytes_per_s=11e9)
    s = stand_in_profile(dataclasses.replace(host, cpu=measured), gpu_memory_bytes=1e6)
    assert s.link.h2d_bytes_per_s == s.link.d2h_bytes_per_s == 11e9  # the measured copy
    with pytest.raises(HrmError, match="has a GPU"):
        stand_in_profile(resolve_hardware("l4"), 1e9)


@pytest.mark.parametrize("schedule", ["cgopipe", "overlap", "gpu-attention", "serial"])
def test_stand_in_queues_add_up(arch, workload, schedule):
    """T_layer >= Q_gpu + Q_cpu + Q_h2d + Q_d2h: one set of cores and one memory bus."""
    from hrm.hardware.stand_in import stand_in_profile

    hw = stand_in_profile(cpu_only_profile(memory_bytes=4e6), gpu_memory_bytes=2e6)
    policy = Policy(
        batch_size=4,
        micro_batch_size=2,
        attention_on_gpu=schedule == "gpu-attention",
        ffn_on_gpu=True,
        weights_gpu_fraction=0.0,
        kv_gpu_fraction=0.0,
        weight_dtype="float32",
        kv_dtype="float32",
    )
    setting = Setting(arch=arch, hardware=hw, workload=workload, schedule=schedule)
    model = batch_model(setting, 4, 2)
    v = policy_vector(policy)
    m, ws = model.full_micro_batches, model.weight_stream_s
    queues = sum(model.queues.queue(q).coefficients(m, ws) for q in ("gpu", "cpu", "h2d", "d2h"))
    rows = model.layer_coefficients()
    assert np.allclose(rows["shared host"] @ v, queues @ v)
    launch = model.queues.components["gpu"]["launch overhead"]  # charged there, none measured
    assert np.all(launch.coefficients(m, ws) == 0)
    plan = predict(arch, hw, workload, policy, schedule)
    layer = np.max([c @ v for c in rows.values()], axis=0)  # per step
    assert np.all(layer >= queues @ v - 1e-15)
    assert plan.predicted.total_s > 0
