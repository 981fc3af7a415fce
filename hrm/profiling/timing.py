"""One timing loop for every measurement: warm up, repeat, take the median, keep the spread.

The clock is passed in, so the CPU (time.perf_counter) and the GPU (CUDA
events, synchronised) share this loop; the module imports no torch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# clock(fn, calls) runs fn `calls` times and returns the elapsed seconds, work finished.
Clock = Callable[[Callable[[], object], int], float]


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Seconds per call, one sample per repeat; each sample averages `calls_per_sample` calls."""

    samples_s: tuple[float, ...]
    calls_per_sample: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    def rate(self, work: float) -> float:
        """Median rate: `work` (FLOPs or bytes per call) over the median time."""
        return work / self.median_s

    def rate_range(self, work: float) -> tuple[float, float]:
        """(slowest, fastest) rate over the samples: the spread a reader should see."""
        return work / max(self.samples_s), work / min(self.samples_s)

    @property
    def relative_spread(self) -> float:
        """(slowest - fastest) / median time: 0.05 means the samples span 5 % of the median."""
        return (max(self.samples_s) - min(self.samples_s)) / self.median_s


def perf_counter_clock(fn: Callable[[], object], calls: int) -> float:
    """The CPU clock: CPU work is finished when the call returns."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - start


def calls_per_sample(call_s: float, min_sample_s: float) -> int:
    """Enough calls that one sample lasts `min_sample_s`, so clock resolution does not matter."""
    return max(1, math.ceil(min_sample_s / max(call_s, 1e-9)))


def estimated_duration_s(call_s: float, *, repeats: int, min_sample_s: float) -> float:
    """What time_calls will spend on a call of `call_s` seconds: one warm-up plus the samples."""
    return call_s + repeats * calls_per_sample(call_s, min_sample_s) * call_s


def time_calls(
    fn: Callable[[], object], *, clock: Clock, repeats: int, min_sample_s: float
) -> Timing:
    """Warm up once (allocation, kernel choice, page faults), then `repeats` timed samples."""
    warmup_s = clock(fn, 1)
    calls = calls_per_sample(warmup_s, min_sample_s)
    samples = tuple(clock(fn, calls) / calls for _ in range(repeats))
    return Timing(samples_s=samples, calls_per_sample=calls)
