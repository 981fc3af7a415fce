"""Group-wise int8 and int4 weights (hrm/formats.py): quantize once at load, dequantize on the
device that computes, into a 16-bit buffer, just before use.

A quantized [out, in] tensor is stored as three consecutive byte ranges: codes (uint8, int4 two
to a byte, the even column in the low nibble), then the float16 scale and the float16 minimum of
each group, [out, in / GROUP] each. w = code * scale + minimum. Scale and minimum are rounded to
float16 before the codes are chosen, so the error of a weight is at most half a step plus the
rounding of the minimum and of the 16-bit arithmetic: |w - w'| <= scale / 2 + a few ulps of w.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from executor.checkpoint import ExpertWeights, ModelWeights
from hrm.formats import BITS, GROUP, SCALE_BYTES, WEIGHT_FORMATS, is_compact, is_quantized
from hrm.policy import FLOAT_DTYPES
from hrm.rules.placement import EXPERT_TENSORS

RUN_DTYPES = (*FLOAT_DTYPES, *WEIGHT_FORMATS)  # the weight dtypes the executor runs


def quantize(w: torch.Tensor, weight_dtype: str) -> torch.Tensor:
    """w [out, in] -> its stored bytes (uint8, flat), on the CPU."""
    bits = BITS[weight_dtype]
    out_dim, in_dim = w.shape
    groups = w.detach().to("cpu", torch.float32).reshape(out_dim, in_dim // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, in/G]
    levels = 2**bits - 1
    scale = ((high - low) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a flat group: any scale
    minimum = low.to(torch.float16)
    codes = (groups - minimum.float()[..., None]) / scale.float()[..., None]
    codes = codes.round_().clamp_(0, levels).to(torch.uint8).reshape(out_dim, in_dim)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    halves = torch.cat([scale.flatten(), minimum.flatten()]).view(torch.uint8)
    return torch.cat([codes.flatten(), halves])


def dequantize_into(out: torch.Tensor, stored: torch.Tensor, weight_dtype: str) -> None:
    """Write the weights of `stored` (the bytes `quantize` made, on out's device) into `out`
    [out, in] (contiguous), computing in out's dtype: two passes over the 16-bit output, the
    fewest bytes moved without a kernel of our own (hrm.formats.DEQUANTIZE_TRAFFIC)."""
    bits = BITS[weight_dtype]
    out_dim, in_dim = out.shape
    groups = out_dim * in_dim // GROUP
    code_bytes = out_dim * in_dim * bits // 8
    codes = stored[:code_bytes].view(out_dim, -1)
    halves = stored[code_bytes : code_bytes + 2 * SCALE_BYTES * groups].view(torch.float16)
    scale, minimum = (t.to(out.dtype)[:, None] for t in (halves[:groups], halves[groups:]))
    if bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1)
    values = codes.reshape(groups, GROUP).to(out.dtype)
    torch.addcmul(minimum, values, scale, out=out.view(groups, GROUP))


def measure_dequantize_rate(
    arch, weight_dtype: str, device: str = "cpu", *, repeats: int = 5
) -> float:
    """Weights per second `dequantize_into` writes on `device`, into bfloat16, for one expert's
    w1 of `arch` (the best of `repeats`): what the planner prices a layer's dequantization at."""
    shape = (arch.intermediate_size, arch.hidden_size)
    w = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02)
    stored = quantize(w, weight_dtype).to(device)
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    dequantize_into(out, stored, weight_dtype)  # warm-up: allocations and kernels
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dequantize_into(out, stored, weight_dtype)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return out.numel() / best


def compute_dtype(weight_dtype: str, device: str | torch.device) -> str:
    """The dtype the layers compute in: a float weight dtype itself; a compact format's 16-bit
    float: bfloat16 on a CPU and on GPUs with bf16 units (compute capability 8.0 on), else
    float16 (a T4 has no bf16 units; HardwareProfile.compute_dtype chooses the same)."""
    if not is_compact(weight_dtype):
        return weight_dtype
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "float16"
    return "bfloat16"


def dequantized(t: torch.Tensor, name: str, weight_dtype: str) -> torch.Tensor:
    """`t` as the layers compute it in `weight_dtype`: the format's values (quantized, then
    dequantized on t's device) where the format stores `name` compact, else `t` itself."""
    if not is_quantized(name, tuple(t.shape), weight_dtype):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    dequantize_into(out, quantize(t, weight_dtype).to(t.device), weight_dtype)
    return out


def dequantized_weights(weights: ModelWeights, fmt: str) -> ModelWeights:
    """Every layer's weights with the format's values (`dequantized`), held in the compute
    dtype: what a run whose weights never stream computes, so that its tokens equal those of
    a run that streams them compact."""
    layers = []
    for w in weights.layers:
        dense = {
            f.name: dequantized(getattr(w, f.name), f.name, fmt)
            for f in dataclasses.fields(w)
            if isinstance(getattr(w, f.name), torch.Tensor)
        }
        experts = tuple(
            ExpertWeights(**{n: dequantized(getattr(e, n), n, fmt) for n in EXPERT_TENSORS})
            for e in w.experts
        )
        layers.append(dataclasses.replace(w, **dense, experts=experts))
    return dataclasses.replace(weights, layers=tuple(layers))
