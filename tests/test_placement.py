"""hrm.rules.placement: whole tensors, dense weights first, never more than the policy allows."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hrm.arch import resolve_model
from hrm.rules.placement import place_model, place_weights, slot_bytes


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


# Qwen2-MoE 57B with four dense layers among its 28 (mlp_only_layers): two kinds of layer
@pytest.fixture(scope="module")
def mixed():
    import json

    from hrm.arch import BUNDLED_DIR, ModelArch

    config = json.loads((BUNDLED_DIR / "qwen2-57b-a14b.json").read_text())
    return ModelArch.from_hf_config(config | {"mlp_only_layers": [0, 1, 2, 27]}, name="mixed")


def _streamed_per_layer(placed, arch) -> list[float]:
    return [placed.of(i)[1].streamed_bytes for i in range(arch.num_layers)]


@given(rw=st.floats(0.0, 1.0))
@settings(max_examples=200, deadline=None)
def test_with_dense_layers_the_placed_fraction_places_the_same_tensors(mixed, rw):
    """The executor places the plan's (placed) r_w again: it must land on the same tensors, and
    never above what was asked; the slot the planner counts holds any layer's streamed part."""
    placed = place_model(mixed, rw, "bfloat16")
    assert placed.fraction <= rw + 1e-12
    again = place_model(mixed, placed.fraction, "bfloat16")
    assert again.kinds == placed.kinds
    nxt = placed.next_fraction
    assert nxt is None or nxt > rw - 1e-12
    assert max(_streamed_per_layer(placed, mixed)) <= (1 - placed.fraction) * slot_bytes(
        mixed, "bfloat16"
    ) * (1 + 1e-9)


def test_dense_layers_mlps_go_resident_before_any_routed_expert(mixed):
    (sparse, n, p), (dense, m, q) = place_model(mixed, 0.0, "bfloat16").kinds
    assert (n, m) == (24, 4) and dense.ffn_is_dense and q.num_experts == 1
    dense_parts = n * p.dense_bytes + m * q.dense_bytes
    total = n * p.layer_bytes + m * q.layer_bytes
    only_dense = place_model(mixed, dense_parts / total, "bfloat16")
    assert [(k[2].dense_resident, k[2].resident_experts) for k in only_dense.kinds] == [
        (True, 0),
        (True, 0),
    ]
    mlps = place_model(mixed, (dense_parts + m * q.expert_bytes) / total, "bfloat16")
    assert [k[2].resident_experts for k in mlps.kinds] == [0, 1]
    one_more = (dense_parts + m * q.expert_bytes + n * p.expert_bytes) / total
    assert mlps.next_fraction == pytest.approx(one_more)
    assert [k[2].resident_experts for k in place_model(mixed, one_more, "bfloat16").kinds] == [1, 1]


def test_one_kind_is_placed_as_before(mixtral):
    """A model without dense layers: place_model is place_weights in every layer."""
    for rw in (0.0, 0.2, 0.6, 1.0):
        ((kind, n, p),) = place_model(mixtral, rw, "bfloat16").kinds
        assert kind == mixtral and n == 32 and p == place_weights(mixtral, rw, "bfloat16")
    assert slot_bytes(mixtral, "bfloat16") == 2 * mixtral.layer_params
