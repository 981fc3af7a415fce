"""The continuous plan: the static search's plans as KV pools, each run as continuous batching
with as many requests as its pool and memory admit, the job simulated by the executor's own
admission rule and priced pass by pass (planner/passes.py); the fastest wins.

Why the static plans are the candidates: a static plan at (N, mu, placement) has already shown
that N sequences at the longest context fit beside its weights and activations, so its KV
memory is a pool of kv_blocks(N, C) blocks. Continuous batching books each request's own life
(prompt + max_tokens - 1) from that pool, so more than N run where requests are shorter than the
longest. What else bounds the running count is the pass's hidden states: the tokens of a pass
(decodes and prompt chunks) must fit what the plan counted for them (activation_tokens).
Within those bounds the candidate is priced at the most requests that can run (a pass streams
the weights once whatever it carries, so more sequences a pass is never slower per token in the
model) at the largest token budget; the best of them is then priced at N running (the static
plan's own concurrency) too, and at half the budget (prompt chunks over more passes mix them
with more decodes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hrm.plan import Continuous, Plan, Prediction
from hrm.rules.admission import Request, blocks_for, kv_blocks, life_tokens
from hrm.rules.batches import plan_batches
from hrm.workload import Workload
from planner.evaluate import predict_batch
from planner.memory import activation_tokens
from planner.passes import JobPrice, price_job
from planner.search import MAX_BATCH_SIZE
from planner.setting import Setting

CANDIDATES = 3  # distinct (mu, placement) of the static top plans priced continuously
CHUNK_SHARES = (1.0, 0.5)  # of one micro-batch of the longest prompt, a pass's prompt tokens


def plan_continuous(setting: Setting, static: Sequence[Plan], requests: Sequence[Request]) -> Plan:
    """The fastest continuous run of `requests` over the static plans' pools: that plan with
    its Continuous limits and prediction."""
    shapes: dict = {}  # group terms, shared by every candidate's pricer

    def priced(plan: Plan, running: int, share: float) -> tuple[JobPrice, Plan, int, int]:
        pol, workload = plan.policy, setting.workload
        chunk = max(1, math.floor(share * pol.micro_batch_size * workload.prompt_len_max))
        budget = min(chunk + running, _pass_tokens(setting, plan))
        price = price_job(setting, pol, requests, token_budget=budget,
                          context_tokens=workload.max_context_len, max_running=running,
                          shapes=shapes)  # fmt: skip
        return price, plan, running, budget

    # each candidate at its most running and largest budget; then the best one's other settings
    tried = [priced(plan, most_running(setting, plan, requests), 1.0)
             for plan in _candidates(static)]  # fmt: skip
    best = max(tried, key=lambda t: t[0].throughput_tok_s)
    _, plan, most, _ = best
    for running in sorted({min(plan.policy.batch_size, most), most}):
        for share in CHUNK_SHARES:
            if (running, share) != (most, 1.0):
                best = max(best, priced(plan, running, share),
                           key=lambda t: t[0].throughput_tok_s)  # fmt: skip
    price, plan, running, budget = best
    continuous = Continuous(
        max_running=running,
        token_budget=budget,
        requests=len(requests),
        passes=price.passes,
        peak_running=price.peak_running,
        peak_kv_blocks=price.peak_blocks,
        predicted=Prediction(
            prefill_s=price.prefill_s,
            decode_s=price.decode_s,
            generated_tokens=price.generated_tokens,
        ),  # fmt: skip
    )
    return dataclasses.replace(plan, continuous=continuous)


def most_running(setting: Setting, plan: Plan, requests: Sequence[Request]) -> int:
    """The most requests that can run at once under `plan`: as many of the job's shortest lives
    as its KV pool holds, at most one pass's tokens' worth, the job's size and the search's
    largest batch."""
    pool = kv_blocks(plan.policy.batch_size, setting.workload.max_context_len)
    shortest = min(blocks_for(life_tokens(r)) for r in requests)
    return max(1, min(pool // shortest, _pass_tokens(setting, plan), len(requests),
                      MAX_BATCH_SIZE))  # fmt: skip


def _pass_tokens(setting: Setting, plan: Plan) -> int:
    pol = plan.policy
    return activation_tokens(setting.arch, setting.workload, batch_size=pol.batch_size,
                             micro_batch_size=pol.micro_batch_size,
                             ffn_on_gpu=pol.ffn_on_gpu)  # fmt: skip


def _candidates(static: Sequence[Plan]) -> list[Plan]:
    """The first CANDIDATES plans of distinct (mu, attention, FFN) placements, each the one of
    largest N (the largest pool) among the top plans."""
    by_kind: dict[tuple, Plan] = {}
    for plan in static:
        p = plan.policy
        kind = (p.micro_batch_size, p.attention_on_gpu, p.ffn_on_gpu)
        if kind not in by_kind or p.batch_size > by_kind[kind].policy.batch_size:
            by_kind[kind] = plan
    return list(by_kind.values())[:CANDIDATES]


def price_static_job(setting: Setting, plan: Plan, requests: Sequence[Request]) -> Prediction:
    """The same job as `hrm run --batching static` runs it, to set beside the continuous one:
    the plan's batches of N (hrm/rules/batches.py, the last one short), one after another, each
    predicted at its own size and lengths over its micro-batches' left-padded KV caches."""
    pol = plan.policy
    prefill = decode = 0.0
    for batch in plan_batches([r.prompt_len for r in requests], pol.batch_size,
                              pol.micro_batch_size):  # fmt: skip
        members = [requests[i] for i in batch.indices]
        answers = [r.max_new for r in members]
        workload = Workload.from_prompt_lens([r.prompt_len for r in members], max(answers),
                                             False, answers)  # fmt: skip
        p = predict_batch(setting.arch, setting.hardware, workload, pol, plan.schedule,
                          len(members)).predicted  # fmt: skip
        prefill, decode = prefill + p.prefill_s, decode + p.decode_s
    generated = sum(r.max_new for r in requests)
    return Prediction(prefill_s=prefill, decode_s=decode, generated_tokens=generated)
