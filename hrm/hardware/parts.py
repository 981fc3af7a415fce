"""The parts of a hardware profile: devices, the CPU-GPU link, GPU interconnects and measured
curves, with their YAML form (decimal units in files, SI base units in the dataclasses).
hrm/hardware/__init__.py assembles them into a HardwareProfile.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hrm.errors import HrmError
from hrm.policy import DTYPE_BYTES

RATE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8")


@dataclass(frozen=True, kw_only=True)
class Curve:
    """Achieved rate against size, interpolated as a power law between measured points (log
    rate linear in log size); flat beyond the ends.

    Matmul curves: x = tokens (rows of the GEMM), y = FLOP/s.  Link curves: x = bytes per
    transfer, y = bytes/s.  Measured curves let the planner charge achieved, not peak, rates.
    Why log-log: a bound regime is a power law, rate ~ size where a fixed cost (a weight read, a
    latency) dominates and rate ~ const where the roof does, and log-log interpolation is exact on
    both. Linear in log(size) overstated the rate between such points: 22% at 2.25 rows between
    measured 1 and 4 (docs/decisions.md, 2026-12-02).
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if not self.points or xs != sorted(xs) or len(set(xs)) != len(xs):
            raise HrmError("curve: points must be non-empty with strictly increasing sizes")
        if any(x <= 0 or y <= 0 for x, y in self.points):
            raise HrmError("curve: sizes and rates must be positive")

    def at(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        if x <= xs[0]:
            return self.points[0][1]
        if x >= xs[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(xs, x)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        if x == x0:
            return y0
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))

    def at_each(self, x):
        """`at` for a numpy array of sizes, elementwise (the cost model's per-step lookups)."""
        import numpy as np

        xs = np.log([p[0] for p in self.points])
        ys = np.log([p[1] for p in self.points])
        return np.exp(np.interp(np.log(np.maximum(x, 1e-30)), xs, ys))

    @property
    def best(self) -> float:
        return max(y for _, y in self.points)


# 16-bit float dtypes a CPU may compute in float32 after widening (hrm.rules.cpu_gemm).
HALF_DTYPES = ("bfloat16", "float16")
# hrm profile times that path on a CPU and stores its rates beside the dtypes under these keys.
WIDENED_KEYS = {dtype: f"{dtype}_widened" for dtype in HALF_DTYPES}
# ... and the path over weights prepacked once for oneDNN (hrm.rules.gemm_paths), under these.
PACKED_KEYS = {dtype: f"{dtype}_packed" for dtype in HALF_DTYPES}
# ... and the routed experts' fused kernel (hrm.rules.cpu_moe), bfloat16 only, under these.
FUSED_KEYS = {"bfloat16": "bfloat16_fused"}
CPU_PATH_KEYS = {"widened": WIDENED_KEYS, "packed": PACKED_KEYS, "fused": FUSED_KEYS}


def path_key(dtype: str, path: str) -> str:
    """The rate key a CPU path of `dtype` is measured under: the dtype itself when native."""
    return dtype if path == "native" else CPU_PATH_KEYS[path][dtype]


@dataclass(frozen=True, kw_only=True)
class LaunchOverhead:
    """The executor's fixed cost on this device beyond FLOPs and bytes (measured, seconds):
    per layer and micro-batch, per expert that micro-batch touches, and per decode step."""

    per_layer_s: float
    per_expert_s: float
    per_step_s: float
    # how sure each figure is: the range of its fits over the profile's rounds, keyed by the
    # figure's name (seconds); empty where one round or none was fitted (a miniature, old files)
    spread: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One kind of processor with its local memory. For a GPU the figures are per GPU."""

    name: str
    count: int = 1
    cores: int | None = None
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    peak_flops_per_s: Mapping[str, float]
    matmul_curves: Mapping[str, Curve] = field(default_factory=dict)
    # Free memory when a measured profile was taken (MemAvailable, cudaMemGetInfo); None if unknown.
    available_memory_bytes: float | None = None
    # per dtype the executor ran in, measured by hrm profile (an older profile's one figure was
    # measured in float32: hrm.hardware.files.upgrade); see launch_overhead_for
    launch_overhead: Mapping[str, LaunchOverhead] = field(default_factory=dict)
    # What long GEMMs sustain (a published measurement, cited in the file): the planner's rate
    # where no curve was measured; the peak stays the roofline's top roof.
    sustained_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    # CPU only: the executor's decode-attention stage, K/V bytes read per call -> bytes/s, per
    # KV dtype (measured by hrm profile); a dtype absent here is priced by FLOPs and memory
    # bandwidth. Per dtype because the rate is: float32 read K/V 1.5x as fast as bfloat16
    # (bench_prediction_by_op, 2026-12-03)
    attention_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: the same stage over latent attention's cache (one row of kv_lora_rank + rope a
    # token that every head reads; batched GEMMs, not SDPA), per KV dtype, at the profiled
    # model's heads where it is latent, else DeepSeek-V2-Lite's 16 (executor/attention.py
    # LATENT_REFERENCE). What a latent model's decode attention is priced at; absent: as above
    latent_attention_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: the executor's prefill attention stage, FLOPs per call (hrm.roofline.ops.
    # prefill_attention_flops) -> FLOP/s, per dtype (measured by hrm profile); a dtype absent
    # here is priced at the GEMM curve with the causal FLOP count
    prefill_attention_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: bytes a host memcpy copies per second, each byte read once and written once
    # (STREAM's copy figure counts twice this), measured by hrm profile; what the CPU standing in
    # for a GPU moves its pages at (hrm/hardware/stand_in.py). None: not measured
    copy_bandwidth_bytes_per_s: float | None = None
    # CPU only: elements read or written per second by the executor's elementwise kernels, per
    # dtype (measured by hrm profile); absent: memory bandwidth / element size
    elementwise_rate: Mapping[str, float] = field(default_factory=dict)
    # GPU only: the executor's whole grouped expert FFN, FLOP/s against rows per expert, per
    # dtype (measured by hrm profile); absent: the GEMM curve plus the elementwise passes
    expert_ffn_curves: Mapping[str, Curve] = field(default_factory=dict)
    # CPU only: GEMM FLOP/s against rows at each other shape the executor runs, keyed by
    # gemm_shape_key ("d_in x d_out") then by rate key (measured by hrm profile); a shape absent
    # here is read between the measured ones (hrm.rules.cpu_gemm.shape_curve)
    gemm_shape_curves: Mapping[str, Mapping[str, Curve]] = field(default_factory=dict)
    # CPU only: the gemm_shape_key matmul_curves were timed at (the profiled model's expert w1,
    # as scaled to fit); None in profiles from before it was recorded
    matmul_shape: str | None = None

    # weights per second the executor dequantizes a compact format at, into 16 bits, per format
    # (hrm/formats.py; measured by hrm profile); absent: priced by memory traffic
    dequantize_rates: Mapping[str, float] = field(default_factory=dict)

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s of all `count` devices for `dtype`; falls back to float32 when absent.
        (A CPU's 16-bit GEMMs take the path hrm.rules.cpu_gemm chooses; price those with it.)"""
        rate = self.peak_flops_per_s.get(dtype, self.peak_flops_per_s.get("float32"))
        if rate is None:
            raise HrmError(f"{self.name}: no FLOP rate for {dtype} or float32 in the profile")
        return rate * self.count

    def matmul_flops_per_s(self, dtype: str, tokens: float) -> float:
        """Achieved GEMM FLOP/s of all devices at `tokens` rows: the measured curve, else the
        sustained rate, else the peak."""
        curve = self.matmul_curves.get(dtype)
        if curve:
            return curve.at(tokens) * self.count
        if dtype in self.sustained_flops_per_s:
            return self.sustained_flops_per_s[dtype] * self.count
        return self.flops_per_s(dtype)

    def launch_overhead_for(self, dtype: str) -> LaunchOverhead | None:
        """The fixed costs measured in `dtype`, else in another (_measured_in), else None."""
        return _measured_in(self.launch_overhead, dtype)

    def elementwise_elements_per_s(self, dtype: str) -> float:
        """Rate of elementwise passes in `dtype`: measured in it or another (_measured_in), else
        each element from memory once."""
        measured = _measured_in(self.elementwise_rate, dtype)
        if measured is not None:
            return measured * self.count
        return self.total_memory_bandwidth_bytes_per_s / DTYPE_BYTES[dtype]

    @property
    def total_memory_bytes(self) -> float:
        return self.memory_bytes * self.count

    @property
    def total_memory_bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.count


def _measured_in(by_dtype: Mapping[str, Any], dtype: str) -> Any:
    """A per-dtype figure that only some dtypes have: `dtype`'s, else float32's (a profile
    older than per-dtype figures has only that), else any dtype's (a quick profile times
    bfloat16 alone), else None."""
    if dtype in by_dtype:
        return by_dtype[dtype]
    if "float32" in by_dtype:
        return by_dtype["float32"]
    return next(iter(by_dtype.values()), None)


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """The CPU <-> GPU link (PCIe), per GPU; both directions can run at once."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_curve: Curve | None = None
    d2h_curve: Curve | None = None
    # Bytes per second moved in both directions together when h2d and d2h run at once (measured).
    bidirectional_bytes_per_s: float | None = None
    # The GPUs' links share one host root complex (a PCIe switch): together they move no more
    # than one link's bandwidth. Default False: each GPU on a root port of its own.
    shared: bool = False
    # Host memory the driver lets a process pin (container or OS limit); None: enough for the
    # weights. Weights beyond it stay pageable behind a pinned staging ring (planner/cost.py).
    pinnable_bytes: float | None = None


@dataclass(frozen=True, kw_only=True)
class DiskSpec:
    """The storage a disk tier reads weights from: sequential read rate against the size of
    each read. A speed quoted without its read size means little (an NVMe may read 4 GB/s in
    8 MiB reads and 30 MB/s in 4 KiB ones), so the planner charges the curve at the size the
    executor reads; `direct`: measured with O_DIRECT, past the page cache."""

    read_bytes_per_s: float  # at the largest read size (a datasheet's sequential read)
    read_curve: Curve | None = None  # bytes per second against bytes per read
    path: str | None = None  # the directory measured (hrm profile --disk); None: a datasheet's
    direct: bool = True

    def read_seconds(self, nbytes: float, read_size: float) -> float:
        rate = self.read_curve.at(read_size) if self.read_curve else self.read_bytes_per_s
        return nbytes / rate


def gemm_shape_key(d_in: int, d_out: int) -> str:
    """The profile's name of a GEMM shape x[T, d_in] @ w[d_out, d_in]^T."""
    return f"{d_in}x{d_out}"


# gloo: processes on one host, the CPU standing in for GPUs (hrm/hardware/stand_in.py)
INTERCONNECTS = ("pcie", "nvlink", "gloo")
# Each ring step's latency where a profile measured none: NCCL's own cost model for a ring
# all-reduce in its LL protocol (src/graph/tuning.cc: a base of 3.6 us a call, and 0.47 us a step
# over NVLink, 1.0 us over PCIe), a 2-GPU call's (two steps) spread over its two steps
DATASHEET_STEP_LATENCY_S = {
    "nvlink": (3.6 + 2 * 0.47) / 2 * 1e-6,
    "pcie": (3.6 + 2 * 1.0) / 2 * 1e-6,
}


@dataclass(frozen=True, kw_only=True)
class Interconnect:
    """The links of tensor parallelism's all-reduces: per GPU and direction, bandwidth (beta)
    and each ring step's latency (alpha)."""

    kind: str  # pcie (peer-to-peer through the host bridge), nvlink, or gloo (see INTERCONNECTS)
    bytes_per_s: float
    step_latency_s: float | None = None  # None: DATASHEET_STEP_LATENCY_S for its kind

    def __post_init__(self) -> None:
        if self.step_latency_s is None and self.kind not in DATASHEET_STEP_LATENCY_S:
            raise HrmError(f"a {self.kind} interconnect needs its measured latency")

    @property
    def latency_s(self) -> float:
        """Seconds each ring step waits beyond its bytes."""
        if self.step_latency_s is not None:
            return self.step_latency_s
        return DATASHEET_STEP_LATENCY_S[self.kind]
