"""The CPU GEMM for 16-bit weights: widened to float32 slice by slice, each slice multiplied.

On CPUs without native 16-bit matrix units torch's bf16/fp16 GEMMs run 4-8x slower than fp32
(docs/decisions.md), so the executor computes them this way, and `hrm profile` times this very
function so that the profile's `<dtype>_widened` rates are the executor's. torch is imported
inside: `import hrm` stays light.
"""

from __future__ import annotations

# A widened slice of 16 MB (fp32) stays in the last-level cache between its conversion and its
# GEMM; a whole expert matrix of Mixtral-shaped models up to 4096 x 1024 is one slice.
WIDEN_SLICE_ELEMENTS = 2**22


# Above 8 tokens, the token count is padded with zero rows to a multiple of this: fp32 GEMMs at
# 9-15 tokens ran at half the rate of 16 on the AVX2 CI machine, 17-31 at 60-80% of 32.
TOKEN_PAD = 16


def padded_tokens(tokens: int) -> int:
    """The token count a widened GEMM is run at (tokens, or the next multiple of TOKEN_PAD)."""
    return tokens if tokens <= 8 else -(-tokens // TOKEN_PAD) * TOKEN_PAD


def widened_linear(x, w, scratch):
    """x [T, in] @ w [out, in].T in float32, the result in x's dtype. `scratch` is a float32
    buffer of WIDEN_SLICE_ELEMENTS, reused call after call."""
    import torch

    tokens = x.shape[0]
    padded = padded_tokens(tokens)
    if padded == tokens:
        xg = x.to(torch.float32)
    else:
        xg = torch.zeros(padded, x.shape[1], dtype=torch.float32)  # [T_pad, in]
        xg[:tokens] = x
    out_t = torch.empty(w.shape[0], padded, dtype=torch.float32)  # [out, T_pad]
    rows = max(1, WIDEN_SLICE_ELEMENTS // w.shape[1])
    for start in range(0, w.shape[0], rows):
        part = w[start : start + rows]
        wide = scratch[: part.numel()].view(part.shape).copy_(part)
        # slice @ x.T into row slices of the output: twice the speed of x @ slice.T
        torch.mm(wide, xg.t(), out=out_t[start : start + rows])
    return out_t[:, :tokens].t().to(x.dtype, memory_format=torch.contiguous_format)
