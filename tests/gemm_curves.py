"""Synthetic CPU GEMM curves for the two kinds of host, shaped after measurements (tests only).

GFLOP/s at GRID tokens: an AVX2 CPU (the AVX2 EPYC of ci-cpu: widened float32 faster at every
token count, with sgemm's dip at 12 rows), an AMX CPU (the Sapphire Rapids VM: native bf16
faster everywhere) and one where the winner changes with the token count.
"""

from __future__ import annotations

from hrm.hardware.parts import Curve
from hrm.rules.cpu_gemm import MeasuredRates

GRID = (1, 4, 12, 16, 64, 256, 1024)


def curve(rates) -> Curve:
    return Curve(points=tuple((float(t), float(r)) for t, r in zip(GRID, rates, strict=True)))


AVX2 = {
    "bfloat16": curve([2, 7, 14, 18, 21, 22, 22]),
    "bfloat16_widened": curve([5, 17, 25, 60, 110, 150, 160]),  # 12 rows: sgemm's dip
}
AMX = {
    "bfloat16": curve([10, 43, 130, 168, 382, 525, 640]),
    "bfloat16_widened": curve([6, 17, 48, 66, 116, 153, 159]),
}
# packed on the AMX Xeon VM (2 cores): 1.3-1.6x native at 1-64 rows, about native above
AMX_PACKED = {**AMX, "bfloat16_packed": curve([16, 68, 195, 250, 560, 540, 640])}
# an AVX-512 CPU without AVX512-BF16: widened wins, and packed (emulated bf16) loses to it
AVX512_PACKED = {**AVX2, "bfloat16_packed": curve([4, 12, 20, 30, 50, 60, 60])}
MIXED = {
    "bfloat16": curve([20, 60, 150, 200, 120, 100, 100]),
    "bfloat16_widened": curve([5, 17, 48, 66, 200, 300, 320]),
}


def rates(curves) -> MeasuredRates:
    return MeasuredRates(matmul_curves={k: scaled(c, 1e9) for k, c in curves.items()})


def scaled(c: Curve, factor: float) -> Curve:
    return Curve(points=tuple((x, y * factor) for x, y in c.points))
