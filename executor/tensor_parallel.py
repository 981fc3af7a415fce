"""Tensor parallelism, Megatron-style: each of tp ranks runs a narrower copy of the model.

Rank r of tp holds query heads [r nq/tp, (r+1) nq/tp) and the key/value heads they read (their Q,
K, V projections' rows: column-parallel), the matching columns of O (row-parallel), and the same
share of every expert's width (rows of w1 and w3, columns of w2), of the shared expert and of a
dense layer's MLP, and its share of the LM head's vocabulary; norms, routers and the embedding
(a lookup) are whole on every rank. So a rank's model is the model of `shard_arch`: the same
hidden size, fewer heads, narrower experts, and every part of the executor (placement, paging,
the KV cache, the schedules) runs it as it runs any model. Two sums complete a layer, as the
planner prices them: the O projection's outputs and the FFN's, all-reduced over the rank's
tensor-parallel group (MoEModel's `reduce`), inside the post-attention action on the GPU queue;
the logits are gathered from the ranks' vocabulary shares (MoEModel's `gather`), so the head's
FLOPs and bytes are spread over the GPUs as the planner prices them. Every rank routes the same
tokens the same way: the router sees the same (all-reduced) hidden states on each.

A bias after O is added after the sum; an expert's bias after w2 (gpt-oss) is rank 0's alone, so
that the sum adds it once. DeepSeek's latent and rotary key are the same on every rank (each
computes them whole, and caches them: every head reads all of them), its heads split as any
model's. What cannot be split is refused before loading (hrm/rules/tensor_parallel.py, which
the planner applies too).
"""

from __future__ import annotations

import dataclasses

import torch

from executor.checkpoint import Checkpoint, LayerWeights, ModelWeights
from hrm.arch import ModelArch

# LayerWeights fields split by rows (column-parallel: their outputs are this rank's heads or
# width; gpt-oss's sinks are one a head; DeepSeek's kv_b_proj widens the latent to each head),
# by columns (row-parallel: their inputs are), and the ones every rank holds whole
_ROWS = ("wq", "wk", "wv", "bq", "bk", "bv", "shared_w1", "shared_w3", "sinks", "wkv_b")
_COLUMNS = ("wo", "shared_w2")


def shard_arch(arch: ModelArch, tp: int) -> ModelArch:
    """The model one of tp ranks runs: its share of the heads and of every width."""
    return dataclasses.replace(
        arch,
        num_attention_heads=arch.num_attention_heads // tp,
        # latent attention's one latent head is every rank's whole
        num_key_value_heads=arch.num_key_value_heads // (1 if arch.kv_lora_rank else tp),
        intermediate_size=arch.intermediate_size // tp,
        shared_expert_intermediate_size=arch.shared_expert_intermediate_size // tp,
        dense_intermediate_size=arch.dense_intermediate_size // tp,
    )


def shard_checkpoint(checkpoint: Checkpoint, rank: int, tp: int) -> Checkpoint:
    """Rank `rank`'s share of a whole checkpoint's weights, each share its own contiguous
    tensor (the whole ones are released when the caller drops `checkpoint`)."""
    if tp == 1:
        return checkpoint
    w = checkpoint.weights
    layers = tuple(_shard_layer(layer, rank, tp) for layer in w.layers)
    return dataclasses.replace(
        checkpoint,
        arch=shard_arch(checkpoint.arch, tp),
        weights=ModelWeights(
            embed=w.embed,
            layers=layers,
            final_norm=w.final_norm,
            lm_head=_part(w.lm_head, rank, tp, 0),  # a copy, also of a tied embedding
        ),
    )


def random_share(arch: ModelArch, rank: int, tp: int, dtype: str, device: str) -> Checkpoint:
    """A rank's share of random weights (`hrm run --random-weights`, a speed run), drawn at the
    share's size: no rank holds the whole model, even for a moment. Every rank draws the same
    numbers, so the tensors they all hold whole (routers, norms, the embedding) agree."""
    from executor.checkpoint import random_checkpoint

    share = random_checkpoint(shard_arch(arch, tp), dtype, device=device)
    lm_head = _part(share.weights.lm_head, rank, tp, 0)  # the vocabulary is not narrowed
    return dataclasses.replace(share, weights=dataclasses.replace(share.weights, lm_head=lm_head))


def _part(t: torch.Tensor | None, rank: int, tp: int, dim: int) -> torch.Tensor | None:
    if t is None:
        return None
    return t.chunk(tp, dim=dim)[rank].contiguous()


def _shard_layer(w: LayerWeights, rank: int, tp: int) -> LayerWeights:
    split = {n: _part(getattr(w, n), rank, tp, 0) for n in _ROWS}
    split |= {n: _part(getattr(w, n), rank, tp, 1) for n in _COLUMNS}
    experts = tuple(
        dataclasses.replace(
            e, w1=_part(e.w1, rank, tp, 0), w3=_part(e.w3, rank, tp, 0),
            w2=_part(e.w2, rank, tp, 1), b1=_part(e.b1, rank, tp, 0), b3=_part(e.b3, rank, tp, 0),
            b2=None if e.b2 is None else e.b2 if rank == 0 else torch.zeros_like(e.b2),
        )
        for e in w.experts
    )  # fmt: skip
    return dataclasses.replace(w, **split, experts=experts)
