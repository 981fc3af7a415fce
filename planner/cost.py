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

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from hrm.arch import ModelArch
from hrm.cpu_gemm import CpuGemmChoice, choose_cpu_gemm
from hrm.hardware import HardwareProfile
from hrm.hardware_parts import DeviceSpec
from hrm.ops import ACTIVATION_DTYPE, layer_ops, lm_head_op, prefill_attention_flops
from hrm.placement import largest_page_bytes
from hrm.policy import dtype_bytes
from hrm.workload import Workload
from planner.memory import PREFILL_CHUNK_TOKENS, MemoryTerms, WeightBytes, memory_terms
from planner.memory import placement_vector as vec
from planner.op_time import expert_ffn_seconds, op_seconds
from planner.overheads import launch_seconds, step_seconds, unhidden_gpu_launch
from planner.transfers import all_reduce_seconds, check_tensor_parallel, link_seconds

DENSE_OPS = ("norms", "qkv_proj", "o_proj", "router", "shared_expert")
QUEUES = ("gpu", "cpu", "h2d", "d2h")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class Setting:
    """Everything fixed while a search runs: model, machine, workload, schedule, dtypes."""

    arch: ModelArch
    hardware: HardwareProfile
    workload: Workload
    schedule: str = "cgopipe"
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    # the CPU's GEMM path by token count (hrm.cpu_gemm); None: chosen from the profile's CPU
    cpu_gemm: CpuGemmChoice | None = None
    # the KV cache is left-padded to the longest prompt (the resident executor's), so decode
    # attends over the padded slots even when prefill packs the prompts
    padded_kv_cache: bool = False
    # the routed FFN's seconds per group of tokens, by device role (planner.op_time)
    ffn_memo: dict[str, dict[float, float]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # one Setting per kind of layer, with its share of the layers (kinds)
    _kinds: list = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_tensor_parallel(self.arch, self.hardware)

    def kinds(self) -> list[tuple[Setting, float]]:
        """This setting for each kind of layer (ModelArch.layer_kinds), with its share of the
        layers; itself alone when every layer is alike."""
        if not self.arch.dense_layers:
            return [(self, 1.0)]
        if not self._kinds:
            self._kinds.extend(
                (dataclasses.replace(self, arch=kind), n / self.arch.num_layers)
                for kind, n in self.arch.layer_kinds()
            )
        return self._kinds

    @property
    def compute_dtype(self) -> str:
        """GEMMs run in the weight dtype, or bfloat16 after dequantising integer weights."""
        return self.weight_dtype if self.weight_dtype in FLOAT_DTYPES else "bfloat16"

    @property
    def cpu_gemm_choice(self) -> CpuGemmChoice:
        """The path the executor takes for each CPU GEMM: given (what a run took), else the one
        hrm.cpu_gemm picks from the profile's curves."""
        if self.cpu_gemm is not None:
            return self.cpu_gemm
        return choose_cpu_gemm(
            self.hardware.cpu, self.compute_dtype, source=f"profile {self.hardware.name}"
        )

    @property
    def steps(self) -> int:
        return self.workload.gen_len

    @property
    def decode_contexts(self) -> np.ndarray:
        """Keys a decode step attends over: S + t for t = 1..G-1 (S the mean, or the max when the
        prompts or the cache are padded)."""
        padded = self.workload.padding or self.padded_kv_cache
        start = self.workload.prompt_len_max if padded else self.workload.prompt_len_mean
        return start + np.arange(1, self.steps, dtype=float)

    @property
    def weights(self) -> WeightBytes:
        return WeightBytes.of(self.arch, self.weight_dtype)

    @property
    def weights_staged(self) -> bool:
        """The streamed weights exceed what the host may pin (`link.pinnable`, judged with every
        layer streamed): they stay pageable and each page goes through a pinned staging ring."""
        link = self.hardware.link
        if link is None or link.pinnable_bytes is None:
            return False
        return self.arch.num_layers * self.weights.layer > link.pinnable_bytes

    def memory(self, batch_size, micro_batch_size: int) -> MemoryTerms:
        """Every buffer at N = batch_size (scalar or array) and mu = micro_batch_size; with staged
        weights also the ring: F_g * 2 * the largest page of a layer streamed whole (pages cut
        at tensor boundaries by hrm.placement, as the executor cuts them)."""
        terms = memory_terms(
            self.arch,
            self.workload,
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            weight_dtype=self.weight_dtype,
            kv_dtype=self.kv_dtype,
            gpu_count=max(1, self.hardware.gpu_count),
        )
        if self.weights_staged:
            m = np.ceil(np.asarray(batch_size, dtype=float) / micro_batch_size)
            pages = np.ones_like(m) if self.schedule in ("serial", "overlap") else m
            page = np.vectorize(lambda p: largest_page_bytes(self.arch, self.weight_dtype, int(p)))
            terms.cpu["weight staging"] = 2 * page(pages)[..., None] * vec(ffn=1.0)
        return terms


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
        """[steps, 5] coefficients at one (N, mu): what the MILP constrains."""
        return m * self.scaled + self.unscaled + weight_stream_s * self.weights[None, :]

    def evaluate(self, m: np.ndarray, weight_stream_s: np.ndarray, v: np.ndarray) -> np.ndarray:
        """[M, steps] values at M points, each with its m, stream time and placement v [M, 5]."""
        return (
            m[:, None] * (v @ self.scaled.T)
            + v @ self.unscaled.T
            + (weight_stream_s * (v @ self.weights))[:, None]
        )


def _zero(steps: int) -> np.ndarray:
    return np.zeros((steps, 5))


def _per_mb(coef_by_step: np.ndarray, seconds: np.ndarray) -> Expr:
    """A per-micro-batch cost: coefficients [steps, 5] times seconds [steps], summed over m."""
    return Expr(coef_by_step * seconds[:, None], _zero(len(seconds)), np.zeros(5))


def _coef(steps: int, prefill: np.ndarray, decode: np.ndarray) -> np.ndarray:
    """[steps, 5]: `prefill` coefficients at step 0, `decode` at the others."""
    out = np.tile(decode, (steps, 1))
    out[0] = prefill
    return out


@dataclass(frozen=True, kw_only=True)
class MicroBatchSeconds:
    """Seconds one micro-batch of b sequences spends per layer at every step, on each resource."""

    gpu_dense: np.ndarray
    gpu_ffn: np.ndarray
    gpu_attention: np.ndarray
    cpu_dense: np.ndarray
    cpu_ffn: np.ndarray
    cpu_attention: np.ndarray
    activations_to_gpu: np.ndarray  # prefill: hidden page in; decode: attention output (D2)
    activations_to_cpu: np.ndarray  # prefill: hidden page out; decode: QKV (D1)
    kv_to_gpu: np.ndarray  # decode with GPU attention: the CPU part of the cache, prefetched
    kv_to_cpu: np.ndarray  # prefill: the prompt's K, V; decode: the new token's
    gpu_all_reduce: np.ndarray  # tensor parallelism: after attention and after the experts
    cpu_launch: np.ndarray  # the executor's fixed cost of one layer on the CPU (measured)
    gpu_launch: np.ndarray  # the host's issue time of a GPU layer its kernels do not cover
    head_gpu: np.ndarray  # final norm + LM head, once per step (not per layer)
    head_cpu: np.ndarray
    embed_to_gpu: np.ndarray  # next tokens' embeddings, gathered on the CPU


def micro_batch_seconds(setting: Setting, b: float) -> MicroBatchSeconds:
    """Per-layer seconds of one micro-batch of b sequences at each step, on either device: of the
    mean layer where dense layers sit among sparse ones (docs/decisions.md, 2026-12-05)."""
    kinds = [(_kind_seconds(kind, b), share) for kind, share in setting.kinds()]
    if len(kinds) == 1:
        return kinds[0][0]
    return MicroBatchSeconds(
        **{
            f.name: sum(getattr(mb, f.name) * share for mb, share in kinds)
            for f in dataclasses.fields(MicroBatchSeconds)
        }
    )


def _kind_seconds(setting: Setting, b: float) -> MicroBatchSeconds:
    """micro_batch_seconds of a model whose layers are all of one kind."""
    arch, hw, wl = setting.arch, setting.hardware, setting.workload
    dtype = setting.compute_dtype
    adt, kdt = dtype_bytes(ACTIVATION_DTYPE), dtype_bytes(setting.kv_dtype)
    steps = setting.steps
    s_pre = wl.prefill_len
    chunk = min(b * s_pre, PREFILL_CHUNK_TOKENS)
    prefill = {
        op.name: op
        for op in layer_ops(
            arch,
            batch=b,
            new_tokens=s_pre,
            context=s_pre,
            weight_dtype=setting.weight_dtype,
            kv_dtype=setting.kv_dtype,
            ffn_group_tokens=chunk,
        )
    }
    decode = {
        op.name: op
        for op in layer_ops(
            arch,
            batch=b,
            new_tokens=1,
            context=setting.decode_contexts,
            weight_dtype=setting.weight_dtype,
            kv_dtype=setting.kv_dtype,
            ffn_group_tokens=b,
        )
    }
    group = arch.num_attention_heads / arch.num_key_value_heads

    def on(role: str, device: DeviceSpec | None, cpu_gemm: CpuGemmChoice | None = None):
        if device is None:  # no GPU: these entries are multiplied by F_g = 0
            return {key: np.zeros(steps) for key in ("dense", "ffn", "attention", "head")}

        def both(name: str, pre_rows: float, dec_rows: float) -> np.ndarray:
            if name not in prefill:
                return np.zeros(steps)
            pre = op_seconds(prefill[name], device, dtype, pre_rows, cpu_gemm=cpu_gemm)
            dec = op_seconds(decode[name], device, dtype, dec_rows, cpu_gemm=cpu_gemm)
            dec = dec * np.ones(steps - 1)
            return np.concatenate([[pre], dec])

        def ffn(tokens: float, group: float) -> float:
            wdt = setting.weight_dtype
            memo = setting.ffn_memo.setdefault(role, {})
            return expert_ffn_seconds(arch, device, dtype, tokens=tokens, group_tokens=group,
                                      weight_dtype=wdt, cpu_gemm=cpu_gemm, memo=memo)  # fmt: skip

        head = lm_head_op(arch, batch=b, weight_dtype=setting.weight_dtype)
        attention = both("attention", s_pre, group)
        on_cpu = cpu_gemm is not None
        prefill_curve = device.prefill_attention_curves.get(setting.kv_dtype) if on_cpu else None
        if prefill_curve is not None:
            # prefill attention on the CPU at the executor's measured rate for the FLOPs it
            # computes, the micro-batch padded to the longest prompt (hrm profile):
            # T = F_exec / R(F_exec)
            flops = prefill_attention_flops(arch, batch=b, length=wl.prompt_len_max)
            attention[0] = flops / prefill_curve.at(flops)
        curve = device.attention_curves.get(setting.kv_dtype) if on_cpu else None
        if curve is not None and steps > 1:
            # decode attention on the CPU at the executor's measured K/V read rate in the KV
            # dtype for this many bytes per call (hrm profile): T = bytes / B_attn(bytes)
            kv = np.asarray(decode["attention"].bytes, dtype=float) * np.ones(steps - 1)
            attention[1:] = kv / curve.at_each(kv)
        return {
            "dense": sum(both(name, chunk, b) for name in DENSE_OPS),
            "ffn": np.concatenate([[ffn(b * s_pre, chunk)], ffn(b, b) * np.ones(steps - 1)]),
            "attention": attention,
            "head": op_seconds(head, device, dtype, b, cpu_gemm=cpu_gemm) * np.ones(steps),
        }

    # a CPU standing in for the GPU runs the CPU's GEMM paths and kernels (hrm/stand_in.py)
    cpu = on("cpu", hw.cpu, setting.cpu_gemm_choice)
    cpu_overhead = hw.cpu.launch_overhead_for(dtype)
    gpu = on("gpu", hw.gpu, setting.cpu_gemm_choice if hw.stand_in else None)
    hidden_page = b * s_pre * arch.hidden_size * adt
    qkv = b * (arch.q_size + 2 * arch.kv_size) * adt
    kv_per_token_layer = 2 * arch.kv_size * kdt
    decode_kv_read = b * setting.decode_contexts * kv_per_token_layer

    def h2d(nbytes):
        return link_seconds(hw, nbytes, "h2d")

    def d2h(nbytes):
        return link_seconds(hw, nbytes, "d2h")

    return MicroBatchSeconds(
        gpu_dense=gpu["dense"],
        gpu_ffn=gpu["ffn"],
        gpu_attention=gpu["attention"],
        cpu_dense=cpu["dense"],
        cpu_ffn=cpu["ffn"],
        cpu_attention=cpu["attention"],
        activations_to_gpu=np.concatenate(
            [[h2d(hidden_page)], h2d(b * arch.q_size * adt) * np.ones(steps - 1)]
        ),
        activations_to_cpu=np.concatenate([[d2h(hidden_page)], d2h(qkv) * np.ones(steps - 1)]),
        kv_to_gpu=np.concatenate([[0.0], h2d(decode_kv_read)]),
        kv_to_cpu=np.concatenate(
            [
                [d2h(b * s_pre * kv_per_token_layer)],
                d2h(b * kv_per_token_layer) * np.ones(steps - 1),
            ]
        ),
        # two all-reduces of the micro-batch's hidden states per layer (Megatron: after the O
        # projection and after the expert FFN), prefill over all its prompt tokens
        gpu_all_reduce=2
        * np.concatenate(
            [
                [all_reduce_seconds(hw, b * s_pre * arch.hidden_size * adt)],
                all_reduce_seconds(hw, b * arch.hidden_size * adt) * np.ones(steps - 1),
            ]
        ),
        cpu_launch=launch_seconds(cpu_overhead, arch, steps, chunk, b),
        gpu_launch=unhidden_gpu_launch(
            hw.gpu.launch_overhead_for(dtype) if hw.gpu is not None else None, gpu["dense"], steps
        ),
        head_gpu=gpu["head"],
        head_cpu=cpu["head"] + step_seconds(cpu_overhead),
        embed_to_gpu=h2d(b * arch.hidden_size * adt) * np.ones(steps),
    )


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
    return Expr(_zero(steps), _zero(steps), np.zeros(5))


def queue_terms(setting: Setting, mb: MicroBatchSeconds) -> QueueTerms:
    """Attach placement coefficients to one micro-batch's seconds (see the module docstring)."""
    steps = setting.steps
    one, att, ffn, rw, rc = (vec(one=1), vec(att=1), vec(ffn=1), vec(rw=1), vec(rc=1))
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
    }
    # chain = one micro-batch through all its stages, i.e. the per-micro-batch sum of every queue
    per_mb = sum((c.scaled for q in components.values() for c in q.values()), _zero(steps))
    chain = Expr(_zero(steps), per_mb, np.zeros(5))
    chain_sum = Expr(per_mb, _zero(steps), np.zeros(5))
    # fill/drain = chain - home: the first micro-batch's stages before its work on the device
    # that runs the layers (GPU if F_g, else CPU), and the last one's after it
    home = sum(c.scaled for c in components["gpu"].values()) + (
        _per_mb(on_cpu, mb.cpu_dense + mb.cpu_ffn + mb.cpu_attention + mb.cpu_launch).scaled
    )
    fill = Expr(_zero(steps), per_mb - home, np.zeros(5))
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
    the GPU (hrm/stand_in.py) the four queues share the host and add up (see below)."""
    gpu, cpu, h2d, d2h = (q.queue(name) for name in QUEUES)
    link = hardware.link if hardware is not None else None
    shared = hardware is not None and hardware.stand_in
    head = sum(q.head.values(), _empty(q.chain))
    empty = _empty(q.chain)
    # stand-in: one set of cores and one memory bus run all four queues: T_layer >= their sum
    host = {"shared host": gpu + cpu + h2d + d2h} if shared else {}
    if schedule == "serial":
        # S3: T_layer = max(W_l stream, sum of chains): micro-batches one after another, no fill
        layer = {"h2d": q.components["h2d"]["weights"], "latency": q.chain_sum, **host}
        return ScheduleTerms(layer=layer, fill=empty, head=head)
    layer = {"gpu": gpu, "cpu": cpu, "h2d": h2d, "d2h": d2h, "latency": q.chain, **host}
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
        layer["h2d"] = h2d + Expr(empty.scaled, gpu.scaled, np.zeros(5))
    return ScheduleTerms(layer=layer, fill=q.fill, head=head)


def weight_stream_seconds(setting: Setting, m: np.ndarray) -> np.ndarray:
    """Seconds to stream all of W_l at the link rate of its pages: m pages (one per micro-batch)
    under cgopipe and gpu-attention, one whole-layer copy under serial and overlap. The page size
    is taken with the whole layer streamed, so that the time stays linear in r_w."""
    pages = (
        np.ones_like(m, dtype=float)
        if setting.schedule in ("serial", "overlap")
        else m.astype(float)
    )
    w = setting.weights.layer
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
