"""The offloading runtime on the CPU standing in for a GPU: every schedule, paged weights, several
micro-batches and batches; tokens against the resident run and transformers; the bytes each step
streams against the plan; the page table; the buffers against the planner's memory model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.api import RunSpec
from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
from executor.run import execute
from executor.runtime import placed_runtime
from hrm.arch import ModelArch
from hrm.hardware import resolve_hardware
from hrm.policy import Policy
from hrm.rules.placement import place_model, place_weights
from hrm.workload import Workload
from planner import predict
from tests.executor.conftest import ragged_prompts, reference_model
from tests.executor.test_matches_transformers import (
    TOLERANCE,
    reference_generate,
    relative_error,
)

LENGTHS = (5, 9, 3, 7, 6, 2, 8)
STEPS = 6
CPU = torch.device("cpu")
# (schedule, attention on the GPU, kv fraction on the GPU)
SCHEDULES = [
    ("serial", False, 0.0),
    ("overlap", False, 0.0),
    ("cgopipe", False, 0.0),
    ("gpu-attention", True, 0.0),
    ("gpu-attention", True, 0.5),
]


def policy(n=7, mu=3, *, attn=False, rw=0.0, rc=0.0, dtype="float32") -> Policy:
    return Policy(
        batch_size=n,
        micro_batch_size=mu,
        attention_on_gpu=attn,
        ffn_on_gpu=True,
        weights_gpu_fraction=rw,
        kv_gpu_fraction=rc,
        weight_dtype=dtype,
        kv_dtype=dtype,
    )


def between(arch: ModelArch, dtype="float32") -> float:
    """A resident fraction strictly between 0 and 1: the dense weights (with the dense layers'
    MLPs) and one routed expert."""
    kinds = place_model(arch, 0.0, dtype).kinds
    first = sum(
        n * (p.dense_bytes + (p.layer_bytes - p.dense_bytes) * k.ffn_is_dense) for k, n, p in kinds
    )
    expert = next(n * p.expert_bytes for k, n, p in kinds if not k.ffn_is_dense)
    return (first + 1.01 * expert) / sum(n * p.layer_bytes for _, n, p in kinds)


def run_on_cpu(path, plan, prompts, dtype: str):
    """Every batch of `prompts` under `plan`, the CPU standing in for the GPU."""
    checkpoint = open_checkpoint(path, dtype)
    spec = RunSpec(checkpoint=None, arch=checkpoint.arch, prompts=tuple(map(tuple, prompts)),
                   gen_len=STEPS, dtype=dtype, device="cpu")  # fmt: skip
    return execute(
        spec, plan.policy, plan.schedule, checkpoint=checkpoint, staged=plan.stages_weights
    )


@pytest.fixture(scope="module")
def resident_tokens(checkpoints):
    cache = {}

    def tokens(name: str):
        if name not in cache:
            model = MoEModel(open_checkpoint(checkpoints[name], "float32"))
            cache[name] = generate(model, ragged_prompts(LENGTHS, seed=3), STEPS).output_token_ids
        return cache[name]

    return tokens


FAMILIES = ("mixtral-single", "mixtral-fused", "dbrx", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss",
            "glm4_moe", "deepseek_v2", "deepseek_v3")  # fmt: skip
DENSE = ("qwen2_moe-dense", "qwen3_moe-dense")  # dense layers among sparse ones


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_moe-64x8", *DENSE])
@pytest.mark.parametrize(("schedule", "attn", "rc"), SCHEDULES)
@pytest.mark.parametrize("resident", ["none", "between"])
def test_every_schedule_matches_the_resident_run(
    checkpoints, resident_tokens, name, schedule, attn, rc, resident
):
    checkpoint = open_checkpoint(checkpoints[name], "float32")
    rw = 0.0 if resident == "none" else between(checkpoint.arch)
    runtime = placed_runtime(checkpoint, policy(attn=attn, rw=rw, rc=rc), schedule, CPU)
    try:
        out = generate(runtime, ragged_prompts(LENGTHS, seed=3), STEPS)
        store = runtime.store
        placed = place_model(checkpoint.arch, rw, "float32")
        layers = [placed.of(i)[1] for i in range(checkpoint.arch.num_layers)]
        # the page table mapped every streamed expert of every layer once per pass of the layer
        expected = {(i, e): STEPS for i, p in enumerate(layers) for e in p.streamed_experts}
        assert dict(store.mapped) == expected
        # weights streamed per step: (1 - r_w) of the layers, as the plan counts them
        assert store.h2d_bytes == STEPS * sum(p.streamed_bytes for p in layers)
        assert store.h2d_bytes == pytest.approx(STEPS * (1 - placed.fraction) * placed.layers_bytes)
    finally:
        runtime.close()
    assert out.output_token_ids == resident_tokens(name)
    assert len(runtime.micro_batches) == 3


def test_matches_transformers_directly(checkpoints):
    path = checkpoints["dbrx"]
    prompts = ragged_prompts(LENGTHS, seed=4)
    theirs, _ = reference_generate(reference_model(path), prompts, STEPS)
    runtime = placed_runtime(open_checkpoint(path, "float32"), policy(), "cgopipe", CPU)
    try:
        assert generate(runtime, prompts, STEPS).output_token_ids == theirs
    finally:
        runtime.close()


@pytest.mark.parametrize("schedule", ["cgopipe", "gpu-attention"])
def test_bf16_logits_within_the_resident_tolerance(checkpoints, schedule):
    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=5)
    ours_policy = policy(attn=schedule == "gpu-attention", dtype="bfloat16")
    runtime = placed_runtime(open_checkpoint(path, "bfloat16"), ours_policy, schedule, CPU)
    try:
        ours = generate(runtime, prompts, STEPS, keep_logits=True)
    finally:
        runtime.close()
    theirs_tokens, theirs = reference_generate(reference_model(path, torch.bfloat16), prompts, 6)
    for step in range(STEPS):
        assert relative_error(ours.step_logits[step], theirs[step]) <= TOLERANCE["bfloat16"]
        if [t[: step + 1] for t in ours.output_token_ids] != [t[: step + 1] for t in theirs_tokens]:
            break


def test_prompts_in_batches_equal_separate_runs(checkpoints, resident_tokens):
    """3N+1 prompts in batches of N give, in input order, what each batch gives alone."""
    path = checkpoints["mixtral-single"]
    prompts = tuple(tuple(p) for p in ragged_prompts((5, 9, 3, 7, 6, 2, 8, 4, 9, 1), seed=6))
    plan = predict(
        open_checkpoint(path).arch,
        resolve_hardware("l4"),
        Workload(prompt_len_mean=5, prompt_len_max=9, gen_len=STEPS),
        policy(n=3, mu=2, rw=0.0),
    )
    run = run_on_cpu(path, plan, prompts, "float32")
    assert len(run.batches) == 4 and sorted(len(b) for b in run.batches) == [1, 3, 3, 3]
    model = MoEModel(open_checkpoint(path, "float32"))
    alone = [generate(model, [p], STEPS).output_token_ids[0] for p in prompts]
    assert [run.outputs[i]["output_token_ids"] for i in range(len(prompts))] == alone
    assert run.measured.link_bytes["h2d"] > 0 and run.measured.busy_fraction["h2d"] > 0


# What the planner counts that the runtime holds in no buffer of its own: temporaries (activations,
# workspace, prefill hidden states parked on the host) and the host's embedding and LM head, which
# stay the checkpoint's own tensors.
NOT_BUFFERS = {
    "gpu": {"activations", "workspace"},
    "cpu": {"activations and workspace", "embedding and head", "hidden-state offload"},
}


def test_buffers_agree_with_the_plan(checkpoints):
    """Each buffer the planner counts is one the runtime allocates (but for NOT_BUFFERS), of the
    size counted (equal-length prompts: the planner's rectangular KV cache is then exact),
    within 5%."""
    path = checkpoints["mixtral-single"]
    arch = open_checkpoint(path).arch
    prompts = tuple(tuple(p) for p in ragged_prompts((6,) * 6, seed=7))
    for attn, schedule in ((False, "cgopipe"), (True, "gpu-attention")):
        p = policy(n=6, mu=3, attn=attn, rw=between(arch, "bfloat16"), dtype="bfloat16")
        plan = predict(
            arch,
            resolve_hardware("l4"),
            Workload(prompt_len_mean=6, prompt_len_max=6, gen_len=STEPS),
            p,
            schedule,
        )
        run = run_on_cpu(path, plan, prompts, "bfloat16")
        for side in ("gpu", "cpu"):
            planned = getattr(plan.memory, side)
            reported = run.measured.buffer_bytes[side]
            assert set(reported) == set(planned) - NOT_BUFFERS[side], side
            for name, allocated in reported.items():
                assert allocated == pytest.approx(planned[name], rel=0.05), (side, name)


def test_weights_beyond_the_pinnable_memory_go_through_a_staging_ring(checkpoints):
    """A link that may pin less than the weights: the plan says so (a "weight staging" buffer of
    two pages, and a slower stream), and the run copies every page through the ring with the
    same tokens."""
    import dataclasses

    path = checkpoints["mixtral-single"]
    arch = open_checkpoint(path).arch
    l4 = resolve_hardware("l4")
    tight = dataclasses.replace(l4, link=dataclasses.replace(l4.link, pinnable_bytes=1e3))
    workload = Workload(prompt_len_mean=6, prompt_len_max=9, gen_len=STEPS)
    free = predict(arch, l4, workload, policy(), "cgopipe")
    plan = predict(arch, tight, workload, policy(), "cgopipe")
    assert "weight staging" not in free.memory.cpu
    layer = place_weights(arch, 0.0, "float32").layer_bytes
    # two of the largest of 3 pages (3 micro-batches), cut at tensor boundaries
    assert 2 * layer / 3 <= plan.memory.cpu["weight staging"] <= 2 * layer / 2
    assert plan.predicted.total_s >= free.predicted.total_s
    prompts = tuple(tuple(p) for p in ragged_prompts(LENGTHS, seed=3))
    run = run_on_cpu(path, plan, prompts, "float32")
    model = MoEModel(open_checkpoint(path, "float32"))
    expected = generate(model, [list(p) for p in prompts], STEPS).output_token_ids
    assert [run.outputs[i]["output_token_ids"] for i in range(len(prompts))] == expected
    assert run.environment["staged_weights"]
    staging = run.measured.buffer_bytes["cpu"]["weight staging"]
    assert staging == pytest.approx(plan.memory.cpu["weight staging"], rel=0.05)


def test_the_attention_curve_times_the_executors_kernel(monkeypatch):
    """hrm profile's CPU attention curve: increasing sizes, positive rates, at the model's heads,
    each call the executor's own stage (the append into a KVCache, then attention over it)."""
    from executor import attention
    from executor.attention import QUICK_CURVE_POINTS, measure_attention_curve
    from hrm.arch import resolve_model

    seen = []

    def stage(cache, layer, q, k, v, **kw):
        seen.append((cache.k[layer].shape, cache.length, cache.has_padding))
        return real_stage(cache, layer, q, k, v, **kw)

    real_stage = attention.append_and_attend
    monkeypatch.setattr(attention, "append_and_attend", stage)
    curve = measure_attention_curve(resolve_model("mixtral-8x7b"), quick=True, rotate_bytes=1e6)
    batch, context = QUICK_CURVE_POINTS[0]
    assert seen[0] == ((batch, 8, context, 128), context - 1, True)
    assert len(curve.points) == len(QUICK_CURVE_POINTS)
    assert curve.points[0][0] == 2 * batch * 8 * context * 128 * 2  # K and V, 8 heads of 128, bf16
    assert all(rate > 0 for _, rate in curve.points)
    # in float32 the stage reads 4-byte K/V, and the curve's sizes say so
    seen.clear()
    fp32 = measure_attention_curve(resolve_model("mixtral-8x7b"), "float32", quick=True,
                                   rotate_bytes=1e6)  # fmt: skip
    assert fp32.points[0][0] == 2 * curve.points[0][0]
    assert seen[0][0] == (batch, 8, context, 128)


def test_the_prefill_attention_curve_times_the_executors_stage(monkeypatch):
    """hrm profile's CPU prefill attention curve: one point per (batch, length), at the FLOPs the
    stage computes there, a quarter of each batch's prompts half as long, positive rates, each
    call the executor's own stage (the K/V store, then masked SDPA over the padded square)."""
    from executor import attention
    from executor.attention import PREFILL_CURVE_POINTS, measure_prefill_attention_curve
    from hrm.arch import resolve_model
    from hrm.roofline.ops import prefill_attention_flops

    seen = []

    def stage(cache, layer, q, k, v, batch_idx, slot_idx, **terms):
        seen.append((cache.length, cache.has_padding, q.shape[0], int(slot_idx.min())))
        return real_stage(cache, layer, q, k, v, batch_idx, slot_idx, **terms)

    real_stage = attention.store_and_attend_prompts
    monkeypatch.setattr(attention, "store_and_attend_prompts", stage)
    small = dataclasses.replace(
        resolve_model("mixtral-8x7b"), num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    curve = measure_prefill_attention_curve(small, "float32")
    assert [x for x, _ in curve.points] == [
        prefill_attention_flops(small, batch=b, length=n) for b, n in PREFILL_CURVE_POINTS
    ]
    assert all(rate > 0 for _, rate in curve.points)
    # (4, 128): one prompt of 64 tokens, left-padded, and three of 128
    length, padded, tokens, first_slot = next(s for s in seen if s[0] == 128)
    assert padded and tokens == 64 + 3 * 128 and first_slot == 0


def test_the_elementwise_rate_times_the_executors_expert_ffn():
    """hrm profile's elementwise rate: the real grouped FFN beyond its GEMMs, positive, and
    below what the same elements would take at a fanciful 10 TB/s."""
    from executor.overhead import measure_elementwise_rate
    from hrm.arch import resolve_model

    small = dataclasses.replace(
        resolve_model("mixtral-8x7b"), hidden_size=64, intermediate_size=128
    )
    rate = measure_elementwise_rate(small, "float32", repeats=2)
    assert 0 < rate < 10e12 / 4
