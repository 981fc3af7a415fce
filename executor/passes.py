"""Continuous batching: every pass of the weights carries the running sequences' next tokens and
chunks of newly admitted prompts, and a request that ends leaves at once, its KV blocks going
to the next request (after MoE-Lens, arXiv 2504.09345, and vLLM's scheduler).

hrm.rules.admission decides each pass (the planner replays the same rule); this module turns a
pass into micro-batches (executor/pass_tasks.PassGroup) over the paged KV pools
(executor/kv_blocks.py), runs it on the placed runtime under the plan's schedule, samples each
request with its own generator (so a seeded request's tokens do not depend on its pass mates),
and hands each request to `on_finish` the moment it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from executor.generate import Limits, greedy, holds_stop_string, sample
from executor.kv_blocks import KVBlocks
from executor.pass_tasks import PassGroup
from executor.runtime import HOST, Runtime
from hrm.rules.admission import BLOCK_TOKENS, Admission, Pass, Request


@dataclass
class PassStats:
    """What the passes did: per pass, its tokens, sequences and LM-head rows; the time of the
    passes that carried prompt tokens and of those that did not; the KV blocks' peak."""

    tokens: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)
    head_rows: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    prefill_s: float = 0.0  # passes with prompt tokens
    decode_s: float = 0.0  # passes of decodes only
    peak_kv_bytes: float = 0.0
    peak_kv_blocks: int = 0  # of one layer's pool (every layer holds the same blocks)
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # if asked: [V] a token

    def summary(self) -> dict:
        n = len(self.tokens)
        return {
            "passes": n,
            "mean_sequences_per_pass": sum(self.sequences) / n if n else 0.0,
            "mean_tokens_per_pass": sum(self.tokens) / n if n else 0.0,
            "peak_kv_bytes": self.peak_kv_bytes,
            "peak_kv_blocks": self.peak_kv_blocks,
            # each pass: its tokens and seconds (the planner's prediction sits beside them)
            "pass_tokens": list(self.tokens),
            "pass_seconds": list(self.seconds),
        }


def run_passes(
    runtime: Runtime,
    prompts: dict[int, Sequence[int]],
    limits: dict[int, Limits],
    *,
    max_running: int,
    token_budget: int,
    total_blocks: int,
    stop_token_ids: Sequence[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    on_finish: Callable[[int, list[int], str], None],
    on_pass: Callable[[int], None] = lambda tokens: None,
    keep_logits: bool = False,
) -> PassStats:
    """Every request of `prompts` (input index -> token ids, in the order they queue) to its
    end; on_finish(index, token ids, "stop" or "length") as each ends; on_pass(sampled) after
    each pass; keep_logits: each request's logits of every token it sampled, in the stats."""
    requests = [Request(index=i, prompt_len=len(p), max_new=limits[i].max_new)
                for i, p in prompts.items()]  # fmt: skip
    admission = Admission(requests, max_running=max_running, token_budget=token_budget,
                          total_blocks=total_blocks)  # fmt: skip
    pools = _pools(runtime, total_blocks)
    runtime.start_passes(pools)
    out = _Answers(limits, stop_token_ids, decode, runtime.device)
    stats, step = PassStats(), 0
    out.logits = stats.logits if keep_logits else None
    with torch.inference_mode():
        while not admission.done:
            p = admission.next_pass()
            t0 = time.perf_counter()
            groups = _groups(p, pools, prompts, out.tokens, runtime.micro_batch_size or 1)
            logits = runtime.run_pass(step, groups)
            stopped = out.sample(groups, logits)
            seconds = time.perf_counter() - t0
            if p.chunks:
                stats.prefill_s += seconds
            else:
                stats.decode_s += seconds
            stats.tokens.append(p.tokens)
            stats.seconds.append(seconds)
            stats.sequences.append(len(p.decodes) + len(p.chunks))
            stats.head_rows.append(sum(0 if x is None else x.shape[0] for x in logits))
            stats.peak_kv_bytes = max(stats.peak_kv_bytes, _held_bytes(pools))
            stats.peak_kv_blocks = pools.peak_held
            for i in admission.complete(p, stopped):
                pools.release(i)
                on_finish(i, out.tokens[i], out.reasons.get(i, "length"))
            on_pass(len(p.samples))
            step += 1
    if pools.held:
        raise RuntimeError(f"{pools.held} KV blocks still held after the job")
    return stats


def _pools(runtime: Runtime, blocks: int) -> KVBlocks:
    """The KV pools: each layer's where the runtime keeps that layer's KV."""
    model, tasks = runtime.model, runtime.tasks
    devices = [
        HOST if runtime.offloaded and tasks.kv_on_host(layer) else runtime.device
        for layer in range(runtime.arch.num_layers)
    ]
    return KVBlocks(runtime.arch, blocks=blocks, dtype=model.dtype, layer_devices=devices,
                    kv_format=model.kv_format)  # fmt: skip


def _held_bytes(pools: KVBlocks) -> float:
    return pools.peak_held * BLOCK_TOKENS * pools.token_bytes * len(pools.k)


def _groups(p: Pass, pools: KVBlocks, prompts, tokens, mu: int) -> list[PassGroup]:
    """The pass's micro-batches, their sequences' blocks grown to hold the pass's tokens."""
    groups = []
    for j, (phase, entries) in enumerate(p.groups(mu)):
        if phase == "decode":
            parts = [(i, pos, [tokens[i][-1]], True) for i, pos in entries]
        else:
            parts = [(c.index, c.start, list(prompts[c.index][c.start : c.start + c.length]),
                      c.last) for c in entries]  # fmt: skip
        groups.append(_group(j, phase, parts, pools))
    return groups


def _group(j: int, phase: str, parts, pools: KVBlocks) -> PassGroup:
    """parts: (sequence, position of its first new token, the new tokens, samples?)."""
    ids, positions, batch_idx, local_idx, write, rows = [], [], [], [], [], []
    for b, (seq, start, new, samples) in enumerate(parts):
        pools.grow(seq, start + len(new))
        ids += new
        positions += range(start, start + len(new))
        batch_idx += [b] * len(new)
        local_idx += range(len(new))
        write += pools.slots(seq, start, start + len(new))
        if samples:
            rows.append(len(ids) - 1)
    key_lens = [start + len(new) for _, start, new, _ in parts]
    width = -(-max(key_lens) // BLOCK_TOKENS)
    table = torch.tensor([(pools.tables[s] + [0] * width)[:width] for s, *_ in parts])
    gather = (table[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).flatten(1)
    long = torch.long
    packed = {
        "token_ids": torch.tensor(ids, dtype=long),
        "positions": torch.tensor(positions, dtype=long),
        "batch_idx": torch.tensor(batch_idx, dtype=long),
        "local_idx": torch.tensor(local_idx, dtype=long),
        "write_slots": torch.tensor(write, dtype=long),
        "gather_slots": gather[:, : max(key_lens)].contiguous(),
        "sample_rows": torch.tensor(rows, dtype=long),
    }
    lens = torch.tensor([len(new) for _, _, new, _ in parts])
    return PassGroup(
        index=j, lens=lens, padded_len=0, cache=None, packed=packed, phase=phase,
        seqs=[s for s, *_ in parts], key_lens=key_lens, starts=[s for _, s, _, _ in parts],
    )  # fmt: skip


class _Answers:
    """Each request's tokens, generator and why it ended."""

    def __init__(self, limits: dict[int, Limits], stop_token_ids, decode, device):
        self.limits, self.decode, self.stops = limits, decode, set(stop_token_ids)
        self.tokens: dict[int, list[int]] = {i: [] for i in limits}
        self.reasons: dict[int, str] = {}
        self.logits: dict[int, list[torch.Tensor]] | None = None  # kept where asked
        self.generators = {
            i: torch.Generator(device=device).manual_seed(lim.sampling.seed)
            for i, lim in limits.items()
            if lim.sampling.temperature > 0
        }

    def sample(self, groups: list[PassGroup], logits) -> list[int]:
        """Each sampling row's next token; returns the requests a stop token or string ended."""
        stopped = []
        for g, lg in zip(groups, logits, strict=True):
            if lg is None:
                continue
            samplers = [g.seqs[int(g.packed["batch_idx"][r])] for r in g.packed["sample_rows"]]
            tokens = greedy(lg).tolist()
            for row, i in enumerate(samplers):
                token = tokens[row]
                if i in self.generators:
                    lim = self.limits[i]
                    token = int(sample(lg[row : row + 1], lim.sampling, self.generators[i]))
                self.tokens[i].append(token)
                if self.logits is not None:
                    self.logits.setdefault(i, []).append(lg[row].float())
                if token in self.stops or holds_stop_string(
                    self.limits[i], self.decode, self.tokens[i]
                ):
                    self.reasons[i] = "stop"
                    stopped.append(i)
        return stopped
