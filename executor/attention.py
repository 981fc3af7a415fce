"""Grouped-query decode attention: one new query per sequence against its cached keys.

Many sequences per call, no repeated K/V: the G query heads that share a K/V head are the rows of
one small matrix product ([B, nkv, G, D] against [B, nkv, S, D]), and ragged sequences' padding
slots are masked. Two kernels compute it; bench/bench_cpu_attention.py times both on the host's
data and shapes, and DECODE_KERNEL names the one kept (with the numbers behind the choice).
The thread budget is torch's intra-op threads of the calling thread (`hrm run --threads`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sdpa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """torch's scaled_dot_product_attention with the groups as query rows: [B, nkv, G, D]."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def matmul_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """Scores by one batched GEMM, softmax in fp32, then one batched GEMM with V: [B, nkv, G, D]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B, nkv, G, S]
    return torch.matmul(probs, values)


DECODE_KERNELS = {"sdpa": sdpa_decode, "matmul": matmul_decode}
# Kept: SDPA. bench/bench_cpu_attention.py on the 2-core Sapphire Rapids VM (2026-12-01,
# Mixtral's 32/8 heads, batch 1-32, context 128-2048, bf16 and fp32): SDPA faster in 16 of 18
# cases (up to 3.3x at batch 1, 1.34x at fp32 32x2048); the batched GEMMs won twice by 3-4%,
# within the VM's noise. reports/bench_cpu_attention.json has the table.
DECODE_KERNEL = "sdpa"


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    kernel: str = DECODE_KERNEL,
) -> torch.Tensor:
    """q [B, nq, D], keys and values [B, nkv, S, D], mask [B, 1, 1, S] or None -> [B, nq*D]."""
    B, nkv, D = q.shape[0], keys.shape[1], q.shape[-1]
    out = DECODE_KERNELS[kernel](q.view(B, nkv, -1, D), keys, values, mask)  # [B, nkv, G, D]
    return out.reshape(B, -1)
