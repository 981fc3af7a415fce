"""What the host is and how fast its memory streams: CPU model, cores, memory, bandwidth.

Bandwidth is measured with every core (torch's threads) on arrays far larger than the
last-level cache, three ways: read (a matrix-vector product, the access pattern of a decode step
streaming weights or a KV cache), copy (b = a) and triad (a = b + 3c). Bytes are counted the
STREAM way: each array element read or written once, write-allocate traffic not counted.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hrm.profiling.timing import Timing, perf_counter_clock, time_calls

BANDWIDTH_KINDS = ("read", "copy", "triad")
# CPU flags that decide which GEMM path is fast (hrm.rules.cpu_gemm): recorded in every profile,
# and a run warns when its host's differ from its profile's
MATRIX_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
_READ_ROW = 4096  # elements per row of the matrix the read kernel multiplies by a vector


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    cpu_model: str
    cores: int  # CPUs this process may run on: torch uses one thread per core
    memory_bytes: float
    available_memory_bytes: float | None
    last_level_cache_bytes: float | None
    matrix_features: tuple[str, ...]


def host_facts() -> HostFacts:
    total, available = _meminfo()
    return HostFacts(
        cpu_model=_cpu_model(),
        cores=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
        memory_bytes=total,
        available_memory_bytes=available,
        last_level_cache_bytes=_last_level_cache_bytes(),
        matrix_features=matrix_features(),
    )


def matrix_features() -> tuple[str, ...]:
    """The MATRIX_FEATURES this CPU has (/proc/cpuinfo flags; empty where that is absent)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return tuple(f for f in MATRIX_FEATURES if f in flags)
    except OSError:
        pass
    return ()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _meminfo() -> tuple[float, float | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; elsewhere the total from sysconf."""
    try:
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/meminfo").read_text().splitlines()
            if ":" in line
        )
        kib = {key: float(value.split()[0]) * 1024 for key, value in fields.items()}
        return kib["MemTotal"], kib.get("MemAvailable")
    except (OSError, KeyError, ValueError):
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), None


def _last_level_cache_bytes() -> float | None:
    """Size of the highest cache level of CPU 0 (Linux sysfs), or None where it is not exposed."""
    best_level, best_size = 0, None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        multiplier = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(size[-1:], 1)
        if level > best_level and size.rstrip("KMG").isdigit():
            best_level, best_size = level, float(size.rstrip("KMG")) * multiplier
    return best_size


@dataclass(frozen=True, kw_only=True)
class CpuTimes:
    """Clock ticks since boot, summed over all CPUs (/proc/stat), and this process's own."""

    busy: int  # user, nice, system, irq, softirq and steal (the hypervisor's share counts)
    total: int
    own: int  # this process, all its threads (/proc/self/stat utime + stime)


def cpu_times() -> CpuTimes | None:
    """Now's tick counts, or None where /proc is not there (contention then goes unmeasured)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    return CpuTimes(busy=sum(ticks) - idle, total=sum(ticks), own=int(own[11]) + int(own[12]))


# Below this many clock ticks (all CPUs together: 2 CPU-seconds) a tick or two of any daemon
# reads as a large share: the share is then not measured.
MIN_SHARE_TICKS = 200


def measured_others_share(start: CpuTimes | None, end: CpuTimes | None) -> float | None:
    """others_cpu_share over an interval long enough to tell, else None."""
    if start is None or end is None or end.total - start.total < MIN_SHARE_TICKS:
        return None
    return others_cpu_share(start, end)


def others_cpu_share(start: CpuTimes, end: CpuTimes) -> float:
    """Fraction of all CPU time between two readings that other processes (or the host) took.

    Measurements share the cores with whatever else runs; 0.5 on two cores means another process
    held one core throughout, and the figures are then understated.
    """
    total = end.total - start.total
    others = (end.busy - start.busy) - (end.own - start.own)
    return min(1.0, max(0.0, others / total)) if total > 0 else 0.0


def measure_bandwidth(
    *,
    array_bytes: float,
    repeats: int,
    min_sample_s: float,
    tick: Callable[[], None],
    kinds: tuple[str, ...] = BANDWIDTH_KINDS,
) -> dict[str, tuple[Timing, float]]:
    """{kind: (timing of one pass, bytes moved per pass)} for read, copy and triad (fp32), or
    the `kinds` asked for (read alone holds one array, not three)."""
    import torch

    rows = max(1, int(array_bytes // (4 * _READ_ROW)))
    size = rows * _READ_ROW
    a = torch.ones(size)  # written once: pages are resident
    others = size if set(kinds) - {"read"} else 0  # copy's and triad's, where they are timed
    b, c = torch.ones(others), torch.ones(others)
    matrix, vector, row_sums = a.view(rows, _READ_ROW), torch.ones(_READ_ROW), torch.empty(rows)
    element_bytes = 4 * a.numel()
    kernels = {
        "read": (lambda: torch.mv(matrix, vector, out=row_sums), element_bytes),
        "copy": (lambda: b.copy_(a), 2 * element_bytes),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3 * element_bytes),
    }
    results = {}
    for kind in kinds:
        kernel, moved = kernels[kind]
        timing = time_calls(
            kernel, clock=perf_counter_clock, repeats=repeats, min_sample_s=min_sample_s
        )
        results[kind] = (timing, float(moved))
        tick()
    return results
