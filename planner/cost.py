"""The end-to-end time model: prefill and every decode step, per layer, per queue.

Once N (batch) and mu (micro-batch) are fixed, every time below is an affine function of the
placement v = (1, A_g, F_g, r_w, r_c): A_g = attention on the GPU, F_g = layers (projections,
router, experts, LM head) on the GPU, r_w = fraction of each layer's weights resident on the GPU,
r_c = fraction of the KV cache on the GPU. Constraints tie them: A_g <= F_g, r_w <= F_g, r_c <= A_g.
The nonlinear parts (expected distinct experts, context growing step by step, efficiency curves,
page sizes) are constants at fixed (N, mu), so one set of coefficients serves the MILP
(planner/milp.py), the closed-form search (planner/search.py) and the evaluation of a given policy.

Steps: index 0 is prefill (the first token), 1..G-1 the decode steps at context S + t.

Per layer and step, each queue's busy time (paper Eq 12-14, extended):
  Q_gpu = sum over micro-batches of F_g*(T_dense + T_ffn + T_allreduce) + A_g*T_attn  (GPU)
  Q_cpu = sum over micro-batches of (1-F_g)*(T_dense + T_ffn) + (1-A_g)*T_attn  (CPU workers)
  Q_h2d = (F_g - r_w)*W_l/B_h2d(page) + sum of activations and KV prefetch   (PCIe in)
  Q_d2h = sum of QKV to the CPU and KV written back                           (PCIe out)
and the schedule (SCHEDULES in hrm.plan) turns them into the layer time:
  cgopipe, gpu-attention: T_layer = max(Q_gpu, Q_cpu, Q_h2d, Q_d2h, chain)   (paper Eq 12)
  overlap (S2): as cgopipe, but the whole-layer weight copy blocks the h2d queue, so
                T_layer >= Q_h2d + one micro-batch's GPU work
  serial (S3): T_layer = max(W_l stream, sum over micro-batches of chain)
where chain = the stage times of one micro-batch end to end (a micro-batch cannot lap itself).
A step costs L*T_layer + fill/drain (when m >= 2: one chain less the work on the device that runs
the layers) + the LM head of every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hrm.formats import DEQUANTIZE_TRAFFIC, is_compact
from hrm.hardware import HardwareProfile
from hrm.plan import QUEUES
from hrm.policy import compute_bytes
from hrm.rules.placement import DISK_READ_BYTES
from planner.layer_seconds import MicroBatchSeconds
from planner.memory import BASIS
from planner.memory import placement_vector as vec
from planner.setting import Setting
from planner.transfers import link_seconds


@dataclass(frozen=True)
class Expr:
    """Per-layer seconds at every step, affine in v:
    value = m * (scaled @ v) + unscaled @ v + weight_stream_s(m) * (weights @ v)."""

    scaled: np.ndarray  # [steps, 5], summed over the m micro-batches
    unscaled: np.ndarray  # [steps, 5], once per layer
    weights: np.ndarray  # [5]

    def __add__(self, other: Expr) -> Expr:
        return Expr(
            self.scaled + other.scaled, self.unscaled + other.unscaled, self.weights + other.weights
        )

    def times(self, factor: float) -> Expr:
        return Expr(self.scaled * factor, self.unscaled * factor, self.weights * factor)

    def coefficients(self, m: float, weight_stream_s: float) -> np.ndarray:
        """[steps, 6] coefficients at one (N, mu): what the MILP constrains."""
        return m * self.scaled + self.unscaled + weight_stream_s * self.weights[None, :]

    def evaluate(self, m: np.ndarray, weight_stream_s: np.ndarray, v: np.ndarray) -> np.ndarray:
        """[M, steps] values at M points, each with its m, stream time and placement v [M, 6]."""
        return (
            m[:, None] * (v @ self.scaled.T)
            + v @ self.unscaled.T
            + (weight_stream_s * (v @ self.weights))[:, None]
        )


def _zero(steps: int) -> np.ndarray:
    return np.zeros((steps, BASIS))


def _per_mb(coef_by_step: np.ndarray, seconds: np.ndarray) -> Expr:
    """A per-micro-batch cost: coefficients [steps, 6] times seconds [steps], summed over m."""
    return Expr(coef_by_step * seconds[:, None], _zero(len(seconds)), np.zeros(BASIS))


def _coef(steps: int, prefill: np.ndarray, decode: np.ndarray) -> np.ndarray:
    """[steps, 6]: `prefill` coefficients at step 0, `decode` at the others."""
    out = np.tile(decode, (steps, 1))
    out[0] = prefill
    return out


@dataclass(frozen=True, kw_only=True)
class QueueTerms:
    """Each queue's per-layer busy time by component, the one-micro-batch chain, and the head."""

    components: dict[str, dict[str, Expr]]  # queue -> component -> Expr
    chain: Expr  # one (the largest) micro-batch through every stage, per layer
    chain_sum: Expr  # every micro-batch through every stage, one after another
    fill: Expr  # pipeline fill and drain, once per step (see queue_terms)
    head: dict[str, Expr]  # queue -> once-per-step LM head and embedding time

    def queue(self, name: str) -> Expr:
        return sum(self.components[name].values(), _empty(self.chain))


def _empty(like: Expr) -> Expr:
    steps = like.scaled.shape[0]
    return Expr(_zero(steps), _zero(steps), np.zeros(BASIS))


def queue_terms(setting: Setting, mb: MicroBatchSeconds) -> QueueTerms:
    """Attach placement coefficients to one micro-batch's seconds (see the module docstring)."""
    steps = setting.steps
    one, att, ffn, rw, rc, rd = (vec(one=1), vec(att=1), vec(ffn=1), vec(rw=1), vec(rc=1),
                                 vec(rd=1))  # fmt: skip
    on_gpu, on_cpu = _coef(steps, ffn, ffn), _coef(steps, one - ffn, one - ffn)
    # prefill attention runs with the layers (F_g); decode attention where A_g says
    att_gpu, att_cpu = _coef(steps, ffn, att), _coef(steps, one - ffn, one - att)
    # activations cross the link in prefill when the GPU runs the layers (hidden pages), and in
    # decode when attention and layers sit on different devices: F_g - A_g  (A_g <= F_g)
    crossing = _coef(steps, ffn, ffn - att)
    # the CPU part of the cache crosses: prefill writes it (F_g - r_c), decode reads and appends
    # to it (A_g - r_c)
    kv_crossing = _coef(steps, ffn - rc, att - rc)
    components = {
        "gpu": {
            "dense": _per_mb(on_gpu, mb.gpu_dense),
            "expert ffn": _per_mb(on_gpu, mb.gpu_ffn),
            "attention": _per_mb(att_gpu, mb.gpu_attention),
            "all-reduce": _per_mb(on_gpu, mb.gpu_all_reduce),
            # a CPU standing in for the GPU pays the executor's per-layer cost there too; a GPU
            # the host's issue time its dense kernels do not cover (planner/overheads.py)
            "launch overhead": _per_mb(
                on_gpu, mb.cpu_launch if setting.hardware.stand_in else mb.gpu_launch
            ),
            # a compact format: once per pass of a layer, (F_g - r_w) * W_l into 16 bits
            "dequantize": Expr(
                _zero(steps),
                _coef(steps, ffn - rw, ffn - rw) * dequantize_seconds(setting),
                np.zeros(BASIS),
            ),
        },
        "cpu": {
            "dense": _per_mb(on_cpu, mb.cpu_dense),
            "expert ffn": _per_mb(on_cpu, mb.cpu_ffn),
            "attention": _per_mb(att_cpu, mb.cpu_attention),
            "launch overhead": _per_mb(on_cpu, mb.cpu_launch),
        },
        "h2d": {
            # (F_g - r_w) * W_l / B_h2d(page): scaled by the weight stream time of the layer
            "weights": Expr(_zero(steps), _zero(steps), ffn - rw),
            "activations": _per_mb(crossing, mb.activations_to_gpu),
            "kv cache": _per_mb(kv_crossing, mb.kv_to_gpu),
        },
        "d2h": {
            "activations": _per_mb(crossing, mb.activations_to_cpu),
            "kv cache": _per_mb(kv_crossing, mb.kv_to_cpu),
        },
        # r_d * W_l read from disk once per layer and pass (FlexGen's dtoc), beside the others
        # (on a GPU machine; the CPU standing in adds them to its shared host)
        "disk": {
            "weights": Expr(
                _zero(steps), _coef(steps, rd, rd) * disk_seconds(setting), np.zeros(BASIS)
            )
        },
    }
    # chain = one micro-batch through all its stages, i.e. the per-micro-batch sum of every queue
    per_mb = sum((c.scaled for q in components.values() for c in q.values()), _zero(steps))
    chain = Expr(_zero(steps), per_mb, np.zeros(BASIS))
    chain_sum = Expr(per_mb, _zero(steps), np.zeros(BASIS))
    # fill/drain = chain - home: the first micro-batch's stages before its work on the device
    # that runs the layers (GPU if F_g, else CPU), and the last one's after it
    home = sum(c.scaled for c in components["gpu"].values()) + (
        _per_mb(on_cpu, mb.cpu_dense + mb.cpu_ffn + mb.cpu_attention + mb.cpu_launch).scaled
    )
    fill = Expr(_zero(steps), per_mb - home, np.zeros(BASIS))
    head = {
        "gpu": _per_mb(on_gpu, mb.head_gpu),
        "cpu": _per_mb(on_cpu, mb.head_cpu),
        "h2d": _per_mb(on_gpu, mb.embed_to_gpu),
    }
    return QueueTerms(components=components, chain=chain, chain_sum=chain_sum, fill=fill, head=head)


def with_last_micro_batch(full: QueueTerms, last: QueueTerms) -> QueueTerms:
    """Terms for m full micro-batches plus one smaller last one (N not a multiple of mu): the last
    one's per-micro-batch seconds are added once, and the chain stays the full one's."""

    def add(x: Expr, y: Expr) -> Expr:
        return Expr(x.scaled, x.unscaled + y.scaled, x.weights)

    return QueueTerms(
        components={
            q: {c: add(e, last.components[q][c]) for c, e in comps.items()}
            for q, comps in full.components.items()
        },
        chain=full.chain,
        chain_sum=add(full.chain_sum, last.chain_sum),
        fill=full.fill,
        head={q: add(e, last.head[q]) for q, e in full.head.items()},
    )


@dataclass(frozen=True, kw_only=True)
class ScheduleTerms:
    """T_layer >= each of `layer` (per layer, per step); a step adds L*T_layer + fill + head."""

    layer: dict[str, Expr]
    fill: Expr  # charged once per step when there are at least two micro-batches
    head: Expr  # LM head and embeddings, once per step


def schedule_terms(
    schedule: str, q: QueueTerms, hardware: HardwareProfile | None = None
) -> ScheduleTerms:
    """The schedule's lower bounds on T_layer; with a link that measured both directions at once
    (`link.bidirectional`), the overlapping copies also share that rate; on a CPU standing in for
    the GPU (hrm/hardware/stand_in.py) the four queues share the host and add up (see below)."""
    gpu, cpu, h2d, d2h = (q.queue(name) for name in QUEUES)
    link = hardware.link if hardware is not None else None
    shared = hardware is not None and hardware.stand_in
    head = sum(q.head.values(), _empty(q.chain))
    empty = _empty(q.chain)
    # stand-in: one set of cores and one memory bus run all the queues (the disk's reads too: the
    # engine runs them inline there): T_layer >= their sum
    host = {"shared host": gpu + cpu + h2d + d2h + q.queue("disk")} if shared else {}
    if schedule == "serial":
        # S3: T_layer = max(W_l stream, sum of chains): micro-batches one after another, no fill
        layer = {"h2d": q.components["h2d"]["weights"], "latency": q.chain_sum, **host,
                 "disk": q.queue("disk")}  # fmt: skip
        return ScheduleTerms(layer=layer, fill=empty, head=head)
    disk = {"disk": q.queue("disk")}  # the reads overlap everything else (a queue of its own)
    layer = {"gpu": gpu, "cpu": cpu, "h2d": h2d, "d2h": d2h, "latency": q.chain, **host, **disk}
    if link is not None and link.bidirectional_bytes_per_s:
        # H2D and D2H overlap here, and together move at most the measured both-ways rate B_bi
        # (hrm profile times both at once): bytes_h2d + bytes_d2h <= B_bi * T_layer, with each
        # queue's bytes = its seconds at its own peak rate:
        #   T_layer >= (B_h2d * Q_h2d + B_d2h * Q_d2h) / B_bi
        both = link.bidirectional_bytes_per_s
        layer["link"] = h2d.times(link.h2d_bytes_per_s / both) + d2h.times(
            link.d2h_bytes_per_s / both
        )
    if schedule == "overlap":
        # S2: no paging: the whole-layer copy holds the h2d queue, so at least one micro-batch's
        # D2 and GPU work come after it:  T_layer >= Q_h2d + T_gpu(one micro-batch)
        layer["h2d"] = h2d + Expr(empty.scaled, gpu.scaled, np.zeros(BASIS))
    return ScheduleTerms(layer=layer, fill=q.fill, head=head)


def dequantize_seconds(setting: Setting) -> float:
    """Seconds the GPU takes to dequantize a whole layer of a compact format into 16 bits, at
    the rate hrm profile measured for the format (weights per second), else at the bytes the
    executor's kernels move per weight (hrm.formats.DEQUANTIZE_TRAFFIC) over its memory
    bandwidth; 0 in a float dtype."""
    fmt, gpu = setting.weight_dtype, setting.hardware.gpu
    if not is_compact(fmt) or gpu is None:
        return 0.0
    weights = setting.weights.layer / compute_bytes(fmt)
    rate = gpu.dequantize_rates.get(fmt)
    if rate is None:
        rate = gpu.memory_bandwidth_bytes_per_s / DEQUANTIZE_TRAFFIC[fmt]
    return weights / rate


def disk_seconds(setting: Setting) -> float:
    """Seconds to read one layer's weights as stored from the disk tier, in reads of
    hrm.rules.placement.DISK_READ_BYTES (or the layer, if smaller) at the profile's rate for that
    size; 0 without a disk in the profile (then r_d stays 0: planner/milp.py)."""
    disk = setting.hardware.disk
    if disk is None:
        return 0.0
    w = setting.weights.stored
    return disk.read_seconds(w, min(DISK_READ_BYTES, w))


def weight_stream_seconds(setting: Setting, m: np.ndarray) -> np.ndarray:
    """Seconds to stream all of W_l at the link rate of its pages: m pages (one per micro-batch)
    under cgopipe and gpu-attention, one whole-layer copy under serial and overlap. The page size
    is taken with the whole layer streamed, so that the time stays linear in r_w."""
    pages = (
        np.ones_like(m, dtype=float)
        if setting.schedule in ("serial", "overlap")
        else m.astype(float)
    )
    w = setting.weights.stored
    hw = setting.hardware
    if hw.link is None:
        return np.zeros_like(pages)
    seconds = np.array([float(link_seconds(hw, w / p, "h2d")) * p for p in pages])
    if setting.weights_staged:
        # pageable -> pinned ring (a host memcpy reads and writes each byte: W_l / (B_cpu / 2)),
        # pipelined over the ring's two pages with the DMA: the slower stage sets the rate
        memcpy = w / (hw.cpu.memory_bandwidth_bytes_per_s / 2)
        seconds = np.maximum(seconds, memcpy)
    return seconds
