"""The CPU's routed experts' GEMMs in one native call each (executor/fused_moe.cpp), where this
host and the model allow it; the GLU between them, a family's biases and the routing scale stay
the executor's torch ops, so a token's arithmetic is the loop's.

Why: the executor's loop runs each expert as its own GEMMs. At decode's few rows a call streams
its expert cold and pays its setup and Python's per expert: 64 small experts x 2 GEMMs x every
layer. vLLM's CPU backend, 1.8x ahead at batch 64 with 64 experts of 384, runs one kernel over
all experts. This one cuts every expert's GEMMs into tiles that torch's threads share, in one of
three forms (`variant`), chosen by what the host's CPU has:
- `amx` (AMX): tiles of our own over weights laid out once at load in 1 KB tile rows, up to
  32 rows of an expert a pass, so a decode reads each weight once. On the AMX VM it streams
  Mixtral's experts at 1.1-1.25x oneDNN's AMX brgemm (the form it replaced), bit for bit its
  sums: 27 GB/s at 1 row an expert (the host's read), 25 at 16, 22 at 32, 16 at 64
  (docs/decisions.md, 2026-12-07). Whole runs on that VM had been 1.3-1.6x the loop at the
  Qwen3-MoE bench shape, 1.1-1.2x at Mixtral's, with brgemm.
- `pairs` (AVX512-BF16 without AMX: Zen 4, Cooper Lake): weights laid out at load in pairs of
  K side by side; each tile multiplies the bf16 rows as they are with vdpbf16ps, six rows a
  pass over its block. On an AVX-512 EPYC (Zen 4), one layer's experts: 2.0-2.8x the widened
  form from 16 tokens up, 1.2-2.9x the loop at 1-512 tokens (docs/decisions.md, 2026-12-07).
- `widened` (AVX2, AVX-512 without BF16, where bf16 GEMMs run widened to float32): weights
  laid out at load as contiguous column blocks, still bf16; each tile widens its block 256 rows
  at a time into an L2-sized float32 buffer and multiplies by torch's float32 brgemm; an expert
  of 1-4 rows reads its block once instead, widened in AVX2 registers (1.3-1.9x the buffer at
  those rows). On an AVX2 EPYC, one layer's experts: 2.1-3.4x the widened loop at 1-256 tokens
  (Qwen3-MoE bench shape), 1.5-3.3x (Mixtral's), even at 1024 (docs/decisions.md,
  2026-12-07).

It is compiled on first use by torch.utils.cpp_extension (about 30-60 s, then cached by torch
under ~/.cache/torch_extensions); where that fails, or the family's experts are not of
64-multiple widths, `missing` says why and the executor runs its loop. bf16 only.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware.parts import Curve
from hrm.rules.cpu_moe import BLOCK, check_mode, model_missing

SOURCES = [str(Path(__file__).with_name(f))
           for f in ("fused_moe.cpp", "small_ops.cpp", "decode_attention.cpp")]  # fmt: skip
GROUP = 8  # experts in one timed call of the profile's sweep (fused_curves)


@functools.cache
def _built():
    """The compiled extension, or the reason it could not be had (a str)."""
    try:
        from torch.utils.cpp_extension import load

        module = load(name="hrm_fused_moe", sources=SOURCES, extra_cflags=["-O3", "-fopenmp"])
    except Exception as exc:  # noqa: BLE001 -- a compiler's failure takes many forms
        return f"the fused MoE kernel did not build ({type(exc).__name__}: {str(exc)[:200]})"
    return module


def missing(arch: ModelArch, dtype: str) -> str | None:
    """Why the fused kernel cannot run `arch`'s experts in `dtype` here (None: it can). Checks
    the model before the host, so that a model it never serves costs no build."""
    return model_missing(arch, dtype) or host_missing()


def ready() -> bool:
    """Whether this process has already built the kernel (nothing is built to answer)."""
    return _built.cache_info().currsize > 0 and not isinstance(_built(), str)


def host_missing() -> str | None:
    """Why this host cannot run the kernel (None: it can): it did not build."""
    built = _built()
    return built if isinstance(built, str) else None


@functools.cache
def variant() -> str:
    """`amx` where the CPU has AMX-BF16 and lets this process use it, else `pairs` where it has
    AVX512-BF16, else `widened`."""
    module = _built()
    return "amx" if module.has_amx() else "pairs" if module.has_pairs() else "widened"


# each variant's grouped call in the extension
_CALLS = {"amx": "grouped", "pairs": "grouped_pairs", "widened": "grouped_widened"}


def fused_experts(arch: ModelArch, dtype: str, mode: str, *, held: bool) -> bool:
    """Whether a CPU model of `arch` in `dtype` (held: its weights held and laid out by it at
    load) runs its routed experts fused under `mode` (hrm.rules.cpu_moe.MODES): auto wherever it
    can; fused, or refused in one line where it cannot; loop never."""
    check_mode(mode)
    if mode == "loop" or (mode == "auto" and (not held or missing(arch, dtype) is not None)):
        return False
    require(arch, dtype)
    if not held:
        _refuse("weights held by the CPU's model (a GPU's layers and a store's pages are not)")
    return True


def require(arch: ModelArch, dtype: str) -> None:
    """Refuse `--cpu-moe fused` in one line where the model or this host cannot run it."""
    why = missing(arch, dtype)
    if why is not None:
        _refuse(why)


def _refuse(why: str) -> None:
    raise HrmError(f"--cpu-moe fused: this run lacks {why}; use --cpu-moe loop or auto")


def pack(w, scratch=None, *, form: str | None = None):
    """w [out, in] bf16 (out a multiple of 64; in of 32 in the amx form, even in pairs) laid
    out for the kernel's `form` (this host's variant unless named) as [out / 64, in * 64]: each
    column block of w^T as the form reads it (`_blocks`). scratch (a buffer of at least w's
    elements): laid out over w itself, through it, and w returned in the layout's shape."""
    n, k = w.shape
    w = w.contiguous()
    blocks = _blocks(w, form or variant())
    if scratch is None:
        return blocks.contiguous().view(n // BLOCK, k * BLOCK)
    laid = scratch[: w.numel()].view(blocks.shape)
    laid.copy_(blocks)
    return w.view(-1).copy_(laid.view(-1)).view(n // BLOCK, k * BLOCK)


def _blocks(w, form: str):
    """A view of w [n, k] in `form`'s order, block by block: amx, two halves of 32 columns,
    each [k / 32][2 column tiles][16 K pairs][16 columns][2] (one AMX tile row 64 bytes, a
    tile 1 KB contiguous); pairs, [k / 2][64 columns][2] (K pairs side by side, vdpbf16ps's
    and oneDNN's VNNI order); widened, [k][64 columns]."""
    n, k = w.shape
    if form == "amx":
        return w.view(n // BLOCK, 2, 2, 16, k // 32, 16, 2).permute(0, 1, 4, 2, 5, 3, 6)
    if form == "pairs":
        return w.view(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    return w.view(n // BLOCK, BLOCK, k).transpose(1, 2)


def k_multiple() -> int:
    """What a matrix's inputs must be a multiple of for this host's form: an AMX tile's 32 K,
    a K pair, or any."""
    return {"amx": 32, "pairs": 2}.get(variant(), 1)


def grouped(xs, counts: list[int], weights: list, n_out: int):
    """xs [A, K] sorted by expert (counts[e] rows each), each row times its expert's weight
    [n_out, K], given whole (weights[e]) or in equal parts by rows (weights[e * parts + p]: a
    gate's and an up's, each laid out by pack() where it was loaded): [A, n_out] bf16, each
    output rounded as a GEMM's."""
    return getattr(_built(), _CALLS[variant()])(xs.contiguous(), counts, weights, n_out)


def glu_in_tiles(arch: ModelArch) -> bool:
    """Whether `arch`'s fused gate-up call computes its SwiGLU in the tiles (grouped_swiglu):
    the amx form, a plain SwiGLU without biases (gpt-oss's clamped, biased GLU runs apart)."""
    return variant() == "amx" and arch.swiglu_limit is None and not arch.expert_bias


def grouped_swiglu(xs, counts: list[int], weights: list, n_out: int):
    """grouped() over gate-up weights (n_out: a gate's and an up's columns), in the amx form
    only: [A, n_out / 2], each row's SwiGLU as the loop's F.silu(gate) * up rounds it, from the
    tiles' own sums, where the loop ran the GEMM, silu_, mul_ and a copy of the gate's strided
    half: 1.4 ms of a 48 ms step at the Mixtral bench shape, batch 64 (AMX Xeon)."""
    return _built().grouped_swiglu(xs.contiguous(), counts, weights, n_out)


def fused_linears(choice) -> bool:
    """Whether a run whose routed experts are fused runs its other matrices on the kernel too,
    each as one expert of all the rows, unless the run named its GEMM path (`choice.named`):
    - `pairs`: the attention projections and an LM head at 1-4 rows 1.6-2.6x faster than
      torch's native bf16 and 1.2-2.0x oneDNN's packed (AVX-512 EPYC);
    - `amx`: whole runs on the AMX Xeon 1.10-1.17x oneDNN's packed at batch 1, 1.01-1.06x
      at batch 64, even at 16 prompts of 512, with the brgemm form it replaced
      (docs/decisions.md, 2026-12-07).
    The widened form was not measured so."""
    return variant() in ("pairs", "amx") and not choice.named


def linear_packing(packed: bool):
    """How fused_linears lays out a matrix [out, in]: for the kernel where its inputs allow
    (Kernel), one narrower than a block or not a whole number of them padded with zero rows:
    Mixtral's 8-wide router took 8-16 us a call so at 1-64 rows against 34-41 us natively and
    177 us as oneDNN's packed GEMM (AMX Xeon; the same bits as native there); else as its path
    has it (oneDNN's packing where the run packs, else a copy)."""
    import torch

    from hrm.rules.gemm_paths import pack_weight

    def lay_out(w):
        if w.dtype == torch.bfloat16 and w.shape[1] % k_multiple() == 0:
            return Kernel(w)
        return pack_weight(w) if packed and w.shape[0] >= BLOCK else w.clone()

    return lay_out


class Kernel:
    """A matrix [out, in] laid out for the kernel (pack; zero rows to a whole number of
    blocks), multiplied by `times` as one expert of all the rows; `shape` and `dtype` are the
    matrix's."""

    __slots__ = ("packed", "shape", "dtype")

    def __init__(self, w):
        import torch

        self.shape, self.dtype = tuple(w.shape), w.dtype
        short = -w.shape[0] % BLOCK
        self.packed = pack(torch.cat([w, w.new_zeros(short, w.shape[1])]) if short else w)

    def times(self, x):
        """x [T, in] @ w.T: [T, out] bf16."""
        width = self.packed.shape[0] * BLOCK
        y = grouped(x, [x.shape[0]], [self.packed], width)
        return y if width == self.shape[0] else y[:, : self.shape[0]]


def fused_curves(
    shapes, *, rows: tuple[int, ...], streamed_bytes: float, repeats: int, min_sample_s: float
) -> dict[str, Curve]:
    """{gemm_shape_key: Curve} of the fused kernel's FLOP/s per expert at each count of rows an
    expert, for each (d_in, d_out) in `shapes`: one call takes GROUP experts' next weights of
    copies packed once (enough to span `streamed_bytes`, so they stream from memory as a model's
    layers do), `rows` rows each. The planner prices an expert at n rows by these curves
    (planner/op_time.py), as the loop's by the packed GEMM's. A shape's points are timed in
    rounds, one sample of each a round, each the median of its `repeats` (the profile's sweeps'
    way); its copies are freed before the next shape's are made."""
    import torch

    from hrm.hardware.parts import gemm_shape_key

    curves = {}
    for d_in, d_out in shapes:
        weight = torch.randn(d_out, d_in).to(torch.bfloat16)
        copies = max(GROUP, math.ceil(streamed_bytes / weight.nbytes))
        packed = [pack(weight) for _ in range(copies)]
        curves[gemm_shape_key(d_in, d_out)] = _timed_rows(packed, d_in, d_out, rows, repeats,
                                                          min_sample_s)  # fmt: skip
        del packed
    return curves


def _timed_rows(packed: list, d_in: int, d_out: int, rows, repeats: int, min_sample_s: float):
    """fused_curves' curve of one shape over its packed copies."""
    import statistics

    import torch

    from hrm.profiling.timing import perf_counter_clock, time_calls

    turn, points = [0], []
    for n in rows:
        x = torch.randn(GROUP * n, d_in).to(torch.bfloat16)

        def call(x=x, n=n):
            first = turn[0] % (len(packed) - GROUP + 1)
            turn[0] += GROUP
            return grouped(x, [n] * GROUP, packed[first : first + GROUP], d_out)

        first = time_calls(call, clock=perf_counter_clock, repeats=1, min_sample_s=min_sample_s)
        points.append((n, call, first.calls_per_sample, [first.samples_s[0]]))
    for _ in range(repeats - 1):
        for _, call, calls, samples in points:
            samples.append(perf_counter_clock(call, calls) / calls)
    flops = 2.0 * GROUP * d_in * d_out  # a row's
    return Curve(points=tuple((float(n), n * flops / statistics.median(s))
                              for n, _, _, s in points))  # fmt: skip
