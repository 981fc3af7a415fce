"""The roofline model pinned to hand-computed numbers."""

import dataclasses

import pytest

from hrm.arch import resolve_model
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.roofline import (
    attainable_flops_per_s,
    cpu_peak_flops_per_s,
    cross_level_flops_per_s,
    ffn_balance_batch,
    op_time,
    run_time_bound,
    turning_points,
)
from hrm.roofline.ops import (
    attention_op,
    expected_distinct_experts,
    expert_ffn_op,
    layer_ops,
    lm_head_op,
    prefill_attention_flops,
)
from hrm.rules.cpu_gemm import choose_cpu_gemm

MIXTRAL = resolve_model("mixtral-8x7b")
L4 = resolve_hardware("l4")


def test_decode_attention_intensity_mixtral_context_512_fp16():
    op = attention_op(MIXTRAL, batch=1, new_tokens=1, context=512, kv_dtype="float16")
    # Per sequence: QK^T and PV are 2 * 512 * 32 * 128 MACs = 4 * 512 * 32 * 128 FLOPs, plus a
    # 5-FLOP softmax per score; bytes: q and output 2 * 32 * 128 * 2, K and V 2 * 512 * 8 * 128 * 2.
    flops = 4 * 512 * 32 * 128 + 5 * 512 * 32
    nbytes = 2 * 32 * 128 * 2 + 2 * 512 * 8 * 128 * 2
    assert op.flops == flops and op.bytes == nbytes
    assert op.intensity == pytest.approx(4.0, rel=0.01)
    # The paper's "about 2" counts the two matmuls in multiply-accumulates (reference, section 1).
    assert (op.flops / 2) / op.bytes == pytest.approx(2.0, rel=0.01)


def test_a_later_chunk_attends_over_its_prompts_earlier_tokens():
    """A chunk of 20 tokens starting 100 into its prompt: query i sees the 100 earlier keys and
    i + 1 of its own (100 * 20 + 20 * 21 / 2 pairs a sequence), reads K and V of all 120; a
    whole prompt (context = new tokens) keeps the causal (s + 1) / 2 keys a query."""
    nq, d, kv = 32, 128, 2 * 8 * 128 * 2
    pairs = 3 * (100 * 20 + 20 * 21 / 2)
    chunk = attention_op(MIXTRAL, batch=3, new_tokens=20, context=120, kv_dtype="bfloat16")
    assert chunk.flops == pytest.approx(2 * pairs * nq * 2 * d + 5 * pairs * nq, rel=1e-12)
    assert chunk.kv_bytes == 3 * 120 * kv
    whole = attention_op(MIXTRAL, batch=3, new_tokens=20, context=20, kv_dtype="bfloat16")
    assert whole.flops == pytest.approx(2 * 3 * 20 * 10.5 * nq * (2 * d + 2.5), rel=1e-12)
    # the executor's masked rectangle: 20 queries by 120 keys
    rect = prefill_attention_flops(MIXTRAL, batch=3, length=20, keys=120)
    assert rect == 2 * 3 * 20 * 120 * nq * 2 * d + 5 * 3 * 20 * 120 * nq
    assert prefill_attention_flops(MIXTRAL, batch=3, length=20) == prefill_attention_flops(
        MIXTRAL, batch=3, length=20, keys=20
    )


def test_latent_attention_reads_one_row_a_key_for_every_head():
    """DeepSeek-V3 decode at context 512, as the executor attends: 128 query heads, each against
    the cached row of 576 (QK^T) and its first 512 columns (PV), the row read once for all of
    them: an intensity of about the heads' count, not a grouped-query model's few FLOP/B."""
    v3 = resolve_model("deepseek-v3")
    op = attention_op(v3, batch=1, new_tokens=1, context=512, kv_dtype="bfloat16")
    assert op.flops == 2 * 512 * 128 * (576 + 512) + 5 * 512 * 128
    assert op.kv_bytes == 512 * 576 * 2
    assert op.activation_bytes == 128 * (576 + 512) * 2  # the absorbed query and the output
    assert op.intensity == pytest.approx(165, rel=0.01)
    # the layer's GEMMs are the executor's: q's low rank, the latent and rotary key, the
    # absorbed key up-projection; after attention the value up-projection, then O
    sparse = v3.layer_arch(3)
    ops = {op.name: op for op in layer_ops(sparse, batch=1, new_tokens=1, context=512)}
    h = 7168
    assert ops["qkv_proj"].gemm_shapes == ((h, 1536), (1536, 128 * 192), (h, 576),
                                           (128 * 128, 512))  # fmt: skip
    assert ops["o_proj"].gemm_shapes == ((512, 128 * 128), (128 * 128, h))


def test_attention_intensity_does_not_depend_on_batch_and_grows_with_smaller_kv():
    one = attention_op(MIXTRAL, batch=1, new_tokens=1, context=512, kv_dtype="bfloat16")
    many = attention_op(MIXTRAL, batch=256, new_tokens=1, context=512, kv_dtype="bfloat16")
    int4 = attention_op(MIXTRAL, batch=256, new_tokens=1, context=512, kv_dtype="int4")
    assert many.intensity == pytest.approx(one.intensity)
    # int4 rows of 128: 64 bytes of codes and a float16 scale and minimum for each of 2 groups,
    # 72 of bf16's 256 (q and output stay bf16): about 3.5x the intensity (paper, without the
    # scales: ~4x, ~8 MAC/B)
    assert int4.kv_bytes == pytest.approx(72 / 256 * many.kv_bytes)
    assert int4.intensity == pytest.approx(256 / 72 * one.intensity, rel=0.05)


@pytest.mark.parametrize("tokens", [16, 64, 256])
def test_expert_ffn_intensity_is_about_n_over_4_against_cpu_weights(tokens):
    op = expert_ffn_op(MIXTRAL, tokens=tokens, weight_dtype="float16")
    # Nearly all 8 experts touched for N >= 16; weight bytes dominate:
    # I = 6*N*h*i*k / (6*h*i*E) = N*k/E.
    touched = 8 * (1 - 0.75**tokens)
    assert op.weight_bytes == pytest.approx(touched * MIXTRAL.expert_params * 2)
    assert op.intensity == pytest.approx(tokens / 4, rel=0.05)


def test_expected_distinct_experts():
    assert expected_distinct_experts(MIXTRAL, 1) == pytest.approx(2.0)
    assert expected_distinct_experts(MIXTRAL, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert expected_distinct_experts(MIXTRAL, 1000) == pytest.approx(8.0)
    # a micro-batch kernel reads only the experts its tokens touch, once per micro-batch
    one_token_groups = expert_ffn_op(MIXTRAL, tokens=4, weight_dtype="bfloat16", group_tokens=1)
    assert one_token_groups.weight_bytes == pytest.approx(4 * 2 * MIXTRAL.expert_params * 2)


def test_layer_and_lm_head_flops_match_active_parameters():
    ops = layer_ops(MIXTRAL, batch=1, new_tokens=1, context=1)
    matmul_flops = sum(
        op.flops for op in ops if op.name in ("qkv_proj", "o_proj", "router", "expert_ffn")
    )
    per_layer_active = (
        MIXTRAL.active_params - 2 * MIXTRAL.embedding_params - MIXTRAL.hidden_size
    ) / 32
    assert matmul_flops == pytest.approx(2 * per_layer_active, rel=1e-3)
    assert lm_head_op(MIXTRAL, batch=3).flops == 2 * 3 * 4096 * 32000


def test_turning_points_l4():
    points = turning_points(L4, "bfloat16")
    assert points.p1 == pytest.approx(1.3e12 / 16e9)  # Eq 9: P_cpu / B_link = 81.25 FLOP/B
    assert points.p2 == pytest.approx(121e12 / 16e9)  # Eq 10: P_gpu / B_link = 7562.5 FLOP/B


def test_turning_points_absent_without_gpu_or_when_roofs_do_not_cross():
    data = L4.to_dict()
    cpu_only = HardwareProfile.from_dict(
        {k: v for k, v in data.items() if k not in ("gpu", "link")}
    )
    assert turning_points(cpu_only, "bfloat16") is None
    fast_link = L4.with_resources(link_bytes_per_s=200e9)  # faster than CPU memory (100 GB/s)
    assert turning_points(fast_link, "bfloat16").p1 is None


def test_cross_level_roof_eq7():
    # Left of P1 the link binds: B_link * I^j
    assert cross_level_flops_per_s(L4, "bfloat16", gpu_intensity=4, cpu_intensity=4) == 16e9 * 4
    # With a small micro-batch the GPU's own memory roof binds: B_gpu * I^i
    assert (
        cross_level_flops_per_s(L4, "bfloat16", gpu_intensity=10, cpu_intensity=1000) == 300e9 * 10
    )
    assert cross_level_flops_per_s(L4, "bfloat16", gpu_intensity=1e6, cpu_intensity=1e6) == 121e12


def test_ffn_balance_point_eq11():
    n = ffn_balance_batch(MIXTRAL, L4, micro_batch=64)
    micro = expert_ffn_op(MIXTRAL, tokens=64, weight_dtype="bfloat16")
    whole = expert_ffn_op(MIXTRAL, tokens=n, weight_dtype="bfloat16")
    assert 16e9 * whole.intensity == pytest.approx(300e9 * micro.intensity, rel=1e-6)
    assert n == pytest.approx(64 * 300 / 16, rel=0.1)  # about mu * B_gpu / B_link


def test_op_time_breakdown():
    op = expert_ffn_op(MIXTRAL, tokens=64, weight_dtype="bfloat16")
    t = op_time(op, L4.cpu, "bfloat16")
    assert t.compute_s == pytest.approx(op.flops / 1.3e12)
    assert t.memory_s == pytest.approx(op.bytes / 100e9)
    assert t.time_s == max(t.compute_s, t.memory_s)
    serial = op_time(
        op, L4.gpu, "bfloat16", link_bytes=op.weight_bytes, link_bytes_per_s=16e9, overlap="sum"
    )
    assert serial.binding == "link"
    assert serial.time_s == pytest.approx(serial.compute_s + serial.memory_s + serial.link_s)


def test_run_time_bound_charges_each_decode_step_its_own_context():
    bound = run_time_bound(MIXTRAL, L4.cpu, batch=4, prompt_len=10, gen_len=3)
    assert bound.generated_tokens == 12
    steps = []
    for context in (11, 12):  # decode steps 1 and 2; the first token comes from prefill
        ops = [o.scaled(32) for o in layer_ops(MIXTRAL, batch=4, new_tokens=1, context=context)]
        ops.append(lm_head_op(MIXTRAL, batch=4))
        steps.append(sum(op_time(o, L4.cpu, "bfloat16").time_s for o in ops))
    assert bound.decode_s == pytest.approx(sum(steps))
    assert steps[1] > steps[0]


def test_the_cpu_roof_is_the_peak_of_the_gemm_path_the_choice_takes():
    """ci-cpu (AVX2, measured): bf16 GEMMs natively at about 22 GFLOP/s, along the widened path
    about 160; the choice widens there, so the CPU's roof is the widened peak."""
    cpu = resolve_hardware("ci-cpu").cpu
    native, widened = cpu.flops_per_s("bfloat16"), cpu.flops_per_s("bfloat16_widened")
    assert native < widened / 4
    assert cpu_peak_flops_per_s(cpu, "bfloat16") == widened
    assert cpu_peak_flops_per_s(cpu, "float32") == cpu.flops_per_s("float32")
    assert attainable_flops_per_s(cpu, "bfloat16", 1e6, peak_flops_per_s=widened) == widened
    # a profile without a measured widened path falls back to float32
    fp32_only = dataclasses.replace(
        cpu, peak_flops_per_s={"float32": 100e9, "bfloat16": 20e9}, matmul_curves={}
    )
    assert cpu_peak_flops_per_s(fp32_only, "bfloat16") == 100e9
    shape = dict(batch=64, prompt_len=64, gen_len=8, dtype="bfloat16")
    choice = choose_cpu_gemm(cpu, "bfloat16")
    bound = run_time_bound(MIXTRAL, cpu, **shape, cpu_gemm=choice)
    assert bound.throughput_tok_s > 2 * run_time_bound(MIXTRAL, cpu, **shape).throughput_tok_s
    # a faster native rate is kept (h200-sxm's host: AMX bf16 above fp32)
    host = resolve_hardware("h200-sxm").cpu
    assert cpu_peak_flops_per_s(host, "bfloat16") == host.flops_per_s("bfloat16") == 20e12


@pytest.mark.parametrize("name", ["qwen2-57b-a14b", "qwen3-30b-a3b", "olmoe-1b-7b"])
def test_each_familys_layer_flops_are_its_active_parameters(name):
    """A token's GEMM FLOPs in a layer are twice the weights it multiplies: the attention
    projections, the router, its k experts and (Qwen2-MoE) the shared expert with its gate. The
    q/k norms and biases are not GEMM weights: taken out of the count."""
    arch = resolve_model(name)
    ops = layer_ops(arch, batch=1, new_tokens=1, context=1)
    gemms = sum(op.flops for op in ops if op.gemm_shapes)
    biases = (arch.q_size + 2 * arch.kv_size) if arch.attention_bias else 0
    per_layer = arch.active_params - arch.embedding_params - arch.lm_head_params - arch.hidden_size
    per_layer = per_layer / arch.num_layers - arch.norm_params - arch.qk_norm_params - biases
    assert gemms == pytest.approx(2 * per_layer, rel=1e-9)
    shared = [op for op in ops if op.name == "shared_expert"]
    if arch.shared_expert_intermediate_size:
        h, si = arch.hidden_size, arch.shared_expert_intermediate_size
        assert shared[0].gemm_shapes == ((h, si), (h, si), (si, h), (h, 1))
        assert shared[0].elementwise_elements == 5 * si + 5 * h + 3
    else:
        assert shared == []


def test_qk_norms_and_biases_add_their_element_passes():
    qwen3 = resolve_model("qwen3-30b-a3b")

    def passes(arch):
        return next(op for op in layer_ops(arch, batch=4, new_tokens=1, context=9)
                    if op.name == "norms").elementwise_elements  # fmt: skip

    plain = dataclasses.replace(qwen3, qk_norm=None)
    qk = qwen3.q_size + qwen3.kv_size
    assert passes(qwen3) - passes(plain) == 4 * 11 * qk
    biased = dataclasses.replace(plain, attention_bias=True)
    assert passes(biased) - passes(plain) == 4 * 3 * (qk + qwen3.kv_size)
