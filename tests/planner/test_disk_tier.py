"""The planner's disk tier: where the host cannot hold the weights, the search keeps the least
share of them on disk that fits, prices its reads at the profile's rate for the read size, and
reports the bytes read per pass; with memory to spare it keeps none."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hrm.arch import resolve_model
from hrm.errors import HrmError
from hrm.hardware import resolve_hardware
from hrm.hardware.parts import Curve, DiskSpec
from hrm.policy import Policy
from hrm.rules.placement import DISK_READ_BYTES
from hrm.workload import Workload
from planner.evaluate import batch_model, least_disk_share, policy_vector, predict
from planner.search import NoPolicyFits, search
from planner.setting import Setting

WORKLOAD = Workload(prompt_len_mean=128, prompt_len_max=128, gen_len=32)


def _t4(cpu_gb: float, disk: DiskSpec | None):
    hw = resolve_hardware("t4").with_resources(cpu_memory_bytes=cpu_gb * 1e9)
    return dataclasses.replace(hw, disk=disk)


def test_disk_holds_what_the_host_cannot():
    arch = resolve_model("mixtral-8x7b")
    with pytest.raises(NoPolicyFits, match="CPU memory"):
        search(arch, _t4(40, None), WORKLOAD, weight_dtype="float16", kv_dtype="float16")
    hw = _t4(40, resolve_hardware("t4").disk)
    best = search(arch, hw, WORKLOAD, weight_dtype="float16", kv_dtype="float16").best
    pol, mem = best.policy, best.memory
    assert 0 < pol.weights_disk_fraction <= 1 - pol.weights_gpu_fraction
    assert mem.cpu_bytes <= mem.cpu_capacity_bytes * (1 + 1e-9) and "cpu" in best.binding_memory
    stored = arch.layers_params * 2  # float16, every layer
    assert mem.disk["weights"] == pytest.approx(pol.weights_disk_fraction * stored)
    assert best.busy_s["disk"] > 0
    # the least share that fits: no more than the host needs
    setting = Setting(arch=arch, hardware=hw, workload=WORKLOAD, weight_dtype="float16",
                      kv_dtype="float16")  # fmt: skip
    model = batch_model(setting, pol.batch_size, pol.micro_batch_size)
    assert least_disk_share(model.memory, hw, policy_vector(pol)) == pytest.approx(
        pol.weights_disk_fraction, abs=1e-8
    )


def test_with_memory_to_spare_the_disk_is_used_only_when_asked():
    """auto (the default) plans as without a disk where the weights fit the host; on lets the
    search trade disk reads for a larger batch (FlexGen's way) where that is faster."""
    arch, disk = resolve_model("mixtral-8x7b"), DiskSpec(read_bytes_per_s=6.5e9)
    without = search(arch, _t4(192, None), WORKLOAD).best
    auto = search(arch, _t4(192, disk), WORKLOAD).best
    assert auto.policy == without.policy and auto.predicted == without.predicted
    assert not auto.memory.disk
    on = search(arch, _t4(192, disk), WORKLOAD, disk_tier="on").best
    assert on.policy.weights_disk_fraction > 0
    assert on.policy.batch_size > without.policy.batch_size
    assert on.predicted.throughput_tok_s >= without.predicted.throughput_tok_s
    with pytest.raises(NoPolicyFits):
        search(arch, _t4(40, disk), WORKLOAD, disk_tier="off")
    with pytest.raises(HrmError, match="--disk-tier must be one of"):
        search(arch, _t4(40, disk), WORKLOAD, disk_tier="maybe")


def test_disk_reads_priced_by_hand(arch, make_gpu_profile, workload):
    """Half of each layer on a disk of 1 MB/s at its read size: every step's layer takes at
    least r_d * W_l / rate, and that binds."""
    curve = Curve(points=((4096.0, 1e5), (float(DISK_READ_BYTES), 1e7)))
    hw = dataclasses.replace(make_gpu_profile(cpu_memory_bytes=1e9),
                             disk=DiskSpec(read_bytes_per_s=1e7, read_curve=curve))  # fmt: skip
    policy = Policy(batch_size=2, micro_batch_size=1, attention_on_gpu=False, ffn_on_gpu=True,
                    weights_gpu_fraction=0.0, kv_gpu_fraction=0.0, weight_dtype="float32",
                    kv_dtype="float32", weights_disk_fraction=0.5)  # fmt: skip
    plan = predict(arch, hw, workload, policy)
    layer = arch.layers_params * 4 / arch.num_layers  # bytes of one layer, float32
    per_layer = 0.5 * layer / curve.at(min(DISK_READ_BYTES, layer))
    setting = Setting(arch=arch, hardware=hw, workload=workload, weight_dtype="float32",
                      kv_dtype="float32")  # fmt: skip
    rows = batch_model(setting, 2, 1).layer_coefficients()
    assert rows["disk"] @ policy_vector(policy) == pytest.approx(np.full(workload.gen_len,
                                                                        per_layer))  # fmt: skip
    assert plan.bottleneck == "disk weights"
    steps = workload.gen_len
    assert plan.predicted.total_s >= steps * arch.num_layers * per_layer
    assert plan.busy_s["disk"] == pytest.approx(steps * arch.num_layers * per_layer)


def test_policy_keeps_the_weights_once():
    base = dict(batch_size=2, micro_batch_size=1, attention_on_gpu=False, ffn_on_gpu=True,
                kv_gpu_fraction=0.0)  # fmt: skip
    with pytest.raises(HrmError, match="needs ffn_on_gpu"):
        Policy(**{**base, "ffn_on_gpu": False}, weights_gpu_fraction=0.0,
               weights_disk_fraction=0.5)  # fmt: skip
    with pytest.raises(HrmError, match="add up to more than 1"):
        Policy(**base, weights_gpu_fraction=0.6, weights_disk_fraction=0.5)
    kept = Policy(**base, weights_gpu_fraction=0.25, weights_disk_fraction=0.5)
    assert Policy.from_dict(json.loads(json.dumps(kept.to_dict()))) == kept
    assert "weights_disk_fraction" not in Policy(**base, weights_gpu_fraction=0.25).to_dict()
