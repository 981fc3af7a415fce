"""How a CPU run's routed experts run, decided in one place for the executor and the planner.

`loop` runs each expert hit as its own GEMMs; `fused` runs each of the experts' two GEMMs as one
native call over every expert (executor/fused_moe.py), over weights packed for it at load.
`auto` takes fused wherever it can run: the model's part of that is here (`model_missing`), the
host's part is whether the kernel builds and has a bf16 micro-kernel (executor/fused_moe.py).
A run's record says which ran (CpuGemmChoice.experts); the planner prices a fused run from the
kernel's own curves (`<dtype>_fused`), which `hrm profile` times only where the kernel runs
(`fused_timed`), and prices the loop elsewhere.
"""

from __future__ import annotations

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware.parts import FUSED_KEYS

MODES = ("auto", "loop", "fused")
BLOCK = 64  # the kernel's column block: widths must be multiples of it
# a fused call takes a run of consecutive experts of at most GROUP_ROWS rows, or one expert of
# more: a prefill's transient is the loop's (one expert's rows; planner/memory.py counts one
# expert taking every token), a decode of up to 512 assignments one call a GEMM; at hundreds
# of rows an expert the kernel is compute-bound, so the cut costs only a call's setup
GROUP_ROWS = 512


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise HrmError(f"--cpu-moe: unknown {mode!r}; use one of {', '.join(MODES)}")


def model_missing(arch: ModelArch, dtype: str) -> str | None:
    """What `arch`'s experts in `dtype` lack for the fused kernel (None: nothing)."""
    if dtype not in FUSED_KEYS:
        return f"bfloat16 weights (the fused kernel is bfloat16 only; this run is {dtype})"
    widths = {"hidden size": arch.hidden_size, "expert width": arch.intermediate_size}
    for name, width in widths.items():
        if width % BLOCK:
            return f"a {name} that is a multiple of {BLOCK} (it is {width})"
    return None


def fused_timed(rates, dtype: str) -> bool:
    """Whether `rates` (a CPU DeviceSpec) hold the fused kernel's curves in `dtype`: hrm profile
    times it only where it builds and runs (executor/fused_moe.py)."""
    key = FUSED_KEYS.get(dtype)
    return key is not None and any(key in c for c in rates.gemm_shape_curves.values())
