"""The policy search: N and mu enumerated exactly over a stated grid, placement by the MILP.

Grid: mu in MU_GRID, N = m * mu for m = 1, 2, ... up to the largest N that fits (memory grows
with N for every placement, so the first N that fits no placement ends the row) and MAX_BATCH_SIZE.

Exactness without a MILP at every grid point (branch and bound over the grid):
1. Every time term is nonincreasing in r_w and r_c (only memory grows with them), so at each point
   and placement (A_g, F_g) two closed forms bracket the MILP's optimum: a feasible placement
   (weights first, then KV cache, into the GPU memory left: also the one that frees the most CPU
   memory) and a relaxed one (r_w and r_c each given all of the GPU memory left), whose time is a
   lower bound. For CPU attention (r_c = 0) they coincide and are exact.
2. Whole rows of mu are skipped when a bound that holds for every N, the work each micro-batch
   must do on the device that runs the layers, cannot beat the k-th best feasible throughput.
3. Points are taken in order of their upper bound and solved by the MILP (planner/milp.py) until
   the next upper bound cannot enter the top k. Every returned plan is a MILP solution.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile
from hrm.plan import Plan, check_schedule
from hrm.policy import Policy
from hrm.units import format_bytes
from hrm.workload import Workload
from planner.closed_form import REL_TOL, bracket_row, fill_gpu
from planner.cost import queue_terms, schedule_terms
from planner.evaluate import batch_model, build_plan, fits
from planner.layer_seconds import micro_batch_seconds
from planner.memory import (
    USABLE_MEMORY_FRACTION,
    kv_cache_bytes,
    usable_bytes,
)
from planner.milp import solve_placement
from planner.setting import Setting

MU_GRID = (
    1,
    2,
    4,
    8,
    16,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
MAX_BATCH_SIZE = 131072
DISK_TIERS = ("auto", "on", "off")


class NoPolicyFits(HrmError):
    """The workload fits no policy on the machine: the message says which memory is short."""


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    grid_points: int  # (N, mu) points whose placement was bracketed in closed form
    rows_skipped: int  # mu values whose bound could not beat the incumbents
    milps_solved: int


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    status: str  # "optimal"
    top: tuple[Plan, ...]  # best first
    stats: SearchStats

    @property
    def best(self) -> Plan:
        return self.top[0]


def placements(hardware: HardwareProfile, schedule: str) -> list[tuple[int, int]]:
    """(F_g, A_g) pairs the machine and schedule allow (A_g <= F_g)."""
    check_schedule(schedule)
    if not hardware.has_gpu:
        if schedule == "gpu-attention":
            raise HrmError(f"{hardware.name} has no GPU: schedule gpu-attention needs one")
        return [(0, 0)]
    return {
        "cgopipe": [(0, 0), (1, 0), (1, 1)],
        "serial": [(0, 0), (1, 0)],
        "overlap": [(0, 0), (1, 0)],
        "gpu-attention": [(1, 1)],
    }[schedule]


def fixed_binaries(hardware: HardwareProfile, schedule: str) -> dict[str, bool | None]:
    combos = placements(hardware, schedule)
    return {
        "ffn_on_gpu": _fixed([f for f, _ in combos]),
        "attention_on_gpu": _fixed([a for _, a in combos]),
    }


def _fixed(values: list[int]) -> bool | None:
    return bool(values[0]) if len(set(values)) == 1 else None


def row_bound(setting: Setting, mb, combos: list[tuple[int, int]], mu: int) -> float:
    """Throughput no N = m*mu can beat: every decode step costs at least L * m * (one micro-batch's
    dense and expert work on the device that runs the layers), so tok/s <= mu * (mean answer
    length) / (L * that work summed over the decode steps)."""
    if setting.workload.gen_len < 2:
        return math.inf
    per_mb = [
        (mb.gpu_dense[1:] + mb.gpu_ffn[1:]).sum()
        if f
        else (mb.cpu_dense[1:] + mb.cpu_ffn[1:] + mb.cpu_attention[1:]).sum()
        for f, _ in combos
    ]
    least = min(per_mb)
    tokens = mu * setting.workload.gen_len_mean
    return math.inf if least <= 0 else tokens / (setting.arch.num_layers * least)


def largest_batch(setting: Setting) -> int:
    """No N above this fits: weights and every sequence's KV cache need memory somewhere."""
    hw, arch, wl = setting.hardware, setting.arch, setting.workload
    total = usable_bytes(hw.cpu.memory_bytes) + (
        usable_bytes(hw.gpu.total_memory_bytes) if hw.gpu else 0.0
    )
    w = setting.weights
    # a disk tier can take every layer's weights off the host (two layers' staging stay)
    held = 2 * w.stored if hw.disk is not None else arch.num_layers * w.stored
    free = total - held - w.embedding
    per_sequence = kv_cache_bytes(arch, wl, 1, setting.kv_dtype)
    return int(min(MAX_BATCH_SIZE, max(free // per_sequence, 0)))


def search(
    arch: ModelArch,
    hardware: HardwareProfile,
    workload: Workload,
    *,
    schedule: str = "cgopipe",
    weight_dtype: str = "bfloat16",
    kv_dtype: str = "bfloat16",
    top_k: int = 5,
    max_batch_size: int | None = None,
    disk_tier: str = "auto",
) -> SearchResult:
    """The top_k (N, mu) points with their optimal placements, best first; N at most
    max_batch_size (a small dataset, or outputs sooner).

    disk_tier (with a disk in the profile): "auto" keeps weights on disk only where nothing
    fits the host without it; "on" lets the search trade disk reads for host memory wherever
    that pays (FlexGen's larger batches); "off" never."""
    if disk_tier not in DISK_TIERS:
        raise HrmError(f"--disk-tier must be one of {', '.join(DISK_TIERS)}, got {disk_tier!r}")
    if hardware.disk is not None and disk_tier != "on":
        try:
            return _search(arch, dataclasses.replace(hardware, disk=None), workload,
                           schedule, weight_dtype, kv_dtype, top_k, max_batch_size)  # fmt: skip
        except NoPolicyFits:
            if disk_tier == "off":
                raise
    return _search(arch, hardware, workload, schedule, weight_dtype, kv_dtype, top_k,
                   max_batch_size)  # fmt: skip


def _search(arch, hardware, workload, schedule, weight_dtype, kv_dtype, top_k, max_batch_size):
    if top_k < 1:
        raise HrmError(f"--top must be at least 1, got {top_k}")
    if max_batch_size is not None and max_batch_size < 1:
        raise HrmError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    setting = Setting(
        arch=arch,
        hardware=hardware,
        workload=workload,
        schedule=schedule,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
    )
    combos = placements(hardware, schedule)
    n_hi = largest_batch(setting)
    if max_batch_size is not None:
        n_hi = min(n_hi, max_batch_size)
    rows = []
    for mu in (mu for mu in MU_GRID if mu <= n_hi):
        mb = micro_batch_seconds(setting, mu)
        rows.append((row_bound(setting, mb, combos, mu), mu, mb))
    rows.sort(key=lambda r: -r[0])
    grid = _Grid(setting=setting, combos=combos, n_hi=n_hi, top_k=top_k)
    skipped = [row for row in rows if not grid.add_row(*row)]
    solved: dict[tuple[int, int], Plan | None] = {}
    top = _solve_best(setting, grid.points, top_k, solved)
    # A row was skipped against the closed form's feasible throughputs, which the MILP's memory
    # slack and whole tensors can undercut (mixtral-8x7b on l4: 216 tok/s closed form, 177 at
    # the MILP, while a skipped row held 190): open every row whose bound beats what it found.
    floor = top[-1].predicted.throughput_tok_s if len(top) >= top_k else -math.inf
    reopened = [row for row in skipped if row[0] > floor * (1 + REL_TOL)]
    if reopened:
        grid.incumbents = sorted(p.predicted.throughput_tok_s for p in top)  # a min-heap
        for row in reopened:
            grid.add_row(*row)
        top = _solve_best(setting, grid.points, top_k, solved)
    if not top:
        raise NoPolicyFits(infeasibility_message(setting, combos))
    stats = SearchStats(
        grid_points=grid.evaluated,
        rows_skipped=len(skipped) - len(reopened),
        milps_solved=len(solved),
    )
    return SearchResult(status="optimal", top=tuple(top), stats=stats)


@dataclass(kw_only=True)
class _Grid:
    """The (N, mu) points bracketed so far, and the k best closed-form feasible throughputs that
    rows are skipped against."""

    setting: Setting
    combos: list[tuple[int, int]]
    n_hi: int
    top_k: int
    incumbents: list[float] = field(default_factory=list)  # min-heap
    points: list[tuple[float, int, int]] = field(default_factory=list)  # (bound, mu, N)
    evaluated: int = 0

    def add_row(self, bound: float, mu: int, mb) -> bool:
        """Bracket the row of mu unless its bound cannot beat the incumbents (False: skipped)."""
        setting, top_k = self.setting, self.top_k
        if len(self.incumbents) >= top_k and bound <= self.incumbents[0] * (1 + REL_TOL):
            return False
        terms = schedule_terms(setting.schedule, queue_terms(setting, mb), setting.hardware)
        m = _fitting_counts(setting, mu, self.n_hi // mu, self.combos)
        self.evaluated += len(m)
        if not len(m):
            return True
        threshold = self.incumbents[0] if len(self.incumbents) >= top_k else -math.inf
        brackets = [bracket_row(setting, mu, m, c, terms, threshold) for c in self.combos]
        feasible = np.max([b.feasible for b in brackets], axis=0)
        upper = np.max([b.bound for b in brackets], axis=0)
        for value in feasible[np.isfinite(feasible)]:
            _push(self.incumbents, float(value), top_k)
        self.points.extend(
            (float(u), mu, int(k * mu)) for u, k in zip(upper, m, strict=True) if np.isfinite(u)
        )
        return True


def _fitting_counts(setting: Setting, mu: int, m_hi: int, combos) -> np.ndarray:
    """m = 1..m_hi, cut at the first N = m*mu that no placement fits (memory grows with N)."""
    m = np.arange(1, m_hi + 1)
    if not len(m):
        return m
    fits = np.zeros(len(m), dtype=bool)
    for combo in combos:
        fits |= fill_gpu(setting, m * mu, mu, combo).fits
    first_miss = np.argmin(fits) if not fits.all() else len(m)
    return m[:first_miss]


def _push(heap: list[float], value: float, k: int) -> None:
    if len(heap) < k:
        heapq.heappush(heap, value)
    elif value > heap[0]:
        heapq.heapreplace(heap, value)


def _solve_best(setting: Setting, points, top_k: int, solved: dict) -> list[Plan]:
    """MILP at points in order of upper bound until no remaining bound can enter the top k;
    `solved` keeps each point's plan (None: no fit), so a second call solves only new points.

    Points are not cut at the closed form's k-th feasible value: the MILP keeps a small memory
    slack the closed form does not, so a point the closed form found feasible by less than that
    slack has no MILP solution, and the next points must still be tried."""
    allowed = fixed_binaries(setting.hardware, setting.schedule)
    candidates = sorted(points, key=lambda p: -p[0])
    top: list[Plan] = []
    for bound, mu, n in candidates:
        if len(top) >= top_k and bound <= top[-1].predicted.throughput_tok_s * (1 + REL_TOL):
            break
        if (n, mu) not in solved:
            solved[n, mu] = solve_point(setting, n, mu, allowed)
        plan = solved[n, mu]
        if plan is not None:
            top = sorted([*top, plan], key=lambda p: -p.predicted.throughput_tok_s)[:top_k]
    return top


def solve_point(
    setting: Setting, batch_size: int, micro_batch_size: int, allowed, *, whole_tensors=True
) -> Plan | None:
    """The MILP's placement at one (N, mu), as a Plan; None if nothing fits there.

    The MILP's r_w is continuous; with whole_tensors it is then placed as whole experts (down, or
    up by one when down overflows the CPU), and a point that no longer fits is None."""
    model = batch_model(setting, batch_size, micro_batch_size)
    result = solve_placement(model, allowed)
    if not result.optimal:
        return None
    policy = Policy(
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        attention_on_gpu=result.attention_on_gpu,
        ffn_on_gpu=result.ffn_on_gpu,
        weights_gpu_fraction=result.weights_gpu_fraction if result.ffn_on_gpu else 0.0,
        kv_gpu_fraction=result.kv_gpu_fraction if result.attention_on_gpu else 0.0,
        weight_dtype=setting.weight_dtype,
        kv_dtype=setting.kv_dtype,
        weights_disk_fraction=result.weights_disk_fraction,
    )
    plan = build_plan(model, policy, whole_tensors=whole_tensors)
    return plan if fits(plan.memory) else None


def infeasibility_message(setting: Setting, combos) -> str:
    """Which memory is short, and by how much, for the smallest run (N = mu = 1)."""
    hw = setting.hardware
    gpu_cap = usable_bytes(hw.gpu.total_memory_bytes) if hw.gpu else 0.0
    cpu_cap = usable_bytes(hw.cpu.memory_bytes)
    shortfalls = []
    for combo in combos:
        fill = fill_gpu(setting, 1, 1, combo)
        gpu_short = -float(fill.budget[0])
        # with a disk tier, after it takes every weight the GPU does not hold
        use = fill.cpu_use(fill.weights, fill.kv_after_weights) + fill.cpu_d * (1 - fill.weights)
        cpu_short = float(use[0]) - cpu_cap
        if gpu_short > 0:
            shortfalls.append(
                (gpu_short, "GPU", gpu_cap + gpu_short, gpu_cap, "--gpu-mem or a larger GPU")
            )
        else:
            shortfalls.append(
                (cpu_short, "CPU", cpu_cap + cpu_short, cpu_cap, "--cpu-mem or more CPU memory")
            )
    short, device, need, cap, fix = min(shortfalls)
    pct = round(100 * USABLE_MEMORY_FRACTION)
    return (
        f"{setting.arch.name} with prompts up to {setting.workload.prompt_len_max} and "
        f"{setting.workload.gen_len} new tokens fits no policy on {hw.name}: even one sequence "
        f"needs "
        f"{format_bytes(need)} of {device} memory, {format_bytes(cap)} is usable ({pct}% of the "
        f"total), {format_bytes(short)} short; try {fix}, or shorter prompts"
    )
