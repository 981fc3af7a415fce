"""The CPU's routed experts' GEMMs in one native call each (executor/fused_moe.cpp), where this
host and the model allow it; the SwiGLU between them and the routing scale stay the executor's
torch ops, so a token's arithmetic is the loop's.

Why: the executor's loop runs each expert as its own oneDNN GEMMs. At decode's few rows a
call streams its expert at 12-16 GB/s (a lone 1.5 MB matrix; 22-24 GB/s for one large one) and
pays its setup and Python's per expert: 64 small experts x 2 GEMMs x every layer. vLLM's CPU
backend, 1.8x ahead at batch 64 with 64 experts of 384, runs one kernel over all experts. This
one cuts every expert's GEMMs into tiles that torch's threads share, each tile one call of
torch's own batch-reduce GEMM (at::native::cpublas::brgemm, oneDNN's AMX or AVX-512-BF16
micro-kernel) over weights packed once at load. Measured on the AMX VM (bf16, 2 threads, whole
runs at batch 64): 1.3-1.6x the loop at the Qwen3-MoE bench shape, 1.1-1.2x at Mixtral's; it
loses at long prefills of few wide experts (0.8x at 2048 tokens; docs/decisions.md,
2026-12-06).

It is compiled on first use by torch.utils.cpp_extension (about 30 s, then cached by torch
under ~/.cache/torch_extensions); where that fails, or the host has no bf16 micro-kernel, or
the family's experts are not a plain SwiGLU of 64-multiple widths, `missing` says why and the
executor runs its loop. bf16 only.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hrm.arch import ModelArch
from hrm.errors import HrmError

MODES = ("loop", "fused")
SOURCE = Path(__file__).with_name("fused_moe.cpp")
BLOCK = 64  # the kernel's column block: widths must be multiples of it


@functools.cache
def _built():
    """The compiled extension, or the reason it could not be had (a str)."""
    try:
        from torch.utils.cpp_extension import load

        module = load(name="hrm_fused_moe", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"])
    except Exception as exc:  # noqa: BLE001 -- a compiler's failure takes many forms
        return f"the fused MoE kernel did not build ({type(exc).__name__}: {str(exc)[:200]})"
    if not module.available():
        return "a bf16 micro-kernel for torch's brgemm (AMX-BF16 or AVX512-BF16)"
    return module


def missing(arch: ModelArch, dtype: str) -> str | None:
    """Why the fused kernel cannot run `arch`'s experts in `dtype` here (None: it can). Checks
    the model before the host, so that a model it never serves costs no build."""
    if dtype != "bfloat16":
        return f"bfloat16 weights (the fused kernel is bfloat16 only; this run is {dtype})"
    if arch.swiglu_limit is not None or arch.expert_bias:
        return f"plain SwiGLU experts ({arch.name}'s have biases or a clamped GLU)"
    widths = {"hidden size": arch.hidden_size, "expert width": arch.intermediate_size}
    for name, width in widths.items():
        if width % BLOCK:
            return f"a {name} that is a multiple of {BLOCK} (it is {width})"
    built = _built()
    return built if isinstance(built, str) else None


def fused_experts(arch: ModelArch, dtype: str, mode: str, *, packed: bool) -> bool:
    """Whether a CPU model of `arch` in `dtype` (packed: its weights packed at load) runs its
    routed experts fused under `mode` (MODES): fused, or refused in one line where it cannot;
    loop never."""
    check_mode(mode)
    if mode == "loop":
        return False
    require(arch, dtype)
    if not packed:
        _refuse(
            "weights packed at load (a resident CPU run on --cpu-gemm packed, or auto where it "
            "picks packed; a GPU's layers and a store's pages are not)"
        )
    return True


def require(arch: ModelArch, dtype: str) -> None:
    """Refuse `--cpu-moe fused` in one line where the model or this host cannot run it."""
    why = missing(arch, dtype)
    if why is not None:
        _refuse(why)


def _refuse(why: str) -> None:
    raise HrmError(f"--cpu-moe fused: this run lacks {why}; use --cpu-moe loop")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise HrmError(f"--cpu-moe: unknown {mode!r}; use one of {', '.join(MODES)}")


def pack(w):
    """w [out, in] bf16 packed for the kernel ([out / 64, in * 64]; out a multiple of 64)."""
    return _built().pack(w.contiguous())


def grouped(xs, counts: list[int], weights: list, n_out: int):
    """xs [A, K] sorted by expert (counts[e] rows each), each row times its expert's weight
    (weights[e]: packed by pack() from [n_out, K]): [A, n_out] bf16, each output rounded as a
    GEMM's."""
    return _built().grouped(xs.contiguous(), counts, weights, n_out)
