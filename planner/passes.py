"""Continuous batching priced pass by pass: the passes hrm.rules.admission makes of a job (the
executor's own rule, replayed), each priced with the static model's terms (planner/cost.py).

A pass's micro-batches are groups of decodes or prompt chunks (executor/passes.py). Each group
is priced as one micro-batch of the static model at its own shape. A decode group of b
sequences whose longest context is c is a decode step of b at context c: the executor gathers
each sequence's rows from the pool up to the longest, then attends, masked, and the gather's
read and write are priced too (Setting.paged_kv_cache). A chunk group of b prompts of mean
chunk l is a prefill of b prompts of l; where the chunks start s tokens into their prompts on
average (a prompt cut across passes), its queries also attend over those s earlier tokens,
which are gathered from the pool with the chunk's own (Setting.prefill_prefix). The pass then
takes what the schedule's overlap gives, exactly as a static step does: per layer T_layer >=
each queue's sum over the groups (and, on a CPU standing in for the GPU, their total), the
longest group's chain; serial adds the chains up; the weights stream once a pass in as many
pages as the pass has groups; fill and drain when there are two groups or more, and each
sampling group's LM head.

Shapes are priced on one grid, each value between the two points either side of it, weighted
linearly (a pass's last group is of any size, and each new shape is a static model's layer to
price): group sizes and chunk lengths are exact to 16, then on the whole numbers about 16 x
GRID^k (26% apart, every power of two on it: a full micro-batch of 64 is priced as itself); a
chunk's start is exact at none, then between none and 16, then on the grid. A start's work is
linear in it (its keys), and a size's and a length's nearly so, so a shape so priced is within
2% of the exact one (docs/decisions.md, 2026-12-07). A decode group's context is priced
exactly: one static model of its size decodes from a 1-token prompt to the job's longest
context, a step per context (its steps are one vectorised evaluation), and a fractional context
between two integers is interpolated.
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

GRID = 2 ** (1 / 3)  # group sizes, chunk lengths and starts from 16: points 16 x GRID^k apart


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


# a group's terms, in this order, as one vector (at a policy) or one row per step (by basis)
TERMS = ("gpu", "cpu", "h2d", "d2h", "dequantize", "disk", "chain", "fill", "head", "weights")
GPU, CPU, H2D, D2H, DEQUANTIZE, DISK, CHAIN, FILL, HEAD, WEIGHTS = range(len(TERMS))
QUEUES = TERMS[: D2H + 1]


class PassPricer:
    """Prices passes for one setting and policy. A group's terms, [rows, TERMS, placement
    basis], are kept by shape in `shapes`, which pricers of one setting may share (a search
    prices many policies' passes of the same shapes); their values at this policy, one vector
    over TERMS a group, in _groups (a pass prices its groups as one array)."""

    def __init__(self, setting: Setting, policy: Policy, shapes: dict | None = None):
        self.setting = setting
        self.v = policy_vector(policy)
        self.shapes: dict[tuple, np.ndarray] = {} if shapes is None else shapes
        self._groups: dict[tuple[str, int, float, float], np.ndarray] = {}
        self._decodes: dict[int, np.ndarray] = {}  # a size's table at this policy
        self._streams: dict[int, float] = {}  # the weights' stream in m pages, per share streamed
        self.busy_s = dict.fromkeys(("gpu", "cpu", "h2d", "d2h"), 0.0)  # over the passes priced

    def group(self, phase: str, b: int, length: float, before: float = 0.0) -> np.ndarray:
        """One group's per-layer seconds on each queue, its chain, fill and head (TERMS): decode
        at context `length`, or prefill of chunks of `length` tokens that start `before` tokens
        into their prompts."""
        if phase == "decode":
            length = max(length, 2.0)  # a decode attends over its prompt and itself at least
        else:  # whole tokens: a group's mean chunk and start
            length, before = float(max(1, round(length))), float(max(0, round(before)))
        key = (phase, b, length, before)
        if key not in self._groups:
            self._groups[key] = self._interpolated(phase, b, length, before)
        return self._groups[key]

    def _interpolated(self, phase: str, b: int, length: float, before: float) -> np.ndarray:
        """A group's terms from the priced shapes about it (_grid_points): its size, and for a
        chunk group its length and start, weighted linearly in each."""
        sizes = _grid_points(b, 16)
        if phase == "decode":
            shapes = [(size, w, length, 0.0) for size, w in sizes]
        else:
            shapes = [(size, ws * wl * wb, at, start) for size, ws in sizes
                      for at, wl in _grid_points(length, 16)
                      for start, wb in _grid_points(before, 0)]  # fmt: skip
        return sum(w * self._values(phase, int(size), at, start) for size, w, at, start in shapes)

    def _values(self, phase: str, b: int, length: float, before: float) -> np.ndarray:
        """A group's terms of b at this policy: a chunk's, or a decode's at context `length`
        (row c - 2 of its size's table, a fractional context between the rows either side)."""
        if phase != "decode":
            key = (phase, b, length, before)
            if key not in self.shapes:
                self.shapes[key] = self._group_terms(b, prompt=length, steps=1, before=before)
            return self.shapes[key][0] @ self.v
        low = math.floor(length)
        rows = self._decodes.get(b)
        if rows is None or len(rows) < low:  # contexts 2..G: G - 1 rows
            table = self.shapes.get(("decode", b))
            if table is None or len(table) < low:  # at once to the job's longest context
                longest = max(low, self.setting.workload.max_context_len)
                reach = max(64, 1 << math.ceil(math.log2(longest + 1)))
                table = self.shapes["decode", b] = self._group_terms(b, prompt=1.0, steps=reach)
            rows = self._decodes[b] = table @ self.v
        share = length - low
        if not share:
            return rows[low - 2]
        return (1 - share) * rows[low - 2] + share * rows[low - 1]

    def _group_terms(self, b: int, *, prompt: float, steps: int, before: float = 0.0) -> np.ndarray:
        """[rows, TERMS, basis] of a group of b over a static model's steps: its prefill of
        `prompt` tokens after `before` in the pool (steps=1), or its decode steps at contexts
        prompt + 1 .. prompt + steps - 1."""
        workload = Workload(prompt_len_mean=prompt, prompt_len_max=math.ceil(prompt),
                            gen_len=max(2, steps))  # fmt: skip
        setting = self.setting.alike(workload=workload, prefill_prefix=before)
        object.__setattr__(setting, "ffn_memo", self.setting.ffn_memo)  # by rows: any workload
        q = queue_terms(setting, micro_batch_seconds(setting, b))
        rows = slice(0, 1) if steps == 1 else slice(1, None)
        out = {name: q.queue(name).scaled[rows] for name in QUEUES}
        # a compact format's dequantize is once per pass of a layer, not per group
        out["dequantize"] = q.components["gpu"]["dequantize"].unscaled[rows]
        out["disk"] = q.queue("disk").unscaled[rows]  # the disk tier's reads: once a pass too
        out["chain"] = q.chain.unscaled[rows]
        out["fill"] = q.fill.unscaled[rows]
        out["head"] = sum(e.scaled[rows] for e in q.head.values())
        out["weights"] = np.broadcast_to(q.components["h2d"]["weights"].weights,
                                         out["chain"].shape)  # fmt: skip
        return np.stack([out[name] for name in TERMS], axis=1)

    def price(self, groups: Sequence[tuple]) -> float:
        """Seconds of a pass cut into `groups` (phase, sequences, context or chunk[, start])."""
        return float(self.prices([groups])[0])

    def prices(self, passes: Sequence[Sequence[tuple]]) -> np.ndarray:
        """Seconds of each pass, each cut into its groups (price), as arrays over the passes: a
        job prices thousands."""
        s, hw = self.setting, self.setting.hardware
        m = np.array([len(groups) for groups in passes])
        starts = np.concatenate([[0], np.cumsum(m)[:-1]])
        priced = np.array([self.group(*g) for groups in passes for g in groups])
        total, first = np.add.reduceat(priced, starts, axis=0), priced[starts]
        for count in set(m.tolist()) - self._streams.keys():
            self._streams[count] = float(weight_stream_seconds(s, np.array([count]))[0])
        stream = np.array([self._streams[c] for c in m.tolist()]) * first[:, WEIGHTS]
        queues = total[:, : D2H + 1].copy()  # QUEUES, then the disk's reads
        queues[:, GPU] += first[:, DEQUANTIZE]
        queues[:, H2D] += stream
        queues = np.column_stack([queues, first[:, DISK]])
        if s.schedule == "serial":
            layer = np.maximum(stream, total[:, CHAIN])
        else:
            layer = np.maximum(queues.max(axis=1), np.maximum.reduceat(priced[:, CHAIN], starts))
            link = hw.link
            if link is not None and link.bidirectional_bytes_per_s:  # as planner/cost.py
                both = (queues[:, H2D] * link.h2d_bytes_per_s
                        + queues[:, D2H] * link.d2h_bytes_per_s)  # fmt: skip
                layer = np.maximum(layer, both / link.bidirectional_bytes_per_s)
            if s.schedule == "overlap":
                layer = np.maximum(layer, queues[:, H2D] + first[:, GPU])
        if hw.stand_in:
            layer = np.maximum(layer, queues.sum(axis=1))
        fill = first[:, FILL] * ((m >= 2) & (s.schedule != "serial"))
        busy = s.arch.num_layers * queues.sum(axis=0)
        for q, seconds in zip((*QUEUES, "disk"), busy.tolist(), strict=True):
            if q != "disk" or seconds:
                self.busy_s[q] = self.busy_s.get(q, 0.0) + seconds
        return s.arch.num_layers * layer + fill + total[:, HEAD]


def _grid_points(x: float, exact: int) -> tuple[tuple[float, float], ...]:
    """A group size, chunk length or start (a whole number) as the priced points either side of
    it with their weights: itself to `exact`; from there to 16, `exact` and 16; above 16 the
    whole numbers about 16 x GRID^k either side. Linear between two points, which a start's
    attention (keys) is, and a size's and a length's work nearly (a length's attention, square
    in it, errs by 1.3% at most)."""
    if x <= exact:
        return ((x, 1.0),)
    if x <= 16:
        lo, hi = float(exact), 16.0
    else:
        k = math.floor(math.log(x / 16, GRID))
        k += (_grid_node(k + 1) <= x) - (_grid_node(k) > x)  # the log's rounding
        lo, hi = _grid_node(k), _grid_node(k + 1)
    share = (x - lo) / (hi - lo)
    return tuple((at, w) for at, w in ((lo, 1.0 - share), (hi, share)) if w > 0)


def _grid_node(k: int) -> float:
    return float(round(16 * GRID**k))


def pass_groups(p: Pass, micro_batch_size: int) -> list[tuple]:
    """The groups of a pass as the executor cuts them (Pass.groups): (decode, sequences,
    context), a decode group's context its longest, to which the executor gathers and attends
    every sequence's rows, masked (executor/kv_blocks.py); (prefill, sequences, mean chunk,
    mean start)."""
    mu, out = max(1, micro_batch_size), []
    positions = np.sort(p.positions).tolist()  # shortest first: a group's last is its longest
    n = len(positions)
    for s in range(0, n, mu):
        end = min(s + mu, n)
        out.append(("decode", end - s, 1 + positions[end - 1]))
    for s in range(0, len(p.chunks), mu):
        entries = p.chunks[s : s + mu]
        k = len(entries)
        out.append(("prefill", k, sum(c.length for c in entries) / k,
                    sum(c.start for c in entries) / k))  # fmt: skip
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
    pricer = PassPricer(setting.alike(paged_kv_cache=True), policy, shapes)  # the run's pools
    passes, chunked, sequences = [], [], 0
    for p, count in spans:
        groups = pass_groups(p, policy.micro_batch_size)
        for later in range(count):  # a span's decodes each a token further, pass by pass
            passes.append([(ph, b, c + later, *r) for ph, b, c, *r in groups])
        chunked += [bool(p.chunks)] * count
        sequences += count * (len(p.positions) + len(p.chunks))
    seconds = pricer.prices(passes).tolist() if passes else []
    prefill = sum(x for x, c in zip(seconds, chunked, strict=True) if c)
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
