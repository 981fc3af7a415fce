"""`hrm run --plan`: check a plan against the run before any weight is loaded, then run every
batch of the prompts under it with one placed runtime, appending finished batches to the partial
output, and measure each queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from executor.api import peak_memory_bytes
from executor.batching import PartialOutput, plan_batches
from executor.checkpoint import TORCH_DTYPES, Checkpoint
from executor.generate import Sampling, generate
from executor.runtime import placed_runtime
from hrm.arch import ModelArch
from hrm.cpu_gemm import CpuGemmChoice
from hrm.errors import HrmError
from hrm.plan import Plan
from hrm.progress import progress_bar
from hrm.record import Measurement
from hrm.units import format_bytes


def check_plan(
    plan: Plan,
    arch: ModelArch,
    prompt_lens: list[int],
    gen_len: int,
    *,
    where: str,
    gpu_bytes: float | None,
    host_bytes: float,
    stand_in: bool,
) -> None:
    """Every reason the plan cannot run these prompts, as one HrmError, before any loading.

    gpu_bytes: the device memory given (--gpu-mem) or present; host_bytes: the host's. Where the
    CPU stands in for the GPU, the host holds both sides of the plan."""
    if not plan.geometry:
        raise HrmError(f"{where}: the plan records no model geometry; make it again with hrm plan")
    theirs, ours = dict(plan.geometry), arch.geometry()
    differ = [k for k in ours if theirs.get(k) != ours[k]]
    if differ:
        k = differ[0]
        raise HrmError(
            f"{where}: the plan is for another model ({k} {theirs.get(k)} in the plan, "
            f"{ours[k]} in {arch.name}); plan for this model with hrm plan --model"
        )
    if plan.policy.weight_dtype not in TORCH_DTYPES:
        raise HrmError(
            f"{where}: weights in {plan.policy.weight_dtype} cannot be run by the executor; "
            f"plan with --dtype {' or '.join(TORCH_DTYPES)}"
        )
    longest, limit = max(prompt_lens), plan.workload.prompt_len_max
    if longest > limit:
        raise HrmError(
            f"a prompt has {longest} tokens, longer than the plan's maximum of {limit}; "
            "plan with --max-prompt-len covering the longest prompt"
        )
    if gen_len > plan.workload.gen_len:
        raise HrmError(
            f"--gen-len {gen_len} exceeds the plan's {plan.workload.gen_len}: its KV cache is "
            "sized for that; plan with the --gen-len of the run"
        )
    arch.check_positions(longest, gen_len)
    gpu, cpu = plan.memory.gpu_bytes, plan.memory.cpu_bytes
    if gpu_bytes is not None and not stand_in and gpu > gpu_bytes:
        raise HrmError(
            f"{where}: the plan needs {format_bytes(gpu)} of GPU memory, {format_bytes(gpu_bytes)}"
            " is there; plan with --gpu-mem for this GPU"
        )
    need = cpu + (gpu if stand_in else 0.0)
    if need > host_bytes:
        what = "CPU and stand-in GPU" if stand_in else "CPU"
        raise HrmError(
            f"{where}: the plan needs {format_bytes(need)} of {what} memory, this host has "
            f"{format_bytes(host_bytes)}; plan with --cpu-mem for this host"
        )


@dataclass(frozen=True, kw_only=True)
class PlanRun:
    outputs: dict[int, dict[str, Any]]  # input index -> output line, of the batches run now
    measured: Measurement
    batches: list[list[int]]  # prompt lengths of each batch that ran, for the prediction
    environment: dict[str, Any]


def execute_plan(
    checkpoint: Checkpoint,
    plan: Plan,
    prompts: tuple[tuple[int, ...], ...],
    gen_len: int,
    *,
    device: torch.device,
    partial: PartialOutput | None,
    decode_text: Callable[[list[int]], str | None],
    cpu_gemm: CpuGemmChoice | None = None,
    sampling: Sampling | None = None,
    stop_token_ids=(),
    quiet: bool = False,
    on_batch: Callable[[list[int], list[dict[str, Any]]], None] | None = None,
    take_over: bool = False,
) -> PlanRun:
    """Run every pending batch of `prompts` under `plan` on `device`; on_batch(indices, rows)
    hears each finished batch; take_over: the checkpoint was loaded for this run alone, and
    its layers are released once placed (executor/weight_store.py)."""
    policy = plan.policy
    staged = plan.memory.cpu.get("weight staging", 0.0) > 0
    runtime = placed_runtime(
        checkpoint, policy, plan.schedule, device, cpu_gemm, staged=staged, take_over=take_over
    )
    weights = _weights_held(runtime.store)  # read now: closing unpins them
    batches = plan_batches([len(p) for p in prompts], policy.batch_size, policy.micro_batch_size)
    pending = partial.pending(batches) if partial is not None else batches
    done: dict[int, dict[str, Any]] = {}
    prefill_s = decode_s = 0.0
    tokens = 0
    peak_buffers: dict[str, dict[str, float]] = {"gpu": {}, "cpu": {}}
    bar = progress_bar(total=len(pending), desc="batches", quiet=quiet)
    start = time.perf_counter()
    try:
        for batch in pending:
            gen = generate(
                runtime,
                [prompts[i] for i in batch.indices],
                gen_len,
                sampling=sampling or Sampling(),
                stop_token_ids=stop_token_ids,
                micro_batch_sizes=batch.micro_batch_sizes,
            )
            rows = [
                {"output_token_ids": ids, "text": decode_text(ids)} for ids in gen.output_token_ids
            ]
            if partial is not None:
                partial.append(batch.indices, rows)
            if on_batch is not None:
                on_batch(batch.indices, rows)
            done.update(zip(batch.indices, rows, strict=True))
            prefill_s, decode_s = prefill_s + gen.prefill_s, decode_s + gen.decode_s
            tokens += gen.generated_tokens
            for side, parts in runtime.allocated_bytes().items():
                for name, nbytes in parts.items():
                    peak_buffers[side][name] = max(peak_buffers[side].get(name, 0.0), nbytes)
            bar.update()
    finally:
        bar.close()
        runtime.close()
    wall = time.perf_counter() - start
    busy = runtime.engine.busy_seconds()
    measured = _measurement(runtime, device, busy, prefill_s, decode_s, tokens, peak_buffers)
    environment = (
        _environment(plan, device, runtime, wall, busy)
        | weights
        | {
            "batches_run": len(pending),
            "batches_resumed": len(batches) - len(pending),
        }
    )
    return PlanRun(
        outputs=done,
        measured=measured,
        batches=[[len(prompts[i]) for i in b.indices] for b in pending],
        environment=environment,
    )


def _weights_held(store) -> dict[str, bool]:
    return {
        "pinned_weights": bool(store is not None and store.pinned),
        "staged_weights": bool(store is not None and store.staged),
    }


def _measurement(runtime, device, busy, prefill_s, decode_s, tokens, peak_buffers) -> Measurement:
    """The run's times, each queue's busy share, the bytes each way and the buffers' peaks."""
    stats, total = runtime.engine.stats, prefill_s + decode_s
    return Measurement(
        prefill_s=prefill_s,
        decode_s=decode_s,
        generated_tokens=tokens,
        busy_fraction={q: (s / total if total else 0.0) for q, s in busy.items()},
        peak_memory_bytes=peak_memory_bytes(device),
        link_bytes={"h2d": float(stats["h2d"].nbytes), "d2h": float(stats["d2h"].nbytes)},
        buffer_bytes=peak_buffers,
    )


def _environment(plan: Plan, device: torch.device, runtime, wall: float, busy) -> dict[str, Any]:
    """How the run ran: schedule, device, engine mode, time, GEMMs."""
    cpu_gemm = runtime.model.cpu_gemm
    return {
        "schedule": plan.schedule,
        "device": str(device),
        "stand_in": device.type == "cpu" and plan.policy.ffn_on_gpu,
        "engine": runtime.engine.mode,
        "wall_s": wall,
        "busy_s": busy,
        "cpu_gemm": None
        if cpu_gemm is None
        else {**cpu_gemm.to_dict(), "calls": dict(runtime.model.gemm_calls)},
    }
