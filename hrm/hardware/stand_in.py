"""The CPU standing in for a GPU, as a profile: what an offloaded run on a CPU-only host is
predicted with (`hrm validate` on such a host runs every schedule this way).

The "GPU" is the host's own CPU (its measured GEMM curves along the CPU GEMM paths the executor
takes there, its attention kernel's curve, its memory, its launch overhead); the
"link" is a host memcpy at the rate the profile measured one (cpu.copy_bandwidth, bytes copied per
second). A profile from before that was measured derives it from the read bandwidth as
B_link = B_read / 2, a copy reading and writing each byte; that was 2-3x slow on the AVX-512
EPYC VM, whose copies ran at 14-26 GB/s against a 15.5 GB/s read (a matrix-vector product does
not fill the memory bus on 2 cores; docs/decisions.md, 2026-12-04). Every queue runs on the same
cores over the same memory bus, so the cost model adds them instead of overlapping them
(planner/cost.py, `stand_in`).
"""

from __future__ import annotations

import dataclasses

from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import LinkSpec

STAND_IN_SUFFIX = "-stand-in"


def stand_in_profile(host: HardwareProfile, gpu_memory_bytes: float) -> HardwareProfile:
    """`host` (CPU-only) with its CPU also standing in for a GPU of `gpu_memory_bytes`."""
    if host.has_gpu:
        raise HrmError(f"{host.name} has a GPU: a stand-in profile is for CPU-only hosts")
    cpu = host.cpu
    copy = cpu.copy_bandwidth_bytes_per_s or cpu.memory_bandwidth_bytes_per_s / 2
    gpu = dataclasses.replace(
        cpu,
        name=f"{cpu.name} (standing in for a GPU)",
        memory_bytes=gpu_memory_bytes,
        available_memory_bytes=None,
    )
    return dataclasses.replace(
        host,
        name=f"{host.name}{STAND_IN_SUFFIX}",
        description=f"{host.description} with its CPU standing in for a GPU".strip(),
        gpu=gpu,
        link=LinkSpec(h2d_bytes_per_s=copy, d2h_bytes_per_s=copy),
        stand_in=True,
    )
