"""DeepSeek's multi-head latent attention (executor/latent_attention.py): the absorbed form equals
attention over keys and values decompressed as the definition writes them, the cache holds one
latent row a token and no values, and the planner counts what the runtime allocates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.checkpoint import open_checkpoint
from executor.latent_attention import LATENT_NORM_EPS, latent_values
from executor.model import MoEModel
from hrm.rules.cpu_gemm import CpuGemmChoice
from hrm.workload import Workload
from planner.memory import memory_terms
from tests.executor.test_quant import _run, policy

NATIVE = CpuGemmChoice(dtype="float32", buckets=((0.0, "native"),), source="test")


def _rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotated_pairs(x, angles):
    """Interleaved pairs (x0, x1), ... rotated as complex numbers by `angles` [T, r/2]."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def _decompressed(model, w, h, positions):
    """The layer's attention as DeepSeek-V2's paper writes it: every head's keys [W_k c, k_rope]
    and values W_v c, then causal softmax attention and each head's output [T, nq*v]."""
    a = model.arch
    nq, n, r, c, v = (a.num_attention_heads, a.qk_nope_head_dim, a.rotary_dim, a.kv_lora_rank,
                      a.v_head_dim)  # fmt: skip
    x = _rms(h, w.attn_norm, a.norm_eps)
    if w.wq_a is not None:
        x_q = _rms(x @ w.wq_a.T, w.q_a_norm, LATENT_NORM_EPS)
    else:
        x_q = x
    q = (x_q @ w.wq.T).view(-1, nq, n + r)
    kv_a = x @ w.wkv_a.T
    latent, k_rope = _rms(kv_a[:, :c], w.kv_a_norm, LATENT_NORM_EPS), kv_a[:, c:]
    angles = positions[:, None].float() * model._inv_freq[None, :]
    q_rope = _rotated_pairs(q[..., n:], angles[:, None])
    k_rope = _rotated_pairs(k_rope, angles)
    kv = (latent @ w.wkv_b.T).view(-1, nq, n + v)
    keys = torch.cat((kv[..., :n], k_rope[:, None].expand(-1, nq, -1)), dim=-1)
    queries = torch.cat((q[..., :n], q_rope), dim=-1)
    scores = torch.einsum("ihd,jhd->hij", queries, keys) * a.softmax_scale
    T = h.shape[0]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), kv[..., n:]).reshape(T, -1)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_attention_equals_the_decompressed_definition(checkpoints, name):
    """q direct (V2) or through its low rank (V3): the queries absorb W_k, attend over the
    cached latent rows, and W_v follows; the result equals decompressing every key and value.
    The model holds W_k and W_v^T laid out apart, contiguous; the definition reads kv_b_proj."""
    checkpoint = open_checkpoint(checkpoints[name], "float32")
    model = MoEModel(checkpoint, NATIVE)
    a, w = model.arch, model.weights.layers[1]
    assert w.wkv_b is None and w.wk_b.is_contiguous() and w.wv_b.is_contiguous()
    T = 7
    h = torch.randn(T, a.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T)
    q, k, v = model.pre_attention(w, h, *model.rotary(positions))
    assert (q.shape, k.shape, v.shape) == ((T, 4, 40), (T, 1, 40), (T, 1, 0))
    cache = model.new_cache(1, T)
    cache.start(torch.tensor([T]), T)
    attn = model.prefill_attention(1, q, k, v, cache, torch.zeros(T, dtype=torch.long), positions)
    ours = latent_values(a, w, attn)
    reference = _decompressed(model, checkpoint.weights.layers[1], h, positions)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    # the cache holds the latent rows, and no values of their own
    assert torch.equal(cache.k[1][0, :, :T], k.transpose(0, 1))
    assert cache.v[1].numel() == 0


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_the_planner_counts_the_latent_cache_the_runtime_allocates(checkpoints, monkeypatch, kv):
    """Prompts of one length: each layer holds C = 9 + 4 latent rows of kv_lora_rank + rope a
    sequence, nothing for V, and the planner's KV term is that."""
    import tests.executor.test_quant as quant_tests

    monkeypatch.setattr(quant_tests, "ragged_prompts", lambda lens, seed: [[3] * 9] * len(lens))
    pol = dataclasses.replace(policy("bfloat16", attn=False), kv_dtype=kv)
    _, _, runtime = _run(checkpoints["deepseek_v2"], "bfloat16", pol, "cgopipe", steps=4)
    arch = runtime.arch
    allocated = runtime.allocated_bytes()["cpu"]["kv cache"]
    row = {"bfloat16": 40 * 2, "int8": 40 + 4}[kv]  # 32 + 8 values; int8: codes, scale, min
    assert arch.kv_token_bytes(kv) == row
    assert allocated == 7 * 13 * arch.num_layers * row
    wl = Workload(prompt_len_mean=9, prompt_len_max=9, gen_len=4)
    terms = memory_terms(arch, wl, batch_size=7, micro_batch_size=3, weight_dtype="bfloat16",
                         kv_dtype=kv)  # fmt: skip
    assert float(terms.cpu["kv cache"][..., 0]) == pytest.approx(allocated)


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
@pytest.mark.parametrize(("schedule", "attn", "rc"),
                         [("cgopipe", False, 0.0), ("gpu-attention", True, 0.5)])  # fmt: skip
def test_latent_rows_on_the_host_and_on_the_gpu_give_the_resident_tokens(
    checkpoints, kv, schedule, attn, rc
):
    """Latent rows read by CPU attention, or prefetched to the GPU and written back a step at a
    time, in 16 bits and int8: the tokens of a resident run."""
    path = checkpoints["deepseek_v3"]
    pol = dataclasses.replace(policy("bfloat16", attn=attn, rc=rc), kv_dtype=kv)
    resident = dataclasses.replace(pol, weights_gpu_fraction=1.0, attention_on_gpu=True,
                                   kv_gpu_fraction=1.0)  # fmt: skip
    ours, *_ = _run(path, "bfloat16", pol, schedule, steps=8)
    theirs, *_ = _run(path, "bfloat16", resident, schedule, steps=8)
    assert ours.output_token_ids == theirs.output_token_ids


@pytest.mark.parametrize(("width", "kernel"), [(576, "matmul"), (128, "sdpa")])
def test_a_latent_width_decode_step_runs_the_batched_gemms(width, kernel):
    """DeepSeek's absorbed heads (512 latent + 64 rotary, 16 queries a key row) decode by the
    batched GEMMs, 4.5-8.4x SDPA's speed there at batch 8 and up; a 128-wide head keeps SDPA.
    Both agree within bf16's rounding of the probabilities."""
    from executor.attention import DECODE_KERNELS, attend_one_step

    torch.manual_seed(0)
    B, G, S = 3, 16, 40
    q = torch.randn(B, G, width).to(torch.bfloat16)
    keys = torch.randn(B, 1, S, width).to(torch.bfloat16)
    values = keys[..., : width - 64]
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., :7] = False  # a left-padded row
    out = attend_one_step(q, keys, values, mask, scale=0.05)
    chosen = DECODE_KERNELS[kernel](q.view(B, 1, G, width), keys, values, mask, 0.05)
    assert torch.equal(out, chosen.reshape(B, -1))
    other = DECODE_KERNELS["sdpa" if kernel == "matmul" else "matmul"]
    also = other(q.view(B, 1, G, width), keys, values, mask, 0.05).reshape(B, -1)
    assert torch.allclose(out.float(), also.float(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 1, 16, 40, 21), (6, 2, 8, 16, 9), (2, 2, 24, 16, 9)])
def test_decode_kernels_over_a_cache_view_equal_the_direct_product(dtype, shape):
    """The batched-GEMM kernel takes the scores as keys @ q^T where q has fewer rows than the
    keys (a strided view of a longer cache): the same as q @ keys^T over contiguous keys,
    masked padding included; a prompt's many rows keep q @ keys^T. Sinks (flash attention and
    its log-sum-exp) agree with the scores computed apart within fp32's rounding, and within
    two bf16 steps (the output rounded once, not the probabilities)."""
    from executor.attention import matmul_decode, sink_attention

    B, nkv, G, D, S = shape
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(B, nkv, S + 5, D, generator=g).to(dtype)
    keys, q = cache[:, :, :S], torch.randn(B, nkv, G, D, generator=g).to(dtype)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[:2, ..., :3] = False
    sinks = torch.randn(nkv, G, generator=g)
    direct = torch.matmul(q, keys.contiguous().transpose(-1, -2)).float() / D**0.5
    direct = direct.masked_fill(~mask, float("-inf"))
    with_sink = torch.cat((direct, sinks[None, :, :, None].expand(B, -1, -1, 1)), dim=-1)
    bf16 = {"atol": 2**-7, "rtol": 2**-7} if dtype == torch.bfloat16 else {}
    for out, scores, tol in (
        (matmul_decode(q, keys, keys, mask), direct, {}),
        (sink_attention(q, keys, keys, mask, sinks), with_sink, bf16),
    ):
        probs = torch.softmax(scores, dim=-1)[..., :S].to(dtype)
        torch.testing.assert_close(out, torch.matmul(probs, keys.contiguous()), **tol)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "gpt-oss-20b", "deepseek-v3"])
def test_the_latent_curve_is_timed_over_full_latent_layers(name):
    """hrm profile's latent attention curve: the model's own attention where it is latent, else
    DeepSeek-V2-Lite's 16 heads over one row of 512 + 64 a token, every layer full (no ring
    reading a window of what the curve counts) and without sinks."""
    from executor.attention import latent_reference
    from hrm.arch import resolve_model

    arch = resolve_model(name)
    ref = latent_reference(arch)
    if arch.kv_lora_rank:
        assert ref is arch
        return
    assert (ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim) == (16, 1, 576)
    assert ref.kv_token_bytes("bfloat16") == 576 * 2 and ref.cached_value_dim == 0
    assert not ref.sliding_layers and not ref.attention_sinks
    assert ref.hidden_size == arch.hidden_size  # the rest is the profiled model's
