"""One (N, mu) of the model, evaluated at a placement: times, busy queues, memory, what binds.

`predict` is the public entry for a given policy (no search); the search evaluates whole rows of
batch sizes through `run_seconds`, and builds its Plans through `build_plan`, so both read the same
coefficients.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.plan import QUEUES, MemoryFootprint, Plan, Prediction, check_schedule
from hrm.policy import Policy
from hrm.rules.cpu_gemm import CpuGemmChoice
from hrm.rules.placement import place_model
from hrm.workload import Workload
from planner.cost import (
    QueueTerms,
    ScheduleTerms,
    queue_terms,
    schedule_terms,
    weight_stream_seconds,
    with_last_micro_batch,
)
from planner.layer_seconds import micro_batch_seconds
from planner.memory import RC, RD, MemoryTerms, memory_terms, placement_vector, usable_bytes
from planner.setting import Setting


@dataclass(frozen=True, kw_only=True)
class BatchModel:
    """Time and memory terms of one (N, mu), affine in the placement v = (1, A_g, F_g, r_w, r_c,
    r_d)."""

    setting: Setting
    batch_size: int
    micro_batch_size: int
    queues: QueueTerms  # each queue's busy time, whatever the schedule
    terms: ScheduleTerms  # the schedule's lower bounds on the layer time
    memory: MemoryTerms

    @property
    def full_micro_batches(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def num_micro_batches(self) -> int:
        return math.ceil(self.batch_size / self.micro_batch_size)

    @property
    def weight_stream_s(self) -> float:
        return float(weight_stream_seconds(self.setting, np.array([self.num_micro_batches]))[0])

    @property
    def fill_factor(self) -> float:
        return 1.0 if self.num_micro_batches >= 2 else 0.0

    def layer_coefficients(self) -> dict[str, np.ndarray]:
        """Each lower bound on T_layer as [steps, 6] coefficients (the MILP's rows)."""
        m, ws = self.full_micro_batches, self.weight_stream_s
        return {name: e.coefficients(m, ws) for name, e in self.terms.layer.items()}

    def extra_coefficients(self) -> np.ndarray:
        """Fill/drain and LM head of each step as [steps, 6] coefficients."""
        m, ws = self.full_micro_batches, self.weight_stream_s
        return self.fill_factor * self.terms.fill.coefficients(
            m, ws
        ) + self.terms.head.coefficients(m, ws)


def batch_model(setting: Setting, batch_size: int, micro_batch_size: int) -> BatchModel:
    queues = queue_terms(setting, micro_batch_seconds(setting, micro_batch_size))
    last = batch_size % micro_batch_size
    if last:
        queues = with_last_micro_batch(
            queues, queue_terms(setting, micro_batch_seconds(setting, last))
        )
    return BatchModel(
        setting=setting,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        queues=queues,
        terms=schedule_terms(setting.schedule, queues, setting.hardware),
        memory=setting.memory(batch_size, micro_batch_size),
    )


def run_seconds(
    setting: Setting, terms: ScheduleTerms, m: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(prefill_s, decode_s) for M points with m equal micro-batches each and placements v [M, 6].

    T_step = L * max_x(term_x) + fill + head; prefill is step 0, decode the sum of the rest.
    """
    ws = weight_stream_seconds(setting, m)
    layer = np.max([e.evaluate(m, ws, v) for e in terms.layer.values()], axis=0)
    fill = (m >= 2)[:, None] * terms.fill.evaluate(m, ws, v)
    step = setting.arch.num_layers * layer + fill + terms.head.evaluate(m, ws, v)
    return step[:, 0], step[:, 1:].sum(axis=1)


def policy_vector(policy: Policy) -> np.ndarray:
    return placement_vector(
        one=1.0,
        att=float(policy.attention_on_gpu),
        ffn=float(policy.ffn_on_gpu),
        rw=policy.weights_gpu_fraction,
        rc=policy.kv_gpu_fraction,
        rd=policy.weights_disk_fraction,
    )


def build_plan(model: BatchModel, policy: Policy, *, whole_tensors: bool = True) -> Plan:
    """The Plan of `policy` at this (N, mu): prediction, busy time per queue, memory, bottleneck.

    whole_tensors: r_w becomes the fraction the executor places (hrm.rules.placement), so the plan
    predicts and counts exactly what a run holds; False keeps the continuous r_w (the search's
    relaxation, whose brackets the tests check)."""
    setting = model.setting
    if whole_tensors:
        policy = placed_policy(model, policy)
    v = policy_vector(policy)
    layers = setting.arch.num_layers
    m, ws = model.full_micro_batches, model.weight_stream_s
    layer_values = {name: c @ v for name, c in model.layer_coefficients().items()}  # [steps]
    layer = np.max(list(layer_values.values()), axis=0)
    step = layers * layer + model.extra_coefficients() @ v
    busy = {
        name: float(layers * (model.queues.queue(name).coefficients(m, ws) @ v).sum())
        for name in QUEUES
    }
    for name, e in model.queues.head.items():
        busy[name] += float((e.coefficients(m, ws) @ v).sum())
    if policy.weights_disk_fraction:
        busy["disk"] = float(layers * (model.queues.queue("disk").coefficients(m, ws) @ v).sum())
    memory = footprint(model.memory, setting.hardware, v)
    return Plan(
        model=setting.arch.name,
        hardware=setting.hardware.name,
        workload=setting.workload,
        policy=policy,
        schedule=setting.schedule,
        predicted=Prediction(
            prefill_s=float(step[0]),
            decode_s=float(step[1:].sum()),
            generated_tokens=round(model.batch_size * setting.workload.gen_len_mean),
        ),
        busy_s=busy,
        memory=memory,
        bottleneck=_bottleneck(model, layer_values, v),
        binding_memory=binding_memory(memory),
        geometry=setting.arch.geometry(),
        tensor_parallel=setting.hardware.gpu_count if setting.hardware.has_gpu else 1,
        machine=setting.hardware,
    )


def placed_policy(model: BatchModel, policy: Policy) -> Policy:
    """`policy` with r_w at whole tensors as hrm.rules.placement places them: rounded down, or up
    by one item when rounding down overflows the CPU memory and rounding up still fits the GPU."""
    if not policy.ffn_on_gpu:
        return policy
    arch, dtype = model.setting.arch, policy.weight_dtype
    down = place_model(arch, policy.weights_gpu_fraction, dtype)
    candidates = [down.fraction]
    if down.next_fraction is not None:
        candidates.append(min(1.0, down.next_fraction))
    hardware = model.setting.hardware

    def at(rw: float) -> Policy:  # the policy's disk share, or the least that fits beside r_w
        placed = dataclasses.replace(policy, weights_gpu_fraction=rw, weights_disk_fraction=0.0)
        if not policy.weights_disk_fraction:
            return placed
        rd = max(least_disk_share(model.memory, hardware, policy_vector(placed)),
                 policy.weights_disk_fraction)  # fmt: skip
        return dataclasses.replace(placed, weights_disk_fraction=min(rd, 1.0 - rw))

    for rw in candidates:
        placed = at(rw)
        if fits(footprint(model.memory, hardware, policy_vector(placed))):
            return placed
    return at(down.fraction)


def least_disk_share(memory: MemoryTerms, hardware: HardwareProfile, v: np.ndarray) -> float:
    """The least r_d at which the host's buffers fit its usable memory, the rest of placement v
    given (r_d only costs time); rounded up to 1e-9, so never short."""
    cpu = memory.cpu_total()
    over = float(cpu @ v) - float(cpu[RD]) * v[RD] - usable_bytes(hardware.cpu.memory_bytes)
    relief = -float(cpu[RD])
    if over <= 0 or relief <= 0:
        return 0.0
    return math.ceil(over / relief * 1e9) / 1e9


def fits(memory: MemoryFootprint) -> bool:
    return memory.gpu_bytes <= memory.gpu_capacity_bytes * (
        1 + 1e-9
    ) and memory.cpu_bytes <= memory.cpu_capacity_bytes * (1 + 1e-9)


def component_seconds(model: BatchModel, policy: Policy) -> dict[str, dict[str, float]]:
    """Busy seconds of each queue's components over the whole run (every layer and step), e.g.
    the GPU's "all-reduce" share of its time."""
    v = policy_vector(policy)
    m, ws = model.full_micro_batches, model.weight_stream_s
    layers = model.setting.arch.num_layers
    return {
        queue: {c: float(layers * (e.coefficients(m, ws) @ v).sum()) for c, e in parts.items()}
        for queue, parts in model.queues.components.items()
    }


def _bottleneck(model: BatchModel, layer_values: dict[str, np.ndarray], v: np.ndarray) -> str:
    """The bound that sets T_layer for the most time, named by its largest component."""
    names = list(layer_values)
    stacked = np.array([layer_values[n] for n in names])  # [terms, steps]
    winner = stacked.argmax(axis=0)
    time_by_term = {n: float(stacked[i][winner == i].sum()) for i, n in enumerate(names)}
    top = max(time_by_term, key=time_by_term.get)
    if top == "latency":
        return "latency: one micro-batch's stages in sequence"
    if top == "link":
        return "link both ways: h2d and d2h together at the bidirectional rate"
    if top == "shared host":
        return "shared host: every queue on the CPU standing in for the GPU"
    m, ws = model.full_micro_batches, model.weight_stream_s
    parts = {
        c: float((e.coefficients(m, ws) @ v).sum()) for c, e in model.queues.components[top].items()
    }
    return f"{top} {max(parts, key=parts.get)}"


def buffer_bytes(memory: MemoryTerms, v: np.ndarray) -> tuple[dict, dict]:
    """(GPU, CPU) bytes per buffer at placement v; the KV prefetch buffer is not allocated when
    the whole cache lives on the GPU (the affine terms count it for any r_c, planner/memory.py),
    nor the disk tier's staging without a disk tier."""
    gpu = {name: float(c @ v) for name, c in memory.gpu.items()}
    if v[RC] >= 1.0:
        gpu["kv prefetch"] = 0.0
    cpu = {name: float(c @ v) for name, c in memory.cpu.items()}
    if not v[RD]:  # no disk tier, no staging for it
        cpu.pop("disk staging", None)
    return gpu, cpu


def footprint(memory: MemoryTerms, hardware: HardwareProfile, v: np.ndarray) -> MemoryFootprint:
    """Bytes per buffer at placement v, with the usable memory of each device."""
    gpu_total = hardware.gpu.total_memory_bytes if hardware.gpu else 0.0
    gpu, cpu = buffer_bytes(memory, v)
    disk = {name: float(c @ v) for name, c in memory.disk.items()}
    return MemoryFootprint(
        gpu=gpu,
        cpu=cpu,
        disk={name: b for name, b in disk.items() if b > 0},
        gpu_capacity_bytes=usable_bytes(gpu_total),
        cpu_capacity_bytes=usable_bytes(hardware.cpu.memory_bytes),
    )


# A device whose use is within this fraction of its usable memory is a binding constraint.
TIGHT_FRACTION = 0.99


def binding_memory(memory: MemoryFootprint) -> str:
    """The devices whose usable memory is (nearly) full, e.g. "gpu+cpu"; "none" when no memory
    is (a plan bound by time, not space)."""
    use = {
        "gpu": memory.gpu_bytes / memory.gpu_capacity_bytes if memory.gpu_capacity_bytes else 0.0,
        "cpu": memory.cpu_bytes / memory.cpu_capacity_bytes,
    }
    tight = [name for name, u in use.items() if u >= TIGHT_FRACTION]
    return "+".join(tight) if tight else "none"


def check_policy(policy: Policy, hardware: HardwareProfile, schedule: str) -> None:
    """The placement rules the model assumes; an HrmError names the one broken."""
    check_schedule(schedule)
    if not hardware.has_gpu and (policy.attention_on_gpu or policy.ffn_on_gpu):
        raise HrmError(
            f"{hardware.name} has no GPU: the policy must run attention and FFN on the CPU"
        )
    if policy.attention_on_gpu and not policy.ffn_on_gpu:
        raise HrmError("attention on the GPU needs the layers (ffn_on_gpu) on the GPU too")
    if policy.weights_gpu_fraction > 0 and not policy.ffn_on_gpu:
        raise HrmError("weights_gpu_fraction > 0 needs ffn_on_gpu: the CPU runs the layers")
    if policy.kv_gpu_fraction > 0 and not policy.attention_on_gpu:
        raise HrmError("kv_gpu_fraction > 0 needs attention_on_gpu: CPU attention reads its cache")
    if schedule in ("serial", "overlap") and policy.attention_on_gpu:
        raise HrmError(
            f"schedule {schedule} runs attention on the CPU; use gpu-attention or cgopipe"
        )
    if schedule == "gpu-attention" and not policy.attention_on_gpu:
        raise HrmError("schedule gpu-attention needs attention_on_gpu")


def predict(
    arch: ModelArch,
    hardware: HardwareProfile,
    workload: Workload,
    policy: Policy,
    schedule: str = "cgopipe",
    *,
    cpu_gemm: CpuGemmChoice | None = None,
    padded_kv_cache: bool = False,
) -> Plan:
    """The model's prediction for one given policy, no search (e.g. for `hrm run --hardware`).

    The Plan's memory shows whether the policy fits; predict does not refuse one that does not.
    cpu_gemm: the CPU GEMM path a run took (default: the one chosen from the profile);
    padded_kv_cache: decode attends over a cache left-padded to the longest prompt.
    """
    check_policy(policy, hardware, schedule)
    setting = Setting(
        arch=arch,
        hardware=hardware,
        workload=workload,
        schedule=schedule,
        weight_dtype=policy.weight_dtype,
        kv_dtype=policy.kv_dtype,
        cpu_gemm=cpu_gemm,
        padded_kv_cache=padded_kv_cache,
    )
    return build_plan(batch_model(setting, policy.batch_size, policy.micro_batch_size), policy)


def predict_batch(
    arch: ModelArch,
    hardware: HardwareProfile,
    workload: Workload,
    policy: Policy,
    schedule: str,
    batch_size: int,
    *,
    cpu_gemm: CpuGemmChoice | None = None,
) -> Plan:
    """One static batch of `batch_size` requests of `workload` under `policy`, as the executor
    runs a batch (hrm/rules/batches.py): N = the batch's size, mu at most that, over its
    micro-batches' left-padded KV caches."""
    at = dataclasses.replace(
        policy, batch_size=batch_size, micro_batch_size=min(batch_size, policy.micro_batch_size)
    )
    return predict(arch, hardware, workload, at, schedule, cpu_gemm=cpu_gemm, padded_kv_cache=True)


def predict_resident_run(
    arch: ModelArch,
    hardware: HardwareProfile,
    workload: Workload,
    *,
    batch_size: int,
    dtype: str,
    on_gpu: bool = False,
    cpu_gemm: CpuGemmChoice | None = None,
) -> Plan:
    """The prediction for a run held wholly by one device in `dtype` (`hrm run --hardware`): the
    weights and KV cache in that device's memory, the whole batch as one micro-batch, prefill
    packed, decode over the executor's left-padded cache."""
    policy = Policy.resident(batch_size, dtype, on_gpu)
    return predict(arch, hardware, workload, policy, cpu_gemm=cpu_gemm, padded_kv_cache=True)


def resident_run_memory(
    arch: ModelArch, workload: Workload, *, batch_size: int, dtype: str, on_gpu: bool = False
) -> tuple[float, float]:
    """(host bytes, device bytes) of the one-device run predict_resident_run prices: what `hrm
    run` checks against the memory present before it allocates anything."""
    terms = memory_terms(
        arch,
        workload,
        batch_size=batch_size,
        micro_batch_size=batch_size,
        weight_dtype=dtype,
        kv_dtype=dtype,
    )
    gpu, cpu = buffer_bytes(terms, policy_vector(Policy.resident(batch_size, dtype, on_gpu)))
    return sum(cpu.values()), sum(gpu.values())
