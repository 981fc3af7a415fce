"""Weights that released checkpoints store compressed, decoded to the run's dtype at load.

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
# quantization_config.quant_method -> the model types whose released checkpoints use it
STORED_FORMATS = {"mxfp4": ("gpt_oss",)}


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


def check_stored_format(config: Mapping[str, Any], model_type: str, where: str) -> str | None:
    """The checkpoint's stored format (None: plain floating point), refused with one line where
    this reader cannot decode it."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if model_type not in STORED_FORMATS.get(method, ()):
        supported = ", ".join(f"{m} ({', '.join(t)})" for m, t in STORED_FORMATS.items())
        raise HrmError(
            f"{where}: weights stored as {method!r} (quantization_config) cannot be read; "
            f"supported: 16- and 32-bit floats, {supported}; use a 16-bit checkpoint"
        )
    return method
