"""A model's weights packed once for the CPU's packed GEMM path (hrm.rules.gemm_paths).

Every matrix that MoEModel.linear multiplies by is reordered at load into oneDNN's blocked
layout, so that no GEMM reorders its weight again: native bf16 reorders on every call, which at
decode's few rows costs as much as the GEMM itself. What is read another way stays as it is: the
embedding (rows looked up), a tied LM head (the embedding itself), the router where it runs in
float32 (grouped routing), DeepSeek's latent up-projection (split per head), norms and biases.
The packed copies replace the model's references; the checkpoint's own stay with the caller.
"""

from __future__ import annotations

import dataclasses

from executor.checkpoint import ExpertWeights, LayerWeights, ModelWeights
from hrm.rules.gemm_paths import pack_weight

# the LayerWeights matrices that go through MoEModel.linear (the router too, unless grouped)
_LINEAR = ("wq", "wk", "wv", "wo", "shared_w1", "shared_w3", "shared_w2", "shared_gate",
           "wq_a", "wkv_a")  # fmt: skip


def packed_weights(weights: ModelWeights, *, router_linear: bool) -> ModelWeights:
    """`weights` with each matrix MoEModel.linear multiplies by packed (router_linear: the
    router is one of them; grouped routers run in float32 on their own)."""
    tied = weights.lm_head is weights.embed
    return dataclasses.replace(
        weights,
        layers=tuple(_packed_layer(w, router_linear) for w in weights.layers),
        lm_head=weights.lm_head if tied else pack_weight(weights.lm_head),
    )


def _packed_layer(w: LayerWeights, router_linear: bool) -> LayerWeights:
    names = _LINEAR + (("router",) if router_linear else ())
    packed = {name: pack_weight(getattr(w, name)) for name in names if getattr(w, name) is not None}
    experts = tuple(_packed_expert(e) for e in w.experts)
    return dataclasses.replace(w, experts=experts, **packed)


def _packed_expert(e: ExpertWeights) -> ExpertWeights:
    return dataclasses.replace(e, w1=pack_weight(e.w1), w3=pack_weight(e.w3), w2=pack_weight(e.w2))
