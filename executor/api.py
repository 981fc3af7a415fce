"""What a run is, fixed before it starts: `prepare_run` turns a run's arguments into a RunSpec.

It reads only config.json, the safetensors headers, the prompts and (for text) the tokenizer, so
the planner's prediction and memory count for the run can be built before any weight is touched.
executor/run.py `execute` loads the weights, generates and measures.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from executor.checkpoint import (
    Checkpoint,
    load_tokenizer,
    open_checkpoint,
    random_checkpoint,
    read_arch,
    stored_dtype,
)
from executor.engine import engine_mode, jitter_seed
from executor.quant import compute_dtype
from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.formats import kv_dtype_problem
from hrm.policy import RUN_DTYPES
from hrm.requests import (
    API,
    Request,
    answer_length,
    answer_lengths,
    locate,
    prompt_ids,
    read_requests,
)
from hrm.workload import Workload


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything a run does, fixed before it starts: model, prompts, lengths, dtype, device."""

    checkpoint: Path | None  # None: random weights made in memory for `arch`
    arch: ModelArch
    prompts: tuple[tuple[int, ...], ...]
    gen_len: int  # the longest answer: each request's default and cap
    dtype: str  # the weights' format: a float dtype, or a compact format (hrm/formats.py)
    device: str
    kv_format: str | None = None  # a compact KV cache format (hrm/formats.py), else None
    tokenizer: Any = None  # the checkpoint's tokenizer, or None (token ids only)
    requests: tuple[Request, ...] = ()  # a request file's lines; () for random prompts

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def compute_dtype(self) -> str:
        """What the layers compute in (executor.quant.compute_dtype)."""
        return compute_dtype(self.dtype, self.device)

    @property
    def kv_dtype(self) -> str:
        """The KV cache's format, else the compute dtype it is then kept in."""
        return self.kv_format or self.compute_dtype

    def workload(self, indices: Sequence[int] | None = None) -> Workload:
        """The prompts at `indices` (default all) with each one's most new tokens, unpadded
        (prefill packs the prompts)."""
        indices = range(self.batch_size) if indices is None else indices
        return Workload.from_prompt_lens(
            [len(self.prompts[i]) for i in indices],
            self.gen_len,
            answer_lens=[self.max_new(i) for i in indices],
        )

    def max_new(self, i: int) -> int:
        """Prompt i's most new tokens: its max_tokens, capped at gen_len, else gen_len."""
        return answer_length(self.requests[i] if self.requests else None, self.gen_len)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]


def prepare_run(
    checkpoint: str | os.PathLike | None,
    *,
    random_arch: ModelArch | None = None,
    gen_len: int | None,
    prompts_path: str | os.PathLike | None = None,
    requests: Sequence[Request] | None = None,
    prompt_len: int | None = None,
    batch: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    device: str = "cpu",
) -> RunSpec:
    """Resolve a run's arguments into a RunSpec; every user error is an HrmError.

    random_arch (with checkpoint None): random weights of that architecture, made in memory.
    requests: read already (the Python API's), else from prompts_path. gen_len None: the
    largest max_tokens of the requests, each of which then needs one."""
    directory = Path(checkpoint) if checkpoint is not None else None
    arch = read_arch(directory) if directory is not None else random_arch
    if dtype is not None and dtype not in RUN_DTYPES:
        raise HrmError(f"--dtype: unknown dtype {dtype!r}; use one of {', '.join(RUN_DTYPES)}")
    dtype = dtype or (stored_dtype(directory, arch) if directory is not None else "bfloat16")
    kv_format = _kv_format(kv_dtype, dtype, device, arch)
    if gen_len is not None and gen_len < 1:
        raise HrmError(f"--gen-len must be a positive integer, got {gen_len}")
    _check_device(device)
    tokenizer = load_tokenizer(directory) if directory is not None else None
    where = directory if directory is not None else f"random {arch.name} weights"
    if requests is None and prompts_path is not None:
        requests = read_requests(Path(prompts_path))
    if requests is not None:
        source = prompts_path if prompts_path is not None else API
        gen_len = max(answer_lengths(list(requests), gen_len, source))
        ids = _request_ids(requests, tokenizer, arch, gen_len, where, source)
    else:
        if not prompt_len or prompt_len < 1 or not batch or batch < 1:
            raise HrmError("--prompt-len and --batch must both be positive integers")
        if gen_len is None:
            raise HrmError("--gen-len: give the tokens to generate for each random prompt")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, arch.vocab_size, (batch, prompt_len), generator=g).tolist()
        arch.check_positions(prompt_len, gen_len)
    return RunSpec(
        checkpoint=directory,
        arch=arch,
        prompts=tuple(tuple(p) for p in ids),
        gen_len=gen_len,
        dtype=dtype,
        device=device,
        kv_format=kv_format,
        tokenizer=tokenizer,
        requests=tuple(requests or ()),
    )


def _kv_format(kv_dtype: str | None, dtype: str, device: str, arch: ModelArch) -> str | None:
    """--kv-dtype: a compact format (checked against the head size), or the dtype the layers
    compute in (the default), in which the cache is kept."""
    computed = compute_dtype(dtype, device)
    if kv_dtype is None or kv_dtype == computed:
        return None
    problem = kv_dtype_problem(kv_dtype, computed, arch.head_dim)
    if problem:
        raise HrmError(f"--kv-dtype {kv_dtype}: {problem}")
    return kv_dtype


def _request_ids(requests, tokenizer, arch: ModelArch, gen_len: int, where, source):
    """Each request's prompt as token ids, checked against the vocabulary and, with its most
    new tokens, against the model's positions; stop strings need the tokenizer."""
    ids = [prompt_ids(r, tokenizer, where, source) for r in requests]
    stops = next((r for r in requests if r.stop), None)
    if stops is not None and tokenizer is None:
        raise HrmError(
            f"{locate(source, stops.line)}: stop strings, but {where} has no tokenizer to read "
            "the text; remove them"
        )
    _check_ids(requests, ids, arch.vocab_size, source)
    for r, p in zip(requests, ids, strict=True):
        fix = "shorten it or lower its max_tokens" + ("" if r.max_tokens else " (--gen-len)")
        arch.check_positions(
            len(p), r.max_tokens or gen_len, f"{locate(source, r.line)}: a prompt", fix
        )
    return ids


def _check_device(device: str) -> None:
    """A device this host has, and an engine mode (HRM_ENGINE) that can run on it."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise HrmError(f"--device {device}: no CUDA device is available here; use --device cpu")
    elif device != "cpu":
        raise HrmError(f"--device: unknown device {device!r}; use cpu or cuda")
    engine_mode(torch.device(device))
    jitter_seed()


def _check_ids(requests, prompts: list[list[int]], vocab_size: int, source) -> None:
    """Every prompt holds tokens of the vocabulary; a message names its request's line."""
    for r, ids in zip(requests, prompts, strict=True):
        if not ids:
            raise HrmError(f"{locate(source, r.line)}: the prompt is empty after tokenisation")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise HrmError(
                f"{locate(source, r.line)}: token id {bad} is outside the vocabulary "
                f"[0, {vocab_size})"
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


def load_weights(spec: RunSpec, device: str = "cpu") -> Checkpoint:
    """The run's weights: its checkpoint mapped (in its compute dtype, on `device`), or random
    ones (a compact format quantizes them as they are placed: executor/runtime.py)."""
    if spec.checkpoint is None:
        return random_checkpoint(spec.arch, spec.compute_dtype, device=device)
    return open_checkpoint(spec.checkpoint, spec.compute_dtype, device=device)


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
