"""Group-wise int8 and int4 weights and KV caches (hrm/formats.py): one codec for both.

A row of `width` values (a weight's input dimension, a head's K or V) is stored as its codes
(uint8, int4 two to a byte, the even value in the low nibble), then the float16 scale of each of
its groups, then their float16 minima: hrm.formats.row_bytes. A weight [out, in] is its `out`
rows, flat; a KV cache keeps each (token, head) row in place of its values. v = code * scale +
minimum. Scale and minimum are rounded to float16 before the codes are chosen, so a value's
error is at most half a step plus the rounding of the minimum and of the arithmetic:
|v - v'| <= scale / 2 + a few ulps of v. Weights are quantized once at load and dequantized on
the device that computes, into a 16-bit buffer, just before use; KV rows as they are written
and read.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from executor.checkpoint import ExpertWeights, ModelWeights
from hrm.formats import BITS, group_size, is_compact, is_quantized


def quantize(w: torch.Tensor, weight_dtype: str) -> torch.Tensor:
    """w [out, in] -> its stored bytes (uint8, flat: its rows, quantize_rows), on w's device."""
    return quantize_rows(w, weight_dtype).view(-1)


def dequantize_into(out: torch.Tensor, stored: torch.Tensor, weight_dtype: str) -> None:
    """Write the weights of `stored` (the bytes `quantize` made, on out's device) into `out`
    [out, in] (contiguous), in out's dtype."""
    out_dim, in_dim = out.shape
    dequantize_rows(stored.view(out_dim, -1), weight_dtype, in_dim, out.dtype, out=out)


def _arithmetic(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What dequantization computes in: the output's dtype, but float32 on a CPU, whose 16-bit
    elementwise kernels ran 2-3x slower than float32 there (an AVX-512 EPYC, 2026-12-05)."""
    return torch.float32 if device.type == "cpu" else dtype


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
    dequantize_into(out, quantize(t, weight_dtype), weight_dtype)
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
            ExpertWeights(
                **{
                    f.name: dequantized(getattr(e, f.name), f.name, fmt)
                    for f in dataclasses.fields(e)
                    if getattr(e, f.name) is not None
                }
            )
            for e in w.experts
        )
        layers.append(dataclasses.replace(w, **dense, experts=experts))
    return dataclasses.replace(weights, layers=tuple(layers))


# -- rows: the codec -----------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., width] -> uint8 [..., row_bytes(width)]: each row's codes, then the float16 scale
    and minimum of each of its groups (hrm.formats.group_size), on x's device."""
    bits, width = BITS[fmt], x.shape[-1]
    group, lead = group_size(width), x.shape[:-1]
    groups = x.float().reshape(*lead, width // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    levels = 2**bits - 1
    scale = ((high - low) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a flat group: any scale
    minimum = low.to(torch.float16)
    codes = (groups - minimum.float()[..., None]) / scale.float()[..., None]
    codes = codes.round_().clamp_(0, levels).to(torch.uint8).reshape(*lead, width)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([codes, torch.cat([scale, minimum], dim=-1).view(torch.uint8)], dim=-1)


def dequantize_rows(
    rows: torch.Tensor,
    fmt: str,
    width: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse of quantize_rows: uint8 [..., row_bytes] -> [..., width] in `dtype` (into
    `out` when given, contiguous). A GPU computes in `dtype`: the codes read and written as
    16-bit, then read again with the scales and the result written, the fewest bytes moved
    without a kernel of our own (hrm.formats.DEQUANTIZE_TRAFFIC)."""
    bits, group, lead = BITS[fmt], group_size(width), rows.shape[:-1]
    code_bytes = width * bits // 8
    codes = rows[..., :code_bytes]
    halves = rows[..., code_bytes:].view(torch.float16)  # [..., 2 * width / group]
    compute = _arithmetic(dtype, rows.device)
    scale, minimum = (t.to(compute)[..., None] for t in halves.split(width // group, dim=-1))
    if bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1)
    values = codes.reshape(*lead, width // group, group).to(compute)
    if out is None:
        return values.mul_(scale).add_(minimum).reshape(*lead, width).to(dtype)
    target = out.view(*lead, width // group, group)
    if compute == dtype:
        torch.addcmul(minimum, values, scale, out=target)
    else:
        target.copy_(values.mul_(scale).add_(minimum))
    return out
