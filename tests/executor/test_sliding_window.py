"""Sliding-window layers (gpt-oss): the KV cache keeps a sliding layer's window as a ring
(executor/kv_cache.py), every path that reads or moves a layer's K/V reads the ring, and the
planner counts the ring the runtime allocates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.attention import append_and_attend
from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.kv_cache import KVCache
from executor.model import MoEModel
from hrm.workload import Workload
from planner.memory import memory_terms
from tests.executor.conftest import GPT_OSS_WINDOW
from tests.executor.test_quant import _run, policy

W = 4


def _cache(slot_major=frozenset(), max_len=12) -> KVCache:
    return KVCache(num_layers=2, batch_size=2, kv_heads=1, max_len=max_len, head_dim=2,
                   dtype=torch.float32, slot_major=slot_major, windows={1: W})  # fmt: skip


def _prompts(cache: KVCache, L: int, lens=(10, 7)):
    """Two left-padded prompts of `lens` in L slots; K of slot s is s + 1, V is -(s + 1)."""
    cache.start(torch.tensor(lens), L)
    batch_idx = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    slot_idx = torch.cat([torch.arange(L - n, L) for n in lens])
    k = (slot_idx.float() + 1)[:, None, None].expand(-1, 1, 2)
    return k, -k, batch_idx, slot_idx


@pytest.mark.parametrize("slot_major", [frozenset(), frozenset({1})])
def test_a_sliding_layer_keeps_its_window_as_a_ring(slot_major):
    cache = _cache(slot_major)
    assert cache.k[0].shape[2] == 12 and cache.k[1].shape[2] == W  # the full layer, the ring
    k, v, batch_idx, slot_idx = _prompts(cache, L=10)
    cache.write_prompts(1, k, v, batch_idx, slot_idx)
    # slots 6..9 of the prompts at 6 % 4 = 2, 3, 0, 1
    assert cache.k[1][0, 0, :, 0].tolist() == [9.0, 10.0, 7.0, 8.0]
    keys, _ = cache.view(1, 10)
    assert keys.shape[2] == W and cache.filled(1, 3) == 3 and cache.filled(0, 10) == 10
    # the next step's key goes where slot 6 was, the key that left the window
    cache.write_step(1, torch.full((2, 1, 2), 11.0), torch.zeros(2, 1, 2))
    assert cache.position(1, 10) == 2 and cache.k[1][1, 0, :, 0].tolist() == [9.0, 10.0, 11.0, 8.0]
    # the second prompt (7 of 10 slots) is padded in slots 0..2: none of them is in the ring
    # at end 11, but at end 6 its ring positions hold slots 4, 5, 2, 3 and slot 2 is padding
    assert cache.mask(11, layer=1)[:, 0, 0].tolist() == [[True] * 4, [True] * 4]
    assert cache.mask(6, layer=1)[1, 0, 0].tolist() == [True, True, False, True]
    assert cache.mask(6, layer=0)[1, 0, 0].tolist() == [False] * 3 + [True] * 3


@pytest.mark.parametrize("slot_major", [frozenset(), frozenset({1})])
@pytest.mark.parametrize("L", [3, 10])
def test_copying_the_prompts_slots_in_equals_scattering_them(slot_major, L):
    """What kv_out copies from a transient device cache lands where write_prompts puts it: in
    two pieces when the window wraps (L = 10), in one when the prompts are shorter (L = 3)."""
    scattered, copied = _cache(slot_major), _cache(slot_major)
    k, v, batch_idx, slot_idx = _prompts(scattered, L, lens=(L, L - 1))
    scattered.write_prompts(1, k, v, batch_idx, slot_idx)
    full = KVCache(num_layers=1, batch_size=2, kv_heads=1, max_len=L, head_dim=2,
                   dtype=torch.float32)  # fmt: skip
    full.start(torch.tensor([L, L - 1]), L)
    full.write_prompts(0, k, v, batch_idx, slot_idx)
    copied.start(torch.tensor([L, L - 1]), L)
    copied.write_prompt_slots(1, full.k[0], full.v[0])
    assert torch.equal(copied.k[1], scattered.k[1]) and torch.equal(copied.v[1], scattered.v[1])


def test_a_query_reads_only_its_window():
    """A key that left the window no longer counts: decode over the ring equals attention over
    the window's keys alone, and a key older than the window changes nothing."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(12, 2, 1, 2, generator=g) for _ in "kv"]
    outs = []
    for poison in (False, True):
        cache = _cache()
        cache.start(torch.tensor([8, 8]), 8)
        for s in range(8):  # one slot at a time; slot 0 left the window long before slot 8
            k = rows[0][s] * (100.0 if poison and s == 0 else 1.0)
            cache.length = s
            cache.write_step(1, k, rows[1][s])
        cache.length = 8
        q = torch.randn(2, 1, 2, generator=torch.Generator().manual_seed(1))
        outs.append(append_and_attend(cache, 1, q, rows[0][8], rows[1][8]))
    assert torch.equal(outs[0], outs[1])
    keys, values = (r[5:9].permute(1, 2, 0, 3) for r in rows)  # slots 5..8: [B, 1, 4, 2]
    q = torch.randn(2, 1, 2, generator=torch.Generator().manual_seed(1))
    scores = torch.softmax((q[:, :, None] @ keys.transpose(-1, -2)) / 2**0.5, dim=-1)
    assert torch.allclose(outs[0], (scores @ values).reshape(2, -1), atol=1e-6)


def test_the_rings_hold_the_window_and_cost_the_same_tokens(checkpoints):
    """gpt-oss's sliding layers hold GPT_OSS_WINDOW slots, not the context; a cache without
    rings (every slot kept, the window a mask) gives the same tokens."""
    checkpoint = open_checkpoint(checkpoints["gpt_oss"], "float32")
    model = MoEModel(checkpoint)
    cache = model.new_cache(3, 20)
    sliding = checkpoint.arch.sliding_layers
    assert sliding == (0, 2)
    assert [cache.k[i].shape[2] for i in range(3)] == [GPT_OSS_WINDOW, 20, GPT_OSS_WINDOW]
    prompts = [[5, 9, 11, 200, 3, 77, 12, 13, 14, 15], [40, 41, 42], [7] * 9]
    ringed = generate(model, prompts, 8).output_token_ids
    model.new_cache = lambda *a, **kw: MoEModel.new_cache(model, *a, **kw, windowed=False)
    assert generate(model, prompts, 8).output_token_ids == ringed


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
@pytest.mark.parametrize(("schedule", "attn", "rc"),
                         [("cgopipe", False, 0.0), ("gpu-attention", True, 0.0),
                          ("gpu-attention", True, 0.5)])  # fmt: skip
def test_rings_on_the_host_and_on_the_gpu_give_the_resident_tokens(
    checkpoints, kv, schedule, attn, rc
):
    """Host rings read by CPU attention, prefetched to the GPU and written back a step at a
    time, or kept on the GPU, in 16 bits and compact: the tokens of a resident run."""
    path = checkpoints["gpt_oss"]
    pol = dataclasses.replace(policy("bfloat16", attn=attn, rc=rc), kv_dtype=kv)
    resident = dataclasses.replace(pol, weights_gpu_fraction=1.0, attention_on_gpu=True,
                                   kv_gpu_fraction=1.0)  # fmt: skip
    ours, _, runtime = _run(path, "bfloat16", pol, schedule, steps=8)
    theirs, *_ = _run(path, "bfloat16", resident, schedule, steps=8)
    assert ours.output_token_ids == theirs.output_token_ids
    assert all(mb.cache.rings == {0: GPT_OSS_WINDOW, 2: GPT_OSS_WINDOW}
               for mb in runtime.micro_batches)  # fmt: skip


def test_the_planner_counts_the_rings_the_runtime_allocates(checkpoints, monkeypatch):
    """Prompts of one length: every micro-batch's cache is the planner's C = 9 + 4 slots long,
    its sliding layers GPT_OSS_WINDOW."""
    import tests.executor.test_quant as quant_tests

    monkeypatch.setattr(quant_tests, "ragged_prompts", lambda lens, seed: [[3] * 9] * len(lens))
    pol = policy("bfloat16", attn=False)
    _, _, runtime = _run(checkpoints["gpt_oss"], "bfloat16", pol, "cgopipe", steps=4)
    arch = runtime.arch
    allocated = runtime.allocated_bytes()["cpu"]["kv cache"]
    token = arch.kv_token_bytes("bfloat16")
    assert allocated == 7 * (13 + 2 * GPT_OSS_WINDOW) * token  # one full layer, two rings
    wl = Workload(prompt_len_mean=9, prompt_len_max=9, gen_len=4)
    terms = memory_terms(arch, wl, batch_size=7, micro_batch_size=3, weight_dtype="bfloat16",
                         kv_dtype="bfloat16")  # fmt: skip
    assert float(terms.cpu["kv cache"][..., 0]) == pytest.approx(allocated)
