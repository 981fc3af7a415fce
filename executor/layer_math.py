"""Norms and rotary embeddings: the elementwise pieces every family's layers are built from
(executor/model.py, executor/latent_attention.py), each as transformers computes it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square, in fp32: what both RMSNorms scale."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Mixtral's RMSNorm: normalise in fp32, round back, then scale (as transformers does)."""
    return weight * _normalised(x, eps).to(x.dtype)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-oss's RMSNorm: scaled in fp32, then rounded (transformers keeps its weight fp32)."""
    return (weight.float() * _normalised(x, eps)).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DBRX's LayerNorm without bias."""
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


NORMS = {"rmsnorm": rms_norm, "rmsnorm_fp32": rms_norm_fp32, "layernorm": layer_norm}


def inverse_frequencies(arch) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies [D/2] and the factor cos and sin are scaled by: plain, or
    rescaled by YaRN (arch.rope_scaling), as transformers' modeling_rope_utils computes them."""
    dim, base = arch.rotary_dim or arch.head_dim, arch.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not arch.rope_scaling:
        return 1.0 / pos_freqs, 1.0
    y = dict(arch.rope_scaling)
    factor, original = y["factor"], y["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = y["attention_factor"]
    if scaling is None:
        both = y["mscale"] and y["mscale_all_dim"]
        scaling = (
            mscale(factor, y["mscale"]) / mscale(factor, y["mscale_all_dim"])
            if both
            else mscale(factor)
        )

    def correction(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(y["beta_fast"]), correction(y["beta_slow"])
    if y["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # the share of each frequency kept as it was
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated
    return inv_freq, float(scaling)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype, scaling: float = 1.0):
    """cos and sin [T, D] for integer positions [T], computed in fp32 as transformers does."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, D] rotated by the half-split convention of Mixtral and DBRX; where cos is
    narrower than a head (GLM's partial rotary), its leading dims only, the rest passed on."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
