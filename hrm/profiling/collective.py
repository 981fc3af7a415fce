"""The all-reduce between a host's processes, as tensor parallelism's ranks make it: gloo's
latency per ring step (alpha) and its bandwidth (beta), for the CPU standing in for GPUs.

Two ranks (torch.multiprocessing, a file store in a temporary folder) all-reduce bf16 messages
from ALL_REDUCE_SIZES bytes. Both ranks make the same fixed number of calls (a calibrated count
could differ between them and hang the collective); rank 0's samples are kept. With g = 2 a
ring all-reduce is 2 steps of S/2 bytes each way, so T(S) = 2 * alpha + S / B
(planner/transfers.all_reduce_seconds): alpha is half the smallest message's median, B the
slope from the smallest to the largest. On this project's 2-core AMX VM: 0.13 ms a step and
about 1 GB/s (docs/decisions.md, 2026-12-06).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import Interconnect

ALL_REDUCE_SIZES = (256, 16 * 2**10, 256 * 2**10, 4 * 2**20)  # bytes: decode's rows to prefill's
RANKS = 2
WARMUP_CALLS = 3


def measure_all_reduce(*, repeats: int, calls: int) -> tuple[Interconnect, dict]:
    """gloo's alpha and beta between two processes of this host, and the medians behind them."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hrm-all-reduce-") as tmp:
        out = Path(tmp) / "rank0.txt"
        try:
            mp.spawn(_rank, args=(tmp, repeats, calls), nprocs=RANKS, join=True)
        except Exception as exc:  # noqa: BLE001 - a rank's failure arrives as ProcessRaisedException
            raise HrmError(
                f"could not time gloo all-reduces between two processes: {exc}"
            ) from None
        medians = [float(x) for x in out.read_text().split()]
    small, large = ALL_REDUCE_SIZES[0], ALL_REDUCE_SIZES[-1]
    alpha = medians[0] / 2
    slope = (medians[-1] - medians[0]) / (large - small)
    if slope <= 0:
        raise HrmError(
            "gloo all-reduces of 4 MiB ran no slower than of 256 B: the timing is noise; "
            "measure again on a quiet machine"
        )
    notes = {
        "backend": "gloo",
        "ranks": RANKS,
        "how_measured": (
            f"bf16 all-reduces, {calls} calls a sample, median of {repeats} samples; "
            "latency per ring step = smallest / 2, bandwidth = the slope to the largest"
        ),
        "median_s_by_bytes": {
            str(s): round(t, 7) for s, t in zip(ALL_REDUCE_SIZES, medians, strict=True)
        },
    }
    return Interconnect(kind="gloo", bytes_per_s=1.0 / slope, step_latency_s=alpha), notes


def _rank(rank: int, folder: str, repeats: int, calls: int) -> None:
    """One rank: each size's samples; rank 0 writes the medians, in seconds per call."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the two ranks share the host's cores, as a tp run's ranks do
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=RANKS
    )
    try:
        medians = []
        for size in ALL_REDUCE_SIZES:
            x = torch.ones(size // 2, dtype=torch.bfloat16)
            for _ in range(WARMUP_CALLS):
                dist.all_reduce(x)
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(x)
                samples.append((time.perf_counter() - start) / calls)
            medians.append(statistics.median(samples))
        if rank == 0:
            Path(folder, "rank0.txt").write_text(" ".join(f"{t:.9f}" for t in medians))
    finally:
        dist.destroy_process_group()


def with_all_reduce(
    profile: HardwareProfile, *, quick: bool, warn: Callable[[str], None]
) -> HardwareProfile:
    """A CPU-only `profile` with its processes' gloo interconnect, where torch.distributed has
    gloo (else a warning, and the stand-in prices all-reduces by bytes alone)."""
    import dataclasses

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        warn("torch.distributed has no gloo here: all-reduce latency not measured")
        return profile
    interconnect, notes = measure_all_reduce(repeats=5 if quick else 7, calls=20 if quick else 40)
    provenance = {**profile.provenance, "all_reduce": notes}
    return dataclasses.replace(profile, interconnect=interconnect, provenance=provenance)
