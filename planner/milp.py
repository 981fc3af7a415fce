"""The placement MILP for one (N, mu), solved with PuLP: HiGHS in process, or PuLP's bundled CBC
where highspy is not installed (docs/decisions.md, 2026-12-06).

Variables: A_g, F_g binary (attention and layers on the GPU), r_w, r_c in [0, 1] (weights and KV
cache resident on the GPU), T_s >= 0 the layer time of step s (0 = prefill). The step times are an
epigraph: T_s >= every lower bound the schedule puts on the layer time, so minimising
sum_s (L*T_s + fill_s + head_s) gives the max over queues exactly (paper Eq 12).
All coefficients come from planner/evaluate.BatchModel; nothing here knows the model.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from hrm.errors import HrmError
from planner.evaluate import BatchModel
from planner.memory import ATT, FFN, ONE, RC, RD, RW, usable_bytes

# Memory rows are written in GB so that they and the time rows (seconds) have similar magnitudes,
# with a kilobyte of slack that covers the solver's feasibility tolerance.
_GB = 1e9
_SLACK_GB = 1e-6


@dataclass(frozen=True, kw_only=True)
class MilpResult:
    status: str  # "Optimal", "Infeasible", ...
    total_s: float | None  # prefill + decode, the objective
    attention_on_gpu: bool = False
    ffn_on_gpu: bool = False
    weights_gpu_fraction: float = 0.0
    kv_gpu_fraction: float = 0.0
    weights_disk_fraction: float = 0.0

    @property
    def optimal(self) -> bool:
        return self.status == "Optimal"


@dataclass(frozen=True, kw_only=True)
class _Vars:
    att: pulp.LpVariable
    ffn: pulp.LpVariable
    rw: pulp.LpVariable
    rc: pulp.LpVariable
    rd: pulp.LpVariable

    def affine(self, coef: np.ndarray) -> pulp.LpAffineExpression:
        """c_0 + c_A*A_g + c_F*F_g + c_w*r_w + c_c*r_c + c_d*r_d."""
        terms = [
            (self.att, coef[ATT]),
            (self.ffn, coef[FFN]),
            (self.rw, coef[RW]),
            (self.rc, coef[RC]),
            (self.rd, coef[RD]),
        ]
        return pulp.LpAffineExpression(
            [(v, float(c)) for v, c in terms if c != 0.0], constant=float(coef[ONE])
        )


def add_placement_constraints(prob, x: _Vars, allowed: dict[str, bool | None]) -> None:
    """What the model assumes and what the schedule or machine fixes."""
    # A_g <= F_g: attention on the GPU only beside the projections it feeds
    prob += x.att <= x.ffn, "attention_needs_gpu_layers"
    # r_w <= F_g: resident weights only where the layers run
    prob += x.rw <= x.ffn, "weights_need_gpu_layers"
    # r_c <= A_g: a GPU-resident cache only for GPU attention
    prob += x.rc <= x.att, "cache_needs_gpu_attention"
    # r_w + r_d <= F_g: the disk tier keeps weights the GPU streams in (none where the CPU
    # runs the layers: the executor reads the disk part into the GPU's pages)
    prob += x.rw + x.rd <= x.ffn, "disk_keeps_streamed_weights"
    for name, var in (("attention_on_gpu", x.att), ("ffn_on_gpu", x.ffn)):
        if allowed.get(name) is not None:
            prob += var == int(allowed[name]), f"fixed_{name}"


def add_memory_constraints(prob, x: _Vars, model: BatchModel) -> None:
    """sum of buffers on each device <= its usable memory (planner/memory.py)."""
    hw = model.setting.hardware
    if hw.gpu is not None:  # without one, F_g = A_g = 0 leave nothing on it
        gpu_cap = usable_bytes(hw.gpu.total_memory_bytes)
        # resident weights + paged buffer + head + r_c*KV + activations + workspace <= usable GPU
        prob += x.affine(model.memory.gpu_total() / _GB) <= gpu_cap / _GB - _SLACK_GB, "gpu_memory"
    # (1-r_w) weights + embedding + (1-r_c)*KV + offload + staging + ... <= usable CPU
    prob += (
        x.affine(model.memory.cpu_total() / _GB)
        <= usable_bytes(hw.cpu.memory_bytes) / _GB - _SLACK_GB,
        "cpu_memory",
    )


def add_time_constraints(prob, x: _Vars, model: BatchModel) -> list[pulp.LpVariable]:
    """T_s >= every bound on the layer time at step s (schedule_terms in planner/cost.py).

    Each row is built as the constraint T_s - (c_0 + c . x) >= 0 directly: a long generation has
    thousands of them, and PuLP's operators copy an expression at each step of `>=`."""
    rows = model.layer_coefficients()
    steps = next(iter(rows.values())).shape[0]
    t = [_variable(prob, f"T_{s}", 0, None) for s in range(steps)]
    names = (ATT, x.att), (FFN, x.ffn), (RW, x.rw), (RC, x.rc), (RD, x.rd)
    for name, coef in rows.items():
        # T_layer(s) >= term(s)   (paper Eq 12: max over queues, as an epigraph)
        used = [(k, var) for k, var in names if coef[:, k].any()]
        cols = coef[:, [k for k, _ in used]].tolist()
        for s, (c, row) in enumerate(zip(coef[:, ONE].tolist(), cols, strict=True)):
            terms = [(t[s], 1.0)] + [(var, -v) for (_, var), v in zip(used, row, strict=True) if v]
            expr = pulp.LpAffineExpression(terms, constant=-c)
            prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE), f"{name}_{s}")
    return t


def solve_placement(model: BatchModel, allowed: dict[str, bool | None]) -> MilpResult:
    """Minimise prefill + decode time over the placement at this (N, mu)."""
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = _Vars(
        att=_variable(prob, "A_g", 0, 1, "Binary"),
        ffn=_variable(prob, "F_g", 0, 1, "Binary"),
        rw=_variable(prob, "r_w", 0, 1),
        rc=_variable(prob, "r_c", 0, 1),
        # r_d only where the profile has a disk: without one, nothing is kept there
        rd=_variable(prob, "r_d", 0, 1 if model.setting.hardware.disk is not None else 0),
    )
    add_placement_constraints(prob, x, allowed)
    add_memory_constraints(prob, x, model)
    t = add_time_constraints(prob, x, model)
    layers = model.setting.arch.num_layers
    # total = sum_s (L * T_s + fill_s + head_s)
    prob += layers * pulp.lpSum(t) + x.affine(model.extra_coefficients().sum(axis=0))
    with warnings.catch_warnings():  # PuLP 3.x announces its 4.0 API; the bundled CBC is this one
        warnings.simplefilter("ignore", DeprecationWarning)
        prob.solve(solver())
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        return MilpResult(status=status, total_s=None)
    return MilpResult(
        status=status,
        total_s=float(pulp.value(prob.objective)),
        attention_on_gpu=round(x.att.value()) == 1,
        ffn_on_gpu=round(x.ffn.value()) == 1,
        weights_gpu_fraction=_fraction(x.rw.value()),
        kv_gpu_fraction=_fraction(x.rc.value()),
        weights_disk_fraction=_disk_fraction(x.rd.value()),
    )


def solver() -> pulp.LpSolver:
    """HiGHS in process where highspy is installed (a dependency): a long generation's thousands
    of step rows solve 25x faster than in CBC (0.7 s against 17.6 s at 4096 steps). Else PuLP's
    bundled CBC, which every PuLP has (the GPU machine's image carries pulp's wheel alone).
    HRM_MILP_SOLVER=highs or cbc picks one."""
    name = os.environ.get("HRM_MILP_SOLVER", "")
    if name not in ("", "highs", "cbc"):
        raise HrmError(f"HRM_MILP_SOLVER must be highs or cbc, got {name!r}; or leave it unset")
    highs = pulp.HiGHS(msg=False, gapRel=1e-9)
    if name == "cbc" or (not name and not highs.available()):
        return pulp.PULP_CBC_CMD(msg=False, gapRel=1e-9)
    if not highs.available():
        raise HrmError("HRM_MILP_SOLVER=highs needs highspy: pip install highspy, or unset it")
    _highs_banner_to_null()
    return highs


@functools.cache
def _highs_banner_to_null() -> None:
    """HiGHS prints its banner on file descriptor 1 when a process makes its first solver,
    whatever output_flag says, and stdout carries `hrm`'s JSONL: make that first one with fd 1 on
    /dev/null."""
    import highspy

    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _variable(prob, name: str, low, high, cat: str = "Continuous") -> pulp.LpVariable:
    """prob.add_variable where PuLP has it (3.x), else the older LpVariable constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, upBound=high, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=high, cat=cat)


def _fraction(value: float | None) -> float:
    """A solver's fraction, clipped to [0, 1] and rounded down to 1e-9 (never past the memory)."""
    value = min(max(value or 0.0, 0.0), 1.0)
    return math.floor(value * 1e9) / 1e9


def _disk_fraction(value: float | None) -> float:
    """r_d rounded up to 1e-9 (never short of the host memory), within [0, 1]."""
    value = min(max(value or 0.0, 0.0), 1.0)
    return min(1.0, math.ceil(value * 1e9) / 1e9)
