"""Continuous batching's one admission rule: which tokens each pass of the weights carries.

The executor runs it (executor/passes.py) and the planner replays it to simulate a job, so the
two see the same passes. It is plain Python over request lengths, with no tensors.

A pass carries, in this order:
- one token of every running sequence whose prompt is in (a decode);
- the next chunk of every prompt that is partly in (chunked prefill), oldest first;
- chunks of requests admitted from the queue, in input order,
while the pass has tokens left of its budget (decodes always go: a pass never starves a running
sequence) and fewer than `max_running` sequences run. A request is admitted only when the KV
blocks of its whole life (prompt + max_new - 1 tokens: the last token is never fed back) are
free beside every running sequence's: admission never over-commits, so no sequence is ever
preempted, and its blocks return to the pool when it ends (docs/decisions.md, 2026-12-06).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hrm.errors import HrmError

BLOCK_TOKENS = 16  # tokens a KV block holds (vLLM's default block size)


@dataclass(frozen=True)
class Request:
    index: int  # input index
    prompt_len: int
    max_new: int


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [start, start + length) of request `index`; `last`: the prompt's end is in
    it, so it samples the first new token."""

    index: int
    start: int
    length: int
    last: bool


class Pass:
    """One pass of the weights: the running sequences' decodes (request index, the position of
    the token fed: its KV length before the pass) and the prompt chunks.

    The decodes are held as two arrays (`requests`, `positions`), which a simulation of
    thousands of sequences a pass makes and reads without a Python object a sequence;
    `decodes` gives them as (index, position) pairs. Passes are never changed once made."""

    __slots__ = ("requests", "positions", "chunks", "_decodes")

    def __init__(self, decodes=(), chunks=(), *, arrays: tuple | None = None):
        if arrays is None:
            pairs = np.array(decodes, dtype=np.int64).reshape(-1, 2)
            arrays = (pairs[:, 0].copy(), pairs[:, 1].copy())
        self.requests, self.positions = arrays
        self.chunks: tuple[Chunk, ...] = tuple(chunks)
        self._decodes = None

    @property
    def decodes(self) -> tuple[tuple[int, int], ...]:
        if self._decodes is None:
            self._decodes = tuple(zip(self.requests.tolist(), self.positions.tolist(), strict=True))
        return self._decodes

    def __eq__(self, other) -> bool:
        if not isinstance(other, Pass):
            return NotImplemented
        return (self.chunks == other.chunks and np.array_equal(self.requests, other.requests)
                and np.array_equal(self.positions, other.positions))  # fmt: skip

    __hash__ = None

    def __repr__(self) -> str:
        return f"Pass(decodes={self.decodes!r}, chunks={self.chunks!r})"

    @property
    def tokens(self) -> int:
        return len(self.positions) + sum(c.length for c in self.chunks)

    @property
    def samples(self) -> tuple[int, ...]:
        """Requests that sample a token in this pass, decodes first."""
        return tuple(self.requests.tolist()) + tuple(c.index for c in self.chunks if c.last)

    def shifted(self, later: int) -> Pass:
        """The decode-only pass `later` passes on in a span (Admission.next_span): the same
        sequences, each `later` tokens further."""
        if not later:
            return self
        return Pass(arrays=(self.requests, self.positions + later))

    def groups(self, micro_batch_size: int) -> list[tuple[str, list]]:
        """The pass cut into micro-batches of at most `micro_batch_size` sequences: decodes
        ("decode", [(index, position)]) shortest first, then chunks ("prefill", [Chunk]). A
        decode micro-batch gathers and attends each sequence to its longest (executor/
        kv_blocks.py), so sequences of like lengths share one. The order holds over a span:
        every decode moves on one token a pass."""
        mu = max(1, micro_batch_size)
        order = np.argsort(self.positions, kind="stable")  # shortest first, ties in pass order
        index, positions = self.requests[order].tolist(), self.positions[order].tolist()
        decodes = list(zip(index, positions, strict=True))
        out = [("decode", decodes[s : s + mu]) for s in range(0, len(decodes), mu)]
        out += [("prefill", list(self.chunks[s : s + mu])) for s in range(0, len(self.chunks), mu)]
        return out


def blocks_for(tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return -(-max(1, tokens) // block_tokens)


def life_tokens(request: Request) -> int:
    """KV rows a request holds at its end: its prompt and every new token but the last."""
    return request.prompt_len + request.max_new - 1


def kv_blocks(batch_size: int, context_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """The blocks of the KV memory a static batch of `batch_size` books at `context_tokens` a
    sequence (longest prompt + most new tokens): what a plan counts, which continuous batching
    shares out by what the running requests hold."""
    return -(-batch_size * context_tokens // block_tokens)


def token_budget_limit(batch_size: int, micro_batch_size: int, prompt_len_max: int) -> int:
    """The most tokens a pass may carry: one micro-batch's prefill, as a plan counts its
    activations (mu x the longest prompt), beside a decode of every running sequence."""
    return micro_batch_size * prompt_len_max + batch_size


def check_fits(requests: Iterable[Request], total_blocks: int, block_tokens: int = BLOCK_TOKENS):
    """Refuse, naming it, the first request whose whole life needs more KV than there is: it
    could never be admitted, and the run would wait for it for ever."""
    for r in requests:
        need = blocks_for(life_tokens(r), block_tokens)
        if need > total_blocks:
            raise HrmError(
                f"request {r.index + 1} (a prompt of {r.prompt_len} tokens and up to "
                f"{r.max_new} new) needs {need * block_tokens} tokens of KV cache; the run "
                f"holds {total_blocks * block_tokens}: shorten it, or plan for more memory"
            )


class Admission:
    """The scheduler's state over one job: the queue, the running sequences and the blocks
    reserved for them."""

    def __init__(
        self,
        requests: Iterable[Request],
        *,
        max_running: int,
        token_budget: int,
        total_blocks: int,
        block_tokens: int = BLOCK_TOKENS,
    ):
        if max_running < 1 or token_budget < 1:
            raise ValueError("max_running and token_budget must be at least 1")
        self.max_running, self.token_budget = max_running, token_budget
        self.total_blocks, self.block_tokens = total_blocks, block_tokens
        self.queue: deque[Request] = deque(requests)
        self.running: dict[int, Request] = {}  # admitted, in admission order
        self.prefilled: dict[int, int] = {}  # prompt tokens in, per running request
        self.filling: dict[int, None] = {}  # running requests whose prompt is partly in
        # the others, decoding, in the order they began: request index, the position of the
        # token each feeds next, tokens sampled and max_new. Arrays, since every pass moves all
        # of them on (the simulation's inner loop, thousands of sequences a pass)
        self.decoding = _Decoding()
        self.reserved = 0  # blocks of the running requests' whole lives
        # the most at once over the job: requests running, blocks reserved, and blocks holding
        # KV rows (what the executor's pools hand out as tokens are written: KVBlocks.peak_held)
        self.peak_running = self.peak_reserved = self.peak_held = 0
        self.held = 0  # blocks holding the running requests' rows
        check_fits(self.queue, total_blocks, block_tokens)

    @property
    def done(self) -> bool:
        return not self.queue and not self.running

    def next_pass(self) -> Pass:
        """The tokens of the next pass (empty only when the job is done)."""
        decodes = self.decoding.arrays()
        room = self.token_budget - len(decodes[0])
        chunks: list[Chunk] = []
        for i in self.filling:  # prompts partly in, oldest first
            if room <= 0:
                break
            chunks.append(self._chunk(self.running[i], self.prefilled[i], room))
            room -= chunks[-1].length
        while room > 0 and self.queue and len(self.running) < self.max_running:
            r = self.queue[0]
            need = blocks_for(life_tokens(r), self.block_tokens)
            if self.reserved + need > self.total_blocks:
                break  # in input order: a long request is not overtaken for ever
            self.queue.popleft()
            self.running[r.index] = r
            self.filling[r.index] = None
            self.prefilled[r.index] = 0
            self.reserved += need
            chunks.append(self._chunk(r, 0, room))
            room -= chunks[-1].length
        self.peak_running = max(self.peak_running, len(self.running))
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Pass(chunks=chunks, arrays=decodes)

    @staticmethod
    def _chunk(r: Request, start: int, room: int) -> Chunk:
        length = min(r.prompt_len - start, room)
        return Chunk(index=r.index, start=start, length=length, last=start + length == r.prompt_len)

    def complete(self, done: Pass, stopped: Sequence[int] = ()) -> list[int]:
        """Account for a pass that ran (the one next_pass gave last): its chunks are in, its
        samplers have a token more. Returns the requests that ended (at max_new, or in
        `stopped`: a stop token or string), whose blocks are free again, in the order they
        sampled."""
        return self.complete_span(done, 1, stopped)

    def next_span(self) -> tuple[Pass, int]:
        """The next pass and how many passes it repeats for: a pass of decodes alone (nothing
        admitted, no prompt partly in and given a chunk) repeats, each sequence a token further
        (Pass.shifted), until the first of its sequences ends, since until then no block, no
        running slot and no token of the budget frees up. complete_span accounts for them."""
        p = self.next_pass()
        if p.chunks or not len(p.positions):
            return p, 1
        return p, self.decoding.steps_left()

    def complete_span(self, span: Pass, count: int, stopped: Sequence[int] = ()) -> list[int]:
        """complete() of `count` passes of a span from next_span (a span of more than one pass
        has no chunks); returns the requests that ended, in the order they sampled."""
        bt, d = self.block_tokens, self.decoding
        if len(span.positions) != len(d):
            raise ValueError("complete() takes the pass that next_pass() gave last")
        for c in span.chunks:
            self.held += -(-(c.start + c.length) // bt) - (-(-c.start // bt))
            self.prefilled[c.index] = c.start + c.length
        self.held += d.advance(count, bt)  # rows pos .. pos + count - 1 written
        ends = d.ended(stopped)
        began = [c for c in span.chunks if c.last]  # first token sampled: decodes from now on
        if began:
            news = [(c.index, c.start + c.length, self.running[c.index].max_new) for c in began]
            for c in began:
                del self.filling[c.index]
            d.add(news)
            ends = np.concatenate([ends, [i in stopped or m <= 1 for i, _, m in news]])
        self.peak_held = max(self.peak_held, self.held)
        return self._end(ends)

    def _end(self, ends: np.ndarray) -> list[int]:
        """Free the blocks of the decoding requests marked in `ends`: those holding their rows
        (as many as the position each feeds next) and their lives'."""
        if not ends.any():
            return []
        ended, rows = self.decoding.remove(ends)
        self.held -= int((-(-rows // self.block_tokens)).sum())
        for i in ended:
            del self.prefilled[i]
            self.reserved -= blocks_for(life_tokens(self.running.pop(i)), self.block_tokens)
        return ended


class _Decoding:
    """The decoding sequences as arrays, in the order they began (request index, position fed
    next, tokens sampled, max_new): a pass moves them all on in a few array operations."""

    def __init__(self):
        self.index, self.pos, self.made, self.max_new = (np.zeros(0, np.int64) for _ in range(4))

    def __len__(self) -> int:
        return len(self.index)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(request indices, positions): never changed in place, so a Pass may keep them."""
        return self.index, self.pos

    def steps_left(self) -> int:
        """Passes until the first of them reaches its max_new."""
        return int((self.max_new - self.made).min())

    def advance(self, count: int, block_tokens: int) -> int:
        """Each a `count` tokens further; returns the blocks that opened."""
        bt = block_tokens
        opened = int((-(-(self.pos + count) // bt) - (-(-self.pos // bt))).sum())
        self.pos, self.made = self.pos + count, self.made + count  # new arrays: see arrays()
        return opened

    def ended(self, stopped: Sequence[int]) -> np.ndarray:
        """Which are done: at max_new, or in `stopped`."""
        ends = self.made >= self.max_new
        if len(stopped):
            ends |= np.isin(self.index, np.asarray(stopped, dtype=np.int64))
        return ends

    def add(self, news: list[tuple[int, int, int]]) -> None:
        """Sequences whose prompts are in, each's first token sampled: (index, pos, max_new)."""
        index, pos, max_new = np.array(news, dtype=np.int64).reshape(-1, 3).T
        self.index = np.concatenate([self.index, index])
        self.pos = np.concatenate([self.pos, pos])
        self.made = np.concatenate([self.made, np.ones_like(index)])
        self.max_new = np.concatenate([self.max_new, max_new])

    def remove(self, ends: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Drop those marked; returns their indices (in order) and the rows each wrote."""
        ended, rows = self.index[ends].tolist(), self.pos[ends]
        keep = ~ends
        self.index, self.pos = self.index[keep], self.pos[keep]
        self.made, self.max_new = self.made[keep], self.max_new[keep]
        return ended, rows


def simulate(requests: Sequence[Request], **limits) -> tuple[list[tuple[Pass, int]], Admission]:
    """Every pass of a job whose requests all run to their max_new (what the planner prices),
    as spans (a pass and how many times it repeats, Admission.next_span), and the admission
    that made them, with its peaks. Work goes with the spans and the sequences in them, not
    with the passes: a job of long generations is many passes of a few spans."""
    admission = Admission(requests, **limits)
    spans = []
    while not admission.done:
        span = admission.next_span()
        spans.append(span)
        admission.complete_span(*span)
    return spans, admission


def expand(spans: Iterable[tuple[Pass, int]]) -> Iterator[Pass]:
    """The passes of `spans`, one by one (what the executor runs)."""
    for p, count in spans:
        for later in range(count):
            yield p.shifted(later)
