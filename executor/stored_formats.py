"""Weights that released checkpoints store compressed, decoded to the run's dtype at load.

FP8 in blocks (DeepSeek-V3's layout, also Qwen3's and GLM's FP8 releases: quant_method "fp8"
with a `weight_block_size`): a linear weight stored as float8_e4m3fn [out, in] beside
`weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)], one scale per bo x bi block that the
weight is multiplied by; the embedding, norms and usually the LM head and routers stay 16-bit.

MXFP4 (gpt-oss's experts; OCP Microscaling Formats v1.0): blocks of 32 FP4 (E2M1) values that
share one E8M0 scale, 2^(s - 127). A checkpoint stores a linear weight [out, in] as `*_blocks`
uint8 [..., out, in/32, 16], two values a byte, low nibble first, and `*_scales` uint8
[..., out, in/32]: 4.25 bits a weight. Decoding at load is what this module does; streaming
the blocks compact is the compact formats' work (hrm/formats.py).

Any other `quantization_config` (GPTQ, AWQ, bitsandbytes, another FP8 layout) is refused before
a tensor is read: `check_stored_format`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hrm.errors import HrmError

# the 16 E2M1 codes' values, in code order (sign bit highest)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
MXFP4_BLOCK = 32  # values that share a scale
SCALE_BIAS = 127  # E8M0: the byte s means 2^(s - 127)
# quantization_config.quant_method -> the model types whose checkpoints this reader decodes in it
STORED_FORMATS = {
    "mxfp4": ("gpt_oss",),
    "fp8": ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"),
}
FP8_SCALES = "_scale_inv"  # a weight's block scales: its name with this appended


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> values [..., G * 32] in `dtype`
    (exact in float32 and bfloat16: an E2M1 value times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32)[..., None] - SCALE_BIAS
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


def decode_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """float8 [out, in] times its block scales [ceil(out/bo), ceil(in/bi)] -> [out, in] in
    `dtype`, computed in `dtype` as transformers' dequantizer computes it (the scales rounded
    to `dtype`, then one product)."""
    (out, inp), (bo, bi) = weight.shape, block
    if scale_inv.shape != (-(-out // bo), -(-inp // bi)):
        raise ValueError(f"FP8 scales {list(scale_inv.shape)} do not tile {[out, inp]} by {block}")
    scale = scale_inv.to(dtype).repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.to(dtype).mul_(scale)


def check_stored_format(config: Mapping[str, Any], model_type: str, where: str):
    """The checkpoint's stored format: None (plain floating point), ("mxfp4", None) or ("fp8",
    its block); refused in one line where this reader cannot decode it, before a tensor is read."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    block = q.get("weight_block_size") if method == "fp8" else None
    fp8_ok = method != "fp8" or (
        q.get("fmt", "e4m3") == "e4m3"
        and isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )
    if model_type not in STORED_FORMATS.get(method, ()) or not fp8_ok:
        supported = ", ".join(f"{m} ({', '.join(t)})" for m, t in STORED_FORMATS.items())
        found = method if fp8_ok else f"fp8 without e4m3 blocks (weight_block_size {block!r})"
        raise HrmError(
            f"{where}: weights stored as {found!r} (quantization_config) cannot be read; "
            f"supported: 16- and 32-bit floats, {supported} (fp8: e4m3 in blocks); use a "
            "16-bit checkpoint"
        )
    return method, (tuple(block) if block else None)
