"""The paged pools' gather and decode attention (executor/kv_blocks.py) against plain torch: the
scratch-buffer gather equals indexing, and the decode path equals a reference softmax over each
sequence's own keys, with a window and with sinks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from executor.kv_blocks import KVBlocks, attend
from hrm.arch import resolve_model


def _pools(blocks: int = 8) -> KVBlocks:
    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), num_key_value_heads=2, head_dim=8,
                               num_attention_heads=4, num_layers=1)  # fmt: skip
    return KVBlocks(arch, blocks=blocks, dtype=torch.float32, layer_devices=[torch.device("cpu")])


def test_gathered_equals_indexing_and_reuses_its_buffer():
    pools = _pools()
    pool = torch.randn(pools.k[0].shape)
    slots = torch.randint(0, pool.shape[0], (3, 20))
    first = pools.gathered(pool, slots, "k")
    assert torch.equal(first, pool[slots])
    ptr = first.data_ptr()
    smaller = slots[:2, :5]
    again = pools.gathered(pool, smaller, "k")
    assert torch.equal(again, pool[smaller]) and again.data_ptr() == ptr  # no new allocation
    other = pools.gathered(pool, smaller, "v")  # K's rows stay valid beside V's
    assert other.data_ptr() != ptr and torch.equal(again, pool[smaller])
    bigger = torch.randint(0, pool.shape[0], (4, 40))
    assert torch.equal(pools.gathered(pool, bigger, "k"), pool[bigger])  # grown


def _reference(q, keys, values, pos, window=None, sinks=None):
    """Each sequence's query heads over its keys 0..pos (the last `window`), fp64 softmax."""
    B, nkv, S, D = keys.shape
    G = q.shape[1] // nkv
    out = torch.zeros(B, nkv, G, values.shape[-1], dtype=torch.float64)
    for b in range(B):
        lo = 0 if window is None else max(0, int(pos[b]) - window + 1)
        k, v = keys[b, :, lo : pos[b] + 1].double(), values[b, :, lo : pos[b] + 1].double()
        qb = q[b].view(nkv, G, D).double()
        scores = qb @ k.transpose(-1, -2) / math.sqrt(D)  # [nkv, G, s]
        if sinks is not None:
            sink = sinks.view(nkv, G, 1).double()
            full = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            full = torch.softmax(scores, -1)
        out[b] = full @ v
    return out.reshape(B, -1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_equals_the_reference(window, with_sinks):
    torch.manual_seed(0)
    B, nkv, G, D, S = 5, 2, 3, 8, 17
    q = torch.randn(B, nkv * G, D)
    keys, values = torch.randn(B, nkv, S, D), torch.randn(B, nkv, S, D)
    pos = torch.tensor([0, 3, 16, 9, 12])  # each sequence's one query, at its own position
    sinks = torch.randn(nkv * G) if with_sinks else None
    got = attend(q, keys, values, pos, torch.arange(B), torch.zeros(B, dtype=torch.long),
                 window=window, sinks=sinks)  # fmt: skip
    want = _reference(q, keys, values, pos, window, sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_chunk_sees_its_prefix_and_itself_causally():
    """The general path (a sequence with several new queries) against the same reference, one
    query at a time."""
    torch.manual_seed(1)
    nkv, G, D, S = 2, 2, 8, 12
    keys, values = torch.randn(2, nkv, S, D), torch.randn(2, nkv, S, D)
    # sequence 0: a chunk of 4 after 6 cached tokens; sequence 1: one decode at position 2
    pos = torch.tensor([6, 7, 8, 9, 2])
    batch_idx, local_idx = torch.tensor([0, 0, 0, 0, 1]), torch.tensor([0, 1, 2, 3, 0])
    q = torch.randn(5, nkv * G, D)
    got = attend(q, keys, values, pos, batch_idx, local_idx)
    for t in range(5):
        b = int(batch_idx[t])
        want = _reference(q[t : t + 1], keys[b : b + 1], values[b : b + 1], pos[t : t + 1])
        torch.testing.assert_close(got[t : t + 1].double(), want, rtol=1e-5, atol=1e-5)
