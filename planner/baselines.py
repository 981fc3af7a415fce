"""The systems MoE-Lightning compares against, as policies chosen by their own rules and then
evaluated with our model, so that the comparison is of policies and schedules, not of models.

- FlexGen-like (reference, section 6): schedule S4 (attention on the GPU, each micro-batch's CPU
  KV cache prefetched over PCIe); GPU micro-batch gbs in 1, 2, 3, 4, then doubling; for each, the
  most micro-batches per block that fit (its doubling and binary search) with its LP's placement,
  weights first, then KV cache (under its cost, a resident weight byte saves L/(L-2) bytes of
  transfer per step and a cache byte 1); the gbs whose block is cheapest per token under FlexGen's
  own decode cost: T = (weights + KV over PCIe) + max(GPU compute at the maximum context with
  every expert read, KV written back), the load not overlapped.
- DeepSpeed-ZeRO-Inference-like: every weight streamed layer by layer (r_w = 0, a prefetch of
  the next layer), attention and the whole KV cache on the GPU (r_c = 1), one micro-batch (no
  micro-batch pipelining); the largest batch whose cache fits in GPU memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hrm.plan import Plan
from hrm.policy import Policy
from hrm.roofline.ops import layer_ops
from hrm.rules.placement import place_model
from planner.closed_form import fill_gpu
from planner.evaluate import batch_model, build_plan, policy_vector
from planner.memory import usable_bytes
from planner.setting import Setting
from planner.transfers import link_seconds

_NO_CAP = 1 << 20  # sequences: far beyond any batch that fits
FLEXGEN_GBS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BASELINE_SCHEDULE = "gpu-attention"


@dataclass(frozen=True, kw_only=True)
class Baseline:
    name: str
    plan: Plan | None  # None when no policy of this kind fits
    rule: str  # how its policy was chosen, in a few words

    def to_dict(self) -> dict:
        if self.plan is None:
            return {"name": self.name, "policy": None, "predicted": None, "rule": self.rule}
        return {
            "name": self.name,
            "policy": self.plan.policy.to_dict(),
            "schedule": self.plan.schedule,
            "predicted": self.plan.predicted.to_dict(),
            "bottleneck": self.plan.bottleneck,
            "rule": self.rule,
        }


def baselines(setting: Setting, max_batch_size: int | None = None) -> list[Baseline]:
    """Both baselines on the setting's machine and workload (none without a GPU), with at most
    `max_batch_size` sequences in a batch (a job's prompts) when given."""
    if not setting.hardware.has_gpu:
        return []
    gpu_setting = Setting(
        arch=setting.arch,
        hardware=setting.hardware,
        workload=setting.workload,
        schedule=BASELINE_SCHEDULE,
        weight_dtype=setting.weight_dtype,
        kv_dtype=setting.kv_dtype,
    )
    cap = max_batch_size or _NO_CAP
    return [flexgen_like(gpu_setting, cap), deepspeed_like(gpu_setting, cap)]


def deepspeed_like(setting: Setting, max_batch_size: int = _NO_CAP) -> Baseline:
    def policy(n: int) -> Policy:
        return _policy(setting, n, n, weights=0.0, kv=1.0)

    n = _largest(lambda n: _fits(setting, policy(n)), max_batch_size)
    plan = build_plan(batch_model(setting, n, n), policy(n)) if n else None
    return Baseline(
        name="deepspeed-like",
        plan=plan,
        rule="all weights streamed, KV cache and attention on the GPU, one micro-batch",
    )


def flexgen_like(setting: Setting, max_batch_size: int = _NO_CAP) -> Baseline:
    best: tuple[float, Policy] | None = None
    for gbs in (g for g in FLEXGEN_GBS if g <= max_batch_size):
        blocks = _largest(
            lambda ngb, gbs=gbs: _fits(setting, _flexgen_policy(setting, gbs, ngb)),
            max_batch_size // gbs,
        )
        if not blocks:
            break  # a larger gbs needs more memory still
        policy = _flexgen_policy(setting, gbs, blocks)
        cost = _flexgen_seconds_per_token(setting, policy)
        if best is None or cost < best[0]:
            best = (cost, policy)
    plan = None
    if best is not None:
        p = best[1]
        plan = build_plan(batch_model(setting, p.batch_size, p.micro_batch_size), p)
    return Baseline(
        name="flexgen-like",
        plan=plan,
        rule="GPU attention with KV prefetch, largest block, its own decode-only cost",
    )


def _flexgen_policy(setting: Setting, gbs: int, blocks: int) -> Policy:
    fill = fill_gpu(setting, gbs * blocks, gbs, (1, 1))
    # rounded down to 1e-9 so that round-off never tips a full GPU over its capacity
    weights, kv = (
        math.floor(float(x[0]) * 1e9) / 1e9 for x in (fill.weights, fill.kv_after_weights)
    )
    return _policy(setting, gbs * blocks, gbs, weights=weights, kv=kv)


def _flexgen_seconds_per_token(setting: Setting, policy: Policy) -> float:
    """FlexGen's own decode cost per token (reference, section 6), per layer:
    T = (streamed weights + CPU part of the KV cache) / B_h2d + max(compute, new KV / B_d2h),
    compute = per micro-batch max(FLOPs / P_gpu, (all of W_l + KV at the max context) / B_gpu)."""
    arch, hw, wl = setting.arch, setting.hardware, setting.workload
    gbs, n = policy.micro_batch_size, policy.batch_size
    ctx = wl.max_context_len
    w_layer = setting.weights.layer
    # the mean layer: each kind of layer (ModelArch.layer_kinds) by its share of the layers
    ops = [
        op.scaled(layers / arch.num_layers)
        for kind, layers in arch.layer_kinds()
        for op in layer_ops(
            kind,
            batch=gbs,
            new_tokens=1,
            context=ctx,
            weight_dtype=setting.weight_dtype,
            kv_dtype=setting.kv_dtype,
        )
    ]
    flops = sum(op.flops for op in ops)
    local_bytes = w_layer + sum(op.kv_bytes + op.activation_bytes for op in ops)
    compute = policy.num_micro_batches * max(
        flops / hw.gpu.flops_per_s(setting.compute_dtype),
        local_bytes / hw.gpu.total_memory_bandwidth_bytes_per_s,
    )
    kv_token_layer = arch.kv_token_bytes(setting.kv_dtype)
    streamed = (1 - policy.weights_gpu_fraction) * setting.weights.stored
    streamed += (1 - policy.kv_gpu_fraction) * n * arch.mean_keys(ctx) * kv_token_layer
    load = float(link_seconds(hw, streamed, "h2d"))
    store = float(link_seconds(hw, n * kv_token_layer, "d2h"))
    return (load + max(compute, store)) / n


def _policy(setting: Setting, n: int, mu: int, *, weights: float, kv: float) -> Policy:
    return Policy(
        batch_size=n,
        micro_batch_size=mu,
        attention_on_gpu=True,
        ffn_on_gpu=True,
        weights_gpu_fraction=weights,
        kv_gpu_fraction=kv,
        weight_dtype=setting.weight_dtype,
        kv_dtype=setting.kv_dtype,
    )


def _fits(setting: Setting, policy: Policy) -> bool:
    """The policy fits with its weights placed as whole tensors (rounded down:
    hrm.rules.placement)."""
    hw = setting.hardware
    mem = setting.memory(policy.batch_size, policy.micro_batch_size)
    placed = place_model(setting.arch, policy.weights_gpu_fraction, policy.weight_dtype)
    v = policy_vector(dataclasses.replace(policy, weights_gpu_fraction=placed.fraction))
    return bool(
        np.all(mem.gpu_total() @ v <= usable_bytes(hw.gpu.total_memory_bytes))
        and np.all(mem.cpu_total() @ v <= usable_bytes(hw.cpu.memory_bytes))
    )


def _largest(fits: Callable[[int], bool], limit: int = _NO_CAP) -> int:
    """The largest n >= 1 with fits(n) (monotone), by doubling then bisection; 0 if none."""
    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= limit and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, limit + 1)  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
