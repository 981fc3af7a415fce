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

Shapes are priced on a grid: contexts and chunks at powers of CONTEXT_BUCKET (6% apart), and
groups of more than 16 sequences between two sizes of that grid, interpolated linearly (a
pass's last group is of any size, and each new shape is a static model's layer to price).
"""

from __future__ import annotations

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
    peak_running: int  # the most requests running at once
    peak_blocks: int  # the most KV blocks reserved at once (admission reserves whole lives)
    pass_seconds: tuple[float, ...]  # each pass's, in order

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class PassPricer:
    """Prices passes for one setting and policy. A group's terms, as vectors over the placement
    basis, are kept by shape in `shapes`, which pricers of one setting may share (a search
    prices many policies' passes of the same shapes); their values at this policy in _groups."""

    def __init__(self, setting: Setting, policy: Policy, shapes: dict | None = None):
        self.setting = setting
        self.v = policy_vector(policy)
        self.shapes: dict[tuple[str, int, float], dict[str, np.ndarray]] = (
            {} if shapes is None else shapes
        )
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
            lo, hi = _sizes_around(b)
            share = (b - lo) / (hi - lo) if hi > lo else 0.0
            terms = {k: (1 - share) * t for k, t in self._terms(phase, lo, length).items()}
            if share:
                for k, t in self._terms(phase, hi, length).items():
                    terms[k] = terms[k] + share * t
            self._groups[key] = {k: float(t @ self.v) for k, t in terms.items()}
        return self._groups[key]

    def _terms(self, phase: str, b: int, length: float) -> dict[str, np.ndarray]:
        key = (phase, b, length)
        if key not in self.shapes:
            self.shapes[key] = self._group_terms(phase, b, length)
        return self.shapes[key]

    def _group_terms(self, phase: str, b: int, length: float) -> dict[str, np.ndarray]:
        prompt = length - 1 if phase == "decode" else length
        prompt = max(prompt, 1.0)
        workload = Workload(prompt_len_mean=prompt, prompt_len_max=math.ceil(prompt), gen_len=2)
        setting = self.setting.alike(workload=workload)
        object.__setattr__(setting, "ffn_memo", self.setting.ffn_memo)  # by rows: any workload
        q = queue_terms(setting, micro_batch_seconds(setting, b))
        step = 0 if phase == "prefill" else 1
        out = {name: q.queue(name).scaled[step] for name in q.components}
        # a compact format's dequantize is once per pass of a layer, not per group
        out["dequantize"] = q.components["gpu"]["dequantize"].unscaled[step]
        out["disk"] = q.queue("disk").unscaled[step]  # the disk tier's reads: once a pass too
        out["chain"] = q.chain.unscaled[step]
        out["fill"] = q.fill.unscaled[step]
        out["head"] = sum(e.scaled[step] for e in q.head.values())
        out["weights"] = q.components["h2d"]["weights"].weights
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
        if priced[0]["disk"]:
            queues["disk"] = priced[0]["disk"]
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
            self.busy_s[q] = self.busy_s.get(q, 0.0) + s.arch.num_layers * busy
        return s.arch.num_layers * layer + fill + sum(g["head"] for g in priced)


def _sizes_around(b: int) -> tuple[int, int]:
    """The priced group sizes either side of `b` sequences: every size to 16, then whole powers
    of CONTEXT_BUCKET (a pass's last group is of any size; a group between two is
    interpolated)."""
    if b <= 16:
        return b, b
    k = math.floor(math.log(b, CONTEXT_BUCKET))
    lo, hi = math.floor(CONTEXT_BUCKET**k), math.ceil(CONTEXT_BUCKET ** (k + 1))
    return max(16, min(lo, b)), max(hi, b)


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
    max_running: int | None = None,
    shapes: dict | None = None,
) -> JobPrice:
    """The job's passes under the executor's admission rule (every request to its max_new), at
    most `max_running` running (default N), KV for N sequences of `context_tokens`, each pass
    priced; `shapes`: group terms shared with other pricers of `setting` (PassPricer)."""
    spans, admission = simulate(
        requests, max_running=max_running or policy.batch_size, token_budget=token_budget,
        total_blocks=kv_blocks(policy.batch_size, context_tokens),
    )  # fmt: skip
    pricer = PassPricer(setting, policy, shapes)
    seconds, prefill, sequences = [], 0.0, 0
    for p, count in spans:
        groups = pass_groups(p, policy.micro_batch_size)
        for later in range(count):  # a span's decodes each a token further, pass by pass
            seconds.append(pricer.price([(ph, b, c + later) for ph, b, c in groups]))
        if p.chunks:
            prefill += seconds[-1]
        sequences += count * (len(p.decodes) + len(p.chunks))
    decode = sum(seconds) - prefill
    return JobPrice(
        passes=len(seconds),
        seconds=prefill + decode,
        prefill_s=prefill,
        decode_s=decode,
        generated_tokens=sum(r.max_new for r in requests),
        mean_sequences=sequences / len(seconds) if seconds else 0.0,
        busy_s=pricer.busy_s,
        peak_running=admission.peak_running,
        peak_blocks=admission.peak_reserved,
        pass_seconds=tuple(seconds),
    )
