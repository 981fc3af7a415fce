"""The decode-attention kernel a step takes (executor/attention.py decode_kernel): SDPA, but the
batched GEMMs for a 16-bit cache on the CPU of GEMM_BATCH sequences and GEMM_KEYS keys a KV head
or more; both give the same attention, in the static cache and in continuous batching's
gathered blocks."""

from __future__ import annotations

import pytest
import torch

from executor.attention import (
    DECODE_KERNELS,
    GEMM_BATCH,
    GEMM_KEYS,
    attend_one_step,
    decode_kernel,
)
from executor.kv_blocks import attend


def _case(batch: int, context: int, dtype: torch.dtype, heads=8, kv_heads=2, dim=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, context, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    ("batch", "context", "dtype", "kernel"),
    [
        (1, 2 * GEMM_KEYS, torch.bfloat16, "sdpa"),  # one sequence: SDPA at any length
        (GEMM_BATCH, GEMM_KEYS // GEMM_BATCH - 1, torch.bfloat16, "sdpa"),
        (GEMM_BATCH, GEMM_KEYS // GEMM_BATCH, torch.bfloat16, "matmul"),
        (32, 128, torch.float16, "matmul"),
        (32, 4096, torch.float32, "sdpa"),
    ],
)
def test_the_kernel_follows_the_caches_dtype_and_keys(batch, context, dtype, kernel):
    keys = torch.empty(batch, 2, context, 8, dtype=dtype)
    assert decode_kernel(keys) == kernel


def test_both_kernels_attend_alike_where_the_gemms_take_over():
    """bf16 at 8 x 1024 keys (the GEMMs' side): the chosen kernel's output is SDPA's within
    bf16's rounding, with the padding mask of a ragged batch."""
    q, k, v = _case(8, 1024, torch.bfloat16)
    mask = torch.ones(8, 1, 1, 1024, dtype=torch.bool)
    mask[:2, ..., :300] = False  # two sequences left-padded
    assert decode_kernel(k) == "matmul"
    chosen = attend_one_step(q, k, v, mask)
    sdpa = attend_one_step(q, k, v, mask, kernel="sdpa")
    assert torch.equal(chosen, attend_one_step(q, k, v, mask, kernel="matmul"))
    assert torch.allclose(chosen.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_continuous_decode_takes_the_same_kernel():
    """kv_blocks.attend with one query a sequence (decode) runs decode_kernel's choice: at 8 x
    1024 bf16 keys it equals the static path's batched GEMMs exactly."""
    batch, context = 8, 1024
    q, k, v = _case(batch, context, torch.bfloat16)
    pos = torch.full((batch,), context - 1)
    idx = torch.arange(batch)
    out = attend(q, k, v, pos, idx, torch.zeros(batch, dtype=torch.long))
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool)
    direct = DECODE_KERNELS["matmul"](q.view(batch, 2, 4, 64), k, v, mask, None)
    assert torch.equal(out, direct.reshape(batch, -1))
