"""hrm.placement: whole tensors, dense weights first, never more than the policy allows."""

import pytest

from hrm.arch import resolve_model
from hrm.placement import place_weights


@pytest.fixture(scope="module")
def mixtral():
    return resolve_model("mixtral-8x7b")


def test_dense_first_then_whole_experts(mixtral):
    a = mixtral
    dense = 2 * (a.attention_params + a.router_params + a.norm_params)  # bf16 bytes
    expert = 2 * a.expert_params
    layer = 2 * a.layer_params
    assert place_weights(a, 0.0, "bfloat16").resident_bytes == 0
    assert not place_weights(a, 0.9 * dense / layer, "bfloat16").dense_resident
    p = place_weights(a, (dense + 2.5 * expert) / layer, "bfloat16")
    assert p.dense_resident and p.resident_experts == 2
    assert p.resident_bytes == dense + 2 * expert
    assert p.streamed_bytes == layer - p.resident_bytes
    assert list(p.streamed_experts) == [2, 3, 4, 5, 6, 7]
    full = place_weights(a, 1.0, "bfloat16")
    assert full.fraction == 1.0 and full.streamed_bytes == 0


@pytest.mark.parametrize("rw", [0.0, 0.03, 0.1, 0.39, 0.5, 0.77, 0.999, 1.0])
def test_never_places_more_than_asked(mixtral, rw):
    p = place_weights(mixtral, rw, "bfloat16")
    assert p.fraction <= rw + 1e-12
    # one more expert (or the dense block) would exceed it
    step = p.expert_bytes if p.dense_resident else p.dense_bytes
    assert p.fraction == 1.0 or (p.resident_bytes + step) / p.layer_bytes > rw


def test_planner_reports_the_placed_fraction(mixtral):
    from hrm.hardware import resolve_hardware
    from hrm.policy import Policy
    from hrm.workload import Workload
    from planner import predict

    policy = Policy(
        batch_size=8,
        micro_batch_size=4,
        attention_on_gpu=False,
        ffn_on_gpu=True,
        weights_gpu_fraction=0.5,
        kv_gpu_fraction=0.0,
    )
    wl = Workload(prompt_len_mean=64, prompt_len_max=64, gen_len=8)
    plan = predict(mixtral, resolve_hardware("l4"), wl, policy)
    placed = place_weights(mixtral, 0.5, "bfloat16")
    assert plan.policy.weights_gpu_fraction == pytest.approx(placed.fraction)
    assert plan.memory.gpu["resident weights"] == pytest.approx(
        mixtral.num_layers * placed.resident_bytes
    )


@pytest.mark.parametrize(
    "name", ["mixtral-8x7b", "dbrx", "qwen2-57b-a14b", "qwen3-30b-a3b", "olmoe-1b-7b"]
)
def test_a_layers_dense_tensors_are_every_weight_but_its_experts(name):
    """What the planner counts (ModelArch) is what the store places: q/k/v biases, q/k norms and
    the gated shared expert are dense weights, kept with the attention and router."""
    arch = resolve_model(name)
    p = place_weights(arch, 0.0, "bfloat16")
    assert p.dense_bytes == 2 * arch.dense_layer_params
    assert p.layer_bytes == 2 * arch.layer_params
