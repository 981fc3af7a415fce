"""Per-layer operations of an MoE transformer with their FLOPs and bytes (reference, section 1).

Each Op says how much arithmetic it does and how many bytes it reads, split by kind (weights,
KV cache, activations) because the kinds live on different levels: where a byte sits decides which
roof binds.  FLOPs count 2 per multiply-accumulate everywhere (GEMMs and attention alike).

Letters: b = sequences, s = new tokens per sequence (1 in decode), c = context (keys per query),
h = hidden, i = expert width, nq/nkv = query/key-value heads, d = head dim, E = experts, k = top-k,
V = vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hrm.arch import ModelArch
from hrm.policy import dtype_bytes

ACTIVATION_DTYPE = "bfloat16"


@dataclass(frozen=True, kw_only=True)
class Op:
    name: str
    flops: float
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    activation_bytes: float = 0.0
    # element reads and writes of the elementwise kernels that run after the op's GEMMs (not
    # under them): charged on top of the roofline time at the device's elementwise rate
    elementwise_elements: float = 0.0
    # (d_in, d_out) of each GEMM the executor runs for this op, all at the op's rows: the FLOPs
    # split over them as d_in * d_out, so that each is priced at its own shape's measured curve
    gemm_shapes: tuple[tuple[int, int], ...] = ()

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte when every byte the op reads comes from one memory level."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def scaled(self, factor: float) -> Op:
        """The same op repeated `factor` times (e.g. over layers)."""
        return Op(
            name=self.name,
            flops=self.flops * factor,
            weight_bytes=self.weight_bytes * factor,
            kv_bytes=self.kv_bytes * factor,
            activation_bytes=self.activation_bytes * factor,
            elementwise_elements=self.elementwise_elements * factor,
            gemm_shapes=self.gemm_shapes,
        )

    def gemm_flops(self) -> list[tuple[tuple[int, int], float]]:
        """(shape, FLOPs) of each of the op's GEMMs: FLOPs_j = FLOPs * in_j*out_j / sum in*out."""
        total = sum(d_in * d_out for d_in, d_out in self.gemm_shapes)
        return [(shape, self.flops * shape[0] * shape[1] / total) for shape in self.gemm_shapes]


def expected_distinct_experts(arch: ModelArch, tokens: float) -> float:
    """Experts a group of `tokens` touches under uniform routing: E * (1 - (1 - k/E)^tokens)."""
    e, k = arch.num_experts, arch.experts_per_token
    if np.ndim(tokens):  # a count per decode step (planner/layer_seconds.py)
        return e * (1.0 - (1.0 - k / e) ** np.maximum(tokens, 0.0))
    return e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))


def _linear(
    name: str, tokens: float, shapes: tuple[tuple[int, int], ...], wdt: float, adt: float
) -> Op:
    """GEMMs over the same `tokens` rows, one per (d_in, d_out) in `shapes`.
    FLOPs = 2 * T * sum d_in * d_out;  bytes = weights + input (once) + outputs."""
    d_in = shapes[0][0]
    return Op(
        name=name,
        flops=2.0 * tokens * sum(i * o for i, o in shapes),
        weight_bytes=sum(i * o for i, o in shapes) * wdt,
        activation_bytes=tokens * (d_in + sum(o for _, o in shapes)) * adt,
        gemm_shapes=shapes,
    )


def attention_op(
    arch: ModelArch, *, batch: float, new_tokens: float, context: float, kv_dtype: str
) -> Op:
    """Scaled dot-product attention, projections excluded.

    Decode (s = 1): FLOPs = 4*b*c*nq*d (QK^T and PV, 2 per MAC) + 5*b*c*nq (softmax);
    bytes = dt*(2*b*nq*d) for q and the output + dt*(2*b*c*nkv*d) for K and V (reference, section 1;
    the paper's formula counts the two matmuls in MACs, i.e. half these FLOPs).
    Prefill (s <= c, causal): query i of the s sees the c - s keys before the chunk and i + 1 of
    its own, c - (s-1)/2 on average ((s+1)/2 for a whole prompt, s = c; more for a later chunk
    of a prompt cut across passes, whose earlier tokens are in the cache).
    A sliding layer's query reads at most its window: decode's c is the mean over the layers of
    the keys each reads (ModelArch.mean_keys), what the executor's decode attention reads.
    """
    adt = dtype_bytes(ACTIVATION_DTYPE)
    # a key row of d and a value row of dv (latent attention: the latent and rotary key, and the
    # latent alone, one head of them read by every query head: ModelArch.kv_lora_rank)
    nq, d, dv = arch.num_attention_heads, arch.head_dim, arch.value_dim
    # keys a query reads in decode; a prefill reads and writes every slot of its prompts
    keys = arch.mean_keys(context) if new_tokens == 1 else context
    keys_per_query = keys if new_tokens == 1 else context - (new_tokens - 1) / 2.0
    pairs = batch * new_tokens * keys_per_query  # (query, key) pairs per head
    return Op(
        name="attention",
        flops=2.0 * pairs * nq * (d + dv) + 5.0 * pairs * nq,
        kv_bytes=batch * keys * arch.kv_token_bytes(kv_dtype),
        activation_bytes=batch * new_tokens * nq * (d + dv) * adt,
    )


def prefill_attention_flops(
    arch: ModelArch, *, batch: float, length: float, keys: float | None = None
) -> float:
    """FLOPs the executor's prefill attention computes for `batch` prompts padded to `length`:
    with an explicit causal-and-padding mask SDPA computes every (query, key) pair of the L x L
    square (executor/attention.py, store_and_attend_prompts), 4*b*L^2*nq*d for QK^T and PV (2
    per MAC) + 5*b*L^2*nq for the softmax, as attention_op counts a pair. The causal count
    attention_op gives is about half of this at uniform prompts, and a ragged batch pads to its
    longest prompt. `keys`: a later chunk's L queries over the keys before it and its own
    (default L), the L x keys rectangle its masked attention computes."""
    keys = length if keys is None else keys
    pairs, nq = batch * length * keys, arch.num_attention_heads
    return 2.0 * pairs * nq * (arch.head_dim + arch.value_dim) + 5.0 * pairs * nq


def expert_ffn_op(
    arch: ModelArch, *, tokens: float, weight_dtype: str, group_tokens: float | None = None
) -> Op:
    """Routed experts over `tokens` tokens.

    FLOPs = 6 * T * h * i * k (three projections per active expert, reference section 1).
    Weight bytes = distinct experts touched * 3*h*i*dt; a kernel launched per micro-batch of
    `group_tokens` tokens reads the experts that micro-batch touches, once per micro-batch.
    Elementwise passes: routed_expert_op's per assignment (A = T*k of them), plus the output's
    per token (ffn_output_elements).
    """
    group = tokens if group_tokens is None else group_tokens
    if np.ndim(group):  # a size per decode step (planner/layer_seconds.py)
        groups = np.divide(tokens, group, out=np.zeros(np.shape(group)), where=group != 0)
    else:
        groups = tokens / group if group else 0.0
    # every assignment counts as one row of one expert; each touched expert's weight once
    rows = routed_expert_op(arch, rows=tokens * arch.experts_per_token, weight_dtype=weight_dtype)
    return dataclasses.replace(
        rows,
        weight_bytes=groups * expected_distinct_experts(arch, group) * rows.weight_bytes,
        elementwise_elements=rows.elementwise_elements + ffn_output_elements(arch, tokens),
    )


def expert_gemm_shapes(arch: ModelArch) -> tuple[tuple[int, int], ...]:
    """(d_in, d_out) of w1, w3, then w2, as the executor runs them (executor/model.py, experts)."""
    h, i = arch.hidden_size, arch.intermediate_size
    return ((h, i), (h, i), (i, h))


def fused_expert_gemm_shapes(arch: ModelArch) -> tuple[tuple[int, int], ...]:
    """(d_in, d_out) of the fused kernel's two calls (executor/fused_moe.py): w1 and w3 as the
    two parts of one weight, then w2."""
    h, i = arch.hidden_size, arch.intermediate_size
    return ((h, 2 * i), (i, h))


def routed_expert_op(
    arch: ModelArch, *, rows: float, weight_dtype: str, fused: bool = False, glu_in_tiles=False
) -> Op:
    """One expert over the `rows` tokens routed to it: its three GEMMs at those rows (fused: as
    the fused kernel's two calls run them, gate and up stacked; hrm.rules.cpu_moe), its whole
    weight read once, and the elementwise passes of the executor's grouped FFN per assignment:
    the gate silu(a)*b, 5*i (2 for silu, 3 for the product; none where the kernel's tiles
    compute it, glu_in_tiles); the gather of inputs, the copy of outputs, the scale by the
    router weight and its rounding, 2*h each; index_add_'s read, h."""
    wdt, adt = dtype_bytes(weight_dtype), dtype_bytes(ACTIVATION_DTYPE)
    h, i = arch.hidden_size, arch.intermediate_size
    glu = 0 if glu_in_tiles else 5 * i
    return Op(
        name="expert_ffn",
        flops=6.0 * rows * h * i,
        weight_bytes=arch.expert_params * wdt,
        activation_bytes=rows * (2 * h + 3 * i) * adt,
        elementwise_elements=rows * (glu + 9 * h),
        gemm_shapes=fused_expert_gemm_shapes(arch) if fused else expert_gemm_shapes(arch),
    )


def ffn_output_elements(arch: ModelArch, tokens: float) -> float:
    """The routed FFN's output, zeroed and then read-modify-written: 3*T*h element passes."""
    return 3 * tokens * arch.hidden_size


def layer_ops(
    arch: ModelArch,
    *,
    batch: float,
    new_tokens: float,
    context: float,
    weight_dtype: str = "bfloat16",
    kv_dtype: str = "bfloat16",
    ffn_group_tokens: float | None = None,
) -> list[Op]:
    """One transformer layer for `batch` sequences adding `new_tokens` each at `context` keys.

    Decode: new_tokens = 1, context = current length. Prefill: new_tokens = context = prompt length,
    or for a later chunk of a prompt, context = the chunk's end.
    """
    if arch.dense_layers and not arch.ffn_is_dense:
        raise ValueError(f"{arch.name}: layer_ops takes one kind of layer (layer_kinds)")
    wdt, adt = dtype_bytes(weight_dtype), dtype_bytes(ACTIVATION_DTYPE)
    t = batch * new_tokens
    h = arch.hidden_size
    # the layer's elementwise passes outside the FFN and attention (executor/model.py), charged
    # with the norms: two RMSNorms in fp32 (upcast, square, mean, scale, round, weight: 11*t*h
    # each), two residual adds (3*t*h each), rotary on q and k (negate, concatenate, two
    # products, a sum: 12 per element), and where the family has them q/k RMSNorms (11 per
    # element of q and k) and q/k/v bias adds (3 per element)
    qk = arch.q_size + arch.kv_size
    # rotary's elements: q and k whole, or latent attention's rotary parts only
    rotated = (arch.num_attention_heads + 1) * arch.rotary_dim if arch.kv_lora_rank else qk
    before, after = arch.attention_linears()
    ops = [
        Op(
            name="norms",
            flops=2 * 4.0 * t * h + (4.0 * t * qk if arch.qk_norm else 0.0),
            weight_bytes=(arch.norm_params + arch.qk_norm_params) * wdt,
            activation_bytes=2 * 2.0 * t * h * adt,
            elementwise_elements=28.0 * t * h
            + 12.0 * t * rotated
            + (11.0 * t * qk if arch.qk_norm else 0.0)
            + (3.0 * t * (qk + arch.kv_size) if arch.attention_bias else 0.0),
        ),
        # q, k and v are three GEMMs in the executor (executor/model.py, pre_attention); latent
        # attention's own (ModelArch.attention_linears)
        _linear("qkv_proj", t, before, wdt, adt),
        attention_op(arch, batch=batch, new_tokens=new_tokens, context=context, kv_dtype=kv_dtype),
        _linear("o_proj", t, after, wdt, adt),
        expert_ffn_op(arch, tokens=t, weight_dtype=weight_dtype, group_tokens=ffn_group_tokens),
    ]
    if not arch.ffn_is_dense:  # a dense layer's MLP is its one expert, taken without a router
        ops.insert(-1, _linear("router", t, ((h, arch.num_experts),), wdt, adt))
    if arch.shared_expert_params:
        ops.append(shared_expert_op(arch, tokens=t, weight_dtype=weight_dtype))
    return ops


def shared_expert_op(arch: ModelArch, *, tokens: float, weight_dtype: str) -> Op:
    """The shared expert, a dense FFN every token runs, as the executor runs it: w1, w3, w2 and
    (Qwen2-MoE) its sigmoid gate, four GEMMs at every token; its passes: silu(a)*b (5*si), the
    gate's sigmoid and scale (2*h + 3), the add to the routed output (3*h)."""
    h, si = arch.hidden_size, arch.shared_expert_intermediate_size
    gated = arch.shared_expert_gate
    op = _linear(
        "shared_expert",
        tokens,
        ((h, si), (h, si), (si, h), (h, 1))[: 4 if gated else 3],
        dtype_bytes(weight_dtype),
        dtype_bytes(ACTIVATION_DTYPE),
    )
    passes = 5.0 * si + 3.0 * h + (2.0 * h + 3.0) * gated
    return dataclasses.replace(op, elementwise_elements=tokens * passes)


def lm_head_op(arch: ModelArch, *, batch: float, weight_dtype: str = "bfloat16") -> Op:
    """Final norm + LM head for the last position of each sequence (once per step)."""
    wdt, adt = dtype_bytes(weight_dtype), dtype_bytes(ACTIVATION_DTYPE)
    return _linear("lm_head", batch, ((arch.hidden_size, arch.vocab_size),), wdt, adt)


def gemm_shapes(arch: ModelArch) -> tuple[tuple[int, int], ...]:
    """Every distinct (d_in, d_out) GEMM shape of a forward pass: what hrm profile times."""
    ops = [
        op
        for kind, _ in arch.layer_kinds()
        for op in layer_ops(kind, batch=1, new_tokens=1, context=1)
    ]
    ops.append(lm_head_op(arch, batch=1))
    return tuple(dict.fromkeys(shape for op in ops for shape in op.gemm_shapes))
