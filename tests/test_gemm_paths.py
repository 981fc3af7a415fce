"""hrm.rules.gemm_paths: the executor's two CPU GEMM paths (also what hrm profile times)."""

from __future__ import annotations

import pytest
import torch

from hrm.rules.gemm_paths import WIDEN_SLICE_ELEMENTS, native_linear, padded_tokens, widened_linear


def test_tokens_are_padded_to_a_multiple_of_16_above_8():
    assert [padded_tokens(n) for n in (1, 8, 9, 16, 17, 32, 33, 1000)] == [
        1, 8, 16, 16, 32, 32, 48, 1008,
    ]  # fmt: skip


def _rows(pad, tokens: int):
    """The rows to run at: none given, a fixed count (a small pad; fewer than the tokens runs
    unpadded), or the multiple-of-16 rule."""
    return int(padded_tokens(tokens)) if pad == "multiple" else pad


@pytest.mark.parametrize("pad", [None, 8, "multiple"])
@pytest.mark.parametrize("tokens", [1, 5, 9, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_linear_is_the_fp32_product_in_the_inputs_dtype(tokens, dtype, pad):
    g = torch.Generator().manual_seed(tokens)
    # more rows than one slice holds, so the slicing is exercised
    w = torch.randn(WIDEN_SLICE_ELEMENTS // 64 + 3, 64, generator=g).to(dtype)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    out = widened_linear(x, w, torch.empty(WIDEN_SLICE_ELEMENTS), rows=_rows(pad, tokens))
    assert out.dtype == dtype and out.shape == (tokens, w.shape[0]) and out.is_contiguous()
    expected = (x.double() @ w.double().t()).to(dtype)
    assert torch.allclose(out.double(), expected.double(), rtol=1e-2, atol=1e-2)
    # no padding row leaks into the result: each token's output depends on that token alone
    alone = widened_linear(x[:1], w, torch.empty(WIDEN_SLICE_ELEMENTS), rows=_rows(pad, 1))
    assert torch.allclose(out[:1].double(), alone.double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("pad", [None, 8, "multiple"])
@pytest.mark.parametrize("tokens", [1, 3, 9, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_linear_is_torchs_own_gemm_padded_or_not(tokens, dtype, pad):
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    out = native_linear(x, w, rows=_rows(pad, tokens))
    assert out.dtype == dtype and out.shape == (tokens, 96)
    expected = torch.nn.functional.linear(x, w)
    assert torch.allclose(out.double(), expected.double(), rtol=1e-2, atol=1e-2)
    # fp32 x with a 16-bit weight: computed in the weight's dtype, returned in x's
    assert native_linear(x.float(), w, rows=_rows(pad, tokens)).dtype == torch.float32
