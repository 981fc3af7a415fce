"""Compact weight formats (hrm/formats.py, executor/quant.py): the round trip's bound, the bytes
that cross the link, the planner's pages and buffers against the store's, and the tokens of a
paged compact run against a resident one and against 16 bits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import tasks as task_module
from executor.attention import append_and_attend, attend_one_step, store_and_attend_prompts
from executor.checkpoint import open_checkpoint
from executor.engine import Op
from executor.generate import generate
from executor.kv_cache import KVCache
from executor.quant import (
    compute_dtype,
    dequantize_into,
    dequantize_rows,
    dequantized,
    quantize,
    quantize_rows,
)
from executor.runtime import placed_runtime
from hrm.formats import BITS, GROUP, bytes_per_weight, is_quantized, row_bytes, stored_bytes
from hrm.policy import Policy
from hrm.rules.cpu_gemm import CpuGemmChoice
from hrm.rules.placement import largest_page_bytes, slot_bytes
from hrm.workload import Workload
from planner.memory import memory_terms
from tests.executor.conftest import ragged_prompts
from tests.executor.test_engine_modes import _without

CPU = torch.device("cpu")
LENGTHS = (5, 9, 3, 7, 6, 2, 8)
STEPS = 5
NATIVE = CpuGemmChoice(dtype="bfloat16", buckets=((0.0, "native"),), source="test")


def policy(fmt: str, *, rw=0.0, attn=False, rc=0.0, n=7, mu=3) -> Policy:
    return Policy(
        batch_size=n, micro_batch_size=mu, attention_on_gpu=attn, ffn_on_gpu=True,
        weights_gpu_fraction=rw, kv_gpu_fraction=rc, weight_dtype=fmt, kv_dtype="bfloat16",
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(sorted(BITS)),
    rows=st.integers(1, 5),
    groups=st.integers(1, 3),
    spread=st.floats(1e-4, 1e3),
    offset=st.floats(-10, 10),
    seed=st.integers(0, 2**16),
)
def test_the_round_trip_is_within_half_a_step(fmt, rows, groups, spread, offset, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * GROUP, generator=g) * spread + offset
    stored = quantize(w, fmt)
    assert stored.numel() == stored_bytes("w1", tuple(w.shape), fmt, 2)
    out = torch.empty_like(w)  # float32: the format's own error alone
    dequantize_into(out, stored, fmt)
    step = (w.view(rows, groups, GROUP).amax(-1) - w.view(rows, groups, GROUP).amin(-1)) / (
        2 ** BITS[fmt] - 1
    )
    # half a step, and float16's rounding of the step and of the minimum (2^-11 relative, and
    # half its subnormal spacing 2^-24 absolute, times the largest code for the step)
    levels = 2 ** BITS[fmt] - 1
    bound = (
        step / 2 * (1 + 2**-9)
        + w.abs().view(rows, groups, GROUP).amax(-1) * 2**-10
        + (levels + 1) * 2**-25
    )
    err = (out - w).abs().view(rows, groups, GROUP).amax(-1)
    assert bool((err <= bound).all()), (err - bound).max()
    # and the error is a real rounding, not zero: the codes hold fewer bits than the weights
    if spread > 1e-2:
        assert float(err.max()) > 0


def test_a_flat_group_comes_back_exactly():
    w = torch.full((2, GROUP), 0.25)
    for fmt in BITS:
        out = torch.empty_like(w)
        dequantize_into(out, quantize(w, fmt), fmt)
        assert torch.equal(out, w)


def test_what_the_format_leaves_in_16_bits():
    assert is_quantized("w1", (96, 64), "int4")
    assert not is_quantized("w2", (64, 96), "int4")  # 96 inputs: not whole groups
    assert not is_quantized("router", (8, 64), "int8")  # a flipped expert costs more
    assert not is_quantized("attn_norm", (64,), "int8")
    assert not is_quantized("w1", (96, 64), "bfloat16")
    assert bytes_per_weight("int8") == 1.0625 and bytes_per_weight("int4") == 0.5625
    w = torch.randn(8, 64)
    assert dequantized(w, "router", "int8") is w


@pytest.mark.parametrize("fmt", sorted(BITS))
def test_a_cpu_dequantizes_in_float32_and_rounds_once(fmt):
    """On a CPU the codes, scales and minima meet in float32 and the result is rounded to
    bfloat16 once (bfloat16 arithmetic would round the float16 scales to 8 bits first)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, generator=g) * torch.logspace(-3, 1, 128)
    stored = quantize_rows(w, fmt)
    exact = dequantize_rows(stored, fmt, 128, torch.float32)
    into = torch.empty(16, 128, dtype=torch.bfloat16)
    dequantize_into(into, stored.view(-1), fmt)
    assert torch.equal(dequantize_rows(stored, fmt, 128, torch.bfloat16), exact.bfloat16())
    assert torch.equal(into, exact.bfloat16())


@pytest.mark.parametrize(("capability", "dtype"), [((7, 5), "float16"), ((8, 0), "bfloat16"),
                                                   ((9, 0), "bfloat16")])  # fmt: skip
def test_a_compact_format_computes_in_the_gpus_fast_16_bit_float(monkeypatch, capability, dtype):
    """bfloat16 from compute capability 8.0 (bf16 units) on, float16 before (a T4 is 7.5)."""
    asked = []

    def capability_of(device):
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    assert compute_dtype("int4", "cuda:0") == dtype
    assert asked == [torch.device("cuda:0")]
    assert (
        compute_dtype("int8", "cpu") == "bfloat16" and compute_dtype("float16", "cuda") == "float16"
    )


def _run(path, fmt, pol, schedule="cgopipe", steps=STEPS):
    checkpoint = open_checkpoint(path, "bfloat16")
    runtime = placed_runtime(checkpoint, pol, schedule, CPU, NATIVE)
    try:
        out = generate(runtime, ragged_prompts(LENGTHS, seed=3), steps)
        return out, runtime.store, runtime
    finally:
        runtime.close()


@pytest.mark.parametrize("fmt", sorted(BITS))
@pytest.mark.parametrize(
    ("name", "schedule", "attn"),
    [
        ("mixtral-single", "cgopipe", False),
        ("mixtral-single", "serial", False),
        ("mixtral-single", "overlap", False),
        ("qwen3_moe-dense", "gpu-attention", True),
        ("qwen2_moe", "cgopipe", False),
    ],
)
def test_a_paged_compact_run_gives_the_resident_compact_run_tokens(
    checkpoints, fmt, name, schedule, attn
):
    """Streamed pages dequantized on the device give the values the resident weights hold, so
    every placement of a format gives the same tokens."""
    resident, *_ = _run(checkpoints[name], fmt, policy(fmt, rw=1.0, attn=attn), schedule)
    paged, store, _ = _run(checkpoints[name], fmt, policy(fmt, attn=attn), schedule)
    assert store.compact and store.dequantized
    assert paged.output_token_ids == resident.output_token_ids


@pytest.mark.parametrize("fmt", sorted(BITS))
def test_a_run_that_streams_nothing_computes_the_formats_values(checkpoints, fmt):
    """Everything on the CPU, no store: the layers' weights (attention, experts and Qwen2-MoE's
    shared expert) hold the format's values, so the tokens are the paged run's, not 16 bits'."""
    path = checkpoints["qwen2_moe"]
    resident = Policy.resident(7, fmt, on_gpu=False, kv_dtype="bfloat16")
    ours, store, _ = _run(path, fmt, resident)
    assert store is None
    paged, *_ = _run(path, fmt, policy(fmt, mu=7))
    assert ours.output_token_ids == paged.output_token_ids
    half, *_ = _run(path, "bfloat16", policy("bfloat16", mu=7))
    assert fmt == "int8" or ours.output_token_ids != half.output_token_ids


@pytest.mark.parametrize(("fmt", "ratio"), [("int8", 0.53), ("int4", 0.28)])
def test_a_compact_run_moves_the_compact_bytes(checkpoints, fmt, ratio):
    """Against the 16-bit run of the same plan: each streamed expert tensor with whole groups
    moves bytes_per_weight / 2 of its 16-bit bytes (the tiny model's w2, of 96 inputs, and its
    norms and router stay 16-bit, so the whole layer moves a little more)."""
    path = checkpoints["qwen3_moe"]
    _, half, _ = _run(path, "bfloat16", policy("bfloat16"), steps=2)
    _, compact, _ = _run(path, fmt, policy(fmt), steps=2)
    layout = compact.layouts[False]
    quantized = [t for t in layout.tensors if t.quantized]
    assert len(quantized) > len(layout.tensors) / 2
    for t in quantized:
        assert t.nbytes == pytest.approx(math.prod(t.shape) * 2 * bytes_per_weight(fmt) / 2)
        assert t.nbytes / (math.prod(t.shape) * 2) == pytest.approx(ratio, abs=0.005)
    whole = compact.h2d_bytes / half.h2d_bytes
    assert ratio < whole < ratio + 0.35
    assert compact.h2d_bytes == 2 * sum(
        layout.nbytes for layout in [compact._layout(i) for i in range(3)]
    )


def _agreement(ours, theirs) -> float:
    """The share of generated tokens before each prompt's first difference."""
    same = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        for a, b in zip(ours.output_token_ids, theirs.output_token_ids, strict=True)
    ]
    return sum(same) / sum(len(b) for b in theirs.output_token_ids)


@pytest.mark.parametrize("name", ["mixtral-single", "qwen3_moe"])
def test_int8_greedy_tokens_agree_with_16_bits(checkpoints, name):
    """int8's error (a 255th of each group's range) is below most of the tiny model's logit
    gaps: every first token agrees, and nearly all that follow (random weights, so not all;
    bench/bench_quant_quality.py measures more); int4 agrees less."""
    half, *_ = _run(checkpoints[name], "bfloat16", policy("bfloat16"))
    int8, *_ = _run(checkpoints[name], "int8", policy("int8"))
    int4, *_ = _run(checkpoints[name], "int4", policy("int4"))
    firsts = [t[0] for t in half.output_token_ids]
    assert [t[0] for t in int8.output_token_ids] == firsts
    assert _agreement(int8, half) >= 0.8
    assert _agreement(int4, half) < _agreement(int8, half)


@pytest.mark.parametrize("fmt", sorted(BITS))
@pytest.mark.parametrize("name", ["mixtral-single", "qwen2_moe-dense", "qwen3_moe"])
def test_the_planner_counts_the_stores_pages_and_slots(checkpoints, fmt, name):
    arch = open_checkpoint(checkpoints[name], "bfloat16").arch
    pages = 3
    checkpoint = open_checkpoint(checkpoints[name], "bfloat16")
    runtime = placed_runtime(checkpoint, policy(fmt, mu=3), "cgopipe", CPU, NATIVE)
    try:
        store = runtime.store
        largest = max(store.page_bytes(i, p) for i in range(arch.num_layers) for p in range(pages))
        assert largest == largest_page_bytes(arch, fmt, pages)
        # a slot holds the largest layer; with dense layers among sparse ones the planner's S is
        # a bound over every placement (hrm.rules.placement.slot_bytes), else the layer itself
        one_kind = not arch.dense_layers
        assert store.streamed_bytes <= slot_bytes(arch, fmt) * (1 + 1e-9)
        assert one_kind <= (store.streamed_bytes == pytest.approx(slot_bytes(arch, fmt)))
        wl = Workload(prompt_len_mean=9, prompt_len_max=9, gen_len=STEPS)
        terms = memory_terms(arch, wl, batch_size=7, micro_batch_size=3, weight_dtype=fmt,
                             kv_dtype="bfloat16")  # fmt: skip
        at = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0]).numpy()  # F_g = 1, r_w = r_d = 0
        gpu = store.allocated_bytes()["gpu"]
        for name_ in ("paged buffer", "dequantized layer"):
            planned = float(terms.gpu[name_] @ at)
            assert gpu[name_] <= planned * (1 + 1e-9)
            assert one_kind <= (gpu[name_] == pytest.approx(planned))
        host = store.allocated_bytes()["cpu"]["layer weights"]
        assert host == pytest.approx(float(terms.cpu["layer weights"] @ at), rel=1e-9)
    finally:
        runtime.close()


# -- the engine's modes and the schedules' order ------------------------------------------------


def _traced(path, fmt, schedule, attn=False):
    checkpoint = open_checkpoint(path, "bfloat16")
    runtime = placed_runtime(checkpoint, policy(fmt, attn=attn), schedule, CPU, NATIVE)
    runtime.engine.trace = []
    try:
        out = generate(runtime, ragged_prompts(LENGTHS, seed=3), STEPS)
    finally:
        runtime.close()
    return out.output_token_ids, runtime


@pytest.fixture(scope="module")
def inline_int4(checkpoints):
    return {
        s: _traced(checkpoints["mixtral-single"], "int4", s, s == "gpu-attention")
        for s in ("serial", "cgopipe", "gpu-attention")
    }


@pytest.mark.parametrize("mode", ["threads", "deferred"])
@pytest.mark.parametrize("schedule", ["serial", "cgopipe", "gpu-attention"])
def test_compact_pages_in_every_engine_mode(checkpoints, inline_int4, monkeypatch, mode, schedule):
    monkeypatch.setenv("HRM_ENGINE", mode)
    monkeypatch.setenv("HRM_ENGINE_JITTER", "11")
    tokens, runtime = _traced(
        checkpoints["mixtral-single"], "int4", schedule, schedule == "gpu-attention"
    )
    assert runtime.engine.mode == ("inline" if (schedule, mode) == ("serial", "threads") else mode)
    assert tokens == inline_int4[schedule][0]


def test_deferred_gives_wrong_tokens_without_the_dequantize_wait(
    checkpoints, inline_int4, monkeypatch
):
    """The dequantization reads pages the h2d queue writes (and the next loads into that slot
    wait for it): without that wait it reads a slot before its pages arrive. Its reader, the
    layer's compute, shares its queue, so their order is the stream's."""
    monkeypatch.setenv("HRM_ENGINE", "deferred")
    op = Op.DEQUANTIZE
    monkeypatch.setitem(task_module.TaskBuilder.BUILDERS, op, _without(op, "weight_page"))
    tokens, _ = _traced(checkpoints["mixtral-single"], "int4", "cgopipe")
    assert tokens != inline_int4["cgopipe"][0]


@pytest.mark.parametrize("schedule", ["serial", "cgopipe", "gpu-attention"])
def test_each_layer_is_dequantized_once_after_its_pages_and_before_its_first_read(
    inline_int4, schedule
):
    trace = inline_int4[schedule][1].engine.trace
    layers = 3
    for step in range(STEPS):
        for layer in range(layers):
            at = [i for i, a in enumerate(trace) if (a.step, a.layer) == (step, layer)]
            ops = [trace[i] for i in at]
            deq = [i for i, a in zip(at, ops, strict=True) if a.op is Op.DEQUANTIZE]
            assert len(deq) == 1 and trace[deq[0]].queue == "gpu"
            reads = [i for i, a in zip(at, ops, strict=True) if a.op in (Op.PRE, Op.POST)]
            loads = [i for i, a in zip(at, ops, strict=True) if a.op is Op.LOAD]
            assert max(loads) < deq[0] < min(reads)
            if layer:  # after the previous layer's last read: one 16-bit slot serves them all
                before = [
                    i for i, a in enumerate(trace)
                    if (a.step, a.layer) == (step, layer - 1) and a.op in (Op.PRE, Op.POST)
                ]  # fmt: skip
                assert max(before) < deq[0]


# -- the KV cache in int8 and int4 ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(BITS))
def test_kv_rows_round_trip_within_half_a_step(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 7, 128, generator=g) * 3
    rows = quantize_rows(x, fmt)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == row_bytes(128, fmt)
    back = dequantize_rows(rows, fmt, 128, torch.float32)
    groups = x.view(4, 2, 7, 2, 64)
    step = (groups.amax(-1) - groups.amin(-1)) / (2 ** BITS[fmt] - 1)
    err = (back - x).abs().view(4, 2, 7, 2, 64).amax(-1)
    assert bool((err <= step / 2 * (1 + 2**-9) + groups.abs().amax(-1) * 2**-10).all())


@pytest.mark.parametrize("fmt", sorted(BITS))
def test_kv_attention_equals_attention_over_the_dequantized_cache(fmt):
    """The compact cache's decode and prefill attention against SDPA over K/V dequantized by
    hand: the same rows, so the same result; and away from 16-bit attention by the format's
    error only."""
    g = torch.Generator().manual_seed(1)
    B, nq, nkv, D, L = 3, 4, 2, 32, 6
    caches = {
        f: KVCache(
            num_layers=1,
            batch_size=B,
            kv_heads=nkv,
            max_len=L + 1,
            head_dim=D,
            dtype=torch.float32,
            kv_format=f,
        )  # fmt: skip
        for f in (fmt, None)
    }
    lens = torch.tensor([6, 4, 5])
    pos = torch.cat([torch.arange(n) for n in lens])
    batch_idx = torch.repeat_interleave(torch.arange(B), lens)
    slot_idx = pos + (L - lens)[batch_idx]
    q, k, v = (torch.randn(int(lens.sum()), n, D, generator=g) for n in (nq, nkv, nkv))
    out = {}
    for f, cache in caches.items():
        cache.start(lens, L)
        out[f] = [store_and_attend_prompts(cache, 0, q, k, v, batch_idx, slot_idx)]
    step = [torch.randn(B, n, D, generator=g) for n in (nq, nkv, nkv)]
    for f, cache in caches.items():
        out[f].append(append_and_attend(cache, 0, *step))
    # by hand: the compact cache's rows, dequantized, attended as 16-bit K/V are
    compact = caches[fmt]
    keys, values = (dequantize_rows(t, fmt, D, torch.float32) for t in (compact.k[0], compact.v[0]))
    mask = compact.mask(L + 1)
    expected = attend_one_step(step[0], keys, values, mask)
    assert torch.equal(out[fmt][1], expected)
    assert (keys - caches[None].k[0]).abs().max() > 0  # it did quantize
    bound = 0.05 if fmt == "int8" else 0.5
    for ours, exact in zip(out[fmt], out[None], strict=True):
        assert (ours - exact).abs().max() < bound * exact.abs().max()


@pytest.mark.parametrize("fmt", sorted(BITS))
@pytest.mark.parametrize(
    ("schedule", "attn", "rc"),
    [("cgopipe", False, 0.0), ("gpu-attention", True, 0.0), ("gpu-attention", True, 0.5)],
)
def test_a_paged_run_with_a_compact_kv_cache_gives_the_resident_runs_tokens(
    checkpoints, fmt, schedule, attn, rc
):
    """Host KV read by CPU attention, prefetched compact to the GPU, or kept there: the same
    rows everywhere, so the same tokens; the prefetch moves the compact bytes."""
    path = checkpoints["qwen3_moe"]
    pol = dataclasses.replace(policy("bfloat16", attn=attn, rc=rc), kv_dtype=fmt)
    resident = dataclasses.replace(pol, weights_gpu_fraction=1.0, attention_on_gpu=True,
                                   kv_gpu_fraction=1.0)  # fmt: skip
    ours, _, runtime = _run(path, "bfloat16", pol, schedule)
    theirs, *_ = _run(path, "bfloat16", resident, schedule)
    assert ours.output_token_ids == theirs.output_token_ids
    assert all(mb.cache.format == fmt for mb in runtime.micro_batches)
    assert runtime.model.kv_format == fmt
    if rc == 0.0:  # every layer's K/V crosses the link compact: against 16-bit rows of D = 32
        half = dataclasses.replace(pol, kv_dtype="bfloat16")
        _, _, sixteen = _run(path, "bfloat16", half, schedule)
        bytes_ = {q: [r.engine.stats[q].nbytes for r in (runtime, sixteen)] for q in ("h2d", "d2h")}
        assert bytes_["d2h"][0] < bytes_["d2h"][1]  # the prompts' K/V to the host cache
        if attn:  # each step's prefetch, beside the same weight pages
            weights = runtime.store.h2d_bytes
            ratio = (bytes_["h2d"][0] - weights) / (bytes_["h2d"][1] - weights)
            assert row_bytes(32, fmt) / (32 * 2) * 0.9 < ratio < 1.0


@pytest.mark.parametrize("fmt", sorted(BITS))
def test_the_planner_counts_the_compact_kv_cache_the_runtime_allocates(checkpoints, fmt):
    path = checkpoints["qwen3_moe"]
    pol = dataclasses.replace(policy("bfloat16", attn=True, rc=0.5), kv_dtype=fmt)
    _, _, runtime = _run(path, "bfloat16", pol, "gpu-attention", steps=2)
    allocated = runtime.allocated_bytes()
    arch = runtime.arch
    # 7 sequences of at most 9 prompt tokens and 2 new ones, in micro-batches of 3, 3 and 1
    slots = sum(mb.cache.max_len * mb.size for mb in runtime.micro_batches)
    per_slot = arch.kv_bytes_per_token(fmt)
    assert per_slot == arch.num_layers * 2 * arch.num_key_value_heads * row_bytes(32, fmt)
    assert allocated["cpu"]["kv cache"] + allocated["gpu"]["kv cache"] == slots * per_slot
    wl = Workload(prompt_len_mean=9, prompt_len_max=9, gen_len=2)
    terms = memory_terms(arch, wl, batch_size=7, micro_batch_size=3, weight_dtype="bfloat16",
                         kv_dtype=fmt)  # fmt: skip
    # r_c of it on the GPU, the rest in host memory: N * C * the compact bytes of a token
    assert float(terms.cpu["kv cache"][..., 0]) == pytest.approx(7 * 11 * per_slot)
    assert float(terms.gpu["kv cache"][..., 4]) == pytest.approx(7 * 11 * per_slot)
    assert slots <= 7 * 11
