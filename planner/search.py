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
from planner.cost import queue_terms, schedule_terms
from planner.evaluate import batch_model, build_plan, fits, run_seconds
from planner.layer_seconds import micro_batch_seconds
from planner.memory import (
    ATT,
    FFN,
    ONE,
    RC,
    RW,
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
# Two throughputs closer than this (relative) are equal: the solver's tolerance.
REL_TOL = 1e-7


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


@dataclass(frozen=True, kw_only=True)
class Fill:
    """Closed-form placements of one kind (F_g, A_g) at many N, packed into the GPU memory left.

    GPU row: gpu_w * r_w + gpu_c * r_c <= budget
    CPU row: cpu_0 + cpu_w * r_w + cpu_c * r_c <= cpu_cap
    """

    ffn: int
    budget: np.ndarray
    gpu_w: np.ndarray
    gpu_c: np.ndarray
    cpu_0: np.ndarray
    cpu_w: np.ndarray
    cpu_c: np.ndarray
    cpu_cap: float

    def weights_for_kv(self, rc: np.ndarray, idx=slice(None)) -> np.ndarray:
        """r_w = the most resident weights the GPU holds beside a cache fraction rc."""
        gw = self.gpu_w[idx]
        room = self.budget[idx] - self.gpu_c[idx] * rc
        return np.where(gw > 0, np.clip(room / np.where(gw > 0, gw, 1.0), 0, 1), 1.0) * self.ffn

    @property
    def weights(self) -> np.ndarray:
        """r_w with no cache on the GPU: as much as fits."""
        return self.weights_for_kv(np.zeros_like(self.budget))

    @property
    def kv_after_weights(self) -> np.ndarray:
        """r_c in what the weights leave: with `weights`, a feasible placement."""
        return self._kv_share(self.budget - self.gpu_w * self.weights)

    @property
    def kv_alone(self) -> np.ndarray:
        """r_c given all of the GPU memory left: with `weights`, a relaxation."""
        return self._kv_share(self.budget)

    def _kv_share(self, room: np.ndarray) -> np.ndarray:
        c = self.gpu_c
        return np.where(c > 0, np.clip(room / np.where(c > 0, c, 1.0), 0, 1), 0.0)

    @property
    def kv_cpu_limit(self) -> np.ndarray:
        """Largest r_c on the frontier (r_w = (budget - gpu_c*r_c)/gpu_w) the CPU memory allows:
        moving GPU memory from weights to cache puts more bytes back on the CPU than it takes."""
        gw = np.where(self.gpu_w > 0, self.gpu_w, 1.0)
        slope = self.cpu_c - self.cpu_w * self.gpu_c / gw
        room = self.cpu_cap - self.cpu_0 - self.cpu_w * self.budget / gw
        limit = np.where(slope > 0, room / np.where(slope > 0, slope, 1.0), 1.0)
        return np.where(self.gpu_w > 0, np.clip(limit, 0, 1), 1.0)

    def cpu_use(self, rw: np.ndarray, rc: np.ndarray) -> np.ndarray:
        return self.cpu_0 + self.cpu_w * rw + self.cpu_c * rc

    @property
    def fits(self) -> np.ndarray:
        return (self.budget >= 0) & (
            self.cpu_use(self.weights, self.kv_after_weights) <= self.cpu_cap
        )


def fill_gpu(setting: Setting, batch_size, mu: int, combo: tuple[int, int]) -> Fill:
    """Per GPU byte, resident weights save L/(L-2) bytes of CPU memory and the KV cache 1, so
    filling weights first, then KV, frees the most CPU memory: if that placement does not fit,
    none of this kind does."""
    ffn, att = combo
    hw = setting.hardware
    mem = setting.memory(batch_size, mu)
    g, c = np.atleast_2d(mem.gpu_total()), np.atleast_2d(mem.cpu_total())
    gpu_cap = usable_bytes(hw.gpu.total_memory_bytes) if hw.gpu else 0.0
    return Fill(
        ffn=ffn,
        budget=gpu_cap - (g[:, ONE] + att * g[:, ATT] + ffn * g[:, FFN]),
        gpu_w=g[:, RW],
        gpu_c=g[:, RC] * att,
        cpu_0=c[:, ONE] + att * c[:, ATT] + ffn * c[:, FFN],
        cpu_w=c[:, RW],
        cpu_c=c[:, RC] * att,
        cpu_cap=usable_bytes(hw.cpu.memory_bytes),
    )


@dataclass(frozen=True, kw_only=True)
class Bracket:
    """Closed-form throughputs of a row of points for one (F_g, A_g): feasible <= MILP <= bound."""

    feasible: np.ndarray  # -inf where nothing fits
    bound: np.ndarray


def bracket_row(
    setting: Setting, mu: int, m: np.ndarray, combo: tuple[int, int], terms, threshold: float
) -> Bracket:
    """Throughput of the feasible and of the relaxed placement at every N = m * mu; with GPU
    attention, points whose bound passes `threshold` are solved along the memory frontier."""
    ffn, att = combo
    fill = fill_gpu(setting, m * mu, mu, combo)
    tokens = m * mu * setting.workload.gen_len_mean

    def throughput(rw: np.ndarray, rc: np.ndarray, keep: np.ndarray) -> np.ndarray:
        v = np.stack(
            [np.ones_like(rw), np.full_like(rw, att), np.full_like(rw, ffn), rw, rc], axis=1
        )
        prefill, decode = run_seconds(setting, terms, m[keep], v)
        return np.where(fill.fits[keep], tokens[keep] / (prefill + decode), -np.inf)

    everywhere = np.ones(len(m), dtype=bool)
    feasible = throughput(fill.weights, fill.kv_after_weights, everywhere)
    if not att:  # r_c = 0: the weights-first placement is the optimum
        return Bracket(feasible=feasible, bound=feasible)
    bound = throughput(fill.weights, fill.kv_alone, everywhere)
    open_ = np.flatnonzero((bound > threshold * (1 - REL_TOL)) & (bound > feasible * (1 + REL_TOL)))
    if len(open_):
        best = _frontier_optimum(setting, fill, open_, lambda rw, rc: throughput(rw, rc, open_))
        feasible[open_] = best
        bound[open_] = best * (1 + REL_TOL)
    return Bracket(feasible=feasible, bound=bound)


# Golden-section steps along the frontier: the bracket shrinks to 0.618**60 ~ 3e-13 of r_c.
_GOLDEN_STEPS = 60


def _frontier_optimum(setting: Setting, fill: Fill, idx: np.ndarray, throughput) -> np.ndarray:
    """Best throughput over r_c in [weights-first r_c, min(KV-alone r_c, CPU limit)], with r_w
    taking the GPU memory r_c leaves. Time is convex along this segment (a max of affine terms of
    a concave r_w(r_c)), so a golden-section search finds the optimum."""
    lo, hi = fill.kv_after_weights[idx], np.minimum(fill.kv_alone[idx], fill.kv_cpu_limit[idx])
    hi = np.maximum(hi, lo)

    def rw_at(rc: np.ndarray) -> np.ndarray:
        return fill.weights_for_kv(rc, idx)

    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo.copy(), hi.copy()
    x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
    f1, f2 = throughput(rw_at(x1), x1), throughput(rw_at(x2), x2)
    for _ in range(_GOLDEN_STEPS):
        left = f1 >= f2  # throughput is concave: the optimum lies in [a, x2] or in [x1, b]
        a, b = np.where(left, a, x1), np.where(left, x2, b)
        new = np.where(left, b - ratio * (b - a), a + ratio * (b - a))
        f_new = throughput(rw_at(new), new)
        x1, x2 = np.where(left, new, x2), np.where(left, x1, new)
        f1, f2 = np.where(left, f_new, f2), np.where(left, f1, f_new)
    ends = [throughput(rw_at(lo), lo), throughput(rw_at(hi), hi)]
    return np.max([f1, f2, *ends], axis=0)


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
    free = total - arch.num_layers * w.stored - w.embedding
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
) -> SearchResult:
    """The top_k (N, mu) points with their optimal placements, best first; N at most
    max_batch_size (a small dataset, or outputs sooner)."""
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
        cpu_short = float(fill.cpu_use(fill.weights, fill.kv_after_weights)[0]) - cpu_cap
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
