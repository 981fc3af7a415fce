"""The executor's CPU attention stages: decode (one new query per sequence against its cached
keys) and prefill (each prompt against itself, causally), and their measurement for hrm profile.

Decode takes many sequences per call, no repeated K/V: the G query heads that share a K/V
head are the rows of one small matrix product ([B, nkv, G, D] against [B, nkv, S, D]), and
ragged sequences' padding slots are masked. Two kernels compute it; bench/bench_cpu_attention.py
times both on the host's data and shapes, and DECODE_KERNEL names the one kept (with the numbers
behind the choice). The thread budget is torch's intra-op threads of the calling thread
(`hrm run --threads`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from executor import small_ops
from executor.kv_cache import KVCache, packed_layout


def sdpa_decode(q, keys, values, mask, scale: float | None = None) -> torch.Tensor:
    """torch's scaled_dot_product_attention with the groups as query rows: [B, nkv, G, D]; the
    scores scaled by `scale` (None: 1/sqrt(D))."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scores(q: torch.Tensor, keys: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q [B, nkv, G, D] against keys [B, nkv, S, D] -> fp32 scores [B, nkv, G, S]. Computed as
    keys @ q^T: with the keys a strided view of the cache, q @ keys^T copied them transposed
    first, and this form took half the time with the same bits (AMX Xeon, bf16: 0.98 against
    2.42 ms at latent attention's 64 x 16 x 576 x 160, 0.29 against 0.60 at gpt-oss's)."""
    if q.shape[-2] >= keys.shape[-2]:  # a prompt's queries: as many rows as the keys
        return torch.matmul(q, keys.transpose(-1, -2)).float() * _scale(q, scale)
    scores = torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2)
    return scores.to(torch.float32, memory_format=torch.contiguous_format) * _scale(q, scale)


def matmul_decode(q, keys, values, mask, scale: float | None = None) -> torch.Tensor:
    """Scores by one batched GEMM, softmax in fp32, then one batched GEMM with V: [B, nkv, G, D]."""
    scores = _scores(q, keys, scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B, nkv, G, S]
    return torch.matmul(probs, values)


def sink_attention(q, keys, values, mask, sinks: torch.Tensor, scale=None) -> torch.Tensor:
    """Attention with a learned logit per query row in each softmax's denominator (gpt-oss's
    sinks, [nkv, rows]): the sink takes its share of the probability and adds no value. On the
    CPU, torch's flash attention also returns each row's log-sum-exp L of its scores, and the
    sink s scales that row's output by e^L / (e^L + e^s) = sigmoid(L - s): 0.69 against 1.50 ms
    for the scores computed apart at gpt-oss's 64 x 2 x 8 x 64 x 160 (AMX Xeon, bf16), within
    one bf16 step of them. Elsewhere the scores are computed apart (eager_sink_attention)."""
    if q.device.type != "cpu":
        return eager_sink_attention(q, keys, values, mask, sinks, scale)
    bias = None
    if mask is not None:  # the kernel takes an additive mask in q's dtype
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, attn_mask=bias, scale=scale
    )  # out [B, nkv, rows, Dv], lse [B, nkv, rows] fp32
    share = torch.sigmoid(lse - sinks.to(torch.float32))
    return (out.float() * share[..., None]).to(values.dtype)


def eager_sink_attention(q, keys, values, mask, sinks, scale=None) -> torch.Tensor:
    """sink_attention with the scores computed apart, the sink joining each row's softmax and
    the probabilities rounded to the model's dtype before the values, as transformers' eager
    attention does. Prompts attend so: the first token is the one a run is compared by, and the
    flash form moved it (bf16 gpt-oss bench shape: the same first token as transformers in 84%
    of sequences, against 89% so)."""
    scores = _scores(q, keys, scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.device, torch.float32)[None, :, :, None]
    combined = torch.cat((scores, sink.expand(scores.shape[0], -1, -1, 1)), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)  # [B, nkv, rows, S + 1]
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(values.dtype)
    return torch.matmul(probs, values)


def last_window(keys, values, mask, window: int | None):
    """The last `window` slots of a decode step's keys, values and mask (None: all of them): a
    sliding layer reads no more."""
    if window is None or keys.shape[2] <= window:
        return keys, values, mask
    mask = None if mask is None else mask[..., -window:]
    return keys[:, :, -window:], values[:, :, -window:], mask


def native_decode(q, keys, values, mask, scale: float | None = None) -> torch.Tensor:
    """small_ops.decode_attention where it serves (an AMX host, bf16, the heads it takes), else
    the kernel the head's width picks. At the bench's decode steps, 64 sequences against ~90
    keys, it took 0.32 against SDPA's 0.63-0.71 ms at Mixtral's 4 x 4 heads of 64 and 0.45
    against 0.55-0.68 at Qwen3-MoE's 2 x 8 of 128 (AMX Xeon; docs/decisions.md, 2026-12-07)."""
    if small_ops.serves_decode(q, keys, values, mask):
        return small_ops.decode_attention(q, keys, values, mask, _scale(q, scale))
    return DECODE_KERNELS[_by_width(q.shape[-1])](q, keys, values, mask, scale)


def decode_kernel(arch, dtype: str) -> str | None:
    """The decode kernel a default CPU run of `arch` in `dtype` takes (None: by the head's
    width): native where its experts run fused (MoEModel.attention_terms) on an AMX host."""
    from executor import fused_moe

    if dtype == "bfloat16" and fused_moe.missing(arch, dtype) is None and small_ops.amx_attention():
        return "native"
    return None


def _by_width(d: int) -> str:
    return "matmul" if d > SDPA_MAX_HEAD_DIM else DECODE_KERNEL


DECODE_KERNELS = {"sdpa": sdpa_decode, "matmul": matmul_decode, "native": native_decode}
# Kept: SDPA. bench/bench_cpu_attention.py on the 2-core Sapphire Rapids VM (2026-12-01,
# Mixtral's 32/8 heads, batch 1-32, context 128-2048, bf16 and fp32): SDPA faster in 16 of 18
# cases (up to 3.3x at batch 1, 1.34x at fp32 32x2048); the batched GEMMs won twice by 3-4%,
# within the VM's noise. reports/bench_cpu_attention.json has the table.
DECODE_KERNEL = "sdpa"
# Beyond this head dimension a decode step runs the batched GEMMs: latent attention's 576
# (DeepSeek's 512 latent + 64 rotary, 16 queries a key row) took SDPA 14.1 against 2.4 ms at
# batch 64 x 192 keys, 86.7 against 19.3 at 64 x 512 and 35.9 against 4.3 at 8 x 2048, the same
# at batch 1 (AMX Xeon, bf16); Mixtral's 128 stays SDPA's (docs/decisions.md, 2026-12-07).
SDPA_MAX_HEAD_DIM = 256


def attend_one_step(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    kernel: str | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, nq, D], keys [B, nkv, S, D] and values [B, nkv, S, Dv], mask [B, 1, 1, S] or None
    -> [B, nq*Dv]; a sliding layer's `window`, gpt-oss's `sinks` [nq] and the scores' `scale`
    (None: 1/sqrt(D)) where the layer has them. kernel: DECODE_KERNELS' name (None: by the head
    dimension, SDPA_MAX_HEAD_DIM)."""
    B, nkv, D = q.shape[0], keys.shape[1], q.shape[-1]
    if kernel is None:
        kernel = _by_width(D)
    keys, values, mask = last_window(keys, values, mask, window)
    q = q.view(B, nkv, -1, D)
    if sinks is not None:
        out = sink_attention(q, keys, values, mask, sinks.view(nkv, -1), scale)
    else:
        out = DECODE_KERNELS[kernel](q, keys, values, mask, scale)  # [B, nkv, G, Dv]
    return out.reshape(B, -1)


def append_and_attend(
    cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw
) -> torch.Tensor:
    """The executor's decode attention stage: write this step's K/V [B, nkv, D] at slot
    `cache.length`, then attend q [B, nq, D] to slots [0, length] of the preallocated cache
    (strided views, the padding mask where there is one) -> [B, nq*D]; `kw` as
    attend_one_step's window and sinks."""
    cache.write_step(layer, k, v)
    end = cache.length + 1
    keys, values = cache.view(layer, end)  # [B, nkv, end (a ring: its filled slots), D]
    return attend_one_step(q, keys, values, cache.mask(end, keys.device, layer), **kw)


def store_and_attend_prompts(
    cache: KVCache,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The executor's prefill attention stage: store the packed prompts' K/V at (batch_idx,
    slot_idx) and attend causally, packed q [T, nq, D] -> [T, nq*Dv]; a sliding layer's queries
    see the last `window` slots, gpt-oss's `sinks` [nq] join each softmax, and `scale` scales
    the scores (None: 1/sqrt(D)).

    Grouped-query attention without repeating K/V: the G query heads that share a K/V head are
    stacked along the query axis ([B, nkv, G*L, D]) with the causal mask repeated per group, so
    one SDPA call reads each K/V head once. With an explicit mask SDPA computes every (query,
    key) pair of the padded L x L square (hrm.roofline.ops.prefill_attention_flops counts that).
    """
    cache.write_prompts(layer, k, v, batch_idx, slot_idx)
    B, L = cache.key_valid.shape[0], cache.length
    nkv, D = k.shape[1], q.shape[-1]
    G = q.shape[1] // nkv
    q_pad = q.new_zeros(B, L, nkv, G, D)
    q_pad[batch_idx, slot_idx] = q.view(-1, nkv, G, D)  # [B, L, nkv, G, D]
    q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(B, nkv, G * L, D)  # [B, nkv, G*L, D]
    if layer in cache.rings:  # the ring keeps the window; the prompts attend over all slots
        keys = k.new_zeros(B, nkv, L, D)
        values = torch.zeros_like(keys)
        keys[batch_idx, :, slot_idx] = cache.values(cache.stored(k))  # as the cache rounds them
        values[batch_idx, :, slot_idx] = cache.values(cache.stored(v))  # (no latent: no ring)
    else:
        keys, values = cache.view(layer, L)  # [B, nkv, L, D]
    mask = _prefill_mask(cache, G, keys.device, window)
    if sinks is not None:  # each of the G heads' sink on its L query rows
        rows = sinks.view(nkv, G, 1).expand(nkv, G, L).reshape(nkv, G * L)
        out = eager_sink_attention(q_pad, keys, values, mask, rows, scale)
    else:
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale)
    # out: [B, nkv, G*L, Dv]
    out = out.view(B, nkv, G, L, -1).permute(0, 3, 1, 2, 4)  # [B, L, nkv, G, Dv]
    return out[batch_idx, slot_idx].reshape(q.shape[0], -1)  # [T, nq*Dv]


def _prefill_mask(
    cache: KVCache, groups: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """[B or 1, 1, G*L, L]: causal (within the last `window` slots where given), padding keys
    hidden; padding queries see themselves."""
    L = cache.length
    slots = torch.arange(L, device=device)
    causal = slots[None, :] <= slots[:, None]  # [L, L]
    if window is not None:
        causal &= slots[:, None] - slots[None, :] < window
    if cache.has_padding:
        diagonal = slots[None, :] == slots[:, None]
        allowed = causal & (cache.valid_on(device)[:, None, :L] | diagonal)  # [B, L, L]
    else:
        allowed = causal[None]  # [1, L, L]
    return allowed[:, None].expand(-1, groups, L, L).reshape(allowed.shape[0], 1, groups * L, L)


# (batch, context) of the points `hrm profile` times: K and V read per call from about half a
# megabyte to a quarter of a gigabyte at Mixtral's 8 KV heads of 128 in bf16
CURVE_POINTS = ((1, 128), (1, 1024), (8, 1024), (8, 4096), (16, 4096))
QUICK_CURVE_POINTS = CURVE_POINTS[:4]
# each point cycles over copies of its K/V totalling at least this, so that small calls read
# memory as a decode step's layers do, not a cache that holds them
ROTATE_BYTES = 512e6


# the latent attention a profile's latent curve is timed at where its model has none:
# DeepSeek-V2-Lite's 16 heads over one row a token of a 512 latent and a 64 rotary key
LATENT_REFERENCE = {"num_attention_heads": 16, "kv_lora_rank": 512, "rotary_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128}  # fmt: skip


def latent_reference(arch):
    """arch where its attention is latent, else arch with LATENT_REFERENCE's, every layer
    full and without sinks (gpt-oss's rings would read less than the bytes counted): what
    `hrm profile` times the latent attention curve at (hrm.hardware.parts:
    latent_attention_curves)."""
    if arch.kv_lora_rank:
        return arch
    head_dim = LATENT_REFERENCE["kv_lora_rank"] + LATENT_REFERENCE["rotary_dim"]
    return dataclasses.replace(arch, num_key_value_heads=1, head_dim=head_dim, q_lora_rank=0,
                               sliding_window=None, sliding_layers=(), attention_sinks=False,
                               **LATENT_REFERENCE)  # fmt: skip


def measure_attention_curve(
    arch,
    dtype: str = "bfloat16",
    *,
    quick: bool = False,
    rotate_bytes: float = ROTATE_BYTES,
    kv_format: str | None = None,
    kernel: str | None = None,
):
    """The achieved K/V read rate of the executor's decode attention stage on this CPU against
    bytes per call (a Curve of bytes -> bytes/s), at the model's heads, a quarter of each batch
    padded to half the context: what the planner charges CPU decode attention at
    (planner/cost.py). Each call is append_and_attend on a KVCache, the append and the strided
    views included: timing contiguous K/V alone was 8-18% fast on an AMX Xeon VM (2026-12-03).
    kv_format: a compact cache (hrm/formats.py), its bytes the stored ones, read and
    dequantized by the stage as a run's are. kernel: attend_one_step's (a run's, decode_kernel)."""
    from hrm.hardware.parts import Curve

    torch_dtype = getattr(torch, dtype)
    nq, nkv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    dv = arch.cached_value_dim
    g = torch.Generator().manual_seed(0)
    points = []
    with torch.inference_mode():
        for batch, context in QUICK_CURVE_POINTS if quick else CURVE_POINTS:
            nbytes = batch * context * arch.kv_token_bytes(kv_format or dtype)
            layers = max(1, math.ceil(rotate_bytes / nbytes))
            cache = KVCache.for_model(
                arch, batch_size=batch, max_len=context, dtype=torch_dtype, num_layers=layers,
                kv_format=kv_format,
            )  # fmt: skip
            for t, width in [*((t, d) for t in cache.k), *((t, dv) for t in cache.v)]:
                t.copy_(cache.stored(torch.randn(*t.shape[:-1], width, generator=g)))
            prompt_lens = torch.full((batch,), context - 1)
            prompt_lens[: max(1, batch // 4)] = (context - 1) // 2
            cache.start(prompt_lens, context - 1)  # each call appends at the last slot

            def tensor(*size):
                return torch.randn(size, generator=g).to(torch_dtype)

            step = (tensor(batch, nq, d), tensor(batch, nkv, d), tensor(batch, nkv, dv))
            points.append((float(nbytes), nbytes / _seconds_per_call(cache, step, kernel)))
    return Curve(points=tuple(points))


def _seconds_per_call(cache: KVCache, step: tuple, kernel: str | None) -> float:
    """Median seconds of one decode attention stage, cycling over the cache's layers."""
    turn = [0]

    def call() -> None:
        append_and_attend(cache, turn[0] % len(cache.k), *step, kernel=kernel)
        turn[0] += 1

    return _median_seconds(call)


def _median_seconds(call, repeats: int = 5) -> float:
    """Median seconds of one call: warm-up, then `repeats` samples of at least 0.05 s."""
    from hrm.profiling.timing import perf_counter_clock, time_calls

    return time_calls(call, clock=perf_counter_clock, repeats=repeats, min_sample_s=0.05).median_s


# (batch, padded prompt length) of the prefill points `hrm profile` times, by FLOPs per call:
# from a few MFLOP to about 140 GFLOP at Mixtral's 32 heads of 128. Many short prompts run
# slower per FLOP than a few longer ones (64 x 64 at 48 GFLOP/s, 4 x 128 at 69, in bf16 at the
# bench model, 2026-12-03), so the batches hrm validate runs (64 prompts of 32-192) have points
PREFILL_CURVE_POINTS = ((1, 32), (4, 128), (64, 64), (16, 256), (64, 192), (8, 1024))
# --quick leaves out the last: at Mixtral 8x7B's heads one call of 8 x 1024 took about 2 s, 4
# calls a dtype; larger calls take the 64 x 192 point's rate (the curve is held flat past it)
QUICK_PREFILL_POINTS = PREFILL_CURVE_POINTS[:-1]


def measure_prefill_attention_curve(arch, dtype: str = "bfloat16", *, quick: bool = False):
    """The achieved FLOP/s of the executor's prefill attention stage on this CPU against the
    FLOPs it computes per call (hrm.roofline.ops.prefill_attention_flops), at the model's heads, a
    quarter of each batch's prompts half as long: what the planner charges CPU prefill attention
    at (planner/cost.py). Each call is store_and_attend_prompts on a KVCache, the K/V store, the
    query scatter and the mask included. quick: fewer points, 3 samples a point, not 5."""
    from hrm.hardware.parts import Curve
    from hrm.roofline.ops import prefill_attention_flops

    torch_dtype = getattr(torch, dtype)
    nq, nkv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    g = torch.Generator().manual_seed(0)
    points = []
    with torch.inference_mode():
        for batch, length in QUICK_PREFILL_POINTS if quick else PREFILL_CURVE_POINTS:
            cache = KVCache.for_model(
                arch, batch_size=batch, max_len=length, dtype=torch_dtype, num_layers=1
            )
            lens = torch.full((batch,), length)
            lens[: batch // 4] = length // 2
            cache.start(lens, length)
            # the executor's own packed layout (left-padded: a prompt of n fills the last n slots)
            packed = packed_layout([[0] * n for n in lens.tolist()], lens, length, "cpu")
            batch_idx, slot_idx = packed["batch_idx"], packed["slot_idx"]
            tokens = int(lens.sum())

            def tensor(*size):
                return torch.randn(size, generator=g).to(torch_dtype)

            dv = arch.cached_value_dim
            step = (tensor(tokens, nq, d), tensor(tokens, nkv, d), tensor(tokens, nkv, dv))

            def call(cache=cache, step=step, batch_idx=batch_idx, slot_idx=slot_idx) -> None:
                store_and_attend_prompts(
                    cache, 0, *step, batch_idx, slot_idx, scale=arch.softmax_scale
                )

            flops = prefill_attention_flops(arch, batch=batch, length=length)
            points.append((flops, flops / _median_seconds(call, 3 if quick else 5)))
    return Curve(points=tuple(points))
