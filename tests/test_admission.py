"""hrm.rules.admission with the executor's KV blocks: admissions and endings in any order never
book a block twice, never over-commit the pool, and leave every block free at the end; the
rule's count of blocks held (what the planner's simulation reports) is the pools'."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.kv_blocks import KVBlocks
from hrm.arch import resolve_model
from hrm.errors import HrmError
from hrm.rules.admission import (
    BLOCK_TOKENS,
    Admission,
    Pass,
    Request,
    blocks_for,
    expand,
    simulate,
)

requests_st = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(requests_st, st.integers(1, 8), st.integers(1, 64), st.integers(0, 2**32 - 1))
def test_blocks_are_never_double_booked_or_leaked(lengths, max_running, budget, seed):
    import random

    rng = random.Random(seed)
    requests = [Request(i, p, g) for i, (p, g) in enumerate(lengths)]
    total = max(blocks_for(p + g - 1) for p, g in lengths) + rng.randint(0, 40)
    admission = Admission(requests, max_running=max_running, token_budget=budget,
                          total_blocks=total)  # fmt: skip
    arch = resolve_model("mixtral-8x7b").first_layers(1)
    pools = KVBlocks(arch, blocks=total, dtype=__import__("torch").float32,
                     layer_devices=["meta"])  # fmt: skip
    held = {}  # request -> KV rows written
    ended = set()
    while not admission.done:
        p = admission.next_pass()
        assert p.tokens, "a pass with nothing in it: the run would wait for ever"
        assert sum(c.length for c in p.chunks) <= max(0, budget - len(p.decodes))
        assert len(p.decodes) + len(p.chunks) <= max_running
        for i, pos in p.decodes:
            pools.grow(i, pos + 1)
            held[i] = pos + 1
        for c in p.chunks:
            pools.grow(c.index, c.start + c.length)
            held[c.index] = c.start + c.length
        owned = [b for t in pools.tables.values() for b in t]
        assert len(owned) == len(set(owned)) and not set(owned) & set(pools.free)
        assert pools.held <= admission.reserved <= total
        stopped = [i for i in p.samples if rng.random() < 0.2]  # a stop token, at random
        for i in admission.complete(p, stopped):
            pools.release(i)
            ended.add(i)
        assert admission.held == pools.held  # the rule counts the blocks the pools hand out
    assert ended == set(range(len(requests)))
    assert pools.held == 0 and sorted(pools.free) == list(range(total))
    assert admission.peak_held == pools.peak_held
    assert admission.peak_held <= admission.peak_reserved <= total


def test_a_request_that_can_never_fit_is_named():
    with pytest.raises(
        HrmError, match="request 2 .* needs 320 tokens of KV cache; the run holds 160"
    ):
        Admission([Request(0, 10, 5), Request(1, 300, 20)], max_running=4, token_budget=32,
                  total_blocks=10)  # fmt: skip


def test_a_long_prompt_is_cut_across_passes_and_decodes_go_first():
    spans, _ = simulate([Request(0, 5, 3), Request(1, 20, 2)], max_running=2, token_budget=8,
                        total_blocks=8)  # fmt: skip
    passes = list(expand(spans))
    shapes = [([i for i, _ in p.decodes], [(c.index, c.start, c.length) for c in p.chunks])
              for p in passes]  # fmt: skip
    assert shapes == [
        ([], [(0, 0, 5), (1, 0, 3)]),
        ([0], [(1, 3, 7)]),
        ([0], [(1, 10, 7)]),
        ([], [(1, 17, 3)]),  # request 0 ended after its third token
        ([1], []),
    ]
    assert BLOCK_TOKENS == 16


@settings(max_examples=60, deadline=None)
@given(requests_st, st.integers(1, 8), st.integers(1, 64), st.integers(0, 40))
def test_a_simulations_spans_are_the_passes_one_by_one(lengths, max_running, budget, spare):
    """simulate's spans (a decode-only pass repeated until a sequence ends) expand to exactly
    the passes the executor's loop (next_pass, complete) makes, with the same peaks."""
    requests = [Request(i, p, g) for i, (p, g) in enumerate(lengths)]
    limits = dict(max_running=max_running, token_budget=budget,
                  total_blocks=max(blocks_for(p + g - 1) for p, g in lengths) + spare)  # fmt: skip
    one_by_one = Admission(requests, **limits)
    passes = []
    while not one_by_one.done:
        passes.append(one_by_one.next_pass())
        one_by_one.complete(passes[-1])
    spans, admission = simulate(requests, **limits)
    assert list(expand(spans)) == passes
    assert len(spans) <= len(passes)
    peaks = ("peak_running", "peak_reserved", "peak_held")
    assert [getattr(admission, k) for k in peaks] == [getattr(one_by_one, k) for k in peaks]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=30), st.integers(1, 8),
       st.integers(0, 50))  # fmt: skip
def test_decodes_are_grouped_shortest_first_and_stay_so_over_a_span(positions, mu, later):
    """A pass's decode micro-batches hold like lengths (each attends to its longest): every
    sequence of a group is at least as long as every one of the group before, each group of mu
    but the last, and a span's later pass (every decode a token on) is grouped alike."""
    p = Pass(decodes=tuple(enumerate(positions)), chunks=())
    groups = [entries for _, entries in p.groups(mu)]
    assert sorted(x for g in groups for x in g) == sorted(p.decodes)
    assert all(len(g) == mu for g in groups[:-1])
    for before, after in zip(groups, groups[1:], strict=False):
        assert max(pos for _, pos in before) <= min(pos for _, pos in after)
    shifted = [[i for i, _ in entries] for _, entries in p.shifted(later).groups(mu)]
    assert shifted == [[i for i, _ in g] for g in groups]
