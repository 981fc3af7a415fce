"""What moving bytes costs: the link (PCIe) per transfer size, the GPUs' all-reduce under tensor
parallelism. Split from cost.py for size."""

from __future__ import annotations

import numpy as np

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.rules.tensor_parallel import tensor_parallel_problem


def link_seconds(hardware: HardwareProfile, nbytes, direction: str) -> np.ndarray:
    """T = bytes / (lanes * B_link(bytes per lane)): each of the `count` GPUs moves its share on
    its own link (lanes = count), or all share one root complex (lanes = 1); at the measured rate
    for that transfer size when the profile has a curve."""
    nbytes = np.asarray(nbytes, dtype=float)
    link = hardware.link
    if link is None:
        return np.zeros_like(nbytes)
    lanes = hardware.link_lanes
    curve = link.h2d_curve if direction == "h2d" else link.d2h_curve
    flat = link.h2d_bytes_per_s if direction == "h2d" else link.d2h_bytes_per_s
    per_link = curve.at_each(nbytes / lanes) if curve else flat
    return nbytes / (per_link * lanes)


def all_reduce_seconds(hardware: HardwareProfile, nbytes) -> np.ndarray:
    """Ring all-reduce of `nbytes` over the g GPUs of tensor parallelism (NCCL's ring: a
    reduce-scatter then an all-gather, 2(g-1) steps of nbytes/g each way on every GPU), in the
    alpha-beta form GenZ and LLMCompass use:
      T_ar = 2 * (g - 1) * (alpha + S / (g * B_peer))
    B_peer, alpha: the profile's interconnect (NVLink, PCIe, or gloo measured by hrm profile),
    else PCIe peer-to-peer at the link's rate with NCCL's step latency. 0 for one GPU."""
    nbytes = np.asarray(nbytes, dtype=float)
    g = hardware.gpu_count
    if g <= 1:
        return np.zeros_like(nbytes)
    steps = 2.0 * (g - 1)
    return steps * (hardware.peer_step_latency_s + nbytes / (g * hardware.peer_bytes_per_s))


def check_tensor_parallel(arch: ModelArch, hardware: HardwareProfile) -> None:
    """What tensor parallelism over the machine's GPUs must split (hrm/rules/tensor_parallel.py,
    the executor's rule too): refused when it cannot."""
    problem = tensor_parallel_problem(arch, max(1, hardware.gpu_count))
    if problem:
        raise HrmError(problem)
