"""Weight formats: which tensors a compact format stores in fewer bits, and their bytes.

`int8` and `int4` are FlexGen's group-wise scheme: asymmetric min-max groups of GROUP weights
along a linear layer's input dimension, each with a float16 scale and minimum. They are a storage
and transfer format: the layers compute in a 16-bit float (`compute_dtype`), after the GPU
dequantizes each streamed layer into a 16-bit slot (executor/quant.py). The planner and the
executor count bytes with the same functions here, so a plan's pages are the pages that move.

What stays 16-bit, and why:
- norms, biases and the q/k norms: vectors, a rounding error there scales whole activations, and
  they are a few kilobytes a layer;
- the router (and Qwen2-MoE's shared-expert gate): a small error flips which experts a token
  takes, and it is 0.1-0.5% of a layer;
- the embedding and the LM head: never streamed (the embedding is a gather in host memory, the
  head sits on the device that runs the layers);
- resident weights: they never cross the link, and computing from them needs no dequantization.
- a linear layer whose input width is not a multiple of GROUP (none in the bundled models).
"""

from __future__ import annotations

import math

GROUP = 64  # weights per group along a linear layer's input dimension
BITS = {"int8": 8, "int4": 4}
WEIGHT_FORMATS = tuple(BITS)
SCALE_BYTES = 2  # float16 scale, and float16 minimum, per group
# bytes of memory traffic per weight of executor/quant.py's dequantization on a GPU, kernel by
# kernel: the codes read and written as 16-bit floats (1 + 2), then read with the scale and
# minimum and the result written (2 + 2); int4 first splits each byte in two (0.5 + 0.5, twice)
# and interleaves the halves (1 + 1). What the planner prices a device's dequantization at where
# hrm profile has not measured it.
DEQUANTIZE_TRAFFIC = {"int8": 1 + 2 + 2 + 2, "int4": 4 * 0.5 + 1 + 1 + 1 + 2 + 2 + 2}
# the linear layers a compact format stores in fewer bits (LayerWeights and ExpertWeights names)
QUANTIZED_TENSORS = frozenset(
    {"wq", "wk", "wv", "wo", "shared_w1", "shared_w2", "shared_w3", "w1", "w2", "w3"}
)


def group_size(width: int) -> int:
    """Values per group of a row `width` wide: GROUP, or the whole row where it is narrower (a
    KV head of 16 or 32; a weight is quantized only with whole groups of GROUP)."""
    return min(GROUP, width)


def row_bytes(width: int, fmt: str) -> int:
    """Bytes of one row of `width` values in a compact format: its codes, then a float16 scale
    and minimum per group (executor/quant.py, quantize_rows)."""
    return width * BITS[fmt] // 8 + 2 * SCALE_BYTES * (width // group_size(width))


def kv_format_problem(kv_dtype: str, head_dim: int) -> str | None:
    """Why a compact KV format cannot hold this head size (None: it can, or it is a float)."""
    if not is_compact(kv_dtype):
        return None
    group = group_size(head_dim)
    if head_dim % group or head_dim % 4:
        return (
            f"a KV cache in {kv_dtype} needs a head_dim that is a multiple of its group of {group} "
            f"(and of 4); this model's is {head_dim}: use a 16-bit --kv-dtype"
        )
    return None


def kv_dtype_problem(kv_dtype: str, computed: str, head_dim: int) -> str | None:
    """Why the executor cannot keep a KV cache in `kv_dtype`, its layers computing in
    `computed` (None: it can): it keeps one in that dtype or in a compact format."""
    if kv_dtype == computed:
        return None
    if not is_compact(kv_dtype):
        return (
            f"a KV cache in {kv_dtype} cannot be run: the executor keeps it in the layers' "
            f"{computed} or in {' or '.join(WEIGHT_FORMATS)}"
        )
    return kv_format_problem(kv_dtype, head_dim)


def is_compact(weight_dtype: str) -> bool:
    return weight_dtype in BITS


def is_quantized(name: str, shape: tuple[int, ...], weight_dtype: str) -> bool:
    """Whether the tensor `name` of `shape` ([out, in]) is stored in the compact format."""
    return (
        is_compact(weight_dtype)
        and name in QUANTIZED_TENSORS
        and len(shape) == 2
        and shape[1] % GROUP == 0
    )


def stored_bytes(name: str, shape: tuple[int, ...], weight_dtype: str, half_bytes: int) -> int:
    """Bytes of one streamed tensor as stored and moved: codes plus a scale and a minimum per
    group when quantized, else its elements at `half_bytes` each (the compute dtype's size)."""
    if not is_quantized(name, shape, weight_dtype):
        return math.prod(shape) * half_bytes
    return shape[0] * row_bytes(shape[1], weight_dtype)


def bytes_per_weight(weight_dtype: str) -> float:
    """Stored bytes per weight of a quantized tensor: codes plus the group's scale and minimum
    (int8 1.0625, int4 0.5625)."""
    return BITS[weight_dtype] / 8 + 2 * SCALE_BYTES / GROUP
