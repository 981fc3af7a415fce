"""`hrm run --plan` (or `--hardware` with a GPU, which plans first): run the prompts under a plan.
hrm/cli/run.py parses the arguments and calls in here (never the other way round).

Everything a user can get wrong is checked before any weight is loaded (executor/plan_run.py);
the outputs go to OUTPUT.partial batch by batch, so `--resume` picks up a killed run; the record
holds the plan, its prediction for the batches that ran, and each queue's measured busy time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_planned(args, hardware, random_arch, sampling, output: Path | None, warn) -> int:
    import torch

    from executor.batching import InOrder, PartialOutput, run_digest
    from executor.plan_run import check_plan
    from hrm.cli.memory_check import host_budget
    from hrm.errors import HrmError
    from hrm.plan import Plan
    from hrm.units import parse_bytes

    plan = Plan.load(args.plan) if args.plan else None
    dtype = args.dtype or (plan.policy.weight_dtype if plan is not None else None)
    if plan is not None and args.dtype and args.dtype != plan.policy.weight_dtype:
        raise HrmError(
            f"--dtype {args.dtype} differs from the plan's {plan.policy.weight_dtype}; "
            "leave --dtype out or plan with it"
        )
    spec = run_spec(args, random_arch, dtype)
    if plan is None:
        plan = _plan_for(args, spec, hardware)
        where = f"the best plan on {hardware.name}"
    else:
        where = args.plan
    device = torch.device(spec.device)
    _check_one_gpu(plan, where)
    gpu_bytes = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None
    if device.type == "cuda" and gpu_bytes is None:
        gpu_bytes = float(torch.cuda.get_device_properties(device).total_memory)
    host, _ = host_budget(parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None)
    check_plan(
        plan,
        spec.arch,
        spec.prompt_lens,
        spec.gen_len,
        where=where,
        gpu_bytes=gpu_bytes,
        host_bytes=host,
        stand_in=device.type == "cpu",
    )
    settings = {
        "plan": {"policy": plan.policy.to_dict(), "schedule": plan.schedule},
        "geometry": spec.arch.geometry(),
        "gen_len": spec.gen_len,
        "dtype": spec.dtype,
        "sampling": [sampling.temperature, sampling.top_p, sampling.seed],
        "ignore_eos": args.ignore_eos,
    }
    partial = None
    if output is not None:
        digest = run_digest(spec.prompts, settings)
        partial = PartialOutput(output, digest, resume=args.resume, overwrite=args.overwrite)
    stream = InOrder(sys.stdout) if output is None and not args.json else None
    try:
        result, choice = _execute(
            args, spec, plan, hardware, device, partial, stream, sampling, warn
        )
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (hrm.cli.Terminated)
        saved = partial.saved() if partial is not None else 0
        if not saved:
            raise
        raise type(exc)(
            f"{saved} of {len(spec.prompts)} outputs are in {partial.path}: run the "
            "same command with --resume to go on"
        ) from None
    if partial is not None:
        partial.finish(len(spec.prompts))
    record = plan_record(spec, plan, result, hardware, choice, warn)
    if args.json:
        print(json.dumps(record.to_dict(), indent=2))
        return 0
    print(format_plan_summary(record), file=sys.stderr)
    return 0


def run_spec(args, random_arch, dtype):
    """The RunSpec of `hrm run`'s arguments (executor.api.prepare_run), in `dtype`."""
    from executor.api import prepare_run

    return prepare_run(
        args.checkpoint,
        random_arch=random_arch,
        gen_len=args.gen_len,
        prompts_path=args.prompts,
        prompt_len=args.prompt_len,
        batch=args.batch,
        seed=args.seed,
        dtype=dtype,
        device=args.device,
    )


def _execute(args, spec, plan, hardware, device, partial, stream, sampling, warn):
    """Load the weights, choose the CPU GEMM path where the layers run on the CPU, and run every
    pending batch: (PlanRun, the GEMM choice)."""
    from executor.api import load_weights, torch_threads
    from executor.plan_run import execute_plan
    from hrm.profiling.host_gemm import cpu_gemm_for_run

    with torch_threads(args.threads):
        checkpoint = load_weights(spec, "cpu")
        runs_cpu_gemms = device.type == "cpu"
        choice = (
            cpu_gemm_for_run(
                spec.arch,
                spec.dtype,
                mode=args.cpu_gemm,
                hardware=hardware if hardware is not None and not hardware.has_gpu else None,
                weights=checkpoint.expert_gate_weights,
                warn=warn,
            )
            if runs_cpu_gemms
            else None
        )
        result = execute_plan(
            checkpoint,
            plan,
            spec.prompts,
            spec.gen_len,
            device=device,
            partial=partial,
            decode_text=lambda ids: (
                None
                if spec.tokenizer is None
                else spec.tokenizer.decode(ids, skip_special_tokens=True)
            ),
            cpu_gemm=choice,
            sampling=sampling,
            stop_token_ids=() if args.ignore_eos else spec.arch.eos_token_ids,
            quiet=args.quiet,
            on_batch=stream.add if stream is not None else None,
            take_over=True,
        )
    return result, choice


def plan_machine(plan):
    """The machine a plan was made for, from its name (a bundled profile, NAME@Ngpu for N of
    its GPUs, NAME-stand-in for its CPU standing in for a GPU); None when it cannot be found."""
    from hrm.errors import HrmError
    from hrm.hardware import resolve_hardware
    from hrm.stand_in import STAND_IN_SUFFIX

    name, _, count = plan.hardware.removesuffix(STAND_IN_SUFFIX).partition("@")
    try:
        machine = resolve_hardware(name)
    except HrmError:
        return None
    if count.endswith("gpu") and count[:-3].isdigit() and machine.has_gpu:
        machine = machine.with_gpu_count(int(count[:-3]))
    return machine


def _check_one_gpu(plan, where: str) -> None:
    """A plan for several GPUs (tensor parallel) needs several devices, which a run cannot use
    yet: refused rather than run on one device against a prediction for several."""
    from hrm.errors import HrmError

    machine = plan_machine(plan)
    gpus = machine.gpu_count if machine is not None else 1
    if gpus > 1:
        name = plan.hardware.partition("@")[0]
        raise HrmError(
            f"{where}: the plan is for {gpus} GPUs in tensor parallel ({plan.hardware}), and a "
            f"run uses one device; plan for one: hrm plan --hardware {name} --gpus 1 -o plan.json"
        )


def _plan_for(args, spec, hardware):
    """The best plan for these prompts on `hardware` (with --gpu-mem), N at most the number of
    prompts, in the host memory there is (--cpu-mem, never more than is available); where the
    CPU stands in for the GPU, the host holds both, so the GPU's memory comes out of it."""
    from hrm.cli.memory_check import host_budget
    from hrm.errors import HrmError
    from hrm.units import format_bytes, parse_bytes
    from hrm.workload import Workload
    from planner.search import search

    if not hardware.has_gpu and not args.gpu_mem:
        raise HrmError(
            f"{hardware.name} has no GPU: give --gpu-mem SIZE for the CPU to stand in for one, "
            "or leave out the planning flags for a resident run"
        )
    gpu = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else hardware.gpu.memory_bytes
    host, named = host_budget(parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None)
    cpu = host - gpu if spec.device == "cpu" else host
    if cpu <= 0:
        raise HrmError(
            f"the CPU stands in for a GPU of {format_bytes(gpu, 3)} and {named}, which leaves "
            "nothing for the host's side; give a smaller --gpu-mem"
        )
    if hardware.has_gpu:
        hardware = hardware.with_resources(cpu_memory_bytes=cpu, gpu_memory_bytes=gpu)
    else:
        from hrm.stand_in import stand_in_profile

        hardware = stand_in_profile(hardware.with_resources(cpu_memory_bytes=cpu), gpu)
    workload = Workload.from_prompt_lens(spec.prompt_lens, spec.gen_len)
    result = search(
        spec.arch,
        hardware,
        workload,
        schedule=args.schedule or "cgopipe",
        weight_dtype=spec.dtype,
        kv_dtype=spec.dtype,
        top_k=1,
        max_batch_size=len(spec.prompts),
    )
    return result.best


def plan_record(spec, plan, result, hardware, cpu_gemm, warn):
    """The RunRecord: the plan, the prediction for the batches that ran (the plan's policy at
    each batch's own prompts, on the machine it was made for), and the measurement."""
    import dataclasses

    from hrm.record import RunRecord
    from hrm.workload import Workload
    from planner import MODEL_VERSION, predict

    profile = prediction_profile(plan, hardware, result.environment["device"], warn)
    predicted = None
    if profile is not None and result.batches:
        totals = {"prefill_s": 0.0, "decode_s": 0.0, "generated_tokens": 0}
        busy: dict[str, float] = {}
        for lens in result.batches:
            n = len(lens)
            policy = dataclasses.replace(
                plan.policy, batch_size=n, micro_batch_size=min(n, plan.policy.micro_batch_size)
            )
            workload = Workload.from_prompt_lens(lens, spec.gen_len)
            batch_plan = predict(
                spec.arch,
                profile,
                workload,
                policy,
                plan.schedule,
                cpu_gemm=cpu_gemm,
                padded_kv_cache=True,
            )
            for key in ("prefill_s", "decode_s", "generated_tokens"):
                totals[key] += getattr(batch_plan.predicted, key)
            for q, s in batch_plan.busy_s.items():
                busy[q] = busy.get(q, 0.0) + s
        total_s = totals["prefill_s"] + totals["decode_s"]
        predicted = {
            **totals,
            "throughput_tok_s": totals["generated_tokens"] / total_s if total_s else 0.0,
            "busy_s": busy,
        }
    environment = {
        **result.environment,
        "checkpoint": str(spec.checkpoint) if spec.checkpoint else "random weights (in memory)",
        "batch_size": plan.policy.batch_size,
        "prompts": len(spec.prompts),
        "dtype": spec.dtype,
        "model_version": MODEL_VERSION,
        "planned_memory": plan.memory.to_dict(),
    }
    return RunRecord(
        model=spec.arch.name,
        hardware=profile.name if profile is not None else plan.hardware,
        workload=Workload.from_prompt_lens(spec.prompt_lens, spec.gen_len).to_dict(),
        plan=plan.to_dict(),
        predicted=predicted,
        measured=result.measured,
        environment=environment,
    )


def prediction_profile(plan, hardware, device: str, warn):
    """The machine this run is predicted on, or None (with a note saying why). On a CPU only
    this host can be predicted: a GPU machine's plan is predicted with this host's stand-in
    model (--hardware naming a CPU-only profile, else a bundled measurement of this host);
    comparing an L4 with this CPU would give a meaningless error."""
    from hrm.profiling.host_gemm import bundled_profile_of_this_host
    from hrm.stand_in import stand_in_profile
    from planner.memory import USABLE_MEMORY_FRACTION

    profile = hardware if hardware is not None else plan_machine(plan)
    if profile is None:
        warn(f"note: cannot open the plan's machine {plan.hardware!r}: no prediction")
        return None
    if not device.startswith("cpu") or profile.stand_in:
        return profile
    if profile.has_gpu:
        own = bundled_profile_of_this_host()
        if own is None:
            warn(
                f"note: no prediction: the plan is for {profile.name}, and this run is on this "
                "host's CPU; hrm profile -o me.yaml, then --hardware me.yaml, predicts it here"
            )
            return None
        profile = own
    if not plan.policy.ffn_on_gpu:
        return profile
    gpu_bytes = plan.memory.gpu_capacity_bytes / USABLE_MEMORY_FRACTION
    return stand_in_profile(profile, gpu_memory_bytes=gpu_bytes or profile.cpu.memory_bytes)


def format_plan_summary(record) -> str:
    m, env, p = record.measured, record.environment, record.plan["policy"]
    where = f"{env['device']} standing in for the GPU" if env["stand_in"] else env["device"]
    lines = [
        f"{record.model}: {env['prompts']} prompts in {env['batches_run']} batches "
        f"(N={p['batch_size']}, mu={p['micro_batch_size']}, {env['schedule']}, on {where}); "
        f"{m.generated_tokens} tokens, prefill {m.prefill_s:.3f} s, decode {m.decode_s:.3f} s, "
        f"{m.throughput_tok_s:.1f} tok/s",
        "busy: "
        + ", ".join(f"{q} {f:.0%}" for q, f in m.busy_fraction.items())
        + f"; link h2d {m.link_bytes['h2d'] / 1e6:.1f} MB, d2h {m.link_bytes['d2h'] / 1e6:.1f} MB",
    ]
    if env.get("batches_resumed"):
        lines.append(f"resumed: {env['batches_resumed']} batches were already done")
    if record.predicted is not None:
        q = record.predicted
        lines.append(
            f"predicted on {record.hardware}: prefill {q['prefill_s']:.3f} s, decode "
            f"{q['decode_s']:.3f} s, {q['throughput_tok_s']:.1f} tok/s "
            f"({100 * record.prediction_error:+.0f}% against measured)"
        )
    return "\n".join(lines)
