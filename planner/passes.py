"""Continuous batching priced pass by pass: the passes hrm.rules.admission makes of a job (the
executor's own rule, replayed), each priced with the static model's terms (planner/cost.py).

A pass's micro-batches are groups of decodes or prompt chunks (executor/passes.py). Each group
is priced as one micro-batch of the static model at its own shape: a decode group of b
sequences at their mean context c is a decode step of b at context c; a chunk group of b
prompts of mean chunk l is a prefill of b prompts of l (a later chunk's attention over its
prompt's earlier tokens is not counted). The pass then takes what the schedule's overlap gives,
exactly as a static step does: per layer T_layer >= each queue's sum over the groups (and, on a
CPU standing in for the GPU, their total), the longest group's chain; serial adds the chains
up; the weights stream once a pass in as many pages as the pass has groups; fill and drain
when there are two groups or more, and each sampling group's LM head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hrm.policy import Policy
from hrm.rules.admission import Pass, Request, kv_blocks, simulate
from hrm.workload import Workload
from planner.cost import queue_terms, weight_stream_seconds
from planner.evaluate import policy_vector
from planner.layer_seconds import micro_batch_seconds
from planner.setting import Setting

CONTEXT_BUCKET = 1.0625  # contexts priced at the next power of this (6% apart at most)


@dataclass(frozen=True, kw_only=True)
class JobPrice:
    """A continuous job's simulated passes and their prices."""

    passes: int
    seconds: float
    prefill_s: float  # passes with prompt tokens
    decode_s: float
    generated_tokens: int
    mean_sequences: float
    busy_s: dict[str, float]  # each queue's busy seconds over the passes (the heads left out)

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class PassPricer:
    """Prices passes for one setting and policy; group prices are kept by shape."""

    def __init__(self, setting: Setting, policy: Policy):
        self.setting = setting
        self.v = policy_vector(policy)
        self._groups: dict[tuple[str, int, float], dict[str, float]] = {}
        self.busy_s = dict.fromkeys(("gpu", "cpu", "h2d", "d2h"), 0.0)  # over the passes priced

    def group(self, phase: str, b: int, length: float) -> dict[str, float]:
        """One group's per-layer seconds on each queue, its chain, fill and head: decode at
        context `length`, or prefill of chunks of `length` tokens."""
        if phase == "decode":
            length = _bucket(max(length, 1.0))
        else:  # chunks too, from 16 tokens (a pass's prompts are of every length)
            length = float(max(1, round(length)))
            if length > 16:
                length = round(_bucket(length))
        key = (phase, b, length)
        if key not in self._groups:
            self._groups[key] = self._price_group(phase, b, length)
        return self._groups[key]

    def _price_group(self, phase: str, b: int, length: float) -> dict[str, float]:
        prompt = length - 1 if phase == "decode" else length
        prompt = max(prompt, 1.0)
        workload = Workload(prompt_len_mean=prompt, prompt_len_max=math.ceil(prompt), gen_len=2)
        setting = dataclasses.replace(self.setting, workload=workload)
        object.__setattr__(setting, "ffn_memo", self.setting.ffn_memo)  # by rows: any workload
        q = queue_terms(setting, micro_batch_seconds(setting, b))
        step, v = (0 if phase == "prefill" else 1), self.v
        out = {name: float(q.queue(name).scaled[step] @ v) for name in q.components}
        # a compact format's dequantize is once per pass of a layer, not per group
        out["dequantize"] = float(q.components["gpu"]["dequantize"].unscaled[step] @ v)
        out["chain"] = float(q.chain.unscaled[step] @ v)
        out["fill"] = float(q.fill.unscaled[step] @ v)
        out["head"] = sum(float(e.scaled[step] @ v) for e in q.head.values())
        out["weights"] = float(q.components["h2d"]["weights"].weights @ v)
        return out

    def price(self, groups: Sequence[tuple[str, int, float]]) -> float:
        """Seconds of a pass cut into `groups` (phase, sequences, context or chunk)."""
        s, hw = self.setting, self.setting.hardware
        priced = [self.group(*g) for g in groups]
        m = len(priced)
        queues = {q: sum(g[q] for g in priced) for q in ("gpu", "cpu", "h2d", "d2h")}
        queues["gpu"] += priced[0]["dequantize"]
        stream = float(weight_stream_seconds(s, np.array([m]))[0]) * priced[0]["weights"]
        queues["h2d"] += stream
        if s.schedule == "serial":
            layer = max(stream, sum(g["chain"] for g in priced))
        else:
            layer = max(*queues.values(), max(g["chain"] for g in priced))
            link = hw.link
            if link is not None and link.bidirectional_bytes_per_s:  # as planner/cost.py
                both = link.bidirectional_bytes_per_s
                layer = max(layer, (queues["h2d"] * link.h2d_bytes_per_s
                                    + queues["d2h"] * link.d2h_bytes_per_s) / both)  # fmt: skip
            if s.schedule == "overlap":
                layer = max(layer, queues["h2d"] + priced[0]["gpu"])
        if hw.stand_in:
            layer = max(layer, sum(queues.values()))
        fill = priced[0]["fill"] if m >= 2 and s.schedule != "serial" else 0.0
        for q, busy in queues.items():
            self.busy_s[q] += s.arch.num_layers * busy
        return s.arch.num_layers * layer + fill + sum(g["head"] for g in priced)


def _bucket(length: float) -> float:
    """The next power of CONTEXT_BUCKET at or above `length`."""
    return CONTEXT_BUCKET ** math.ceil(math.log(length, CONTEXT_BUCKET))


def pass_groups(p: Pass, micro_batch_size: int) -> list[tuple[str, int, float]]:
    """The groups of a pass as the executor cuts them: (phase, sequences, mean context or
    mean chunk)."""
    out = []
    for phase, entries in p.groups(micro_batch_size):
        if phase == "decode":
            out.append((phase, len(entries), sum(pos + 1 for _, pos in entries) / len(entries)))
        else:
            out.append((phase, len(entries), sum(c.length for c in entries) / len(entries)))
    return out


def price_job(
    setting: Setting,
    policy: Policy,
    requests: Sequence[Request],
    *,
    token_budget: int,
    context_tokens: int,
) -> JobPrice:
    """The job's passes under the executor's admission rule (every request to its max_new), at
    most N running, KV for N sequences of `context_tokens`, each pass priced."""
    passes = simulate(requests, max_running=policy.batch_size, token_budget=token_budget,
                      total_blocks=kv_blocks(policy.batch_size, context_tokens))  # fmt: skip
    pricer = PassPricer(setting, policy)
    prefill = decode = 0.0
    for p in passes:
        seconds = pricer.price(pass_groups(p, policy.micro_batch_size))
        if p.chunks:
            prefill += seconds
        else:
            decode += seconds
    sequences = sum(len(p.decodes) + len(p.chunks) for p in passes)
    return JobPrice(
        passes=len(passes),
        seconds=prefill + decode,
        prefill_s=prefill,
        decode_s=decode,
        generated_tokens=sum(r.max_new for r in requests),
        mean_sequences=sequences / len(passes) if passes else 0.0,
        busy_s=pricer.busy_s,
    )
