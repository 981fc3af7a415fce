"""GPU and link measurements: device memory, device-to-device copy, host<->device transfers.

All GPU timing uses CUDA events on the current stream after a synchronize (timing.py's loop
with `cuda_event_clock`), never the host clock around asynchronous work. Figures are for GPU 0;
the profile's `count` multiplies them, which assumes identical GPUs, each with its own link.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from hrm.errors import HrmError
from hrm.profiling.timing import Timing, time_calls

DIRECTIONS = ("h2d", "d2h")
HOST_MEMORY_KINDS = ("pinned", "pageable")


@dataclass(frozen=True, kw_only=True)
class GpuFacts:
    name: str
    count: int
    memory_bytes: float
    available_memory_bytes: float


def require_cuda() -> None:
    """Fail before any long work when CUDA was asked for and is not there."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no visible CUDA device"
        raise HrmError(f"--device cuda: CUDA is not available ({build}); use --device cpu")


# nvidia-smi --query-gpu fields recorded beside a GPU profile, GPU 0 only
CLOCK_POWER_FIELDS = (
    "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu",
    "clocks_throttle_reasons.active",
)  # fmt: skip


def clock_and_power(run=None) -> dict[str, str] | None:
    """GPU 0's clocks, power and throttle state as the driver reports them (nvidia-smi), or None
    where nvidia-smi is absent or fails: a profile says under which clocks it was taken."""
    import subprocess

    command = [
        "nvidia-smi", "--id=0", f"--query-gpu={','.join(CLOCK_POWER_FIELDS)}",
        "--format=csv,noheader,nounits",
    ]  # fmt: skip
    try:
        result = (run or subprocess.run)(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    values = [v.strip() for v in result.stdout.strip().splitlines()[0].split(",")]
    if len(values) != len(CLOCK_POWER_FIELDS):
        return None
    return dict(zip(CLOCK_POWER_FIELDS, values, strict=True))


def cuda_event_clock(fn: Callable[[], object], calls: int) -> float:
    """Seconds for `calls` calls of `fn`, timed with CUDA events on the current stream."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def gpu_facts() -> GpuFacts:
    import torch

    free, total = torch.cuda.mem_get_info()
    return GpuFacts(
        name=torch.cuda.get_device_name(),
        count=torch.cuda.device_count(),
        memory_bytes=float(total),
        available_memory_bytes=float(free),
    )


def measure_device_bandwidth(
    *, copy_bytes: float, repeats: int, min_sample_s: float
) -> tuple[Timing, float]:
    """(timing, bytes moved) of a device-to-device copy: bytes read + bytes written."""
    import torch

    size = int(copy_bytes)
    src = torch.ones(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    timing = time_calls(
        lambda: dst.copy_(src), clock=cuda_event_clock, repeats=repeats, min_sample_s=min_sample_s
    )
    return timing, 2.0 * size


def measure_link_sweep(
    *, sizes_bytes: tuple[float, ...], repeats: int, min_sample_s: float, tick: Callable[[], None]
) -> dict[tuple[str, str], list[tuple[float, Timing]]]:
    """{(direction, host memory kind): [(bytes per transfer, timing)]} over `sizes_bytes`.

    Pinned copies are asynchronous (non_blocking), as the executor issues them; pageable ones
    go through the driver's staging buffer and block the host.
    """
    import torch

    largest = int(max(sizes_bytes))
    device_buffer = torch.ones(largest, dtype=torch.uint8, device="cuda")
    results: dict[tuple[str, str], list[tuple[float, Timing]]] = {}
    for kind in HOST_MEMORY_KINDS:
        pinned = kind == "pinned"
        host = torch.ones(largest, dtype=torch.uint8, pin_memory=pinned)
        for direction in DIRECTIONS:
            for size in sizes_bytes:
                h, d = host[: int(size)], device_buffer[: int(size)]
                dst, src = (d, h) if direction == "h2d" else (h, d)
                timing = time_calls(
                    partial(dst.copy_, src, non_blocking=pinned),
                    clock=cuda_event_clock,
                    repeats=repeats,
                    min_sample_s=min_sample_s,
                )
                results.setdefault((direction, kind), []).append((float(size), timing))
                tick()
        del host
    return results


def measure_both_directions(
    *, size_bytes: float, repeats: int, min_sample_s: float
) -> tuple[Timing, float]:
    """(timing, bytes moved in both directions) with h2d and d2h on two streams at once (pinned)."""
    import torch

    size = int(size_bytes)
    host_in = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device_in = torch.empty(size, dtype=torch.uint8, device="cuda")
    device_out = torch.ones(size, dtype=torch.uint8, device="cuda")
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        current = torch.cuda.current_stream()
        h2d_stream.wait_stream(current)
        d2h_stream.wait_stream(current)
        with torch.cuda.stream(h2d_stream):
            device_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(d2h_stream):
            host_out.copy_(device_out, non_blocking=True)
        current.wait_stream(h2d_stream)  # the clock's end event waits for both copies
        current.wait_stream(d2h_stream)

    timing = time_calls(both, clock=cuda_event_clock, repeats=repeats, min_sample_s=min_sample_s)
    return timing, 2.0 * size
