"""Closed-form placements that bracket the MILP's optimum at a row of (N, mu) points, for the
exact search (planner/search.py, its module docstring): weights first then KV cache into the
GPU memory left (feasible), or each given all of it (a bound), and the disk tier's least share
beside either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.evaluate import run_seconds
from planner.memory import ATT, FFN, ONE, RC, RD, RW, usable_bytes
from planner.setting import Setting

# Two throughputs closer than this (relative) are equal: the solver's tolerance.
REL_TOL = 1e-7


@dataclass(frozen=True, kw_only=True)
class Fill:
    """Closed-form placements of one kind (F_g, A_g) at many N, packed into the GPU memory left.

    GPU row: gpu_w * r_w + gpu_c * r_c <= budget
    CPU row: cpu_0 + cpu_w * r_w + cpu_c * r_c + cpu_d * r_d <= cpu_cap, r_d <= 1 - r_w
    r_d (the disk tier's share, cpu_d < 0 its relief; cpu_d = 0 without a disk) only costs time,
    so every placement takes the least r_d that fits: `disk_share`.
    """

    ffn: int
    budget: np.ndarray
    gpu_w: np.ndarray
    gpu_c: np.ndarray
    cpu_0: np.ndarray
    cpu_w: np.ndarray
    cpu_c: np.ndarray
    cpu_cap: float
    cpu_d: np.ndarray

    def disk_share(self, rw: np.ndarray, rc: np.ndarray, idx=slice(None)) -> np.ndarray:
        """The least r_d that fits the CPU row (0 where it fits without, or without a disk)."""
        over = self.cpu_use(rw, rc, idx) - self.cpu_cap
        relief = -self.cpu_d[idx]
        return np.where(relief > 0, np.maximum(over, 0) / np.where(relief > 0, relief, 1.0), 0.0)

    def cpu_fits(self, rw: np.ndarray, rc: np.ndarray, idx=slice(None)) -> np.ndarray:
        """The CPU row holds with the disk tier taking at most the weights not on the GPU."""
        return self.cpu_use(rw, rc, idx) + self.cpu_d[idx] * (1 - rw) <= self.cpu_cap

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
        # with a disk tier the row is cpu_0 + (cpu_w - cpu_d) r_w + cpu_c r_c <= cap - cpu_d
        cpu_w, cap = self.cpu_w - self.cpu_d, self.cpu_cap - self.cpu_d
        slope = self.cpu_c - cpu_w * self.gpu_c / gw
        room = cap - self.cpu_0 - cpu_w * self.budget / gw
        limit = np.where(slope > 0, room / np.where(slope > 0, slope, 1.0), 1.0)
        return np.where(self.gpu_w > 0, np.clip(limit, 0, 1), 1.0)

    def cpu_use(self, rw: np.ndarray, rc: np.ndarray, idx=slice(None)) -> np.ndarray:
        """The CPU row's bytes before the disk tier takes any."""
        return self.cpu_0[idx] + self.cpu_w[idx] * rw + self.cpu_c[idx] * rc

    @property
    def fits(self) -> np.ndarray:
        return (self.budget >= 0) & self.cpu_fits(self.weights, self.kv_after_weights)


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
        # the disk keeps streamed weights only: none where the CPU runs the layers
        cpu_d=c[:, RD] * ffn if hw.disk is not None else np.zeros_like(c[:, RD]),
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
        rd = fill.disk_share(rw, rc, keep)
        v = np.stack(
            [np.ones_like(rw), np.full_like(rw, att), np.full_like(rw, ffn), rw, rc, rd], axis=1
        )
        prefill, decode = run_seconds(setting, terms, m[keep], v)
        ok = fill.fits[keep] & (rd <= 1 - rw + 1e-12)
        return np.where(ok, tokens[keep] / (prefill + decode), -np.inf)

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
