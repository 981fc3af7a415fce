"""The small bf16 ops of a CPU layer in one native pass each (executor/small_ops.cpp, built with
the fused experts' kernel): RMSNorm (Mixtral's and gpt-oss's), rotary, the routed experts'
combination, greedy choice, and on AMX hosts a decode step's attention
(executor/decode_attention.cpp).

Why: between the GEMMs, torch runs each of these as four to eight ops over fp32 or bf16 copies
of the rows, each paying its dispatch and an allocation. On the AMX Xeon at batch 64 (Qwen3-MoE
bench shape) they took about 3 ms of a 52 ms decode step: an RMSNorm of [64, 1024] 72 us,
rotary of [64, 16, 128] 88 us, the routing scale's mixed-dtype mul_ of [512, 1024] up to 500
us, the combination's gather and seven adds 137 us (docs/decisions.md, 2026-12-07). vLLM's
CPU backend runs them in C++. A model takes them where its routed experts run fused (bf16, the
kernel built); each falls back to torch's ops for what it does not serve.
"""

from __future__ import annotations

import functools

import torch

from executor import fused_moe
from executor.layer_math import apply_rotary
from executor.layer_math import rms_norm as torch_rms_norm
from executor.layer_math import rms_norm_fp32 as torch_rms_norm_fp32


def _ops():
    return fused_moe._built()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_math.rms_norm, in one pass (bf16 rows; else torch's)."""
    return _rms_norm(x, weight, eps, fp32_scale=False)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_math.rms_norm_fp32 (gpt-oss's, scaled in fp32, rounded once), in one pass."""
    return _rms_norm(x, weight, eps, fp32_scale=True)


def _rms_norm(x, weight, eps: float, *, fp32_scale: bool) -> torch.Tensor:
    bf16 = x.dtype == weight.dtype == torch.bfloat16
    if not (bf16 and x.is_contiguous() and weight.is_contiguous()):
        return (torch_rms_norm_fp32 if fp32_scale else torch_rms_norm)(x, weight, eps)
    return _ops().rms_norm(x, weight, eps, fp32_scale)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layer_math.apply_rotary, in one pass (bf16, a whole head rotated; else torch's)."""
    if x.dtype != torch.bfloat16 or cos.shape[-1] != x.shape[-1] or not x.is_contiguous():
        return apply_rotary(x, cos, sin)
    return _ops().rotary(x, cos.contiguous(), sin.contiguous())


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """generate.greedy's choice natively (bf16 or fp32 CPU rows [B, V]; else torch's max), where
    this process already has the kernel (a fused model built it): a sampler never builds it.
    Read once as bf16, where widening a batch-64 step's [64, 32000] to fp32 and torch's max
    took 2.2 ms of a 49 ms Mixtral-shape step (AMX Xeon)."""
    rows = logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[-1] > 0
    if rows and logits.dtype in (torch.bfloat16, torch.float32) and fused_moe.ready():
        return _ops().greedy(logits.contiguous())
    return logits.max(dim=-1).indices


def dispatch(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, experts: int):
    """A step's assignments laid out for the grouped GEMMs in one pass: (xs [A, H] each token's
    row in expert order, stably; scale [A] fp32; combine's source [A]; counts, a list of
    `experts`), as MoEModel.experts' argsort, bincount, index_selects and _by_token give them,
    where at batch 64 they took about 0.36 ms a layer (Qwen3-MoE shape, AMX Xeon). bf16 CPU
    rows (a fused model's)."""
    top_w, top_i = top_w.contiguous(), top_i.contiguous()
    xs, scale, source, counts = _ops().dispatch(x.contiguous(), top_w, top_i, experts)
    return xs, scale, source, counts.tolist()


def combine(ys: torch.Tensor, scale: torch.Tensor, source: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H] bf16: each token's K rows of ys (source[t * K + j], in expert index order), each
    scaled by its row's routing weight and rounded, added in turn, each sum rounded."""
    return _ops().combine(ys.contiguous(), scale.reshape(-1).float().contiguous(), source, k)


@functools.cache
def amx_attention() -> bool:
    """Whether this host runs decode_attention: AMX-BF16 granted (fused_moe's amx form), the
    kernel built (building it here if need be; not on a CPU without AMX tiles)."""
    has_tiles = getattr(torch.cpu, "_is_amx_tile_supported", lambda: True)()
    return has_tiles and fused_moe.host_missing() is None and fused_moe.variant() == "amx"


def serves_decode(q, keys, values, mask) -> bool:
    """Whether decode_attention takes these: bf16 CPU q [B, nkv, G, D], keys and values [B, nkv,
    S, D or Dv] with contiguous rows, a bool mask [B, 1, 1, S] or None, G dividing 16, D a
    multiple of 32 up to 128, Dv up to 256, on an AMX host."""
    tensors = (q, keys, values)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 4 for t in tensors):
        return False
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.shape[2] == 0:
        return False
    rows = (q.shape[0], 1, 1, keys.shape[2])
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != rows):
        return False
    return amx_attention() and _ops().decode_attention_serves(*q.shape[2:], values.shape[-1])


def decode_attention(q, keys, values, mask, scale: float) -> torch.Tensor:
    """attention.sdpa_decode's product in one native pass a K/V head (decode_attention.cpp):
    [B, nkv, G, Dv] bf16, for what serves_decode takes."""
    return _ops().decode_attention(q.contiguous(), keys, values, mask, scale)
