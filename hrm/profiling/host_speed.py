"""Is the host still as fast as its profile says? One GEMM point the profile timed, timed again.

A VM's compute rate can move under a long sweep: on a 2-core AMX Xeon VM one bf16 GEMM ran
0.46-1.06 TFLOP/s within a minute with 1-2% steal (docs/decisions.md, 2026-12-03). `hrm
validate` times this check before every run so that the report can tell the host moving from
the model being wrong; it never changes a prediction. It is timed again right after each run,
because the host can change speed within one run: a bf16 overlap run whose repeat ran 37% faster
took 1.8x as long in prefill as that repeat (reports/cpu-validation-amx-l3-105mb, 2026-12-03).
Each run's record keeps both checks.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from hrm.arch import ModelArch
from hrm.hardware import HardwareProfile
from hrm.profiling import cpu
from hrm.profiling.matmul import GemmShape, rotating_weights, sweep_matmul
from hrm.profiling.timing import perf_counter_clock

CHECK_TOKENS = 64  # rows of the checked GEMM: on every profile's grid, a decode-sized batch
CHECK_BUDGET_S = 0.3


@dataclass
class HostSpeedCheck:
    """The native GEMM at the model's expert shape and CHECK_TOKENS rows, per dtype, over
    weights streamed from memory as the profile's sweep streams them; `ratios` holds each
    check's rate over the profile's rate at that point, by the name of the run it preceded, and
    `after` the check right after that run."""

    shape: GemmShape
    expected: dict[str, float]  # dtype -> the profile's FLOP/s at CHECK_TOKENS
    weights: dict[str, list] = field(default_factory=dict)
    ratios: dict[str, tuple[str, float]] = field(default_factory=dict)  # run -> (dtype, ratio)
    after: dict[str, float] = field(default_factory=dict)  # run -> ratio right after it

    @classmethod
    def for_profile(cls, arch: ModelArch, hardware: HardwareProfile, dtypes) -> HostSpeedCheck:
        shape = GemmShape(
            model=arch.name, hidden=arch.hidden_size, intermediate=arch.intermediate_size
        )
        return cls(shape=shape, expected=dict.fromkeys(dtypes, 0.0)).against(hardware)

    def rates_of(self, hardware: HardwareProfile) -> dict[str, float]:
        """`hardware`'s FLOP/s at the checked point, for the dtypes this check times."""
        curves = hardware.cpu.matmul_curves
        return {d: curves[d].at(CHECK_TOKENS) for d in self.expected if d in curves}

    def against(self, hardware: HardwareProfile) -> HostSpeedCheck:
        """The same check, its ratios so far kept, measuring later runs against `hardware` (a
        fresh profile taken in the middle of a sweep)."""
        return replace(self, expected=self.rates_of(hardware))

    def check(self, run: str, dtype: str, *, after: bool = False) -> None:
        """Time the GEMM now (about CHECK_BUDGET_S) and keep its ratio under `run`: as the check
        before it, or with `after` as the one right after it."""
        if dtype not in self.expected:
            return
        ratio = self._rate(dtype) / self.expected[dtype]
        if after:
            self.after[run] = ratio
        else:
            self.ratios[run] = (dtype, ratio)

    def of_run(self, run: str) -> dict | None:
        """The checks around `run` for its record: {"dtype", "before"[, "after"]}, or None."""
        if run not in self.ratios:
            return None
        dtype, before = self.ratios[run]
        out = {"dtype": dtype, "before": before}
        if run in self.after:
            out["after"] = self.after[run]
        return out

    def _rate(self, dtype: str) -> float:
        import torch

        if dtype not in self.weights:
            cache = cpu.host_facts().last_level_cache_bytes or 0.0
            on = {"dtype": getattr(torch, dtype), "device": "cpu"}
            self.weights[dtype] = rotating_weights(self.shape, on, 2 * cache)
        sweep = sweep_matmul(
            dtype=dtype,
            shape=self.shape,
            tokens_grid=(CHECK_TOKENS,),
            device="cpu",
            clock=perf_counter_clock,
            repeats=3,
            min_sample_s=CHECK_BUDGET_S / 4,
            budget_s=CHECK_BUDGET_S,
            tick=lambda: None,
            weights=self.weights[dtype],
        )
        ((_, rate),) = sweep.curve().points
        return rate

    def summary(self, errors: dict[str, float]) -> list[str]:
        """Report lines: the before-run ratios' range per dtype, and how the runs' errors follow
        each run's share (the mean of the checks before and after it, where both were taken)."""
        if not self.ratios:
            return []
        parts = []
        for dtype in self.expected:
            values = sorted(r for d, r in self.ratios.values() if d == dtype)
            if values:
                parts.append(
                    f"{dtype} {values[0]:.0%}-{values[-1]:.0%} "
                    f"(median {statistics.median(values):.0%})"
                )
        lines = [
            f"Host speed during the sweep: the native GEMM at the model's expert shape "
            f"({self.shape.hidden}x{self.shape.intermediate}, {CHECK_TOKENS} rows), timed before "
            f"each run, ran at this share of its profile's rate for it: {'; '.join(parts)}."
        ]
        paired = [(self.share(n), errors[n]) for n in self.ratios if n in errors]
        if len(paired) > 2 and len({r for r, _ in paired}) > 1 and len({e for _, e in paired}) > 1:
            r = statistics.correlation([p[0] for p in paired], [p[1] for p in paired])
            lines[0] += (
                f" Correlation of each run's error with its share (before and after it): "
                f"{r:+.2f} (a host that "
                "speeds up after its profile makes the prediction low: negative)."
            )
        return [*lines, ""]

    def share(self, run: str) -> float:
        """The host's speed over the profile's during `run`: the mean of the checks around it."""
        before = self.ratios[run][1]
        return (before + self.after[run]) / 2 if run in self.after else before
