"""Batched generation: prefill of ragged prompts, then one decode step per token, then stop.

Prompts are packed for the token-wise work and left-padded in the KV cache (kv_cache.py), which is
how transformers' generate lays out a padded batch, so each sequence's tokens and logits equal
those of the same prompt run alone.  Sampling is greedy, or temperature with top-p from a
seeded generator so that a run repeats exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

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
class Generation:
    output_token_ids: list[list[int]]  # per prompt, in input order; ends at its stop token if any
    prefill_s: float  # prompts through the model and the first token sampled
    decode_s: float  # every later step
    step_logits: list[torch.Tensor] = field(default_factory=list)  # [B, V] per step, if asked

    @property
    def generated_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids)


def sample(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token per sequence from fp32 logits [B, V] -> [B]."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)  # [B, V]
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
    stop_token_ids: Sequence[int] = (),
    keep_logits: bool = False,
    on_step: Callable[[str], None] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
) -> Generation:
    """Generate up to `gen_len` tokens for every prompt; a sequence stops after a stop token.

    `model` is a resident MoEModel or a placed Runtime (executor/runtime.py): the one loop below
    drives both. on_step(phase) after each step: "prefill" once (the first token), then "decode"
    per step. micro_batch_sizes: how a Runtime cuts the batch (default mu each)."""
    if gen_len < 1 or not prompts or not all(prompts):
        raise HrmError("generation needs at least one non-empty prompt and gen_len >= 1")
    runtime = model if isinstance(model, Runtime) else resident_runtime(model)
    device = runtime.device
    B = len(prompts)
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)

    step_logits: list[torch.Tensor] = []
    tokens = torch.empty(B, gen_len, dtype=torch.long, device=device)  # [B, N]
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
    stop_step = gen_len

    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            runtime.start_batch([list(p) for p in prompts], gen_len, micro_batch_sizes)
            for step in range(gen_len):
                previous = tokens[:, step - 1] if step else None
                logits = runtime.step(step, previous, last=step == gen_len - 1)
                if keep_logits:
                    step_logits.append(logits)
                tokens[:, step] = sample(logits, sampling, generator)
                if step == 0:
                    _sync(device)  # a GPU's work is queued: the clock waits for it
                    t1 = time.perf_counter()  # the first token is prefill's output
                if on_step is not None:
                    on_step("decode" if step else "prefill")
                if stops.numel():
                    finished |= torch.isin(tokens[:, step], stops)
                    if bool(finished.all()):
                        stop_step = step + 1
                        break
        _sync(device)
        t2 = time.perf_counter()
    finally:
        if runtime is not model:
            runtime.close()
    return Generation(
        output_token_ids=_trim(tokens[:, :stop_step].tolist(), stop_token_ids),
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        step_logits=step_logits,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trim(rows: list[list[int]], stop_token_ids: Sequence[int]) -> list[list[int]]:
    """Cut each sequence after its first stop token (kept, as transformers keeps EOS)."""
    stops = set(stop_token_ids)
    out = []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out
