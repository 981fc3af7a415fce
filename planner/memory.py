"""Memory per device: every buffer the executor allocates, as affine functions of the placement.

Each buffer is a coefficient vector over the placement basis v = (1, A_g, F_g, r_w, r_c, r_d)
(see planner/cost.py; r_d: the share of the weights a disk tier keeps on disk), so the same
numbers feed the MILP's memory constraints, the closed-form search and the footprint a Plan
reports. N (batch) may be a numpy array: the search evaluates a whole row
of batch sizes at once.

Letters: L = layers, W_l = one layer's weight bytes (attention, router, norms and all experts;
with dense layers among sparse ones, the mean layer's),
N = sequences, mu = micro-batch, S = prompt tokens per sequence (maximum), C = maximum context
(S + generation), h = hidden, i = expert width, k = top-k, V = vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from hrm.arch import ModelArch
from hrm.formats import is_compact
from hrm.policy import compute_bytes, dtype_bytes
from hrm.roofline.ops import ACTIVATION_DTYPE
from hrm.rules.placement import PREFILL_CHUNK_TOKENS, place_model, slot_bytes
from hrm.workload import Workload

# The one headroom: plans use at most this fraction of each device's memory; the rest is left for
# the CUDA context, allocator fragmentation and the operating system.
USABLE_MEMORY_FRACTION = 0.9


ONE, ATT, FFN, RW, RC, RD = range(6)
BASIS = 6


def placement_vector(*, one=0.0, att=0.0, ffn=0.0, rw=0.0, rc=0.0, rd=0.0) -> np.ndarray:
    """Coefficients over the basis (1, A_g, F_g, r_w, r_c, r_d); r_d: the weights on disk."""
    return np.array([one, att, ffn, rw, rc, rd], dtype=float)


@dataclass(frozen=True, kw_only=True)
class WeightBytes:
    """Bytes of the model's weights by where they can live."""

    layer: float  # W_l: everything one layer holds as computed (what is resident on the GPU)
    stored: float  # W_l as stored in host memory and streamed page by page (compact formats)
    slot: float  # S: a page slot holds at most (1 - r_w) * S (hrm.rules.placement.slot_bytes)
    # a compact format's one 16-bit slot, which the GPU dequantizes a streamed layer into
    # (at most (1 - r_w) * this); 0 when the layers compute the stored weights as they are
    dequantized_slot: float
    head: float  # final norm + LM head: on the device that runs the layers
    embedding: float  # the token embedding: always in CPU memory (a gather, then h2d)
    num_layers: int

    @classmethod
    @functools.lru_cache(maxsize=256)  # per (arch, dtype): the search and pricing ask it often
    def of(cls, arch: ModelArch, weight_dtype: str) -> WeightBytes:
        wdt = compute_bytes(weight_dtype)
        layer = arch.layers_params * wdt / arch.num_layers
        ratio = place_model(arch, 0.0, weight_dtype).stored_ratio
        return cls(
            layer=layer,
            stored=layer * ratio,
            slot=slot_bytes(arch, weight_dtype),
            dequantized_slot=slot_bytes(arch, weight_dtype, stored=False) if ratio < 1 else 0.0,
            head=(arch.lm_head_params + arch.hidden_size) * wdt,
            embedding=arch.embedding_params * wdt,
            num_layers=arch.num_layers,
        )


@dataclass(frozen=True, kw_only=True)
class MemoryTerms:
    """Buffers on each device: name -> coefficients over the placement basis (shape [..., 6])."""

    gpu: dict[str, np.ndarray]
    cpu: dict[str, np.ndarray]
    disk: dict[str, np.ndarray]  # the weights a disk tier keeps there (not a capacity: a read)

    def gpu_total(self) -> np.ndarray:
        return sum(self.gpu.values())

    def cpu_total(self) -> np.ndarray:
        return sum(self.cpu.values())


def kv_cache_bytes(arch: ModelArch, workload: Workload, batch_size, kv_dtype: str):
    """KV = N * C * 2 * L * nkv * d * dt: a rectangular cache, every sequence sized for the
    longest context (the paper's artifact does the same; the executor allocates [N, C]), a
    sliding layer's for its window (the executor keeps it as a ring: ModelArch.mean_keys)."""
    slots = arch.mean_keys(workload.max_context_len)  # per layer, on average
    return batch_size * slots * arch.kv_bytes_per_token(kv_dtype)


def workspace_bytes(arch: ModelArch, workload: Workload, micro_batch_size: int) -> float:
    """Largest transient of one prefill chunk (executor/model.py): its QKV and attention output;
    the experts' routed token copies and their outputs (2 k h) with one expert's SiLU(gate), up
    and their product (3 i) for at most all of the chunk's tokens; or the norm's two fp32 copies
    of its hidden states (2 h * 4 bytes a token). Plus the fp32 logits of one micro-batch
    (mu * V * 4)."""
    adt = dtype_bytes(ACTIVATION_DTYPE)
    chunk = min(micro_batch_size * workload.prompt_len_max, PREFILL_CHUNK_TOKENS)
    per_token = max(
        (arch.q_size + arch.attention_output_size + arch.kv_width) * adt,
        *(
            (2 * k.experts_per_token * k.hidden_size + 3 * k.intermediate_size) * adt
            for k, _ in arch.layer_kinds()
        ),
        2 * arch.hidden_size * 4.0,
    )
    return chunk * per_token + micro_batch_size * arch.vocab_size * 4.0


def prefill_tensors_bytes(
    arch: ModelArch, workload: Workload, micro_batch_size: int, gpu_count: int = 1
) -> float:
    """What one micro-batch's prefill holds whole (T = mu * S tokens; chunking bounds only the
    GEMMs' transients), per device: its hidden states (h), Q/K/V (q + kv, ModelArch.kv_width,
    kept until the next layer), and at the peak of one of three moments:
    - pre-attention's chunks and their concatenation: a second Q/K/V;
    - attention: the padded queries, SDPA's output and the output gathered back (q + 2 out,
      ModelArch.attention_output_size);
    - post-attention: the attention output, and the new hidden states' chunks and concatenation
      (out + 2 h).
    Over g GPUs in tensor parallel each holds its 1/g of the heads and the whole h (and the whole
    latent of latent attention, which every head reads)."""
    h, g = arch.hidden_size, gpu_count
    q, out = arch.q_size / g, arch.attention_output_size / g
    kv = arch.kv_width / (1 if arch.kv_lora_rank else g)
    held = h + q + kv
    peak = max(q + kv, q + 2 * out, out + 2 * h)
    tokens = micro_batch_size * workload.prompt_len_max
    return tokens * (held + peak) * dtype_bytes(ACTIVATION_DTYPE)


def activation_tokens(
    arch: ModelArch,
    workload: Workload,
    *,
    batch_size: int,
    micro_batch_size: int,
    ffn_on_gpu: bool,
) -> int:
    """The most tokens one continuous pass may carry (its decodes and prompt chunks), so that
    their hidden states, held between layers, fit what memory_terms counts for a static plan at
    (N, mu): where the GPU runs the layers, a pass's micro-batches are the static ones (at most
    mu sequences, mu prompts' tokens) and their hidden states go to the host between layers, as
    N prompts' do (the hidden-state offload, N * S); where the CPU runs them, the whole pass's
    stay in the CPU's activations (N decodes' residual stream, or one micro-batch's prefill)."""
    if ffn_on_gpu:
        return batch_size * workload.prompt_len_max
    stream = arch.hidden_size * dtype_bytes(ACTIVATION_DTYPE)
    held = max(batch_size * stream, prefill_tensors_bytes(arch, workload, micro_batch_size))
    return int(held // stream)


def memory_terms(
    arch: ModelArch,
    workload: Workload,
    *,
    batch_size,
    micro_batch_size: int,
    weight_dtype: str,
    kv_dtype: str,
    gpu_count: int = 1,
) -> MemoryTerms:
    """Every buffer of a run with N = batch_size (scalar or array) and mu = micro_batch_size.

    Over g GPUs in tensor parallel, weights, KV cache and expert intermediates are sharded (the
    totals stay), while each GPU holds the whole residual stream: activations count g times."""
    n = np.asarray(batch_size, dtype=float)[..., None]  # [..., 1] broadcasts against the basis
    mu = float(micro_batch_size)
    adt = dtype_bytes(ACTIVATION_DTYPE)
    w = WeightBytes.of(arch, weight_dtype)
    layers, stored = w.num_layers * w.layer, w.num_layers * w.stored
    kv = kv_cache_bytes(arch, workload, n, kv_dtype)
    h, s_max = arch.hidden_size, workload.prompt_len_max

    # residual stream of all N sequences between layers (decode), or one micro-batch's prefill
    def activations_of(g: int):  # on each of g devices: decode's residual stream, or prefill
        return np.maximum(n * h * adt, prefill_tensors_bytes(arch, workload, micro_batch_size, g))

    activations = activations_of(1)
    workspace = workspace_bytes(arch, workload, micro_batch_size)
    # D1 (QKV to the CPU) and D2 (attention output back), double-buffered per micro-batch
    staging = 2 * mu * (arch.q_size + arch.attention_output_size + arch.kv_width) * adt
    prefetch = (
        2 * mu * workload.max_context_len * arch.kv_bytes_per_token(kv_dtype) / arch.num_layers
    )
    # CPU decode attention scores of one micro-batch at the longest context, fp32
    cpu_attention_scores = mu * arch.num_attention_heads * workload.max_context_len * 4.0
    # a compact KV cache is attended through a 16-bit copy of one micro-batch's K and V of a
    # layer (executor/kv_cache.py, view): on the device that attends
    kv_copy = mu * workload.max_context_len * arch.kv_width * adt if is_compact(kv_dtype) else 0
    v = placement_vector
    kv_copies = gpu_count if arch.kv_lora_rank else 1
    gpu = {
        # r_w * L * W_l: the resident part of every layer
        "resident weights": v(rw=layers) * np.ones_like(n),
        # 2 * (1 - r_w) * S when the GPU runs the layers: current and next layer's pages
        "paged buffer": v(ffn=2 * w.slot, rw=-2 * w.slot) * np.ones_like(n),
        "lm head": v(ffn=w.head) * np.ones_like(n),
        # r_c * KV; latent attention's on each of g GPUs, whose heads all read the whole latent
        "kv cache": v(rc=kv_copies) * kv,
        # A_g * 2 * mu * C * 2 * nkv * d * dt: under GPU attention, two (layer, micro-batch)
        # slices of the host part of the cache being copied in. Needed whenever r_c < 1, so the
        # affine form counts it always; a plan at r_c = 1 reports 0 (planner/evaluate.footprint)
        "kv prefetch": v(att=prefetch * kv_copies) * np.ones_like(n),
        "activations": v(ffn=gpu_count) * activations_of(gpu_count),
        "workspace": v(ffn=workspace + kv_copy) * np.ones_like(n),
    }
    if w.dequantized_slot:  # a compact format: (1 - r_w) * S16, the 16-bit slot computed from
        gpu["dequantized layer"] = v(ffn=w.dequantized_slot, rw=-w.dequantized_slot) * np.ones_like(
            n
        )
    cpu = {
        # (1 - r_w - r_d) * L * W_l as stored, pinned so that pages go straight to the GPU
        "layer weights": v(one=stored, rw=-stored, rd=-stored) * np.ones_like(n),
        # the disk tier's pinned reads: two layers' disk parts, 2 * r_d * W_l (one being sent on
        # while the next is read)
        "disk staging": v(rd=2 * w.stored) * np.ones_like(n),
        # embedding always; the LM head too when the CPU runs the layers
        "embedding and head": v(one=w.embedding + w.head, ffn=-w.head) * np.ones_like(n),
        # (1 - r_c) * KV
        "kv cache": v(one=1.0, rc=-1.0) * kv,
        # prefill hidden states of all N sequences, offloaded between layers (N * S * h)
        "hidden-state offload": v(ffn=1.0) * (n * s_max * h * adt),
        "pinned staging": v(ffn=staging, att=-staging) * np.ones_like(n),
        # when the CPU runs the layers its activations and workspace live here instead
        "activations and workspace": v(one=1.0, ffn=-1.0) * (activations + workspace)
        + v(one=cpu_attention_scores + kv_copy, att=-cpu_attention_scores - kv_copy)
        * np.ones_like(n),
    }
    return MemoryTerms(gpu=gpu, cpu=cpu, disk={"weights": v(rd=stored) * np.ones_like(n)})


def usable_bytes(total_bytes: float) -> float:
    return USABLE_MEMORY_FRACTION * total_bytes
