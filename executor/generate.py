"""Batched generation: prefill of ragged prompts, then one decode step per token, then stop.

Prompts are packed for the token-wise work and left-padded in the KV cache (kv_cache.py), which is
how transformers' generate lays out a padded batch, so each sequence's tokens and logits equal
those of the same prompt run alone.  Sampling is greedy, or temperature with top-p from a
seeded generator so that a run repeats exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from executor import small_ops
from executor.model import MoEModel
from executor.runtime import Runtime
from hrm.errors import HrmError


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise HrmError(f"temperature must be 0 (greedy) or positive, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise HrmError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """One sequence's own: at most `max_new` tokens, its sampling (its generator seeded with its
    seed), and stop strings that end it once its text holds one (`decode` gives the text)."""

    max_new: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Generation:
    output_token_ids: list[list[int]]  # per prompt, in input order; ends at its stop token if any
    prefill_s: float  # prompts through the model and the first token sampled
    decode_s: float  # every later step
    finish_reasons: list[str] = field(default_factory=list)  # "stop" or "length", per prompt
    decode_rows: int = 0  # sequence-steps computed after prefill (finished ones leave the batch)
    step_logits: list[torch.Tensor] = field(default_factory=list)  # [B, V] per step, if asked

    @property
    def generated_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first largest logit's index per row, [B, V] (the LM head's dtype) -> [B]: argmax's
    choice, by max, which took 0.56 against 1.45 ms at [64, 32000] float32 on the AMX Xeon (its
    own reduction); natively where a fused model built the kernel (small_ops.greedy)."""
    return small_ops.greedy(logits)


def sample(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token per sequence from logits [B, V] -> [B], sampled in fp32."""
    if sampling.temperature == 0:
        return greedy(logits)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)  # [B, V]
    if sampling.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token).
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs[mass_before >= sampling.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, sorted_ids, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def resident_runtime(model: MoEModel) -> Runtime:
    """Everything where the model's weights are, the batch as one micro-batch, run inline."""
    return Runtime(model, schedule="serial", micro_batch_size=None, attention_on_gpu=True)


def generate(
    model: MoEModel | Runtime,
    prompts: Sequence[Sequence[int]],
    gen_len: int,
    *,
    sampling: Sampling = Sampling(),
    limits: Sequence[Limits] | None = None,
    stop_token_ids: Sequence[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    keep_logits: bool = False,
    on_step: Callable[[str, int], None] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
) -> Generation:
    """Generate up to `gen_len` tokens for every prompt; a sequence stops after a stop token,
    at its own `limits` (default: gen_len, `sampling` with seed + its row), or once `decode` of
    its tokens holds one of its stop strings. A sequence that stops leaves its micro-batch, so
    no later step computes it; the batch ends when every sequence has stopped.

    `model` is a resident MoEModel or a placed Runtime (executor/runtime.py): the one loop below
    drives both. on_step(phase, tokens) after each step: "prefill" once (the first token), then
    "decode" per step, with the tokens it made. micro_batch_sizes: how a Runtime cuts the batch
    (default mu each)."""
    if gen_len < 1 or not prompts or not all(prompts):
        raise HrmError("generation needs at least one non-empty prompt and gen_len >= 1")
    B = len(prompts)
    if limits is None:
        limits = [Limits(max_new=gen_len, sampling=replace(sampling, seed=sampling.seed + i))
                  for i in range(B)]  # fmt: skip
    if any(not 1 <= lim.max_new <= gen_len for lim in limits):
        raise HrmError(f"each sequence's max_new must be in [1, {gen_len}]")
    runtime = model if isinstance(model, Runtime) else resident_runtime(model)
    state = _Sequences(limits, stop_token_ids, decode, runtime.device)
    step_logits: list[torch.Tensor] = []
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            runtime.start_batch([list(p) for p in prompts], gen_len, micro_batch_sizes)
            previous = None
            for step in range(gen_len):
                logits = runtime.step(step, previous, last=step == gen_len - 1)
                if keep_logits:
                    step_logits.append(logits.float())
                previous = state.advance(logits)
                if step == 0:
                    _sync(runtime.device)  # a GPU's work is queued: the clock waits for it
                    t1 = time.perf_counter()  # the first token is prefill's output
                if on_step is not None:
                    on_step("decode" if step else "prefill", len(state.rows))
                keep = state.retire()
                if not keep.any():
                    break
                if not keep.all():
                    runtime.retire(keep)
                    previous = previous[keep.to(previous.device)]
                state.decode_rows += int(keep.sum()) if step + 1 < gen_len else 0
        _sync(runtime.device)
        t2 = time.perf_counter()
    finally:
        if runtime is not model:
            runtime.close()
    return Generation(
        output_token_ids=state.tokens,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        finish_reasons=state.reasons,
        decode_rows=state.decode_rows,
        step_logits=step_logits,
    )


class _Sequences:
    """Each sequence's tokens and why it stopped, and which rows of the running batch are which
    sequences (rows leave the batch as their sequences stop)."""

    def __init__(self, limits: Sequence[Limits], stop_token_ids, decode, device: torch.device):
        self.limits, self.decode = list(limits), decode
        self.stops = set(stop_token_ids)
        self.rows = list(range(len(limits)))  # row -> sequence
        self.tokens: list[list[int]] = [[] for _ in limits]
        self.reasons: list[str] = ["length"] * len(limits)
        self.done = [False] * len(limits)
        self.decode_rows = 0
        self.generators = [
            torch.Generator(device=device).manual_seed(lim.sampling.seed)
            if lim.sampling.temperature > 0
            else None
            for lim in limits
        ]

    def advance(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample every row's next token [rows], and note the sequences it ends."""
        out = greedy(logits)
        for row, i in enumerate(self.rows):
            if self.generators[i] is not None:
                out[row] = sample(
                    logits[row : row + 1], self.limits[i].sampling, self.generators[i]
                )
        for row, token in enumerate(out.tolist()):
            i = self.rows[row]
            self.tokens[i].append(token)
            if token in self.stops or self._stop_string(i):
                self.done[i], self.reasons[i] = True, "stop"
            elif len(self.tokens[i]) >= self.limits[i].max_new:
                self.done[i] = True
        return out

    def _stop_string(self, i: int) -> bool:
        return holds_stop_string(self.limits[i], self.decode, self.tokens[i])

    def retire(self) -> torch.Tensor:
        """The rows that go on [rows] (bool); the others' sequences have stopped."""
        keep = torch.tensor([not self.done[i] for i in self.rows], dtype=torch.bool)
        self.rows = [i for i in self.rows if not self.done[i]]
        return keep


def holds_stop_string(limits: Limits, decode, tokens: list[int]) -> bool:
    """Whether the text of `tokens` (by `decode`) holds one of the sequence's stop strings."""
    return (
        bool(limits.stop) and decode is not None and any(s in decode(tokens) for s in limits.stop)
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
