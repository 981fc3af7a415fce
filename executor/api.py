"""What `hrm run` calls: describe a run from its arguments, then execute it.

`prepare_run` reads only config.json, the safetensors headers, the prompts and (for text) the
tokenizer, so the planner's prediction for the run can be built from its RunSpec before any weight
is touched.  `execute` loads the weights, generates and measures.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from executor.checkpoint import (
    TORCH_DTYPES,
    Checkpoint,
    load_tokenizer,
    open_checkpoint,
    random_checkpoint,
    read_arch,
    stored_dtype,
)
from executor.engine import engine_mode, jitter_seed
from executor.generate import Generation, Sampling, generate, resident_runtime
from executor.model import MoEModel
from hrm.arch import ModelArch
from hrm.cpu_gemm import CpuGemmChoice
from hrm.errors import HrmError
from hrm.io import read_prompts_file
from hrm.profiling import BUSY_WARNING_SHARE
from hrm.profiling.cpu import cpu_times, measured_others_share
from hrm.progress import progress_bar
from hrm.record import Measurement


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything a run does, fixed before it starts: model, prompts, lengths, dtype, device."""

    checkpoint: Path | None  # None: random weights made in memory for `arch`
    arch: ModelArch
    prompts: tuple[tuple[int, ...], ...]
    gen_len: int
    dtype: str
    device: str
    tokenizer: Any = None  # the checkpoint's tokenizer, or None (token ids only)

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]


@dataclass(frozen=True, kw_only=True)
class RunResult:
    spec: RunSpec
    outputs: list[dict[str, Any]]  # {"output_token_ids": [...], "text": str | None}, input order
    measured: Measurement
    environment: dict[str, Any]
    cpu_gemm: CpuGemmChoice | None = None  # the GEMM path the run took on a CPU


def prepare_run(
    checkpoint: str | os.PathLike | None,
    *,
    random_arch: ModelArch | None = None,
    gen_len: int,
    prompts_path: str | os.PathLike | None = None,
    prompt_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    device: str = "cpu",
) -> RunSpec:
    """Resolve a run's arguments into a RunSpec; every user error is an HrmError.

    random_arch (with checkpoint None): random weights of that architecture, made in memory."""
    directory = Path(checkpoint) if checkpoint is not None else None
    arch = read_arch(directory) if directory is not None else random_arch
    if dtype is not None and dtype not in TORCH_DTYPES:
        raise HrmError(f"--dtype: unknown dtype {dtype!r}; use one of {', '.join(TORCH_DTYPES)}")
    dtype = dtype or (stored_dtype(directory, arch) if directory is not None else "bfloat16")
    if gen_len < 1:
        raise HrmError(f"--gen-len must be a positive integer, got {gen_len}")
    _check_device(device)
    tokenizer = load_tokenizer(directory) if directory is not None else None
    where = directory if directory is not None else f"random {arch.name} weights"
    if prompts_path is not None:
        prompts, needs_text = read_prompts_file(Path(prompts_path))
        if needs_text and tokenizer is None:
            raise HrmError(
                f"{prompts_path}: has text prompts but {where} has no tokenizer; "
                "give prompt_token_ids instead"
            )
        ids = [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in prompts]
        _check_ids(ids, arch.vocab_size, prompts_path)
    else:
        if not prompt_len or prompt_len < 1 or not batch or batch < 1:
            raise HrmError("--prompt-len and --batch must both be positive integers")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, arch.vocab_size, (batch, prompt_len), generator=g).tolist()
    arch.check_positions(max(len(p) for p in ids), gen_len)
    return RunSpec(
        checkpoint=directory,
        arch=arch,
        prompts=tuple(tuple(p) for p in ids),
        gen_len=gen_len,
        dtype=dtype,
        device=device,
        tokenizer=tokenizer,
    )


def _check_device(device: str) -> None:
    """A device this host has, and an engine mode (HRM_ENGINE) that can run on it."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise HrmError(f"--device {device}: no CUDA device is available here; use --device cpu")
    elif device != "cpu":
        raise HrmError(f"--device: unknown device {device!r}; use cpu or cuda")
    engine_mode(torch.device(device))
    jitter_seed()


def _check_ids(prompts: list[list[int]], vocab_size: int, where) -> None:
    for n, ids in enumerate(prompts, 1):
        if not ids:
            raise HrmError(f"{where}: prompt {n} is empty after tokenisation")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise HrmError(
                f"{where}: prompt {n} has token id {bad} outside the vocabulary [0, {vocab_size})"
            )


@contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op threads set to `threads` for the block (None: leave them), then restored."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def execute(
    spec: RunSpec,
    *,
    cpu_gemm: CpuGemmChoice | Callable[[Checkpoint], CpuGemmChoice] | None = None,
    sampling: Sampling | None = None,
    ignore_eos: bool = False,
    quiet: bool = False,
    warn: Callable[[str], None] = lambda message: None,
) -> RunResult:
    """Load the weights, generate, and measure prefill and decode time.

    cpu_gemm: the CPU GEMM path (MoEModel), or a function of the opened checkpoint that chooses
    it (so a broken checkpoint fails before a probe, which times its weights). `warn` hears when
    other processes took enough of the CPU that the measurement is not comparable."""
    checkpoint = load_weights(spec, spec.device)
    model = MoEModel(checkpoint, cpu_gemm(checkpoint) if callable(cpu_gemm) else cpu_gemm)
    bar = progress_bar(total=1, desc="prefill", quiet=quiet)

    def on_step(phase: str) -> None:
        if phase == "prefill":  # the decode steps get a bar of their own
            bar.reset(total=spec.gen_len - 1)
            bar.set_description("decode")
        else:
            bar.update()

    times_before = cpu_times()
    runtime = resident_runtime(model)
    try:
        generation: Generation = generate(
            runtime,
            spec.prompts,
            spec.gen_len,
            sampling=sampling or Sampling(),
            stop_token_ids=() if ignore_eos else spec.arch.eos_token_ids,
            on_step=on_step,
        )
    finally:
        bar.close()
        runtime.close()
    times_after = cpu_times()
    busy = measured_others_share(times_before, times_after)
    if busy is not None and busy > BUSY_WARNING_SHARE:
        warn(
            f"other processes took {busy:.0%} of the CPU time during the run: its timings are "
            "not comparable with a quiet run; run again on a quiet machine"
        )
    outputs = [
        {"output_token_ids": ids, "text": _decode(spec.tokenizer, ids)}
        for ids in generation.output_token_ids
    ]
    measured = Measurement(
        prefill_s=generation.prefill_s,
        decode_s=generation.decode_s,
        generated_tokens=generation.generated_tokens,
        peak_memory_bytes=peak_memory_bytes(spec.device),
        # on a CPU the one device is the CPU, busy the whole run; a GPU's queues are not timed yet
        busy_fraction={"cpu": 1.0} if spec.device == "cpu" else {},
    )
    environment = {
        **_environment(spec),
        "other_processes_cpu_share": round(busy, 3) if busy is not None else "unknown",
        "engine": runtime.engine.mode,
        "cpu_gemm": None
        if model.cpu_gemm is None
        else {**model.cpu_gemm.to_dict(), "calls": dict(model.gemm_calls)},
    }
    return RunResult(
        spec=spec,
        outputs=outputs,
        measured=measured,
        environment=environment,
        cpu_gemm=model.cpu_gemm,
    )


def load_weights(spec: RunSpec, device: str = "cpu") -> Checkpoint:
    """The run's weights: its checkpoint mapped (in its dtype, on `device`), or random ones."""
    if spec.checkpoint is None:
        return random_checkpoint(spec.arch, spec.dtype, device=device)
    return open_checkpoint(spec.checkpoint, spec.dtype, device=device)


def _decode(tokenizer, ids: list[int]) -> str | None:
    return None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def peak_rss_bytes() -> float:
    """This process's peak resident set. VmHWM, not ru_maxrss: after fork + exec, ru_maxrss also
    counts the parent's resident set at the fork."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def peak_memory_bytes(device: str | torch.device) -> dict[str, float]:
    """Peak bytes per device: this process's resident set, and on CUDA the allocator's peak."""
    peak = {"cpu": peak_rss_bytes()}
    if torch.device(device).type == "cuda":
        peak["gpu"] = float(torch.cuda.max_memory_allocated(device))
    return peak


def _environment(spec: RunSpec) -> dict[str, Any]:
    return {
        "checkpoint": str(spec.checkpoint) if spec.checkpoint else "random weights (in memory)",
        "batch_size": spec.batch_size,
        "dtype": spec.dtype,
        "device": spec.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "python": platform.python_version(),
    }
