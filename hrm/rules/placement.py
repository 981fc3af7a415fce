"""Which weights live on the GPU: one function that the planner's memory model and the executor's
weight store both call, so that a plan counts exactly the tensors a run places.

A policy's `weights_gpu_fraction` r_w becomes whole tensors, the same in every layer of a kind
(the cost model streams (1 - r_w) of the layers' bytes, reference, section 2):

1. the layers' dense weights first (norms, Q, K, V, O, router, and where the family has them
   q/k biases and norms and the shared expert): every token of every micro-batch needs them,
   whichever experts it routes to;
2. then the MLP of each dense layer (a model with dense layers among sparse ones), for the same
   reason;
3. then whole experts in index order (w1, w3, w2 together), as many as fit.

What is left of each layer is streamed: its dense weights (when not resident) then its experts,
cut into pages at tensor boundaries. Rounding down to whole tensors never places more than the
policy allows; the planner reports the placed fraction, not the requested one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from hrm.arch import ModelArch
from hrm.formats import stored_bytes
from hrm.policy import compute_bytes

# Prefill runs each micro-batch's token-wise work (projections, router, experts) in chunks of at
# most this many tokens, so the workspace of one chunk, not of a whole micro-batch, must fit
# (planner/memory.py counts it; executor/runtime.py chunks by it).
PREFILL_CHUNK_TOKENS = 8192

# the disk tier reads the weights it keeps on disk in reads of this size (O_DIRECT, aligned),
# and the planner prices them at the profile's disk rate for it (hrm.hardware.parts.DiskSpec)
DISK_READ_BYTES = 8 * 2**20
EXPERT_TENSORS = ("w1", "w3", "w2")  # an expert's projections; expert_shapes adds its biases
# requested fractions within this of a placement boundary reach it (float noise from the MILP)
_TOLERANCE = 1e-9


def dense_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's dense tensors, in the linear layout [out, in], in arena order: the
    LayerWeights fields this family has (executor/checkpoint.py). `arch` is of one kind of layer
    (ModelArch.layer_arch)."""
    h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
    if arch.kv_lora_rank:
        shapes = _latent_attention_shapes(arch)
    else:
        shapes = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q)}
    if arch.attention_bias:
        shapes |= {"bq": (q,), "bk": (kv,), "bv": (kv,)}
    if arch.output_bias:
        shapes |= {"bo": (h,)}
    if arch.qk_norm == "head":
        shapes |= {"q_norm": (arch.head_dim,), "k_norm": (arch.head_dim,)}
    elif arch.qk_norm == "projection":
        shapes |= {"q_norm": (q,), "k_norm": (kv,)}
    shapes |= {"ffn_norm": (h,)}
    if not arch.ffn_is_dense:  # a dense layer's MLP is its one expert, taken without a router
        shapes |= {"router": (arch.num_experts, h)}
        if arch.router_bias:
            shapes |= {"router_bias": (arch.num_experts,)}
    if arch.shared_expert_intermediate_size:
        si = arch.shared_expert_intermediate_size
        shapes |= {"shared_w1": (si, h), "shared_w3": (si, h), "shared_w2": (h, si)}
        if arch.shared_expert_gate:
            shapes |= {"shared_gate": (1, h)}
    return shapes


def _latent_attention_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Latent attention's (DeepSeek): q directly or through its low rank and RMSNorm (wq_a,
    q_a_norm, then wq), the latent and rotary key (wkv_a) with the latent's RMSNorm, the
    up-projection of the latent to each head's key and value (wkv_b), and O."""
    h, nq, c, r = arch.hidden_size, arch.num_attention_heads, arch.kv_lora_rank, arch.q_lora_rank
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (h,)}
    if r:
        shapes |= {"wq_a": (r, h), "q_a_norm": (r,)}
    q_out = nq * (arch.qk_nope_head_dim + arch.rotary_dim)
    return shapes | {
        "wq": (q_out, r or h),
        "wkv_a": (arch.head_dim, h),
        "kv_a_norm": (c,),
        "wkv_b": (nq * (arch.qk_nope_head_dim + arch.v_head_dim), c),
        "wo": (h, nq * arch.v_head_dim),
    }


def expert_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shapes of one expert's tensors, the ExpertWeights fields this family has, in arena order
    (w1 first: the weight store maps an expert by where its w1 lies)."""
    h, i = arch.hidden_size, arch.intermediate_size
    shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}
    if arch.expert_bias:
        shapes |= {"b1": (i,), "b3": (i,), "b2": (h,)}
    return shapes


def _elements(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def _stored(shapes: dict[str, tuple[int, ...]], weight_dtype: str) -> int:
    half = int(compute_bytes(weight_dtype))
    return sum(stored_bytes(n, s, weight_dtype, half) for n, s in shapes.items())


@dataclass(frozen=True, kw_only=True)
class WeightPlacement:
    """Per layer: whether the dense weights are resident, and how many leading experts are."""

    dense_resident: bool
    resident_experts: int
    num_experts: int
    dense_bytes: float  # one layer's dense tensors, as the layers compute them
    expert_bytes: float  # one expert
    # a layer's bytes as stored and streamed over its bytes as computed: below 1 in a compact
    # format (hrm/formats.py), where the dense part (placed first) holds the 16-bit tensors
    stored_ratio: float = 1.0

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
    """The tensors of r_w = weights_gpu_fraction, in the order of the module docstring, for a
    model whose layers are all of one kind."""
    (placement,) = (p for _, _, p in place_model(arch, weights_gpu_fraction, weight_dtype).kinds)
    return placement


@dataclass(frozen=True)
class ModelPlacement:
    """Each kind of layer's placement (ModelArch.layer_kinds) at one r_w."""

    arch: ModelArch
    kinds: tuple[tuple[ModelArch, int, WeightPlacement], ...]  # (geometry, layers, placement)

    def of(self, layer: int) -> tuple[ModelArch, WeightPlacement]:
        """Layer `layer`'s geometry and placement."""
        dense = self.arch.is_dense(layer)
        return next((k, p) for k, _, p in self.kinds if k.ffn_is_dense == dense)

    @property
    def layers_bytes(self) -> float:
        return sum(n * p.layer_bytes for _, n, p in self.kinds)

    @property
    def resident_bytes(self) -> float:
        return sum(n * p.resident_bytes for _, n, p in self.kinds)

    @property
    def stored_ratio(self) -> float:
        """All layers' bytes as stored over their bytes as computed (1 in a float dtype)."""
        return sum(n * p.stored_ratio * p.layer_bytes for _, n, p in self.kinds) / self.layers_bytes

    @property
    def fraction(self) -> float:
        """The placed r_w: resident bytes over all layers' bytes."""
        return self.resident_bytes / self.layers_bytes

    @property
    def next_fraction(self) -> float | None:
        """The r_w that places the next whole item (module docstring); None when all are."""
        items = _items(self.kinds)
        placed = sum(p.dense_resident + p.resident_experts for _, _, p in self.kinds)
        if placed == len(items):
            return None
        return (self.resident_bytes + items[placed][2]) / self.layers_bytes


def _items(kinds) -> list[tuple[int, str, float]]:
    """What becomes resident, in order, as (kind index, "dense" or "expert", bytes over all the
    kind's layers): every kind's dense tensors, then the dense layers' MLPs (every token runs
    them), then the routed experts by index."""
    items = [(i, "dense", n * p.dense_bytes) for i, (_, n, p) in enumerate(kinds)]
    order = sorted(range(len(kinds)), key=lambda i: not kinds[i][0].ffn_is_dense)
    for i in order:
        _, n, p = kinds[i]
        items += [(i, "expert", n * p.expert_bytes)] * p.num_experts
    return items


@functools.lru_cache(maxsize=4096)
def place_model(arch: ModelArch, weights_gpu_fraction: float, weight_dtype: str) -> ModelPlacement:
    """Whole items of `_items` in order while they fit in r_w of all layers' bytes: the first
    that does not fit ends it, so placing the placed fraction again places the same tensors. In
    a model of one kind this is, per layer, its dense tensors then whole experts in index
    order. Cached: a plan's search and its pass pricing ask the same questions thousands of
    times (ModelArch is frozen, the placement a frozen result)."""
    wdt = compute_bytes(weight_dtype)
    kinds = []
    for kind, n in arch.layer_kinds():
        dense, expert = dense_shapes(kind), expert_shapes(kind)
        stored = _stored(dense, weight_dtype) + kind.num_experts * _stored(expert, weight_dtype)
        bytes_of = WeightPlacement(
            dense_resident=False,
            resident_experts=0,
            num_experts=kind.num_experts,
            dense_bytes=_elements(dense) * wdt,
            expert_bytes=_elements(expert) * wdt,
            stored_ratio=stored / ((_elements(dense) + kind.num_experts * _elements(expert)) * wdt),
        )
        kinds.append((kind, n, bytes_of))
    budget = weights_gpu_fraction * sum(n * p.layer_bytes for _, n, p in kinds) * (1 + _TOLERANCE)
    placed = [[False, 0] for _ in kinds]
    for i, what, nbytes in _items(kinds):
        if nbytes > budget:
            break
        budget -= nbytes
        if what == "dense":
            placed[i][0] = True
        else:
            placed[i][1] += 1
    kinds = tuple(
        (kind, n, dataclasses.replace(p, dense_resident=d, resident_experts=e))
        for (kind, n, p), (d, e) in zip(kinds, placed, strict=True)
    )
    return ModelPlacement(arch=arch, kinds=kinds)


def slot_bytes(arch: ModelArch, weight_dtype: str, *, stored: bool = True) -> float:
    """S with a layer's streamed bytes at most (1 - r_w) * S at any placed r_w: what the planner
    counts per page slot. One kind: S = W_l. With dense layers (their items placed first):
    a sparse layer streams at most (1 - r_w) * (all layers' bytes) / (sparse layers), and a
    dense layer streams only while r_w < f, the fraction that places every dense layer whole.
    In stored bytes (the slots pages land in), or as computed (stored=False: the 16-bit slot a
    compact format is dequantized into); a kind's streamed part is stored at most at its
    layer's ratio, since its dense part, the one with 16-bit tensors, is placed first."""
    kinds = place_model(arch, 0.0, weight_dtype).kinds
    total = sum(n * p.layer_bytes for _, n, p in kinds)
    bound = 0.0
    for kind, n, p in kinds:
        ratio = p.stored_ratio if stored else 1.0
        if not kind.ffn_is_dense:
            bound = max(bound, ratio * total / n)
            continue
        full = sum(m * q.dense_bytes for _, m, q in kinds) + n * p.num_experts * p.expert_bytes
        whole = p.layer_bytes / (1 - full / total) if full < total else p.layer_bytes
        bound = max(bound, ratio * whole)
    return bound


def streamed_tensors(arch: ModelArch, placement: WeightPlacement) -> list[tuple[tuple, tuple]]:
    """One layer's streamed tensors in arena order: (key, shape); key (name,) for a dense
    tensor, (expert, name) for an expert's."""
    names: list[tuple[tuple, tuple[int, ...]]] = []
    if not placement.dense_resident:
        names += [((n,), shape) for n, shape in dense_shapes(arch).items()]
    for e in placement.streamed_experts:
        names += [((e, n), shape) for n, shape in expert_shapes(arch).items()]
    return names


def cut_pages(sizes: list[int], pages: int) -> list[tuple[int, int]]:
    """Ranges of `pages` pages of near-equal size over tensors of `sizes` (elements or bytes),
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
    """The largest page of a layer streamed whole in `pages` pages, over the kinds of layer:
    the ring's page size."""
    largest, half = 0, int(compute_bytes(weight_dtype))
    for kind, _, placement in place_model(arch, 0.0, weight_dtype).kinds:
        sizes = [
            stored_bytes(key[-1], shape, weight_dtype, half)
            for key, shape in streamed_tensors(kind, placement)
        ]
        largest = max(largest, max(end - start for start, end in cut_pages(sizes, pages)))
    return float(largest)
