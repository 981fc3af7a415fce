"""Plan: a Policy with its schedule and the planner's prediction, the file `hrm plan -o` writes.

`hrm run --plan plan.json` reads exactly this file, so the executor allocates by the same
accounting the planner checked (docs/architecture.md, Data model).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.io import atomic_write_json, load_json
from hrm.policy import Policy
from hrm.schema import check_keys, dataclass_keys, positive_int
from hrm.workload import Workload

SCHEDULES = ("cgopipe", "serial", "overlap", "gpu-attention")
# the four queues of a run: the GPU, the CPU workers and the link in each direction
QUEUES = ("gpu", "cpu", "h2d", "d2h")


def check_schedule(name: str) -> str:
    if name not in SCHEDULES:
        raise HrmError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return name


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """End-to-end time of one batch: prefill of all prompts, then every decode step."""

    prefill_s: float
    decode_s: float
    generated_tokens: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def throughput_tok_s(self) -> float:
        """Generated tokens / (prefill + decode time), the paper's metric."""
        return self.generated_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "throughput_tok_s": self.throughput_tok_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "generated_tokens": self.generated_tokens,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "predicted") -> Prediction:
        data = check_keys(
            data,
            where=where,
            required={"prefill_s", "decode_s", "generated_tokens"},
            optional={"throughput_tok_s"},
        )
        return cls(
            prefill_s=float(data["prefill_s"]),
            decode_s=float(data["decode_s"]),
            generated_tokens=int(data["generated_tokens"]),
        )


@dataclass(frozen=True, kw_only=True)
class MemoryFootprint:
    """Bytes per buffer on each device, and each device's usable capacity (after headroom)."""

    gpu: Mapping[str, float]
    cpu: Mapping[str, float]
    gpu_capacity_bytes: float
    cpu_capacity_bytes: float
    # the disk tier's bytes: the weights kept on disk, each read once a pass (empty: no tier)
    disk: Mapping[str, float] = field(default_factory=dict)

    @property
    def disk_bytes(self) -> float:
        return float(sum(self.disk.values()))

    @property
    def gpu_bytes(self) -> float:
        return float(sum(self.gpu.values()))

    @property
    def cpu_bytes(self) -> float:
        return float(sum(self.cpu.values()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_bytes": self.gpu_bytes,
            "cpu_bytes": self.cpu_bytes,
            "gpu_capacity_bytes": self.gpu_capacity_bytes,
            "cpu_capacity_bytes": self.cpu_capacity_bytes,
            "gpu": dict(self.gpu),
            "cpu": dict(self.cpu),
        } | ({"disk": dict(self.disk)} if self.disk_bytes else {})

    @classmethod
    def from_dict(cls, data: Any, where: str = "memory") -> MemoryFootprint:
        data = check_keys(
            data,
            where=where,
            required={"gpu", "cpu", "gpu_capacity_bytes", "cpu_capacity_bytes"},
            optional={"gpu_bytes", "cpu_bytes", "disk"},
        )
        return cls(
            gpu={k: float(v) for k, v in data["gpu"].items()},
            cpu={k: float(v) for k, v in data["cpu"].items()},
            disk={k: float(v) for k, v in (data.get("disk") or {}).items()},
            gpu_capacity_bytes=float(data["gpu_capacity_bytes"]),
            cpu_capacity_bytes=float(data["cpu_capacity_bytes"]),
        )


@dataclass(frozen=True, kw_only=True)
class Continuous:
    """How a continuous run of the plan admits requests (hrm/rules/admission.py), and the
    planner's simulation of the job it was planned for. The KV pool is what the policy's N
    sequences at the workload's longest context hold; up to `max_running` requests share it."""

    max_running: int
    token_budget: int  # the most tokens a pass carries
    requests: int  # in the job simulated
    passes: int
    peak_running: int  # the most that ran at once in the simulation
    peak_kv_blocks: int  # reserved at the simulated peak, of the pool's
    predicted: Prediction  # prefill_s: the passes that carried prompt tokens

    def __post_init__(self) -> None:
        positive_int(self.max_running, where="plan: continuous: max_running")
        positive_int(self.token_budget, where="plan: continuous: token_budget")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"predicted": self.predicted.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str = "continuous") -> Continuous:
        required, optional = dataclass_keys(cls)
        data = check_keys(data, where=where, required=required, optional=optional)
        ints = {k: data[k] for k in required - {"predicted"}}
        for key, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise HrmError(f"{where}: {key} must be a whole number, got {value!r}")
        return cls(**ints, predicted=Prediction.from_dict(data["predicted"], f"{where}: predicted"))


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    hardware: str
    workload: Workload
    policy: Policy
    schedule: str
    predicted: Prediction
    busy_s: Mapping[str, float] = field(default_factory=dict)  # per resource, whole run
    memory: MemoryFootprint
    bottleneck: str  # the binding roof or queue, e.g. "h2d" or "cpu attention"
    binding_memory: str  # the memory constraint closest to its capacity, e.g. "gpu"
    geometry: Mapping[str, Any] = field(default_factory=dict)  # ModelArch.geometry() planned for
    # GPUs the layers are sharded over (Megatron-style); a plan written before this field is 1
    tensor_parallel: int = 1
    # The profile planned on (with --gpus, --gpu-mem, ... applied), so that a plan file needs
    # nothing beside it wherever it is copied; None in a plan older than it (`hardware` names it)
    machine: HardwareProfile | None = None
    # hrm plan --batching continuous: the limits of a continuous run and its prediction
    continuous: Continuous | None = None

    def __post_init__(self) -> None:
        check_schedule(self.schedule)
        positive_int(self.tensor_parallel, where="plan: tensor_parallel")

    @property
    def stages_weights(self) -> bool:
        """Weights cross the link through a pinned staging ring (the memory model counts one)."""
        return self.memory.cpu.get("weight staging", 0.0) > 0

    @property
    def busy_fraction(self) -> dict[str, float]:
        total = self.predicted.total_s
        return {r: (self.busy_s.get(r, 0.0) / total if total > 0 else 0.0) for r in QUEUES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "workload": self.workload.to_dict(),
            "policy": self.policy.to_dict(),
            "schedule": self.schedule,
            "predicted": self.predicted.to_dict(),
            "busy_s": dict(self.busy_s),
            "memory": self.memory.to_dict(),
            "bottleneck": self.bottleneck,
            "binding_memory": self.binding_memory,
            "geometry": dict(self.geometry),
            "tensor_parallel": self.tensor_parallel,
            **({"machine": self.machine.to_dict()} if self.machine is not None else {}),
            **({"continuous": self.continuous.to_dict()} if self.continuous is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> Plan:
        required, optional = dataclass_keys(cls)
        data = check_keys(data, where=where, required=required, optional=optional)
        return cls(
            model=str(data["model"]),
            hardware=str(data["hardware"]),
            workload=Workload.from_dict(data["workload"], f"{where}: workload"),
            policy=Policy.from_dict(data["policy"], f"{where}: policy"),
            schedule=data["schedule"],
            predicted=Prediction.from_dict(data["predicted"], f"{where}: predicted"),
            busy_s={k: float(v) for k, v in (data.get("busy_s") or {}).items()},
            memory=MemoryFootprint.from_dict(data["memory"], f"{where}: memory"),
            bottleneck=str(data["bottleneck"]),
            binding_memory=str(data["binding_memory"]),
            geometry=dict(data.get("geometry") or {}),
            tensor_parallel=data.get("tensor_parallel", 1),
            machine=HardwareProfile.from_dict(data["machine"], f"{where}: machine")
            if data.get("machine") is not None
            else None,
            continuous=Continuous.from_dict(data["continuous"], f"{where}: continuous")
            if data.get("continuous") is not None
            else None,
        )

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        return cls.from_dict(load_json(path), where=str(path))
