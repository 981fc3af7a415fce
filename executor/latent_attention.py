"""Multi-head latent attention (DeepSeek-V2/V3), in its absorbed form.

Each token's keys and values come from one latent c of kv_lora_rank (RMS-normalised) and one
rotary key of rope dims shared by every head. Per head h, key = [W_k[h] c, k_rope] and value =
W_v[h] c, where W_k and W_v are the halves of kv_b_proj. Since q_nope . (W_k c) = (W_k^T q_nope)
. c, the query absorbs W_k and attends over [c, k_rope] itself; and since the output is a sum of
values, W_v can follow attention instead of preceding it. The cache then holds [c, k_rope] per
token, one key/value "head" of kv_lora_rank + rope whose values are its first kv_lora_rank
columns, and attention is grouped-query attention over it with nq queries per head: every kernel
of executor/attention.py runs it unchanged, the scores scaled by the model's softmax_scale.

The other form decompresses K and V of every cached token at every step (transformers does);
bench/bench_latent_attention.py measures both on this host and docs/decisions.md keeps the
numbers behind the choice.

Legend: T tokens, nq heads, c = kv_lora_rank, r = rope dims, n = qk_nope_head_dim, v = v_head_dim.
"""

from __future__ import annotations

import dataclasses

import torch

from executor.layer_math import apply_rotary, rms_norm

# transformers builds the latent's and the low-rank query's RMSNorms with their default eps, not
# the config's rms_norm_eps (DeepseekV2RMSNorm(kv_lora_rank))
LATENT_NORM_EPS = 1e-6


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs (x0, x1), (x2, x3), ... regrouped as (x0, x2, ..., x1, x3, ...): the
    half-split layout apply_rotary turns, bit for bit what DeepSeek's interleaved rotary gives
    (transformers' apply_rotary_pos_emb_interleave), in an order q and k share."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def key_up_projection(arch, wkv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [nq*(n + v), c] as its per-head halves: W_k [nq, n, c] and W_v^T [nq, c, v]
    (views)."""
    heads = wkv_b.view(arch.num_attention_heads, -1, arch.kv_lora_rank)
    n = arch.qk_nope_head_dim
    return heads[:, :n], heads[:, n:].transpose(1, 2)


def absorbed_layout(arch, weights):
    """`weights` with each latent layer's kv_b_proj replaced by contiguous W_k and W_v^T (wk_b,
    wv_b): laid out once for a CPU that holds the model, where the batched GEMMs copied the
    views at every call (AMX Xeon, bf16, 16 heads x 64 tokens: 0.41 -> 0.28 ms and 0.86 ->
    0.29 ms a layer)."""

    def split(w):
        w_k, w_vt = key_up_projection(arch, w.wkv_b)
        return dataclasses.replace(w, wkv_b=None, wk_b=w_k.contiguous(), wv_b=w_vt.contiguous())

    layers = tuple(w if w.wkv_b is None else split(w) for w in weights.layers)
    return dataclasses.replace(weights, layers=layers)


def absorbed_up_projections(arch, w) -> tuple[torch.Tensor, torch.Tensor]:
    """W_k [nq, n, c] and W_v^T [nq, c, v]: the layer's own contiguous copies where the CPU
    holds it (absorbed_layout), else views of kv_b_proj."""
    if w.wk_b is not None:
        return w.wk_b, w.wv_b
    return key_up_projection(arch, w.wkv_b)


def latent_queries_and_keys(model, w, x: torch.Tensor, cos, sin):
    """Normalised hidden states x [T, H] -> q [T, nq, c + r] (the key up-projection absorbed),
    k [T, 1, c + r] (the latent, normalised, and the rotated key) and v [T, 1, 0] (the values
    are k's first c columns: nothing of their own)."""
    a, T = model.arch, x.shape[0]
    n, r, c = a.qk_nope_head_dim, a.rotary_dim, a.kv_lora_rank
    if w.wq_a is not None:
        x_q = rms_norm(model.linear(x, w.wq_a), w.q_a_norm, LATENT_NORM_EPS)
    else:
        x_q = x
    q = model.linear(x_q, w.wq).view(T, a.num_attention_heads, n + r)
    latent, k_rot = model.linear(x, w.wkv_a).split((c, r), dim=-1)  # [T, c], [T, r]
    latent = rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS)
    q_rot, k_rot = q[..., n:], k_rot[:, None]  # [T, nq, r], [T, 1, r]
    if a.rope_interleave:
        q_rot, k_rot = deinterleaved(q_rot), deinterleaved(k_rot)
    q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
    w_k, _ = absorbed_up_projections(a, w)
    q_latent = torch.matmul(q[..., :n].transpose(0, 1), w_k).transpose(0, 1)  # [T, nq, c]
    k = torch.cat((latent[:, None], k_rot), dim=-1)
    return torch.cat((q_latent, q_rot), dim=-1), k, k[..., :0]


def latent_values(arch, w, attn: torch.Tensor) -> torch.Tensor:
    """Attention over the latents [T, nq*c] -> each head's value up-projection [T, nq*v]."""
    T = attn.shape[0]
    _, w_vt = absorbed_up_projections(arch, w)  # [nq, c, v]
    heads = attn.view(T, arch.num_attention_heads, arch.kv_lora_rank).transpose(0, 1)
    return torch.matmul(heads, w_vt).transpose(0, 1).reshape(T, -1)
