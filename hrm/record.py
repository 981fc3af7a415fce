"""RunRecord: one run's prediction and measurement side by side (JSON; `hrm report` reads it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hrm.io import atomic_write_json, load_json
from hrm.schema import check_keys, dataclass_keys


@dataclass(frozen=True, kw_only=True)
class Measurement:
    prefill_s: float
    decode_s: float
    generated_tokens: int
    busy_fraction: Mapping[str, float] = field(default_factory=dict)  # per resource
    peak_memory_bytes: Mapping[str, float] = field(default_factory=dict)  # per device
    link_bytes: Mapping[str, float] = field(default_factory=dict)  # "h2d", "d2h": bytes moved
    # device -> buffer -> bytes allocated, by the planner's buffer names (an offloaded run)
    buffer_bytes: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def throughput_tok_s(self) -> float:
        """Generated tokens / (prefill + decode time), as the planner predicts it."""
        total = self.prefill_s + self.decode_s
        return self.generated_tokens / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "generated_tokens": self.generated_tokens,
            "throughput_tok_s": self.throughput_tok_s,
            "busy_fraction": dict(self.busy_fraction),
            "peak_memory_bytes": dict(self.peak_memory_bytes),
            "link_bytes": dict(self.link_bytes),
            "buffer_bytes": {d: dict(b) for d, b in self.buffer_bytes.items()},
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "measured") -> Measurement:
        required, optional = dataclass_keys(cls)
        data = check_keys(
            data, where=where, required=required, optional=optional | {"throughput_tok_s"}
        )
        data = {k: v for k, v in data.items() if k != "throughput_tok_s"}
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    model: str
    hardware: str | None
    workload: Mapping[str, Any]
    plan: Mapping[str, Any] | None  # Plan.to_dict() when the run followed a plan
    predicted: Mapping[str, Any] | None  # Prediction.to_dict() for this exact run
    measured: Measurement
    environment: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured throughput; None without a prediction."""
        if not self.predicted or not self.measured.throughput_tok_s:
            return None
        predicted = self.predicted["throughput_tok_s"]
        return (predicted - self.measured.throughput_tok_s) / self.measured.throughput_tok_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "workload": dict(self.workload),
            "plan": dict(self.plan) if self.plan is not None else None,
            "predicted": dict(self.predicted) if self.predicted is not None else None,
            "measured": self.measured.to_dict(),
            "prediction_error": self.prediction_error,
            "environment": dict(self.environment),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "run record") -> RunRecord:
        required, optional = dataclass_keys(cls)
        data = check_keys(
            data, where=where, required=required, optional=optional | {"prediction_error"}
        )
        fields = {k: v for k, v in data.items() if k != "prediction_error"}
        fields["measured"] = Measurement.from_dict(data["measured"], f"{where}: measured")
        return cls(**fields)

    def save(self, path: str | os.PathLike) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunRecord:
        return cls.from_dict(load_json(path), where=str(path))
