"""The executor's fixed costs beyond FLOPs and bytes, as `hrm profile` measured them on its own
forward, per dtype: per layer, per expert touched and per step (on the CPU at the model's own
shapes, executor/cpu_overhead.py; on a GPU on a miniature, executor/overhead.py).

On the CPU the cores that compute also run the Python, so the cost adds to the compute. On a
GPU the host issues kernels while earlier ones run: a layer's dense kernels take no less than
the host needs to issue them, T_gpu_dense = max(T_dense, per_layer), so the queue is charged
max(0, per_layer - T_dense) beyond its kernels. The grouped expert FFN's own launches and its
host read of the routing counts are inside its measured curve (gpu.expert_ffn_curves) and are
not charged again. A CPU standing in for a GPU pays the CPU's cost on its "GPU" queue.
"""

from __future__ import annotations

import numpy as np

from hrm.arch import ModelArch
from hrm.hardware.parts import LaunchOverhead
from hrm.roofline.ops import expected_distinct_experts


def launch_seconds(
    overhead: LaunchOverhead | None,
    arch: ModelArch,
    steps: int,
    prefill_tokens: float,
    b: float,
    *,
    fused: bool = False,
) -> np.ndarray:
    """T_launch = per_layer + E_touched(tokens) * per_expert, at prefill's tokens then each
    decode step's b; 0 where the profile has no measurement. Fused experts (hrm.rules.cpu_moe)
    pay no per-expert cost here: the kernel's calls, setup included, are timed in its curves."""
    if overhead is None:
        return np.zeros(steps)
    per_expert = 0.0 if fused else overhead.per_expert_s

    def per_layer(tokens: float) -> float:
        return overhead.per_layer_s + expected_distinct_experts(arch, tokens) * per_expert

    return np.concatenate([[per_layer(prefill_tokens)], per_layer(b) * np.ones(steps - 1)])


def step_seconds(overhead: LaunchOverhead | None) -> float:
    """The fixed cost of a step outside the layers (embedding, rotary tables, sampling), once per
    micro-batch; 0 where not measured."""
    return overhead.per_step_s if overhead is not None else 0.0


def unhidden_gpu_launch(overhead: LaunchOverhead | None, dense_s: np.ndarray, steps: int):
    """max(0, per_layer - T_dense): the host's issue time the GPU's dense kernels do not cover."""
    if overhead is None:
        return np.zeros(steps)
    return np.maximum(overhead.per_layer_s - np.asarray(dense_s, dtype=float), 0.0)
