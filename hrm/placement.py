"""Which weights live on the GPU: one function that the planner's memory model and the executor's
weight store both call, so that a plan counts exactly the tensors a run places.

A policy's `weights_gpu_fraction` r_w becomes whole tensors, the same in every layer (the cost
model streams (1 - r_w) * W_l per layer, reference, section 2):

1. the layer's dense weights first (norms, Q, K, V, O, router, and where the family has them
   q/k biases and norms and the shared expert): every token of every micro-batch needs them,
   whichever experts it routes to;
2. then whole experts in index order (w1, w3, w2 together), as many as fit in r_w * W_l.

What is left of each layer is streamed: its dense weights (when not resident) then its experts,
cut into pages at tensor boundaries. Rounding down to whole tensors never places more than the
policy allows; the planner reports the placed fraction, not the requested one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hrm.arch import ModelArch
from hrm.policy import dtype_bytes

# Prefill runs each micro-batch's token-wise work (projections, router, experts) in chunks of at
# most this many tokens, so the workspace of one chunk, not of a whole micro-batch, must fit
# (planner/memory.py counts it; executor/runtime.py chunks by it).
PREFILL_CHUNK_TOKENS = 8192

EXPERT_TENSORS = ("w1", "w3", "w2")
# requested fractions within this of a placement boundary reach it (float noise from the MILP)
_TOLERANCE = 1e-9


def dense_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's dense tensors, in the linear layout [out, in], in arena order: the
    LayerWeights fields this family has (executor/checkpoint.py)."""
    h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
    shapes = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q)}
    if arch.attention_bias:
        shapes |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    if arch.qk_norm == "head":
        shapes |= {"q_norm": (arch.head_dim,), "k_norm": (arch.head_dim,)}
    elif arch.qk_norm == "projection":
        shapes |= {"q_norm": (q,), "k_norm": (kv,)}
    shapes |= {"ffn_norm": (h,), "router": (arch.num_experts, h)}
    if arch.shared_expert_intermediate_size:
        si = arch.shared_expert_intermediate_size
        shapes |= {"shared_w1": (si, h), "shared_w3": (si, h), "shared_w2": (h, si)}
        shapes |= {"shared_gate": (1, h)}
    return shapes


def expert_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, i = arch.hidden_size, arch.intermediate_size
    return {"w1": (i, h), "w3": (i, h), "w2": (h, i)}


def _elements(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


@dataclass(frozen=True, kw_only=True)
class WeightPlacement:
    """Per layer: whether the dense weights are resident, and how many leading experts are."""

    dense_resident: bool
    resident_experts: int
    num_experts: int
    dense_bytes: float  # one layer's dense tensors
    expert_bytes: float  # one expert

    @property
    def layer_bytes(self) -> float:
        return self.dense_bytes + self.num_experts * self.expert_bytes

    @property
    def resident_bytes(self) -> float:
        """Per layer, on the GPU for the whole run."""
        return self.dense_resident * self.dense_bytes + self.resident_experts * self.expert_bytes

    @property
    def streamed_bytes(self) -> float:
        """Per layer, copied to the GPU on every pass of the layer."""
        return self.layer_bytes - self.resident_bytes

    @property
    def fraction(self) -> float:
        """The placed r_w: resident bytes over the layer's bytes."""
        return self.resident_bytes / self.layer_bytes

    @property
    def streamed_experts(self) -> range:
        return range(self.resident_experts, self.num_experts)


def place_weights(
    arch: ModelArch, weights_gpu_fraction: float, weight_dtype: str
) -> WeightPlacement:
    """The tensors of r_w = weights_gpu_fraction, in the order of the module docstring."""
    wdt = dtype_bytes(weight_dtype)
    dense = _elements(dense_shapes(arch)) * wdt
    expert = _elements(expert_shapes(arch)) * wdt
    layer = dense + arch.num_experts * expert
    budget = weights_gpu_fraction * layer * (1 + _TOLERANCE)
    dense_resident = budget >= dense
    experts = 0
    if dense_resident:
        experts = min(arch.num_experts, math.floor((budget - dense) / expert))
    return WeightPlacement(
        dense_resident=dense_resident,
        resident_experts=experts,
        num_experts=arch.num_experts,
        dense_bytes=dense,
        expert_bytes=expert,
    )


def streamed_tensors(arch: ModelArch, placement: WeightPlacement) -> list[tuple[tuple, tuple]]:
    """One layer's streamed tensors in arena order: (key, shape); key (name,) for a dense
    tensor, (expert, name) for an expert's."""
    names: list[tuple[tuple, tuple[int, ...]]] = []
    if not placement.dense_resident:
        names += [((n,), shape) for n, shape in dense_shapes(arch).items()]
    for e in placement.streamed_experts:
        names += [((e, n), expert_shapes(arch)[n]) for n in EXPERT_TENSORS]
    return names


def cut_pages(sizes: list[int], pages: int) -> list[tuple[int, int]]:
    """Element ranges of `pages` pages of near-equal size over tensors of `sizes` elements,
    cut at tensor boundaries (a page holds whole tensors; fewer pages when there are fewer
    tensors)."""
    total = sum(sizes)
    if not total:
        return []
    bounds, offset = [], 0
    for n in sizes:
        bounds.append(offset)
        offset += n
    cuts = [0]
    for p in range(1, max(1, pages)):
        target = total * p / pages
        best = min(bounds, key=lambda b: abs(b - target))
        if cuts[-1] < best < total:
            cuts.append(best)
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def largest_page_bytes(arch: ModelArch, weight_dtype: str, pages: int) -> float:
    """The largest page of a layer streamed whole in `pages` pages: the ring's page size."""
    placement = place_weights(arch, 0.0, weight_dtype)
    sizes = [math.prod(shape) for _, shape in streamed_tensors(arch, placement)]
    return max(end - start for start, end in cut_pages(sizes, pages)) * dtype_bytes(weight_dtype)
