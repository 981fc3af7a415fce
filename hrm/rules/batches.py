"""Static batches: which requests run together when a prompts file runs in batches of a plan's N
(hrm run --batching static). The executor runs them and the planner prices a job by them, so the
two see the same batches.

Batches (reference, section 3, Algorithm 2): prompts sorted longest first are cut into batches of
N; inside a batch each prompt goes to the micro-batch with the fewest tokens that has room
(mu sequences), which evens out the micro-batches' work. The reference moves a request that would
overflow the KV budget to the next batch; here no request can: each micro-batch's cache is sized
for its own longest prompt, and no prompt is longer than the plan's maximum (checked before any
weight is loaded), so every batch fits the N x (longest prompt + generation) the plan counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    """Input indices of one batch, ordered micro-batch by micro-batch (mu at most in each)."""

    indices: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]


def plan_batches(prompt_lens: Sequence[int], batch_size: int, micro_batch_size: int) -> list[Batch]:
    order = sorted(range(len(prompt_lens)), key=lambda i: (-prompt_lens[i], i))
    batches = []
    for start in range(0, len(order), batch_size):
        members = order[start : start + batch_size]
        count = -(-len(members) // micro_batch_size)
        groups: list[list[int]] = [[] for _ in range(count)]
        tokens = [0] * count
        for i in members:  # longest first, into the open micro-batch with the fewest tokens
            open_ = [g for g in range(count) if len(groups[g]) < micro_batch_size]
            g = min(open_, key=lambda g: (tokens[g], g))
            groups[g].append(i)
            tokens[g] += prompt_lens[i]
        batches.append(
            Batch(
                indices=tuple(i for g in groups for i in g),
                micro_batch_sizes=tuple(len(g) for g in groups),
            )
        )
    return batches
