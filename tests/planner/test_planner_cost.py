"""The cost and memory model pinned to hand-derived numbers.

Tiny model (conftest): L=2, h=64, i=128, nq=4, nkv=2, d=16, E=4, k=2, V=100; float32 weights and
KV (4 B), bfloat16 activations (2 B). Per layer: attention 64*128 + 64*64 = 12288 params, router
256, norms 128, experts 4*3*64*128 = 98304: W_l = 110976 * 4 B = 443904 B.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hrm.errors import HrmError
from hrm.hardware.parts import Curve
from hrm.policy import Policy
from hrm.rules.placement import place_weights
from hrm.workload import Workload
from planner import predict
from planner.evaluate import batch_model, policy_vector
from planner.memory import RC, RW
from planner.setting import Setting

W_LAYER = 443904.0


def policy(**kw) -> Policy:
    base = dict(
        batch_size=2,
        micro_batch_size=1,
        attention_on_gpu=False,
        ffn_on_gpu=False,
        weights_gpu_fraction=0.0,
        kv_gpu_fraction=0.0,
        weight_dtype="float32",
        kv_dtype="float32",
    )
    return Policy(**{**base, **kw})


def test_cpu_only_run_by_hand(arch, make_cpu_profile):
    # CPU at 1e18 FLOP/s (never compute-bound) and 1e9 B/s: every op costs its bytes / 1e9.
    hw = make_cpu_profile(flops=1e18)
    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)
    plan = predict(arch, hw, wl, policy(), schedule="cgopipe")

    # Decode, one sequence at context c, bytes per layer:
    #   norms 512 + 2*2*64*2 = 1024; qkv 64*128*4 + (64+128)*2 = 33152; attention 2*c*2*16*4 +
    #   2*4*16*2 = 256c + 256; o_proj 64*64*4 + 128*2 = 16640; router 64*4*4 + 68*2 = 1160;
    #   experts: 1 token touches 4*(1-(1-2/4)^1) = 2 experts: 2*3*64*128*4 = 196608 + 2*(128+384)*2
    #   = 198656.  Sum 250888 + 256c.  LM head 64*100*4 + (64+100)*2 = 25928 per sequence.
    # Elementwise passes at B / 4 bytes = 2.5e8 fp32 elements/s (no measured rate), i.e. 4 byte
    # each: norms 28*64 + 12*(64+32) = 2944, experts A = 2: 2*(5*128 + 9*64) + 3*64 = 2624;
    #   5568 elements -> 22272.  Per layer 273160 + 256c.
    # Two micro-batches of one: T_layer = Q_cpu = 2*(273160 + 256c); no fill on one device.
    def decode_step(c):
        return (2 * 2 * (273160 + 256 * c) + 2 * 25928) / 1e9

    # Prefill, 8 tokens per sequence: norms 512 + 4*8*64*2 = 4608; qkv 32768 + 8*192*2 = 35840;
    #   attention 2*8*2*16*4 + 2*8*64*2 = 4096; o_proj 16384 + 8*128*2 = 18432;
    #   router 1024 + 8*68*2 = 2112; experts 4*(1-0.5^8) = 3.984375 experts * 98304 = 391680
    #   + 8*2*512*2 = 16384 -> 408064.  Sum 473152 per sequence per layer.  Elementwise: norms
    #   8*2944 = 23552, experts A = 16: 16*1216 + 3*8*64 = 20992; 44544 elements -> 178176.
    prefill = (2 * 2 * (473152 + 178176) + 2 * 25928) / 1e9
    assert plan.predicted.prefill_s == pytest.approx(prefill, rel=1e-12)
    # decode steps 1 and 2 attend over 8 + 1 and 8 + 2 keys
    assert plan.predicted.decode_s == pytest.approx(decode_step(9) + decode_step(10), rel=1e-12)
    assert plan.predicted.generated_tokens == 2 * 3
    assert plan.busy_s["cpu"] == pytest.approx(plan.predicted.total_s, rel=1e-12)
    assert plan.busy_s["gpu"] == plan.busy_s["h2d"] == 0.0
    assert plan.bottleneck == "cpu expert ffn"


def test_a_dense_layer_is_priced_as_its_mlp_by_hand(arch, make_cpu_profile):
    """Layer 1 dense (an MLP of width 96, no router): per decode token it reads the MLP's
    3*64*96*4 = 73728 B + its activations (2*64 + 3*96)*2 = 832 B, and passes 5*96 + 9*64 +
    3*64 = 1248 elements (4992 B), where a sparse layer reads the router 1160 B, two experts
    198656 B and passes 2624 elements (10496 B): 130760 B less per sequence, two micro-batches
    of one.
    On one device the layer times add, so the mixed model's step is the sparse model's less
    the difference, and the mean of the two kinds' models exactly."""
    hw = make_cpu_profile(flops=1e18)
    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)
    mixed = dataclasses.replace(arch, dense_layers=(1,), dense_intermediate_size=96)
    sparse, dense = (dataclasses.replace(k, num_layers=2) for k, _ in mixed.layer_kinds())
    dense = dataclasses.replace(dense, dense_layers=(0, 1))
    ours, theirs = (predict(a, hw, wl, policy(), schedule="cgopipe") for a in (mixed, arch))
    per_step = 2 * 130760 / 1e9
    assert ours.predicted.decode_s == pytest.approx(theirs.predicted.decode_s - 2 * per_step)
    each = [predict(a, hw, wl, policy(), schedule="cgopipe").predicted for a in (sparse, dense)]
    assert ours.predicted.total_s == pytest.approx(sum(p.total_s for p in each) / 2)
    # and its weights: the MLP and norms and attention, not the router and the four experts
    dense_layer = (12288 + 128 + 3 * 64 * 96) * 4
    assert ours.memory.cpu["layer weights"] == pytest.approx(W_LAYER + dense_layer)


def test_weight_stream_term_by_hand(arch, make_gpu_profile):
    # GPU layers, CPU attention, half the weights resident, PCIe 1e8 B/s both ways.
    hw = make_gpu_profile(link_bytes_per_s=1e8)
    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)
    setting = Setting(
        arch=arch, hardware=hw, workload=wl, weight_dtype="float32", kv_dtype="float32"
    )
    p = policy(ffn_on_gpu=True, weights_gpu_fraction=0.5)
    h2d = batch_model(setting, 2, 1).layer_coefficients()["h2d"] @ policy_vector(p)
    # (1 - r_w) * W_l / B + per micro-batch: prefill hidden page 8*64*2 = 1024 B in, decode
    # attention output 64*2 = 128 B back (D2); two micro-batches
    weights = 0.5 * W_LAYER / 1e8
    assert h2d[0] == pytest.approx(weights + 2 * 1024 / 1e8, rel=1e-12)
    assert h2d[1:] == pytest.approx([weights + 2 * 128 / 1e8] * 2, rel=1e-12)


def test_memory_by_hand(arch, make_gpu_profile):
    hw = make_gpu_profile()
    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)  # context up to 11
    plan = predict(arch, hw, wl, policy(ffn_on_gpu=True, weights_gpu_fraction=0.5))
    gpu, cpu = plan.memory.gpu, plan.memory.cpu
    # r_w = 0.5 placed as whole tensors: the dense weights and the experts that fit beside them
    rw = place_weights(arch, 0.5, "float32").fraction
    assert plan.policy.weights_gpu_fraction == rw <= 0.5
    assert gpu["resident weights"] == pytest.approx(rw * 2 * W_LAYER)  # r_w * L * W_l
    assert gpu["paged buffer"] == pytest.approx(2 * (1 - rw) * W_LAYER)  # 2 * (1 - r_w) * W_l
    assert gpu["lm head"] == (6400 + 64) * 4  # LM head + final norm
    assert gpu["kv cache"] == 0.0
    # one micro-batch's prefill, mu*S = 8 tokens: held h + q + 2kv = 192, at its peak another
    # max(q + 2kv, 3q, q + 2h) = 192 (more than decode's N*h = 128), in bf16
    assert gpu["activations"] == 8 * (192 + 192) * 2
    # one prefill chunk of 8 tokens: max((QKV+out 192) * 2 B, (2kh + 3i = 640) * 2 B, fp32 norm
    # 2h * 4 B = 512) = 1280 B a token; fp32 logits 1*100*4
    assert gpu["workspace"] == 8 * 1280 + 100 * 4
    assert cpu["layer weights"] == pytest.approx((1 - rw) * 2 * W_LAYER)
    assert cpu["embedding and head"] == 100 * 64 * 4
    # K and V: 2 sequences * 11 tokens * 2 layers * 2 * 32 * 4 B
    assert cpu["kv cache"] == 2 * 11 * 2 * 2 * 32 * 4
    assert cpu["hidden-state offload"] == 2 * 8 * 64 * 2
    assert cpu["pinned staging"] == 2 * 1 * (2 * 64 + 2 * 32) * 2
    assert cpu["activations and workspace"] == 1 * 4 * 11 * 4  # CPU attention scores, fp32
    assert plan.memory.gpu_capacity_bytes == 0.9 * 1.5e6


def test_time_never_grows_with_resident_weights_or_cache(arch, make_gpu_profile, workload):
    """What the search's closed forms rely on: every time term is nonincreasing in r_w and r_c."""
    for schedule in ("cgopipe", "serial", "overlap", "gpu-attention"):
        setting = Setting(
            arch=arch, hardware=make_gpu_profile(), workload=workload, schedule=schedule
        )
        for n, mu in ((1, 1), (6, 2), (7, 3)):
            model = batch_model(setting, n, mu)
            rows = [*model.layer_coefficients().values(), model.extra_coefficients()]
            assert all((c[:, [RW, RC]] <= 1e-18).all() for c in rows)


def test_last_micro_batch_counts_its_own_size(arch, make_cpu_profile, workload):
    hw = make_cpu_profile()
    five = predict(arch, hw, workload, policy(batch_size=5, micro_batch_size=2))
    four = predict(arch, hw, workload, policy(batch_size=4, micro_batch_size=2))
    one = predict(arch, hw, workload, policy(batch_size=1, micro_batch_size=1))
    # all on the CPU there is no overlap: 2+2+1 costs what 2+2 and 1 cost
    assert five.predicted.total_s == pytest.approx(four.predicted.total_s + one.predicted.total_s)


def test_matmul_curve_slows_small_gemms(arch, make_cpu_profile, workload):
    hw = make_cpu_profile(flops=1e12, bandwidth=1e14)  # compute-bound
    slow = dataclasses.replace(
        hw,
        cpu=dataclasses.replace(
            hw.cpu, matmul_curves={"float32": Curve(points=((1, 1e10), (1024, 1e12)))}
        ),
    )
    p = policy()
    assert (
        predict(arch, slow, workload, p).predicted.total_s
        > 10 * predict(arch, hw, workload, p).predicted.total_s
    )


def test_overlap_never_beats_cgopipe(arch, make_gpu_profile, workload):
    p = policy(batch_size=8, micro_batch_size=2, ffn_on_gpu=True, weights_gpu_fraction=0.3)
    hw = make_gpu_profile()
    paged = predict(arch, hw, workload, p, schedule="cgopipe").predicted.total_s
    whole = predict(arch, hw, workload, p, schedule="overlap").predicted.total_s
    assert whole >= paged


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(attention_on_gpu=True), "needs the layers"),
        (dict(weights_gpu_fraction=0.5), "needs ffn_on_gpu"),
        (dict(ffn_on_gpu=True, kv_gpu_fraction=0.5), "needs attention_on_gpu"),
    ],
)
def test_predict_rejects_impossible_policies(arch, make_gpu_profile, workload, changes, fragment):
    with pytest.raises(HrmError, match=fragment):
        predict(arch, make_gpu_profile(), workload, policy(**changes))


def test_cpu_only_machine_refuses_gpu_placement(arch, make_cpu_profile, workload):
    with pytest.raises(HrmError, match="no GPU"):
        predict(arch, make_cpu_profile(), workload, policy(ffn_on_gpu=True))


def test_decode_charges_each_step_its_own_context(arch, make_cpu_profile):
    hw = make_cpu_profile(flops=1e18)
    short = predict(arch, hw, Workload(prompt_len_mean=8, prompt_len_max=64, gen_len=3), policy())
    padded = predict(
        arch, hw, Workload(prompt_len_mean=8, prompt_len_max=64, gen_len=3, padding=True), policy()
    )
    assert padded.predicted.prefill_s > short.predicted.prefill_s
    # decode attention: padded contexts are 56 keys longer at both steps, 256 B per key per layer
    extra = 2 * 2 * 2 * 256 * 56 / 1e9
    assert padded.predicted.decode_s - short.predicted.decode_s == pytest.approx(extra, rel=1e-9)
    assert np.isfinite(short.predicted.throughput_tok_s)


def _with_rates(device, rates: dict, curves: dict | None = None):
    return dataclasses.replace(device, peak_flops_per_s=rates, matmul_curves=curves or {})


def test_cpu_computes_16_bit_at_the_faster_float32_rate(arch, make_gpu_profile, workload):
    """The executor widens bf16 weights to fp32 for each CPU GEMM (docs/decisions.md): the CPU's
    bf16 math runs at max(bf16, fp32) rate, bytes stay bf16; the GPU gets no such help."""
    hw = make_gpu_profile()
    slow_bf16 = {"float32": 1e10, "bfloat16": 1e8}
    curves = {"float32": Curve(points=((1, 1e9), (64, 1e10)))}
    p = policy(weight_dtype="bfloat16", kv_dtype="bfloat16")
    cpu_slow = dataclasses.replace(hw, cpu=_with_rates(hw.cpu, slow_bf16, curves))
    same_curves = {**curves, "bfloat16": curves["float32"]}
    cpu_same = dataclasses.replace(
        hw, cpu=_with_rates(hw.cpu, {"float32": 1e10, "bfloat16": 1e10}, same_curves)
    )
    slow = predict(arch, cpu_slow, workload, p)
    assert slow.predicted.total_s == predict(arch, cpu_same, workload, p).predicted.total_s
    # and the curve is used: at a flat 1e10 FLOP/s the small GEMMs would be faster
    flat = dataclasses.replace(hw, cpu=_with_rates(hw.cpu, {"float32": 1e10, "bfloat16": 1e10}))
    assert predict(arch, flat, workload, p).predicted.total_s < slow.predicted.total_s
    on_gpu = policy(ffn_on_gpu=True, weights_gpu_fraction=1.0, weight_dtype="bfloat16")
    gpu_slow = dataclasses.replace(hw, gpu=_with_rates(hw.gpu, {"float32": 1e12, "bfloat16": 1e8}))
    assert (
        predict(arch, gpu_slow, workload, on_gpu).predicted.total_s
        > 10 * predict(arch, hw, workload, on_gpu).predicted.total_s
    )


def test_resident_run_puts_everything_on_one_device(arch, make_gpu_profile, workload):
    from planner import predict_resident_run

    hw = make_gpu_profile(gpu_memory_bytes=1e7)
    cpu = predict_resident_run(arch, hw, workload, batch_size=3, dtype="float32")
    assert cpu.policy.micro_batch_size == cpu.policy.batch_size == 3
    assert cpu.busy_s["gpu"] == cpu.busy_s["h2d"] == cpu.busy_s["d2h"] == 0.0
    assert cpu.memory.gpu_bytes == 0.0
    gpu = predict_resident_run(arch, hw, workload, batch_size=3, dtype="float32", on_gpu=True)
    assert gpu.policy.attention_on_gpu and gpu.policy.weights_gpu_fraction == 1.0
    assert gpu.busy_s["cpu"] == pytest.approx(0.0, abs=1e-15)
    assert gpu.memory.cpu["kv cache"] == 0.0 and gpu.memory.gpu["kv cache"] > 0
    # the GPU of tiny-gpu is 100x the CPU in bandwidth and FLOP/s
    assert gpu.predicted.total_s < cpu.predicted.total_s / 10


def test_a_measured_widened_curve_prices_the_cpus_16_bit_math(arch, make_cpu_profile, workload):
    """hrm profile's `<dtype>_widened` curve (the executor's own path) replaces the fp32 one."""
    hw = make_cpu_profile(flops=1e12, bandwidth=1e14)  # compute-bound
    p = policy(weight_dtype="bfloat16", kv_dtype="bfloat16")

    def with_cpu_rates(rates, curves):
        return dataclasses.replace(hw, cpu=_with_rates(hw.cpu, rates, curves))

    widened = Curve(points=((1, 1e9), (64, 1e10)))
    measured = with_cpu_rates(
        {"float32": 1e12, "bfloat16": 1e8, "bfloat16_widened": 1e10},
        {"bfloat16_widened": widened},
    )
    same_as_native = with_cpu_rates(
        {"float32": 1e12, "bfloat16": 1e10}, {"bfloat16": widened, "float32": widened}
    )
    assert (
        predict(arch, measured, workload, p).predicted.total_s
        == predict(arch, same_as_native, workload, p).predicted.total_s
    )


def test_the_measured_launch_overhead_is_charged_per_layer_expert_and_step(arch, workload):
    """T_launch = per_layer + E_touched(tokens) * per_expert per layer and micro-batch on the CPU,
    and per_step once per step, each at the run's dtype: pinned to hand values on the tiny model
    (4 experts, top-2)."""
    from tiny_setup import cpu_only_profile

    from hrm.hardware.parts import LaunchOverhead
    from hrm.roofline.ops import expected_distinct_experts
    from planner.layer_seconds import micro_batch_seconds
    from planner.setting import Setting

    plain = cpu_only_profile()
    overhead = LaunchOverhead(per_layer_s=1e-3, per_expert_s=1e-4, per_step_s=2e-3)
    other = LaunchOverhead(per_layer_s=1.0, per_expert_s=1.0, per_step_s=1.0)  # another dtype's
    overheads = {"bfloat16": overhead, "float32": other}
    hw = dataclasses.replace(plain, cpu=dataclasses.replace(plain.cpu, launch_overhead=overheads))
    with_oh = micro_batch_seconds(Setting(arch=arch, hardware=hw, workload=workload), 3)
    without = micro_batch_seconds(Setting(arch=arch, hardware=plain, workload=workload), 3)
    decode = 1e-3 + expected_distinct_experts(arch, 3) * 1e-4  # 3 tokens: 3.25 of 4 experts
    assert with_oh.cpu_launch[1:] == pytest.approx(np.full(workload.gen_len - 1, decode))
    assert with_oh.cpu_launch[0] == pytest.approx(1e-3 + expected_distinct_experts(arch, 48) * 1e-4)
    assert with_oh.head_cpu == pytest.approx(without.head_cpu + 2e-3)
    assert not without.cpu_launch.any()
    # the prediction of an all-CPU run grows by layers * T_launch + per_step each decode step, for
    # each micro-batch: here one of 3 sequences
    p = policy(batch_size=3, micro_batch_size=3, weight_dtype="bfloat16", kv_dtype="bfloat16")
    slower = predict(arch, hw, workload, p).predicted.decode_s
    faster = predict(arch, plain, workload, p).predicted.decode_s
    assert slower - faster == pytest.approx((workload.gen_len - 1) * (2 * decode + 2e-3))


def test_a_resident_run_attends_over_its_left_padded_cache(arch, make_cpu_profile):
    """Prefill packs ragged prompts, but the resident executor's KV cache is left-padded to the
    longest: decode step t attends over S_max + t keys, not S_mean + t."""
    from planner import predict_resident_run

    ragged = Workload(prompt_len_mean=10, prompt_len_max=30, gen_len=4)
    hw = make_cpu_profile()
    plain = Setting(arch=arch, hardware=hw, workload=ragged)
    padded = dataclasses.replace(plain, padded_kv_cache=True)
    assert list(plain.decode_contexts) == [11, 12, 13]
    assert list(padded.decode_contexts) == [31, 32, 33]
    resident = predict_resident_run(arch, hw, ragged, batch_size=2, dtype="float32")
    p = policy(batch_size=2, micro_batch_size=2)
    assert resident.predicted.decode_s == pytest.approx(
        predict(arch, hw, ragged, p, padded_kv_cache=True).predicted.decode_s
    )
    assert resident.predicted.decode_s > predict(arch, hw, ragged, p).predicted.decode_s
    assert resident.predicted.prefill_s == predict(arch, hw, ragged, p).predicted.prefill_s


def test_bidirectional_link_caps_overlapping_copies(arch, make_gpu_profile, workload):
    """T_layer >= (B_h2d * Q_h2d + B_d2h * Q_d2h) / B_bi, by hand: with B_bi = B_h2d = B_d2h the
    bound is Q_h2d + Q_d2h; without a measured B_bi there is no such bound."""
    hw = make_gpu_profile()
    capped = dataclasses.replace(
        hw, link=dataclasses.replace(hw.link, bidirectional_bytes_per_s=1e8)
    )
    p = policy(batch_size=4, micro_batch_size=2, ffn_on_gpu=True)
    v = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    for profile, expect in ((hw, False), (capped, True)):
        setting = Setting(arch=arch, hardware=profile, workload=workload)
        model = batch_model(setting, p.batch_size, p.micro_batch_size)
        rows = model.layer_coefficients()
        assert ("link" in rows) == expect
        if expect:
            q = model.queues
            m, ws = model.full_micro_batches, model.weight_stream_s
            both = (q.queue("h2d").coefficients(m, ws) + q.queue("d2h").coefficients(m, ws)) @ v
            assert rows["link"] @ v == pytest.approx(both)
    slower = predict(arch, capped, workload, p)
    assert slower.predicted.total_s >= predict(arch, hw, workload, p).predicted.total_s


def test_kv_prefetch_buffer_by_hand(arch, make_gpu_profile):
    """GPU attention over host KV: 2 buffers x mu x C x 2 (K, V) x nkv*d x 4 B; 0 at r_c = 1."""
    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)  # C = 11
    p = policy(attention_on_gpu=True, ffn_on_gpu=True, weights_gpu_fraction=1.0)
    plan = predict(arch, make_gpu_profile(), wl, p, "gpu-attention")
    assert plan.memory.gpu["kv prefetch"] == 2 * 1 * 11 * 2 * 32 * 4
    full = predict(
        arch,
        make_gpu_profile(),
        wl,
        policy(attention_on_gpu=True, ffn_on_gpu=True, weights_gpu_fraction=1.0, kv_gpu_fraction=1),
        "gpu-attention",
    )
    assert full.memory.gpu["kv prefetch"] == 0.0


def test_cpu_decode_attention_is_charged_at_the_measured_kv_read_rate(arch, workload):
    """With attention curves of 1 GB/s in bfloat16 and 3 GB/s in float32, CPU decode attention
    costs bytes / 1e9 with a bfloat16 KV cache and bytes / 3e9 with a float32 one; a KV dtype
    without its curve keeps the FLOPs-and-bandwidth model."""
    from hrm.hardware.parts import Curve
    from hrm.roofline.ops import layer_ops
    from planner.layer_seconds import micro_batch_seconds
    from tests.planner.tiny_setup import cpu_only_profile

    hw = cpu_only_profile()
    curves = {"bfloat16": Curve(points=((1.0, 1e9),)), "float32": Curve(points=((1.0, 3e9),))}
    curved = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, attention_curves=curves))
    for kv_dtype, rate in (("bfloat16", 1e9), ("float32", 3e9)):
        plain = micro_batch_seconds(
            Setting(arch=arch, hardware=hw, workload=workload, kv_dtype=kv_dtype), 2
        )
        setting = Setting(arch=arch, hardware=curved, workload=workload, kv_dtype=kv_dtype)
        mb = micro_batch_seconds(setting, 2)
        ops = layer_ops(arch, batch=2, new_tokens=1, context=setting.decode_contexts,
                        weight_dtype="bfloat16", kv_dtype=kv_dtype, ffn_group_tokens=2)  # fmt: skip
        attention = next(op for op in ops if op.name == "attention")
        assert mb.cpu_attention[1:] == pytest.approx(np.asarray(attention.bytes) / rate)
        assert mb.cpu_attention[0] == plain.cpu_attention[0]  # prefill keeps the GEMM model
    # a float16 cache: no curve of its own, so the FLOPs-and-bandwidth model in prefill and decode
    fp16 = Setting(arch=arch, hardware=curved, workload=workload, kv_dtype="float16")
    plain = Setting(arch=arch, hardware=hw, workload=workload, kv_dtype="float16")
    assert micro_batch_seconds(fp16, 2).cpu_attention == pytest.approx(
        micro_batch_seconds(plain, 2).cpu_attention
    )


def test_latent_attention_decode_is_charged_at_its_own_curve_where_measured(workload):
    """A latent model's CPU decode attention reads its bytes at the latent curve (2 GB/s here)
    where the profile has one for the KV dtype, else at the attention curve (8 GB/s); a model
    of grouped heads keeps the attention curve."""
    from hrm.arch import resolve_model
    from hrm.hardware.parts import Curve
    from hrm.roofline.ops import layer_ops
    from planner.layer_seconds import micro_batch_seconds
    from tests.planner.tiny_setup import cpu_only_profile

    def decode_seconds_per_byte(name: str, cpu) -> np.ndarray:
        hw = dataclasses.replace(cpu_only_profile(), cpu=cpu)
        sparse = resolve_model(name).layer_kinds()[0][0]  # a model of its sparse layers alone
        setting = Setting(arch=sparse, hardware=hw, workload=workload)
        ops = layer_ops(
            setting.arch,
            batch=2,
            new_tokens=1,
            context=setting.decode_contexts,
            weight_dtype="bfloat16",
            kv_dtype="bfloat16",
            ffn_group_tokens=2,
        )
        kv = np.asarray(next(op for op in ops if op.name == "attention").bytes)
        return micro_batch_seconds(setting, 2).cpu_attention[1:] / kv  # fmt: skip

    cpu = dataclasses.replace(
        cpu_only_profile().cpu,
        attention_curves={"bfloat16": Curve(points=((1.0, 8e9),))},
        latent_attention_curves={"bfloat16": Curve(points=((1.0, 2e9),))},
    )
    assert decode_seconds_per_byte("deepseek-v2-lite", cpu) == pytest.approx(1 / 2e9)
    assert decode_seconds_per_byte("mixtral-8x7b", cpu) == pytest.approx(1 / 8e9)
    no_latent = dataclasses.replace(cpu, latent_attention_curves={})
    assert decode_seconds_per_byte("deepseek-v2-lite", no_latent) == pytest.approx(1 / 8e9)


def test_cpu_prefill_attention_is_charged_at_its_measured_rate_over_the_padded_square(
    arch, workload
):
    """With a prefill attention curve of 1 TFLOP/s, CPU prefill attention costs the FLOPs the
    executor computes, every pair of the square padded to the longest prompt, over 1e12; decode
    keeps its own model. By hand for b = 2 at prompt_len_max 32: 2 * 32^2 = 2048 pairs per head,
    4 * 2048 * nq * d + 5 * 2048 * nq FLOPs."""
    from hrm.hardware.parts import Curve
    from hrm.roofline.ops import prefill_attention_flops
    from planner.layer_seconds import micro_batch_seconds
    from tests.planner.tiny_setup import cpu_only_profile

    hw = cpu_only_profile()
    curve = {"bfloat16": Curve(points=((1.0, 1e12),))}
    curved = dataclasses.replace(
        hw, cpu=dataclasses.replace(hw.cpu, prefill_attention_curves=curve)
    )
    plain = micro_batch_seconds(Setting(arch=arch, hardware=hw, workload=workload), 2)
    mb = micro_batch_seconds(Setting(arch=arch, hardware=curved, workload=workload), 2)
    nq, d = arch.num_attention_heads, arch.head_dim
    by_hand = 4.0 * 2048 * nq * d + 5.0 * 2048 * nq
    assert prefill_attention_flops(arch, batch=2, length=32) == by_hand
    assert mb.cpu_attention[0] == pytest.approx(by_hand / 1e12)
    assert mb.cpu_attention[1:] == pytest.approx(plain.cpu_attention[1:])
    # a float32 run has no curve here: the GEMM model, as without the curve
    fp32 = Setting(arch=arch, hardware=curved, workload=workload, kv_dtype="float32")
    fp32_plain = Setting(arch=arch, hardware=hw, workload=workload, kv_dtype="float32")
    assert micro_batch_seconds(fp32, 2).cpu_attention[0] == pytest.approx(
        micro_batch_seconds(fp32_plain, 2).cpu_attention[0]
    )


def test_the_cost_models_array_lookup_is_curve_at():
    """Curve.at_each, the cost model's array lookup, and Curve.at are one rule (log-log, flat
    outside)."""
    curve = Curve(points=((1.0, 2e9), (4.0, 8e9), (64.0, 100e9)))
    xs = np.array([0.5, 1.0, 2.25, 4.0, 10.0, 64.0, 500.0])
    assert curve.at_each(xs) == pytest.approx([curve.at(x) for x in xs])
    assert curve.at_each(np.array([2.25]))[0] == pytest.approx(4.5e9)  # rate ~ rows


def test_elementwise_passes_are_charged_after_the_roofline_time(arch, make_cpu_profile):
    """T_op = max(FLOPs / P, bytes / B) + elements / R: the expert FFN's and the norms' element
    passes (counted by hand here) at a measured 1e9 elements/s."""
    from hrm.roofline.ops import expert_ffn_op, layer_ops
    from planner.op_time import op_seconds

    hw = make_cpu_profile()
    tokens, k, h, i = 64, arch.experts_per_token, arch.hidden_size, arch.intermediate_size
    ffn = expert_ffn_op(arch, tokens=tokens, weight_dtype="bfloat16")
    assert ffn.elementwise_elements == tokens * k * (5 * i + 9 * h) + 3 * tokens * h
    norms = next(
        op for op in layer_ops(arch, batch=tokens, new_tokens=1, context=8) if op.name == "norms"
    )
    assert norms.elementwise_elements == 28 * tokens * h + 12 * tokens * (
        arch.q_size + arch.kv_size
    )
    cpu = dataclasses.replace(hw.cpu, elementwise_rate={"bfloat16": 1e9})
    plain = dataclasses.replace(ffn, elementwise_elements=0.0)
    extra = op_seconds(ffn, cpu, "bfloat16", 16) - op_seconds(plain, cpu, "bfloat16", 16)
    assert extra == pytest.approx(ffn.elementwise_elements / 1e9)
    assert ffn.scaled(2).elementwise_elements == 2 * ffn.elementwise_elements


def test_a_measured_grouped_ffn_curve_prices_the_gpus_expert_ffn(arch, workload):
    """T_ffn = 6*T*h*i*k / P_ffn(rows) on the GPU where the profile measured the executor's whole
    grouped FFN (a flat curve here, so the rate is P at any rows); without one, the GEMM curve."""
    from hrm.hardware import resolve_hardware
    from planner.layer_seconds import micro_batch_seconds
    from planner.setting import Setting

    l4 = resolve_hardware("l4")
    rate = 5e12
    curves = {"bfloat16": Curve(points=((1.0, rate), (1e6, rate)))}
    hw = dataclasses.replace(l4, gpu=dataclasses.replace(l4.gpu, expert_ffn_curves=curves))
    setting = Setting(arch=arch, hardware=hw, workload=workload)
    measured = micro_batch_seconds(setting, 3)
    h, i, k = arch.hidden_size, arch.intermediate_size, arch.experts_per_token
    prefill_tokens = 3 * workload.prefill_len
    assert measured.gpu_ffn[0] == pytest.approx(6 * prefill_tokens * h * i * k / rate)
    assert measured.gpu_ffn[1:] == pytest.approx(
        np.full(workload.gen_len - 1, 6 * 3 * h * i * k / rate)
    )
    plain = micro_batch_seconds(Setting(arch=arch, hardware=l4, workload=workload), 3)
    assert plain.gpu_ffn[1] != pytest.approx(measured.gpu_ffn[1])
    assert measured.cpu_ffn == pytest.approx(plain.cpu_ffn)  # the CPU keeps its own pricing


def test_the_gpu_is_charged_the_launch_time_its_dense_kernels_do_not_hide(arch, workload):
    """gpu_launch = max(0, per_layer - T_dense): all of a per-layer cost far above the kernels'
    time, less the kernels; nothing when the kernels outlast it; nothing unmeasured."""
    from hrm.hardware import resolve_hardware
    from hrm.hardware.parts import LaunchOverhead
    from planner.cost import queue_terms
    from planner.layer_seconds import micro_batch_seconds
    from planner.setting import Setting

    l4 = resolve_hardware("l4")

    def seconds(per_layer_s):
        overhead = LaunchOverhead(per_layer_s=per_layer_s, per_expert_s=1.0, per_step_s=1.0)
        gpu = dataclasses.replace(l4.gpu, launch_overhead={"float32": overhead})
        setting = Setting(arch=arch, hardware=dataclasses.replace(l4, gpu=gpu), workload=workload)
        return setting, micro_batch_seconds(setting, 3)

    setting, slow_host = seconds(1.0)
    assert slow_host.gpu_launch == pytest.approx(1.0 - slow_host.gpu_dense)
    assert (slow_host.gpu_launch > 0.99).all()  # the tiny model's kernels take microseconds
    terms = queue_terms(setting, slow_host).components["gpu"]["launch overhead"]
    assert np.abs(terms.scaled).sum() > 0  # on the GPU queue
    assert not seconds(0.0)[1].gpu_launch.any()
    assert not micro_batch_seconds(
        Setting(arch=arch, hardware=l4, workload=workload), 3
    ).gpu_launch.any()


def test_a_decode_step_computes_the_sequences_still_going(arch, make_cpu_profile):
    """Two sequences in one micro-batch, one answering 1 token and one 3: each decode step
    computes one sequence, as a batch of that one alone does; prefill computes both."""
    hw = make_cpu_profile(flops=1e18)
    mixed = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3, gen_lens=((1, 1), (3, 1)))
    assert list(mixed.decode_active) == [0.5, 0.5] and mixed.gen_len_mean == 2
    two = predict(arch, hw, mixed, policy(batch_size=2, micro_batch_size=2), schedule="cgopipe")
    one = predict(arch, hw, dataclasses.replace(mixed, gen_lens=()),
                  policy(batch_size=1, micro_batch_size=1), schedule="cgopipe")  # fmt: skip
    every = predict(arch, hw, dataclasses.replace(mixed, gen_lens=()),
                    policy(batch_size=2, micro_batch_size=2), schedule="cgopipe")  # fmt: skip
    assert two.predicted.decode_s == pytest.approx(one.predicted.decode_s, rel=1e-12)
    assert two.predicted.prefill_s == pytest.approx(every.predicted.prefill_s, rel=1e-12)
    assert two.predicted.decode_s < every.predicted.decode_s
    assert two.predicted.generated_tokens == 4 and every.predicted.generated_tokens == 6


def test_transient_memory_by_hand(arch):
    """workspace_bytes and prefill_tensors_bytes, each of their terms winning in turn (tiny model
    of the module docstring, bfloat16 activations, mu = 2 micro-batch of 8-token prompts: a
    16-token chunk, fp32 logits of 2 x 100)."""
    from planner.memory import prefill_tensors_bytes, workspace_bytes

    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)

    def shaped(**kw):
        return dataclasses.replace(arch, **kw)

    # per token: max(QKV + attention out (2q + 2kv) * 2, the experts' rows (2kh + 3i) * 2,
    # the norm's fp32 copies 2h * 4)
    assert workspace_bytes(arch, wl, 2) == 16 * max(384, 1280, 512) + 800  # experts
    heads = shaped(num_attention_heads=16, num_key_value_heads=8, head_dim=32)  # q 512, kv 256
    assert workspace_bytes(heads, wl, 2) == 16 * 3072 + 800
    small = shaped(intermediate_size=8, experts_per_token=1)
    assert workspace_bytes(small, wl, 2) == 16 * 512 + 800  # the norm's copies
    # held h + q + 2kv, peak max(q + 2kv, 3q, q + 2h), 16 tokens of 2 bytes; over g GPUs each
    # holds 1/g of q and kv
    assert prefill_tensors_bytes(arch, wl, 2) == (192 + 192) * 32
    assert prefill_tensors_bytes(arch, wl, 2, gpu_count=2) == (128 + 160) * 32
    assert prefill_tensors_bytes(heads, wl, 2) == (1088 + 1536) * 32  # 3q
    mha = shaped(num_key_value_heads=4)  # q = kv = 64: q + 2kv ties the others
    assert prefill_tensors_bytes(mha, wl, 2) == (256 + 192) * 32


def test_each_buffer_of_the_memory_model_by_hand(arch):
    """memory_terms' buffers at N = 2 (prefill's tensors bind the activations) and N = 1000
    (the residual stream binds), fp32 KV at a longest context of 11."""
    from planner.memory import ATT, FFN, ONE, RC, memory_terms

    wl = Workload(prompt_len_mean=8, prompt_len_max=8, gen_len=3)

    def terms(n, gpus=None):  # None: the default, one GPU (what a resident run counts)
        more = {} if gpus is None else {"gpu_count": gpus}
        return memory_terms(arch, wl, batch_size=n, micro_batch_size=2, weight_dtype="float32",
                            kv_dtype="float32", **more)  # fmt: skip

    few, many, two_gpus = terms(2), terms(1000), terms(2, gpus=2)
    assert few.gpu["activations"][..., FFN] == pytest.approx(12288)  # prefill, mu 2 x 8 tokens
    assert many.gpu["activations"][..., FFN] == pytest.approx(1000 * 64 * 2)  # N h, bf16
    assert two_gpus.gpu["activations"][..., FFN] == pytest.approx(2 * 9216)  # each GPU its own
    # K and V of one token: 2 layers x 2 x 32 x 4 B = 512; N C of them
    assert few.gpu["kv cache"][..., RC] == pytest.approx(2 * 11 * 512)
    assert few.cpu["kv cache"][..., ONE] == pytest.approx(2 * 11 * 512)
    # two (layer, micro-batch) slices of the host cache: 2 mu C (one layer's 256 B a token)
    assert few.gpu["kv prefetch"][..., ATT] == pytest.approx(2 * 2 * 11 * 256)
    # D1 and D2 double-buffered per micro-batch: 2 mu (2q + 2kv) 2 B
    # (with CPU attention: GPU attention stages nothing)
    staging = few.cpu["pinned staging"]
    assert (staging[..., FFN], staging[..., ATT]) == pytest.approx((1536, -1536))
    # the CPU running the layers holds the activations (12288), the workspace (21280) and its
    # attention scores (mu nq C fp32 = 352)
    held = few.cpu["activations and workspace"]
    assert held[..., ONE] == pytest.approx(12288 + 21280 + 352)
    assert held[..., ATT] == pytest.approx(-352)  # GPU attention scores on the GPU
    assert few.gpu_total().shape[-1] == few.cpu_total().shape[-1] == 6
    # the disk tier: r_d of the weights leave the host's layer weights (2 layers x W_l as stored),
    # two layers' disk parts are staged pinned, and the disk holds r_d of them
    from planner.memory import RD, RW

    layer_weights = few.cpu["layer weights"]
    assert layer_weights[..., RD] == layer_weights[..., RW] == pytest.approx(-2 * W_LAYER)
    assert few.cpu["disk staging"][..., RD] == pytest.approx(2 * W_LAYER)
    assert few.disk["weights"][..., RD] == pytest.approx(2 * W_LAYER)
    assert few.gpu_total()[..., FFN] == pytest.approx(sum(t[..., FFN] for t in few.gpu.values()))
