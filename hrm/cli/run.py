"""`hrm run`: generate with a real checkpoint and report measured prefill/decode time.

This module parses the arguments; hrm/cli/run_plan.py settles the job (resident, or under a
plan); the one run driver (executor/run.py) runs it, batch by batch into OUTPUT.partial (so
`--resume` picks up a killed run) or onto stdout in input order; hrm/cli/records.py joins the
planner's prediction for the same run to the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

from hrm.cli.run_arguments import add_prompt_arguments, add_run_arguments
from hrm.plan import SCHEDULES

BATCHINGS = ("static", "continuous")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="generate with a local MoE checkpoint (or random weights) and measure throughput",
        description="Run batched generation on a local checkpoint directory (config.json + "
        "safetensors) and report measured prefill and decode time and throughput.",
    )
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="checkpoint directory")
    weights.add_argument(
        "--model",
        help="bundled model name or config.json: with --random-weights, its real architecture",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights made in memory for --model (speed runs; nothing is downloaded)",
    )
    p.add_argument("--layers", type=int, help="with --random-weights: keep this many layers")
    p.add_argument("--plan", help="run this plan (hrm plan -o plan.json): placement and schedule")
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="with --hardware: plan for this schedule, then run the best plan (cgopipe)",
    )
    p.add_argument("--gpu-mem", help="with --hardware: GPU memory to plan for, e.g. '16 GB'")
    p.add_argument("--cpu-mem", help="with --hardware: CPU memory to plan for, e.g. '64 GB'")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUTPUT.partial, skipping the batches already done (needs --output)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, discarding an OUTPUT.partial a killed run left (needs --output)",
    )
    add_prompt_arguments(p)
    add_run_arguments(p, BATCHINGS)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    def warn(message: str) -> None:
        print(f"hrm run: {message}", file=sys.stderr)

    job, result = run_job(args, warn)
    if result is None:  # a data-parallel rank other than 0: rank 0 reports the job
        return 0
    from hrm.cli.records import format_summary, run_record

    record = run_record(
        job.spec, result, policy=job.policy, schedule=job.schedule, profile=job.profile,
        plan=job.plan,
    )  # fmt: skip
    _note_unpriced_fusion(record, job.profile, warn)
    if args.json:
        print(json.dumps(record.to_dict(), indent=2))
        return 0
    print(format_summary(record), file=sys.stderr)
    return 0


def _note_unpriced_fusion(record, profile, warn) -> None:
    """A fused run predicted by a profile without the kernel's curves is priced as the loop
    (planner/op_time.py), slower than it ran by the kernel's gain: say so, and how to mend it."""
    gemm = record.environment.get("cpu_gemm") or {}
    if record.predicted is None or gemm.get("experts") != "fused":
        return
    from hrm.rules.cpu_moe import fused_timed

    if not fused_timed(profile.cpu, gemm["dtype"]):
        warn(f"note: {profile.name} has no curves of the fused experts, so they are predicted "
             "at the loop's speed; hrm profile on this host times them")  # fmt: skip


def run_job(args: argparse.Namespace, warn):
    """(job, result) of `hrm run ARGS`: the job settled before any weight is loaded, then run by
    the one run driver into OUTPUT (resumable) or, with no --output, onto stdout in input order
    (not with --json, nor from the Python API, which sets args.requests: hrm.api.generate).
    Started by torchrun, each data-parallel group runs its share of the batches and rank 0
    writes the output and returns the job's result; the other ranks return None
    (executor/world.py)."""
    from executor.batching import run_digest
    from executor.world import join, world_from_env
    from hrm.cli.run_plan import settle_job
    from hrm.hardware import resolve_hardware

    planner_args = _check_flags(args)
    random_arch = _random_arch(args)
    output = _output_path(args)
    hardware = resolve_hardware(args.hardware) if args.hardware else None
    notes: list[str] = []  # said once the job is sure to run: bad input gets its one line alone
    job = settle_job(args, hardware, random_arch, planner_args, notes.append)
    _check_batching(args, job)
    tp = job.plan.tensor_parallel if job.plan is not None else 1
    if tp > 1 and "WORLD_SIZE" not in os.environ:
        _launch(args, tp)  # one machine's ranks, started by torch's launcher
    world = world_from_env(tp)
    # one digest whatever the world size, so that any world resumes any world's partial files
    digest = run_digest(job.spec.prompts, _settings(args, job))
    if job.plan is None and world.data_parallel > 1:  # a resident run's prompts, a batch a group
        n = -(-len(job.spec.prompts) // world.data_parallel)
        p = job.policy
        job = dataclasses.replace(job, policy=dataclasses.replace(p, batch_size=n,
                                                                  micro_batch_size=n))  # fmt: skip
    if world.distributed:
        world = join(world, job.spec.device, digest)
    lock = None
    try:
        lock = _lock(output, world)
        partial = _partial(args, output, digest, world)
        for note in notes:
            warn(note)
        result = _run_shard(args, job, hardware, partial, warn, world)
    finally:
        if lock is not None:
            lock.release()
        world.close()
    return job, result


def _output_path(args):
    """--output, checked before anything runs: writable, none of the run's inputs, and not a
    finished output unless --overwrite (or --resume of the run that is finishing it)."""
    from executor.output_files import check_not_an_input, partial_files
    from hrm.errors import HrmError
    from hrm.io import check_writable

    if not args.output:
        return None
    output = check_writable(args.output)
    inputs = {"--prompts": args.prompts, "--plan": args.plan, "--hardware": args.hardware}
    check_not_an_input(output, inputs)
    if output.exists() and not args.overwrite and not (args.resume and partial_files(output)):
        raise HrmError(
            f"{output} holds the answers of a finished run: add --overwrite to replace them, or "
            "choose another --output"
        )
    return output


def _lock(output, world):
    """The lock on OUT that rank 0 holds for the run (executor/output_files.py), taken before
    any partial file is read, so that a second run into OUT stops at once on every rank."""
    from executor.output_files import OutputLock
    from hrm.errors import HrmError

    if output is None:
        return None
    lock, problem = None, None
    if world.rank == 0:
        try:
            lock = OutputLock(output)
        except HrmError as exc:
            problem = str(exc)
    world.agree(problem)
    return lock


def _launch(args, tp: int) -> None:
    """Start this very command as tp ranks on this machine (torchrun --standalone) and exit
    with their status; the Python API, which cannot be started again, is refused."""
    import subprocess
    import sys

    from hrm.errors import HrmError

    if getattr(args, "requests", None) is not None:
        raise HrmError(
            f"the plan shards the layers over {tp} processes (tensor_parallel {tp}); run it "
            f"with hrm run, or torchrun --nproc-per-node {tp} -m hrm run"
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp}", "-m", "hrm", *args.argv]  # fmt: skip
    threads = str(args.threads or max(1, (os.cpu_count() or 1) // tp))  # each its share
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


def _partial(args, output, digest, world):
    """This rank's partial output: its data-parallel group's file, which the group's first rank
    opens (resuming it or not) and the group's other ranks follow (FollowerPartial); None
    without --output. A problem any rank meets stops every rank."""
    from executor.batching import PartialOutput
    from executor.world import FollowerPartial
    from hrm.errors import HrmError

    if output is None:
        return None
    partial, problem = None, None
    if world.leads_group:
        part = world.group if world.data_parallel > 1 else None
        try:
            partial = PartialOutput(
                output,
                digest,
                resume=args.resume,
                overwrite=args.overwrite,
                part=part,
                batching=args.batching,
            )
        except HrmError as exc:
            problem = str(exc)
    world.agree(problem)
    done = world.share_in_group(list(partial.done) if partial is not None else None)
    return partial if world.leads_group else FollowerPartial(done)


def _run_shard(args, job, hardware, partial, warn, world):
    """This process's batches; a world of one finishes its output itself, a data-parallel rank
    hands its rows to rank 0 (_gathered)."""
    try:
        result = _execute(args, job, hardware, partial, warn, world)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (hrm.cli.Terminated)
        saved = partial.saved() if partial is not None else 0
        if not saved:
            raise
        raise type(exc)(
            f"{saved} of {len(job.spec.prompts)} outputs are in {partial.path}: run the "
            "same command with --resume to go on"
        ) from None
    result.environment.update(
        all_reduces=world.reduces["count"], all_reduce_s=world.reduces["seconds"]
    )
    if world.distributed:
        return _gathered(args, job, result, partial, world)
    if partial is not None:
        partial.finish(len(job.spec.prompts))
    return result


def _gathered(args, job, result, partial, world):
    """Every group's rows (resumed and run now) and results at rank 0, which writes the output
    once in input order and returns the combined result; each group then removes its partial
    file. None on the other ranks."""
    import sys

    from executor.batching import in_input_order
    from executor.output_files import partial_files
    from executor.world import combined
    from hrm.io import atomic_write_text

    rows = partial.done if partial is not None else result.outputs
    pieces = world.gather((rows, result))
    if pieces is not None:  # a tensor-parallel group's rows: its first rank's
        done = {i: row for r, _ in pieces[:: world.tensor_parallel] for i, row in r.items()}
        text = in_input_order(done, len(job.spec.prompts))
        if partial is not None:
            atomic_write_text(partial.output, text)
        elif not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()
    world.barrier()  # the output is whole before any partial file goes
    if partial is not None and partial.path is not None:
        partial.path.unlink(missing_ok=True)
    if pieces is not None and partial is not None:  # and those another world size left
        for path in partial_files(partial.output):
            path.unlink(missing_ok=True)
    return combined([r for _, r in pieces], world) if pieces is not None else None


def _settings(args, job) -> dict:
    """What a resumed run must share with the run it continues, beside its prompts: not the
    world size, since every world cuts the batches by one rule."""
    return {
        "plan": {"policy": job.policy.to_dict(), "schedule": job.schedule},
        "geometry": job.spec.arch.geometry(),
        "gen_len": job.spec.gen_len,
        "dtype": job.spec.dtype,
        "sampling": [args.temperature, args.top_p, args.seed],
        "requests": [
            # return_token_ids only where asked: partial files of earlier versions still resume
            [r.max_tokens, r.temperature, r.top_p, r.seed, list(r.stop), r.custom_id]
            + ([True] if r.return_token_ids else [])
            for r in job.spec.requests
        ],
        "ignore_eos": args.ignore_eos,
    } | ({"batching": "continuous"} if args.batching == "continuous" else {})


def _execute(args, job, hardware, partial, warn, world):
    """Run the job with the one run driver: the CPU GEMM path chosen once the checkpoint has
    opened, at the run's own thread count (from a CPU-only --hardware profile of this host, or a
    probe), each finished batch written to stdout in input order when there is no --output."""
    import sys

    from executor.api import torch_threads
    from executor.batching import InOrder
    from executor.generate import Sampling
    from executor.run import execute
    from hrm.profiling.host_gemm import cpu_gemm_chooser

    spec = job.spec
    to_stdout = partial is None and not args.json and getattr(args, "requests", None) is None
    to_stdout = to_stdout and not world.distributed  # rank 0 writes a data-parallel run's
    stream = InOrder(sys.stdout) if to_stdout else None
    if args.cpu_moe == "fused":  # the model's and host's part, before a probe speaks
        from executor.fused_moe import require

        require(spec.arch, spec.compute_dtype)
    choose = cpu_gemm_chooser(
        spec.arch,
        spec.compute_dtype,
        mode=args.cpu_gemm,
        hardware=hardware if hardware is not None and not hardware.has_gpu else None,
        warn=warn,
    )

    with torch_threads(args.threads):
        return execute(
            spec,
            job.policy,
            job.schedule,
            cpu_gemm=choose,
            cpu_moe=args.cpu_moe,
            staged=job.staged,
            disk=(job.disk_dir or tempfile.gettempdir(), not args.disk_buffered),
            partial=partial,
            sampling=Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
            stop_token_ids=() if args.ignore_eos else spec.arch.eos_token_ids,
            quiet=args.quiet,
            on_batch=stream.add if stream is not None else None,
            # other processes' share of the CPU: a rank's siblings are among them
            warn=(lambda m: None) if world.distributed else lambda m: warn(f"warning: {m}"),
            share=world.share(),
            batching=args.batching,
            token_budget=args.max_tokens_per_pass,
            kv_context=job.plan.workload.max_context_len if job.plan else None,
            max_running=_max_running(job),
        )


def _max_running(job) -> int:
    """Requests running at once: the plan's continuous limit (hrm plan --batching continuous),
    else N."""
    c = job.plan.continuous if job.plan is not None else None
    return c.max_running if c is not None else job.policy.batch_size


def _check_flags(args) -> list[str]:
    """Flags that contradict each other or lack their partner, refused one line at a time;
    returns the planning flags given (gpu_mem, cpu_mem, schedule)."""
    from hrm.errors import HrmError
    from hrm.rules.cpu_gemm import MODES
    from hrm.rules.cpu_moe import check_mode as check_cpu_moe

    if args.prompt_len is not None and args.batch is None:
        raise HrmError("--prompt-len needs --batch (the number of random prompts)")
    if args.prompts is not None and args.batch is not None:
        raise HrmError("--batch goes with --prompt-len; a --prompts file sets its own batch")
    if args.cpu_gemm not in MODES:
        raise HrmError(f"--cpu-gemm: unknown path {args.cpu_gemm!r}; use one of {', '.join(MODES)}")
    check_cpu_moe(args.cpu_moe)
    if args.threads is not None and args.threads < 1:
        raise HrmError(f"--threads must be at least 1, got {args.threads}")
    if args.resume and not args.output:
        raise HrmError("--resume continues OUTPUT.partial: give --output OUTPUT")
    if args.overwrite and not args.output:
        raise HrmError("--overwrite discards OUTPUT.partial: give --output OUTPUT")
    if args.json and not args.output:
        raise HrmError(
            "--json prints the run record on stdout, where the answers would go: add --output "
            "FILE for the answers"
        )
    if args.resume and args.overwrite:
        raise HrmError("--resume continues OUTPUT.partial, --overwrite discards it: give one")
    planner_args = [f for f in ("gpu_mem", "cpu_mem", "schedule") if getattr(args, f)]
    if planner_args and (args.plan or not args.hardware):
        flag = "--" + planner_args[0].replace("_", "-")
        raise HrmError(
            f"{flag} is for planning with --hardware; "
            + ("a --plan has fixed it already: leave it out" if args.plan else "add --hardware")
        )
    return planner_args


def _check_batching(args, job) -> None:
    """A pass's token budget: at least 1, at most what the plan's memory holds (one
    micro-batch of its longest prompt beside N decodes), and that most when not given;
    continuous batching only."""
    from hrm.errors import HrmError
    from hrm.rules.admission import token_budget_limit

    budget = args.max_tokens_per_pass
    if budget is not None and args.batching != "continuous":
        raise HrmError("--max-tokens-per-pass is for --batching continuous (the default); "
                       "leave out --batching static, or the flag")  # fmt: skip
    p, running = job.policy, _max_running(job)
    longest = job.plan.workload.prompt_len_max if job.plan else max(job.spec.prompt_lens)
    most = token_budget_limit(running, p.micro_batch_size, longest)
    planned = job.plan.continuous.token_budget if job.plan and job.plan.continuous else most
    if budget is None:
        args.max_tokens_per_pass = planned if args.batching == "continuous" else None
    elif not 1 <= budget <= most:
        raise HrmError(
            f"--max-tokens-per-pass {budget}: a pass carries 1 to {most} tokens under this "
            f"{'plan' if job.plan else 'run'} ({running} decodes and one micro-batch of "
            f"{p.micro_batch_size} prompts of {longest} tokens, what its memory holds)"
        )


def _random_arch(args):
    """The architecture of --model --random-weights (with --layers), or None for --checkpoint."""
    from hrm.arch import resolve_model
    from hrm.errors import HrmError

    if args.random_weights != (args.model is not None):
        raise HrmError(
            "--random-weights goes with --model (an architecture); a --checkpoint has weights"
            if args.random_weights
            else "--model runs random weights: add --random-weights, or give --checkpoint"
        )
    if args.layers is not None and not args.random_weights:
        raise HrmError("--layers goes with --random-weights (a checkpoint has its own layers)")
    if args.model is None:
        return None
    return resolve_model(args.model).first_layers(args.layers)
