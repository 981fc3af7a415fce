"""The one run driver: a RunSpec run under a policy and schedule, resident or planned.

A resident run (`hrm run` without a plan) is the policy that places everything on one device
(Policy.resident); a plan places the rest. Either way every pending batch of the prompts runs on
one placed runtime (executor/runtime.py), each finished batch is appended to the partial output
(executor/batching.py), and the run is measured per queue. `check_plan` refuses a plan that
cannot run these prompts before any weight is loaded.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from executor.api import RunSpec, load_weights, peak_memory_bytes
from executor.batching import PartialOutput
from executor.checkpoint import Checkpoint
from executor.generate import Limits, Sampling, generate
from executor.passes import run_passes
from executor.quant import compute_dtype
from executor.runtime import placed_runtime
from executor.tensor_parallel import random_share, shard_checkpoint
from executor.world import Share
from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.formats import kv_dtype_problem
from hrm.plan import Plan
from hrm.policy import RUN_DTYPES, Policy
from hrm.profiling import BUSY_WARNING_SHARE
from hrm.profiling.cpu import cpu_times, measured_others_share
from hrm.progress import RunProgress
from hrm.record import Measurement
from hrm.requests import answer_line
from hrm.rules.admission import Request, check_fits, kv_blocks, token_budget_limit
from hrm.rules.batches import plan_batches
from hrm.rules.cpu_gemm import CpuGemmChoice
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
    device: str = "cpu",
    max_new: list[int] | None = None,
) -> None:
    """Every reason the plan cannot run these prompts, as one HrmError, before any loading.
    max_new (continuous batching): each request's most new tokens; a request then needs only to
    fit the KV memory the plan counted (its prompt is cut into passes), not the plan's lengths.

    gpu_bytes: the device memory given (--gpu-mem) or present; host_bytes: the host's. Where the
    CPU stands in for the GPU, the host holds both sides of the plan. device: the run's (the
    dtype a compact format computes in depends on it)."""
    if not plan.geometry:
        raise HrmError(f"{where}: the plan records no model geometry; make it again with hrm plan")
    theirs, ours = dict(plan.geometry), arch.geometry()
    differ = [k for k in {**theirs, **ours} if theirs.get(k) != ours.get(k)]
    if differ:
        k = differ[0]
        raise HrmError(
            f"{where}: the plan is for another model ({k} {theirs.get(k)} in the plan, "
            f"{ours.get(k)} in {arch.name}); plan for this model with hrm plan --model"
        )
    if plan.policy.weight_dtype not in RUN_DTYPES:
        raise HrmError(
            f"{where}: weights in {plan.policy.weight_dtype} cannot be run by the executor; "
            f"plan with --dtype {' or '.join(RUN_DTYPES)}"
        )
    computed = compute_dtype(plan.policy.weight_dtype, device)
    problem = kv_dtype_problem(plan.policy.kv_dtype, computed, arch.head_dim)
    if problem:
        raise HrmError(f"{where}: {problem}; plan with another --kv-dtype")
    longest, limit = max(prompt_lens), plan.workload.prompt_len_max
    if max_new is not None:
        lives = [
            Request(i, n, g) for i, (n, g) in enumerate(zip(prompt_lens, max_new, strict=True))
        ]
        check_fits(lives, kv_blocks(plan.policy.batch_size, plan.workload.max_context_len))
    elif longest > limit:
        raise HrmError(
            f"a prompt has {longest} tokens, longer than the plan's maximum of {limit}; "
            "plan with --max-prompt-len covering the longest prompt"
        )
    if max_new is None and gen_len > plan.workload.gen_len:  # --gen-len, or the max_tokens
        raise HrmError(
            f"{where}: the run asks for up to {gen_len} new tokens a prompt (its --gen-len, or "
            f"its requests' largest max_tokens), more than the plan's {plan.workload.gen_len} "
            f"that its KV cache is sized for; plan with --gen-len {gen_len}, or ask for fewer"
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
class RunResult:
    outputs: dict[int, dict[str, Any]]  # input index -> output line, of the batches run now
    measured: Measurement
    batches: list[tuple[int, ...]]  # input indices of each batch that ran, for the prediction
    environment: dict[str, Any]
    cpu_gemm: CpuGemmChoice | None  # the GEMM path the layers took on a CPU, else None
    # a data-parallel run's batches by group (executor/world.py combined), which ran side by side
    groups: list[list[tuple[int, ...]]] | None = None


def execute(
    spec: RunSpec,
    policy: Policy,
    schedule: str,
    *,
    checkpoint: Checkpoint | None = None,
    cpu_gemm: CpuGemmChoice | Callable[[Checkpoint], CpuGemmChoice] | None = None,
    staged: bool = False,
    partial: PartialOutput | None = None,
    sampling: Sampling | None = None,
    stop_token_ids=(),
    quiet: bool = False,
    on_batch: Callable[[list[int], list[dict[str, Any]]], None] | None = None,
    warn: Callable[[str], None] = lambda message: None,
    share: Share | None = None,
    batching: str = "static",
    token_budget: int | None = None,
    kv_context: int | None = None,
    max_running: int | None = None,
    disk: tuple[str, bool] | None = None,
    cpu_moe: str = "loop",
) -> RunResult:
    """Run every pending batch of `spec`'s prompts under `policy` and `schedule` on its device.

    checkpoint: weights loaded already (tests, benches), else they are loaded here for this run
    alone (onto a GPU that holds everything, else into host memory) and released from the host
    as they are placed. cpu_gemm: the GEMM path where the layers run on the CPU, or a function of
    the opened checkpoint that chooses it (so a broken checkpoint fails before a probe, which
    times its weights). staged: weights cross the link through a pinned staging ring (the plan's
    "weight staging"). on_batch(indices, rows) hears each finished batch; `warn` hears when other
    processes took enough of the CPU that the measurement is not comparable. share: this
    process's batches and share of each layer in a run torchrun started (executor/world.py).
    batching: "static" (batches of N, each to its longest answer) or "continuous"
    (executor/passes.py, at most token_budget tokens a pass and max_running requests at once
    (default N), KV for N sequences of kv_context). disk: (directory, O_DIRECT) of the disk
    tier's file where the policy keeps weights on disk (default: the temp directory, O_DIRECT).
    cpu_moe: how a packed CPU model runs its routed experts (MoEModel)."""
    share = share or Share()
    continuous = batching == "continuous"
    runtime = _placed(spec, policy, schedule, checkpoint, cpu_gemm, staged, quiet, share,
                      continuous, disk, cpu_moe)  # fmt: skip
    if runtime.store is not None and runtime.store.disk is not None and not quiet:
        print(f"hrm: {runtime.store.disk.describe()}", file=sys.stderr)
    job = _Job(spec=spec, policy=policy, schedule=schedule, runtime=runtime, partial=partial,
               sampling=sampling or Sampling(), stop_token_ids=stop_token_ids, quiet=quiet,
               on_batch=on_batch, share=share, weights=_weights_held(runtime.store))  # fmt: skip
    times_before, start = cpu_times(), time.perf_counter()
    try:
        limits = (token_budget, kv_context, max_running or policy.batch_size)
        ran = _continuous(job, *limits) if continuous else _static(job)
    finally:
        runtime.close()
    wall = time.perf_counter() - start
    others = _others_share(times_before, warn)
    busy = runtime.engine.busy_seconds()
    environment = {
        **_environment(spec, policy, schedule, runtime, wall, busy),
        **job.weights,
        **ran.environment,
        "other_processes_cpu_share": round(others, 3) if others is not None else "unknown",
    }
    return RunResult(
        outputs=ran.done,
        measured=_measurement(runtime, torch.device(spec.device), busy, ran.totals, ran.peaks),
        batches=ran.batches,
        environment=environment,
        cpu_gemm=runtime.model.cpu_gemm,
    )


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What both batchings run with: the run, where it writes, and who hears of each answer."""

    spec: RunSpec
    policy: Policy
    schedule: str
    runtime: Any
    partial: PartialOutput | None
    sampling: Sampling
    stop_token_ids: Any
    quiet: bool
    on_batch: Callable[[list[int], list[dict[str, Any]]], None] | None
    share: Share
    weights: dict[str, bool]

    def answered(self, indices: list[int], rows: list[dict[str, Any]]) -> None:
        """Finished answers: to the partial output (whole on disk first), then to on_batch."""
        if self.partial is not None:
            self.partial.append(indices, rows)
        if self.on_batch is not None:
            self.on_batch(indices, rows)


@dataclass(frozen=True, kw_only=True)
class _Ran:
    done: dict[int, dict[str, Any]]  # input index -> output line, of what ran now
    totals: dict[str, float]  # prefill_s, decode_s, generated_tokens
    peaks: dict[str, dict[str, float]]  # the buffers' peak bytes by device
    batches: list[tuple[int, ...]]  # the static batches that ran (none: continuous)
    environment: dict[str, Any]


def _static(job: _Job) -> _Ran:
    """Every pending batch of N to its longest answer, each batch's answers written as it ends."""
    spec, policy, runtime = job.spec, job.policy, job.runtime
    batches = plan_batches(spec.prompt_lens, policy.batch_size, policy.micro_batch_size)
    batches = batches[job.share.group :: job.share.groups]
    pending = job.partial.pending(batches) if job.partial is not None else batches
    done: dict[int, dict[str, Any]] = {}
    totals = {"prefill_s": 0.0, "decode_s": 0.0, "generated_tokens": 0}
    peaks: dict[str, dict[str, float]] = {"gpu": {}, "cpu": {}}
    budget = [sum(spec.max_new(i) for i in b.indices) for b in pending]  # tokens at most
    bar = RunProgress(tokens=sum(budget), requests=sum(len(b.indices) for b in pending),
                      quiet=job.quiet)  # fmt: skip
    created = int(time.time())
    try:
        for batch, most in zip(pending, budget, strict=True):

            def step(phase: str, tokens: int) -> None:
                bar.step(phase, tokens)
                if phase == "prefill":  # the batch's buffers whole, before any row retires
                    _keep_peaks(peaks, runtime.allocated_bytes())

            gen = _generate_batch(spec, runtime, batch, job.sampling, job.stop_token_ids, step)
            bar.batch_done(len(batch.indices), most)
            answers = zip(batch.indices, gen.output_token_ids, gen.finish_reasons, strict=True)
            rows = [_output(spec, i, ids, reason, created) for i, ids, reason in answers]
            job.answered(list(batch.indices), rows)
            done.update(zip(batch.indices, rows, strict=True))
            for key in totals:
                totals[key] += getattr(gen, key)
    finally:
        bar.close()
    environment = {"batches_run": len(pending), "batches_resumed": len(batches) - len(pending)}
    return _Ran(done=done, totals=totals, peaks=peaks, batches=[b.indices for b in pending],
                environment=environment)  # fmt: skip


def _continuous(job: _Job, token_budget: int | None, kv_context: int | None,
                max_running: int) -> _Ran:  # fmt: skip
    """The requests not done yet (a data-parallel group's every groups-th), in input order,
    through continuous passes (executor/passes.py); each answer written as it ends. The KV
    blocks are what a static batch of N books at `kv_context` tokens a sequence (the plan's
    longest prompt and generation; default: the run's)."""
    spec, policy = job.spec, job.policy
    mine = list(range(len(spec.prompts)))[job.share.group :: job.share.groups]
    pending = [i for i in mine if job.partial is None or i not in job.partial.done]
    limits = {i: _limits(spec, i, job.sampling) for i in pending}
    done: dict[int, dict[str, Any]] = {}
    bar = RunProgress(tokens=sum(lim.max_new for lim in limits.values()),
                      requests=len(pending), quiet=job.quiet)  # fmt: skip
    created = int(time.time())

    def finish(i: int, ids: list[int], reason: str) -> None:
        done[i] = _output(spec, i, ids, reason, created)
        job.answered([i], [done[i]])
        bar.request_done(len(ids), limits[i].max_new)

    longest = max(spec.prompt_lens)
    budget = token_budget or token_budget_limit(max_running, policy.micro_batch_size, longest)
    context = kv_context or longest + max(map(spec.max_new, mine), default=1)
    blocks = kv_blocks(policy.batch_size, context)
    try:
        stats = run_passes(
            job.runtime, {i: spec.prompts[i] for i in pending}, limits,
            max_running=max_running, token_budget=budget, total_blocks=blocks,
            stop_token_ids=job.stop_token_ids, decode=_decoder(spec), on_finish=finish,
            on_pass=lambda sampled: bar.step("pass", sampled),
        )  # fmt: skip
    finally:
        bar.close()
    totals = {"prefill_s": stats.prefill_s, "decode_s": stats.decode_s,
              "generated_tokens": bar.made}  # fmt: skip
    environment = {"batching": "continuous", "continuous": stats.summary(), "batches_run": 0,
                   "batches_resumed": len(mine) - len(pending), "token_budget": budget,
                   "kv_context": context, "max_running": max_running}  # fmt: skip
    peaks = job.runtime.allocated_bytes()
    return _Ran(done=done, totals=totals, peaks=peaks, batches=[], environment=environment)


def _generate_batch(spec: RunSpec, runtime, batch, sampling, stop_token_ids, on_step):
    """One batch to its longest answer, each prompt with its own limits; on_step(phase,
    tokens) after each step."""
    return generate(
        runtime,
        [spec.prompts[i] for i in batch.indices],
        max(spec.max_new(i) for i in batch.indices),
        limits=[_limits(spec, i, sampling or Sampling()) for i in batch.indices],
        stop_token_ids=stop_token_ids,
        decode=_decoder(spec),
        micro_batch_sizes=batch.micro_batch_sizes,
        on_step=on_step,
    )


def _placed(spec: RunSpec, policy: Policy, schedule: str, checkpoint, cpu_gemm, staged, quiet,
            share: Share, continuous: bool = False, disk=None, cpu_moe: str = "loop"):  # fmt: skip
    """The run's runtime: its weights loaded for it unless given (onto a GPU that holds
    everything, else into host memory, the store taking them over as it places them), this
    rank's share of them where it runs tensor-parallel, the CPU GEMM path chosen once they have
    opened."""
    device = torch.device(spec.device)
    take_over = checkpoint is None
    on = spec.device if policy.all_on_gpu and device.type == "cuda" else "cpu"
    if checkpoint is None and spec.checkpoint is None and share.tp > 1:
        checkpoint = random_share(spec.arch, share.tp_rank, share.tp, spec.compute_dtype, on)
    else:
        checkpoint = checkpoint if checkpoint is not None else load_weights(spec, on)
        checkpoint = shard_checkpoint(checkpoint, share.tp_rank, share.tp)
    if callable(cpu_gemm):
        cpu_gemm = cpu_gemm(checkpoint) if device.type == "cpu" else None
    return placed_runtime(
        checkpoint, policy, schedule, device, cpu_gemm, staged=staged, take_over=take_over,
        quiet=quiet, collectives=(share.reduce, share.gather), continuous=continuous,
        disk=disk, cpu_moe=cpu_moe,
    )  # fmt: skip


def _limits(spec: RunSpec, i: int, run: Sampling) -> Limits:
    """Prompt i's own length, sampling and stop strings: its request's where it gives them,
    else the run's, its seed the run's plus i (so that a prompt's draws do not depend on the
    batch it runs in)."""
    r = spec.requests[i] if spec.requests else None
    sampling = Sampling(
        temperature=run.temperature if r is None or r.temperature is None else r.temperature,
        top_p=run.top_p if r is None or r.top_p is None else r.top_p,
        seed=run.seed + i if r is None or r.seed is None else r.seed,
    )
    return Limits(max_new=spec.max_new(i), sampling=sampling, stop=r.stop if r else ())


def _decoder(spec: RunSpec) -> Callable[[list[int]], str] | None:
    if spec.tokenizer is None:
        return None
    return lambda ids: spec.tokenizer.decode(ids, skip_special_tokens=True)


def _output(spec: RunSpec, i: int, ids: list[int], reason: str, created: int) -> dict[str, Any]:
    """Prompt i's output line: OpenAI's batch answer for an OpenAI request (its token ids in it
    where there is no text), else the generated ids and (with a tokenizer) their text, why it
    stopped and its token counts. The text ends before the first stop string it holds."""
    r = spec.requests[i] if spec.requests else None
    text = None if spec.tokenizer is None else spec.tokenizer.decode(ids, skip_special_tokens=True)
    if text is not None and r is not None and r.stop:
        cut = min((text.find(s) for s in r.stop if s in text), default=len(text))
        text = text[:cut]
    if r is not None and r.openai:
        name = spec.checkpoint.name if spec.checkpoint else spec.arch.name
        return answer_line(r, i, text=text, token_ids=ids, prompt_token_ids=spec.prompts[i],
                           finish_reason=reason, model=name, created=created)  # fmt: skip
    counts = {"prompt_tokens": len(spec.prompts[i]), "completion_tokens": len(ids)}
    return {"output_token_ids": ids, "text": text, "finish_reason": reason, **counts}


def _keep_peaks(peaks: dict[str, dict[str, float]], now: dict[str, dict[str, float]]) -> None:
    for side, parts in now.items():
        for name, nbytes in parts.items():
            peaks[side][name] = max(peaks[side].get(name, 0.0), nbytes)


def _others_share(times_before, warn) -> float | None:
    """Other processes' share of the CPU time since `times_before`, warned of past
    BUSY_WARNING_SHARE."""
    busy = measured_others_share(times_before, cpu_times())
    if busy is not None and busy > BUSY_WARNING_SHARE:
        warn(
            f"other processes took {busy:.0%} of the CPU time during the run: its timings are "
            "not comparable with a quiet run; run again on a quiet machine"
        )
    return busy


def _weights_held(store) -> dict[str, bool]:
    return {
        "pinned_weights": bool(store is not None and store.pinned),
        "staged_weights": bool(store is not None and store.staged),
    }


def _measurement(runtime, device, busy, totals, peak_buffers) -> Measurement:
    """The run's times, each queue's busy share, the bytes each way and the buffers' peaks."""
    stats = runtime.engine.stats
    total = totals["prefill_s"] + totals["decode_s"]
    return Measurement(
        **totals,
        busy_fraction={q: (s / total if total else 0.0) for q, s in busy.items()},
        peak_memory_bytes=peak_memory_bytes(device),
        link_bytes={"h2d": float(stats["h2d"].nbytes), "d2h": float(stats["d2h"].nbytes)}
        | ({"disk": float(stats["disk"].nbytes)} if stats["disk"].tasks else {}),
        buffer_bytes=peak_buffers,
    )


def _environment(spec: RunSpec, policy: Policy, schedule, runtime, wall, busy) -> dict[str, Any]:
    """How the run ran: what, where, under which schedule and engine, in what time, which GEMMs."""
    cpu_gemm = runtime.model.cpu_gemm
    device = torch.device(spec.device)
    return {
        "checkpoint": str(spec.checkpoint) if spec.checkpoint else "random weights (in memory)",
        "batch_size": policy.batch_size,
        "prompts": spec.batch_size,
        "dtype": spec.dtype,
        "compute_dtype": spec.compute_dtype,
        "kv_dtype": policy.kv_dtype,
        "schedule": schedule,
        "device": str(device),
        "stand_in": device.type == "cpu" and policy.ffn_on_gpu,
        "engine": runtime.engine.mode,
        "wall_s": wall,
        "busy_s": busy,
        "cpu_gemm": None
        if cpu_gemm is None
        else {**cpu_gemm.to_dict(), "calls": dict(runtime.model.gemm_calls)},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "python": platform.python_version(),
    }
