"""Continuous batching (executor/passes.py): every request's tokens equal the same request run
alone, under every schedule and family, with requests admitted while others run, prompts
longer than a pass, and requests that end on their first token; the passes do only the work of
the running sequences; the KV blocks are never double-booked or leaked."""

from __future__ import annotations

import pytest
import torch

from executor.checkpoint import open_checkpoint
from executor.generate import Limits, generate
from executor.model import MoEModel
from executor.passes import run_passes
from executor.runtime import Runtime, placed_runtime
from tests.executor.conftest import ragged_prompts, reference_model
from tests.executor.test_matches_transformers import TOLERANCE, reference_generate, relative_error
from tests.executor.test_offload import CPU, SCHEDULES, policy

# a 30-token prompt is longer than a pass (BUDGET); max_new 1 ends on the first token
LENGTHS = (5, 30, 3, 7, 1, 12, 9, 2)
MAX_NEW = (4, 3, 1, 6, 2, 5, 1, 6)
BUDGET = 8
FAMILIES = ("mixtral-single", "dbrx", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen2_moe-dense")


def alone(path, prompts, dtype="float32", kv_format=None) -> list[list[int]]:
    model = MoEModel(open_checkpoint(path, dtype), kv_format=kv_format)
    return [
        generate(model, [p], n).output_token_ids[0] for p, n in zip(prompts, MAX_NEW, strict=True)
    ]


def continuous(runtime, prompts, *, n=3, budget=BUDGET, stops=()):
    """Every prompt through run_passes: (tokens per prompt, the pass stats, finish order)."""
    out, order = {}, []

    def finish(i, ids, reason):
        out[i] = list(ids)
        order.append(i)

    stats = run_passes(
        runtime, dict(enumerate(prompts)), {i: Limits(max_new=m) for i, m in enumerate(MAX_NEW)},
        max_running=n, token_budget=budget, total_blocks=64, stop_token_ids=stops,
        on_finish=finish,
    )  # fmt: skip
    return [out[i] for i in range(len(prompts))], stats, order


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("schedule", "attn", "rc"), SCHEDULES)
def test_every_schedule_gives_each_request_its_tokens_alone(checkpoints, name, schedule, attn, rc):
    prompts = ragged_prompts(LENGTHS, seed=7)
    ck = open_checkpoint(checkpoints[name], "float32")
    runtime = placed_runtime(ck, policy(n=3, mu=2, attn=attn, rc=rc), schedule, CPU,
                             continuous=True)  # fmt: skip
    try:
        got, stats, _ = continuous(runtime, prompts)
    finally:
        runtime.close()
    assert got == alone(checkpoints[name], prompts)
    assert max(stats.sequences) <= 3 and len(stats.tokens) > len(LENGTHS)


def test_a_resident_run_and_transformers_agree(checkpoints):
    """No store: the layers where the weights are; and transformers' generate of each alone."""
    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=8)
    model = MoEModel(open_checkpoint(path, "float32"))
    runtime = Runtime(model, schedule="serial", micro_batch_size=2, attention_on_gpu=True,
                      continuous=True)  # fmt: skip
    got, _, _ = continuous(runtime, prompts)
    reference = reference_model(path)
    theirs = [
        reference_generate(reference, [p], n)[0][0] for p, n in zip(prompts, MAX_NEW, strict=True)
    ]
    assert got == theirs


@pytest.mark.parametrize("mode", ["threads", "deferred"])
@pytest.mark.parametrize(("schedule", "attn", "rc"), [SCHEDULES[2], SCHEDULES[4]])
def test_engine_modes_give_the_same_tokens(checkpoints, monkeypatch, mode, schedule, attn, rc):
    """A missing wait between a pass's groups would give other tokens in these modes (deferred
    runs device work late, the jitter early)."""
    monkeypatch.setenv("HRM_ENGINE", mode)
    monkeypatch.setenv("HRM_ENGINE_JITTER", "5")
    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=9)
    runtime = placed_runtime(open_checkpoint(path, "float32"),
                             policy(n=4, mu=2, attn=attn, rc=rc, rw=0.3), schedule, CPU,
                             continuous=True)  # fmt: skip
    try:
        assert runtime.engine.mode == mode
        got, _, _ = continuous(runtime, prompts, n=4)
    finally:
        runtime.close()
    assert got == alone(path, prompts)


def test_a_pass_computes_the_running_sequences_and_admitted_tokens_only(checkpoints):
    """Per pass, the layers compute one token per decoding sequence and the admitted prompt
    tokens, and the LM head one row per sampling sequence: none for a finished request."""
    from hrm.rules.admission import Admission, Request

    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=7)
    runtime = placed_runtime(open_checkpoint(path, "float32"), policy(n=3, mu=2), "cgopipe", CPU,
                             continuous=True)  # fmt: skip
    try:
        _, stats, _ = continuous(runtime, prompts)
    finally:
        runtime.close()
    requests = [
        Request(i, len(p), m) for i, (p, m) in enumerate(zip(prompts, MAX_NEW, strict=True))
    ]
    admission = Admission(requests, max_running=3, token_budget=BUDGET, total_blocks=64)
    expected_tokens, expected_rows = [], []
    while not admission.done:
        p = admission.next_pass()
        expected_tokens.append(p.tokens)
        expected_rows.append(len(p.samples))
        admission.complete(p)
    assert stats.tokens == expected_tokens and stats.head_rows == expected_rows
    assert sum(stats.head_rows) == sum(MAX_NEW)  # every token sampled once, no finished rows
    assert sum(stats.tokens) == sum(LENGTHS) + sum(MAX_NEW) - len(LENGTHS)


@pytest.mark.parametrize(("n", "budget"), [(3, BUDGET), (8, 40)])
def test_the_planners_simulation_is_the_runs_passes_and_blocks(checkpoints, n, budget):
    """The planner's simulation (hrm.rules.admission.simulate, what planner/passes.py prices) of
    a job is the executor's run of it, pass by pass, and its peak of blocks holding KV rows is
    the peak the executor's pools handed out; with more requests running than a static batch
    (8 > N=3, as a continuous plan admits) as with N."""
    from hrm.rules.admission import Request, expand, simulate

    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=7)
    runtime = placed_runtime(open_checkpoint(path, "float32"), policy(n=3, mu=2), "cgopipe", CPU,
                             continuous=True)  # fmt: skip
    try:
        _, stats, _ = continuous(runtime, prompts, n=n, budget=budget)
    finally:
        runtime.close()
    requests = [
        Request(i, len(p), m) for i, (p, m) in enumerate(zip(prompts, MAX_NEW, strict=True))
    ]
    spans, admission = simulate(requests, max_running=n, token_budget=budget, total_blocks=64)
    passes = list(expand(spans))
    assert stats.tokens == [p.tokens for p in passes]
    assert stats.sequences == [len(p.decodes) + len(p.chunks) for p in passes]
    assert stats.peak_kv_blocks == admission.peak_held > 0
    assert max(stats.sequences) == admission.peak_running


def test_a_stop_token_ends_a_request_and_frees_its_blocks(checkpoints):
    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=7)
    first = alone(path, prompts)
    stop = first[3][1]  # request 3 ends on its second token, others where it appears
    runtime = placed_runtime(open_checkpoint(path, "float32"), policy(n=3, mu=2), "cgopipe", CPU,
                             continuous=True)  # fmt: skip
    try:
        got, _, _ = continuous(runtime, prompts, stops=(stop,))
    finally:
        runtime.close()
    for ours, full in zip(got, first, strict=True):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert ours == full[:end]


def test_a_compact_kv_cache_gives_the_static_runs_tokens(checkpoints):
    """int8 KV rows are quantized per row in blocks as in the static cache."""
    import dataclasses

    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=7)
    p = dataclasses.replace(policy(n=3, mu=2), kv_dtype="int8")
    runtime = placed_runtime(open_checkpoint(path, "float32"), p, "cgopipe", CPU, continuous=True)
    try:
        got, _, _ = continuous(runtime, prompts)
    finally:
        runtime.close()
    assert got == alone(path, prompts, kv_format="int8")


def test_bf16_logits_are_within_the_suites_tolerance(checkpoints):
    """In bf16 each request's logits, token by token, within the suite's tolerance of the same
    request run alone (as long as the tokens agree), and its first against transformers'. (On
    this checkpoint request 3 flips an expert at its fifth token in bf16 alone too, 0.15 from
    transformers: its pass mates change nothing.)"""
    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=7)
    p = policy(n=3, mu=2, dtype="bfloat16")
    runtime = placed_runtime(open_checkpoint(path, "bfloat16"), p, "cgopipe", CPU, continuous=True)
    got = {}
    try:
        limits = {i: Limits(max_new=m) for i, m in enumerate(MAX_NEW)}
        stats = run_passes(
            runtime, dict(enumerate(prompts)), limits,
            max_running=3, token_budget=BUDGET, total_blocks=64, keep_logits=True,
            on_finish=lambda i, ids, r: got.__setitem__(i, ids),
        )  # fmt: skip
    finally:
        runtime.close()
    model = MoEModel(open_checkpoint(path, "bfloat16"))
    reference = reference_model(path, torch.bfloat16)
    limit = TOLERANCE["bfloat16"]
    for i, (prompt, n) in enumerate(zip(prompts, MAX_NEW, strict=True)):
        alone = generate(model, [prompt], n, keep_logits=True)
        _, theirs = reference_generate(reference, [prompt], 1)
        assert relative_error(stats.logits[i][0][None], theirs[0]) <= limit, i
        for step in range(n):
            assert relative_error(stats.logits[i][step][None], alone.step_logits[step]) <= limit
            if got[i][: step + 1] != alone.output_token_ids[0][: step + 1]:
                break


def test_blocks_come_back_as_requests_end(checkpoints):
    """The pools hold blocks only while requests run: all free after the job, and the peak is
    what at most three running requests hold."""
    path = checkpoints["mixtral-single"]
    runtime = placed_runtime(open_checkpoint(path, "float32"), policy(n=3, mu=2), "serial", CPU,
                             continuous=True)  # fmt: skip
    try:
        _, stats, _ = continuous(runtime, ragged_prompts(LENGTHS, seed=7))
        pools = runtime.tasks.pools
        assert pools.held == 0 and not pools.tables
        life = sorted(
            (-(-(n + m - 1) // 16) for n, m in zip(LENGTHS, MAX_NEW, strict=True)), reverse=True
        )
        assert 1 <= pools.peak_held <= sum(life[:3])
    finally:
        runtime.close()
    assert stats.peak_kv_bytes == pools.peak_held * 16 * pools.token_bytes * len(pools.k)


def test_sampling_is_per_request_whatever_shares_its_passes(checkpoints):
    """A seeded request gives the same tokens in passes of other company."""
    from executor.generate import Sampling

    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=7)
    sampled = Limits(max_new=5, sampling=Sampling(temperature=0.9, top_p=0.9, seed=42))

    def tokens_of(company: list[int]) -> list[int]:
        runtime = placed_runtime(open_checkpoint(path, "float32"), policy(n=3, mu=2), "cgopipe",
                                 CPU, continuous=True)  # fmt: skip
        got = {}
        limits = {i: Limits(max_new=MAX_NEW[i]) for i in company} | {99: sampled}
        try:
            run_passes(runtime, {i: prompts[i] for i in company} | {99: prompts[5]}, limits,
                       max_running=3, token_budget=BUDGET, total_blocks=64,
                       on_finish=lambda i, ids, r: got.__setitem__(i, ids))  # fmt: skip
        finally:
            runtime.close()
        return got[99]

    assert tokens_of([]) == tokens_of([0, 1, 2]) == tokens_of([3, 6])
    assert torch.tensor(tokens_of([])).numel() == 5
