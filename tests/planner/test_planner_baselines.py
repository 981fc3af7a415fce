"""The baselines follow their own rules and are evaluated with the same model."""

from __future__ import annotations

import pytest

from hrm.arch import resolve_model
from hrm.hardware import resolve_hardware
from hrm.workload import Workload
from planner import predict
from planner.baselines import baselines
from planner.search import search
from planner.setting import Setting

WORKLOAD = Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=64)


@pytest.fixture(scope="module")
def l4_baselines():
    setting = Setting(
        arch=resolve_model("mixtral-8x7b"), hardware=resolve_hardware("l4"), workload=WORKLOAD
    )
    return {b.name: b for b in baselines(setting)}


def test_deepspeed_like_streams_everything_with_one_micro_batch(l4_baselines):
    plan = l4_baselines["deepspeed-like"].plan
    p = plan.policy
    assert p.weights_gpu_fraction == 0.0 and p.kv_gpu_fraction == 1.0
    assert p.attention_on_gpu and p.ffn_on_gpu and p.micro_batch_size == p.batch_size
    assert plan.memory.gpu_bytes <= plan.memory.gpu_capacity_bytes
    assert plan.schedule == "gpu-attention"


def test_flexgen_like_uses_gpu_attention_and_fills_weights_first(l4_baselines):
    plan = l4_baselines["flexgen-like"].plan
    p = plan.policy
    assert p.attention_on_gpu and p.ffn_on_gpu and plan.schedule == "gpu-attention"
    assert p.kv_gpu_fraction == 0.0 or p.weights_gpu_fraction > 0.999
    assert plan.memory.gpu_bytes <= plan.memory.gpu_capacity_bytes
    assert plan.memory.cpu_bytes <= plan.memory.cpu_capacity_bytes


def test_baselines_are_the_same_model_and_no_better_than_the_search(l4_baselines):
    arch, hw = resolve_model("mixtral-8x7b"), resolve_hardware("l4")
    best = search(arch, hw, WORKLOAD, top_k=1).best
    for baseline in l4_baselines.values():
        plan = baseline.plan
        again = predict(arch, hw, WORKLOAD, plan.policy, plan.schedule)
        assert again.predicted == plan.predicted
        assert plan.predicted.throughput_tok_s <= best.predicted.throughput_tok_s


def test_no_baselines_without_a_gpu(arch, make_cpu_profile, workload):
    assert baselines(Setting(arch=arch, hardware=make_cpu_profile(), workload=workload)) == []
