"""The CPU's three GEMM paths for a weight: native, widened to float32 slice by slice, and packed.

`native` is torch's own GEMM in the weight's dtype: fast on CPUs with 16-bit matrix units (AMX,
AVX-512 BF16/FP16), 4-8x slower than float32 on CPUs without them (AVX2). `widened` converts a
16-bit weight to float32 one cache-sized slice at a time and multiplies each slice at once.
`packed` is oneDNN's GEMM over a weight reordered once, at load, into the blocked layout its AMX
and AVX-512 kernels read (torch's own mkldnn ops, as inductor's freezing uses them): native
reorders the weight on every call, which at decode's few rows costs as much as the GEMM.
Which one a run takes is chosen in hrm.rules.cpu_gemm from measured curves; the executor runs these
functions and `hrm profile` times these very functions, so the profile's rates are the
executor's. Either may run at more rows than it has, zero-padded (`rows`), where hrm.rules.cpu_gemm
measured that to pay. torch is imported inside: `import hrm` stays light.
"""

from __future__ import annotations

# A widened slice of 16 MB (fp32) stays in the last-level cache between its conversion and its
# GEMM; a whole expert matrix of Mixtral-shaped models up to 4096 x 1024 is one slice.
WIDEN_SLICE_ELEMENTS = 2**22

# Above 8 tokens a padded GEMM runs at the next multiple of this: fp32 GEMMs at 9-15 tokens ran at
# half the rate of 16 on an AVX2 EPYC, 17-31 at 60-80% of 32 (docs/decisions.md).
TOKEN_PAD = 16


def padded_tokens(tokens: float) -> float:
    """The rows a padded GEMM runs at: tokens up to 8, else the next multiple of TOKEN_PAD."""
    return tokens if tokens <= 8 else -(-tokens // TOKEN_PAD) * TOKEN_PAD


# The row count oneDNN is told to expect when a weight is packed: its layout then suits decode's
# micro-batches (on the AMX Xeon VM a hint of 16 ran 1-256 rows within 5% of each row count's own
# hint, but for 64 rows of a stacked 7168 x 1024 expert, 13% slower; docs/decisions.md).
PACK_ROWS_HINT = 16


def packing_missing(dtype: str) -> str | None:
    """What this CPU lacks for the packed path in `dtype` (None: it has it): oneDNN's kernels
    of that dtype."""
    import torch

    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN's bfloat16 kernels, which need AVX-512 (AVX512-BF16 or AMX-BF16 for speed)"
    if dtype == "float16" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return "oneDNN's float16 kernels, which need AVX512-FP16 or AMX-FP16"
    if dtype not in ("bfloat16", "float16"):
        return f"a packed path for {dtype} (16-bit weights only)"
    return None


def host_paths(dtype: str) -> tuple[str, ...]:
    """The paths this CPU runs `dtype` along: native; widened and, where oneDNN has the
    dtype's kernels here, packed for 16-bit dtypes."""
    if dtype not in ("bfloat16", "float16"):
        return ("native",)
    return ("native", "widened") + (("packed",) if packing_missing(dtype) is None else ())


def pack_weight(w):
    """w [out, in] reordered for oneDNN (an opaque mkldnn tensor of the same shape and dtype)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)


def packed_linear(x, w, *, rows: int | None = None):
    """x [T, in] @ w.T for a packed w (pack_weight), run at `rows` rows; the result in x's
    dtype."""
    import torch

    tokens = x.shape[0]
    out = torch.ops.mkldnn._linear_pointwise(_rows(x, w.dtype, rows), w, None, "none", [], "")
    return out[:tokens].to(x.dtype)


def _rows(x, dtype, rows: int | None):
    """x in `dtype`, with zero rows appended up to `rows` (none when None)."""
    import torch

    tokens = x.shape[0]
    rows = tokens if rows is None else max(tokens, int(rows))
    if rows == tokens:
        return x.to(dtype)
    out = torch.zeros(rows, x.shape[1], dtype=dtype, device=x.device)  # [T_pad, in]
    out[:tokens] = x
    return out


def native_linear(x, w, *, rows: int | None = None):
    """x [T, in] @ w [out, in].T by torch in w's dtype, run at `rows` rows; the result in x's
    dtype."""
    import torch.nn.functional as F

    tokens = x.shape[0]
    return F.linear(_rows(x, w.dtype, rows), w)[:tokens].to(x.dtype)


def widened_linear(x, w, scratch, *, rows: int | None = None):
    """x [T, in] @ w [out, in].T in float32 at `rows` rows, the result in x's dtype. `scratch`
    is a float32 buffer of WIDEN_SLICE_ELEMENTS, reused call after call."""
    import torch

    tokens = x.shape[0]
    xg = _rows(x, torch.float32, rows)  # [T_pad, in]
    out_t = torch.empty(w.shape[0], xg.shape[0], dtype=torch.float32)  # [out, T_pad]
    rows = max(1, WIDEN_SLICE_ELEMENTS // w.shape[1])
    for start in range(0, w.shape[0], rows):
        part = w[start : start + rows]
        wide = scratch[: part.numel()].view(part.shape).copy_(part)
        # slice @ x.T into row slices of the output: twice the speed of x @ slice.T
        torch.mm(wide, xg.t(), out=out_t[start : start + rows])
    return out_t[:, :tokens].t().to(x.dtype, memory_format=torch.contiguous_format)
