"""What `hrm run` runs, settled before any weight is loaded: the RunSpec, and the policy and
schedule it runs under. Without a plan that is the resident policy (everything on the one
device); with `--plan`, or `--hardware` with a GPU (which plans first), it is the plan's.

Everything a user can get wrong is checked here (executor/run.py `check_plan`, the host's memory
for a resident run); hrm/cli/run.py then executes the job and builds its record. This module
imports nothing back from it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    spec: Any  # executor.api.RunSpec
    policy: Any  # hrm.policy.Policy
    schedule: str
    plan: Any  # hrm.plan.Plan, or None for a resident run
    profile: Any  # the HardwareProfile the run is predicted on, or None
    staged: bool  # weights cross the link through a pinned staging ring (the plan says)
    disk_dir: str | None = None  # where the disk tier's file goes, when the plan has one


def settle_job(args, hardware, random_arch, planner_args: list[str], warn) -> Job:
    """The job `hrm run`'s arguments describe: planned with --plan, or with --hardware that has
    a GPU or planning flags; resident otherwise."""
    if args.plan is not None or (hardware is not None and (hardware.has_gpu or planner_args)):
        return _planned_job(args, hardware, random_arch, warn)
    return _resident_job(args, hardware, random_arch, warn)


def _resident_job(args, hardware, random_arch, warn) -> Job:
    """Everything on the one device, the prompts one batch: refused where the host's memory
    would not hold it; predicted with a CPU-only --hardware profile."""
    from hrm.cli.memory_check import check_resident_run
    from hrm.errors import HrmError
    from hrm.policy import Policy
    from hrm.profiling.host_gemm import host_differs

    on_gpu = args.device.startswith("cuda")
    if hardware is not None and on_gpu and not hardware.has_gpu:
        raise HrmError(
            f"--hardware {args.hardware} has no GPU, so it cannot predict a --device "
            f"{args.device} run; give a profile with a GPU or run on the cpu"
        )
    spec = run_spec(args, random_arch, args.dtype, args.kv_dtype)
    check_resident_run(spec, random_weights=args.random_weights)
    if hardware is not None and hardware.source == "measured":
        differs = host_differs(hardware)
        if differs:
            warn(f"warning: {differs}: the prediction is for that host")
    policy = Policy.resident(spec.batch_size, spec.dtype, on_gpu, spec.kv_dtype)
    return Job(spec, policy, "serial", None, hardware, staged=False)


def _planned_job(args, hardware, random_arch, warn) -> Job:
    """The plan (--plan, or the best one on --hardware for these prompts), checked against the
    run before any loading."""
    import torch

    from executor.run import check_plan
    from hrm.cli.memory_check import host_budget
    from hrm.errors import HrmError
    from hrm.formats import WEIGHT_FORMATS
    from hrm.plan import Plan
    from hrm.policy import RUN_DTYPES
    from hrm.units import parse_bytes

    plan = Plan.load(args.plan) if args.plan else None
    if plan is not None and plan.policy.weight_dtype not in RUN_DTYPES:
        raise HrmError(
            f"{args.plan}: a what-if plan: the executor runs no {plan.policy.weight_dtype} "
            f"weights (it runs {', '.join(RUN_DTYPES)}); plan again with one of those"
        )
    dtype = args.dtype or (plan.policy.weight_dtype if plan is not None else None)
    if plan is not None and args.dtype and args.dtype != plan.policy.weight_dtype:
        raise HrmError(
            f"--dtype {args.dtype} differs from the plan's {plan.policy.weight_dtype}; "
            "leave --dtype out or plan with it"
        )
    kv = args.kv_dtype or (plan.policy.kv_dtype if plan is not None else None)
    if not args.kv_dtype and kv not in WEIGHT_FORMATS:
        kv = None  # a float KV dtype of a plan is checked against the run by check_plan
    if plan is not None and args.kv_dtype and args.kv_dtype != plan.policy.kv_dtype:
        raise HrmError(
            f"--kv-dtype {args.kv_dtype} differs from the plan's {plan.policy.kv_dtype}; "
            "leave --kv-dtype out or plan with it"
        )
    spec = run_spec(args, random_arch, dtype, kv)
    if plan is None:
        plan, note = _plan_for(args, spec, hardware)
        where = f"the best plan on {hardware.name}"
        if note:
            warn(note)
    else:
        where = args.plan
    disk_dir = _disk_dir(args, plan, spec) if plan.policy.weights_disk_fraction else None
    device = torch.device(spec.device)
    _check_tensor_parallel(plan, spec.arch, where)
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
        device=spec.device,
        max_new=[spec.max_new(i) for i in range(len(spec.prompts))]
        if args.batching == "continuous"
        else None,
    )
    profile = prediction_profile(plan, hardware, spec.device, warn)
    return Job(spec, plan.policy, plan.schedule, plan, profile, plan.stages_weights, disk_dir)


def _disk_dir(args, plan, spec) -> str:
    """Where a plan with weights on disk writes its disk tier's file: --disk-dir, else the
    directory its profile's disk was measured in, else the temp directory; checked, with the
    checkpoint its reads may come from in place, before any weight loads."""
    from executor.disk_tier import check_checkpoint, check_directory

    if spec.checkpoint is not None:
        check_checkpoint(spec.checkpoint, direct=not args.disk_buffered)
    disk = plan.machine.disk if plan.machine is not None else None
    measured = disk.path if disk is not None else None
    directory = args.disk_dir or measured or tempfile.gettempdir()
    what = "--disk-dir" if args.disk_dir or not measured else "the profile's disk path"
    check_directory(directory, direct=not args.disk_buffered, what=what)
    return directory


def run_spec(args, random_arch, dtype, kv_dtype=None):
    """The RunSpec of `hrm run`'s arguments (executor.api.prepare_run), in `dtype`, the KV
    cache in `kv_dtype` (None: the compute dtype)."""
    from executor.api import prepare_run

    return prepare_run(
        args.checkpoint,
        random_arch=random_arch,
        gen_len=args.gen_len,
        prompts_path=args.prompts,
        requests=getattr(args, "requests", None),  # the Python API's (hrm.api.generate)
        prompt_len=args.prompt_len,
        batch=args.batch,
        seed=args.seed,
        dtype=dtype,
        kv_dtype=kv_dtype,
        device=args.device,
    )


def plan_machine(plan):
    """The machine a plan was made for: the profile it stores, else (a plan older than that)
    from its name (a bundled profile, NAME@Ngpu for N of its GPUs, NAME-stand-in for its CPU
    standing in for a GPU); None when it cannot be found."""
    from hrm.errors import HrmError
    from hrm.hardware import resolve_hardware
    from hrm.hardware.stand_in import STAND_IN_SUFFIX

    if plan.machine is not None:
        return plan.machine
    name, _, count = plan.hardware.partition("@")
    name = name.removesuffix(STAND_IN_SUFFIX)
    try:
        machine = resolve_hardware(name)
    except HrmError:
        return None
    if count.endswith("gpu") and count[:-3].isdigit() and machine.has_gpu:
        machine = machine.with_gpu_count(int(count[:-3]))
    return machine


def _check_tensor_parallel(plan, arch, where: str) -> None:
    """A plan that shards the layers over several GPUs (its tensor_parallel; a plan older than
    that field: the GPUs of the machine it names) must split this model's heads and widths
    (executor/tensor_parallel.py)."""
    from hrm.errors import HrmError
    from hrm.rules.tensor_parallel import tensor_parallel_problem

    machine = plan_machine(plan)
    if plan.tensor_parallel == 1 and machine is not None and machine.gpu_count > 1:
        name = plan.hardware.partition("@")[0]
        raise HrmError(
            f"{where}: the plan is for {machine.gpu_count} GPUs in tensor parallel "
            f"({plan.hardware}) and names no tensor_parallel; make it again: hrm plan "
            f"--hardware {name} --gpus N -o plan.json"
        )
    problem = tensor_parallel_problem(arch, plan.tensor_parallel)
    if problem:
        raise HrmError(f"{where}: {problem}")


def _plan_for(args, spec, hardware):
    """The best plan for these prompts on `hardware` (with --gpu-mem), N at most the number of
    prompts, in the host memory there is (--cpu-mem, never more than is available). Where the
    CPU stands in for the GPU the host holds both sides, so what the plan places on the stand-in
    GPU comes out of the host's memory: planned with all of it first, then, where both sides do
    not fit, with what that plan left the host; else refused saying what the run needs and what
    is available. (Taking the whole stand-in GPU out first made a run fail or pass with the
    moment's free memory.) Returns the plan and _best_plan's note about it, or None."""
    from hrm.cli.memory_check import host_budget
    from hrm.errors import HrmError
    from hrm.units import format_bytes, parse_bytes

    if not hardware.has_gpu and not args.gpu_mem:
        raise HrmError(
            f"{hardware.name} has no GPU: give --gpu-mem SIZE for the CPU to stand in for one, "
            "or leave out the planning flags for a resident run"
        )
    gpu = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else hardware.gpu.memory_bytes
    host, named = host_budget(parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None)
    plan, note = _best_plan(args, spec, hardware, gpu, host)
    if spec.device != "cpu":
        return plan, note
    need = plan.memory.gpu_bytes + plan.memory.cpu_bytes
    if need > host and host > plan.memory.gpu_bytes:
        plan, note = _best_plan(args, spec, hardware, gpu, host - plan.memory.gpu_bytes)
        need = plan.memory.gpu_bytes + plan.memory.cpu_bytes
    if need > host:
        raise HrmError(
            f"the best plan on {hardware.name} with the CPU standing in for its GPU needs "
            f"{format_bytes(need, 3)} of host memory ({format_bytes(plan.memory.gpu_bytes, 3)} "
            f"on the stand-in GPU, {format_bytes(plan.memory.cpu_bytes, 3)} on the host side) "
            f"and {named}; free memory, or give a smaller --gpu-mem"
        )
    return plan, note


def _best_plan(args, spec, hardware, gpu: float, cpu: float):
    """The search's best plan for the run's prompts with `gpu` and `cpu` bytes (the CPU standing
    in for a GPU where `hardware` has none); under continuous batching (the default), the
    continuous plan of its requests over the search's top plans, as `hrm plan --batching
    continuous` makes it, so the run admits by that plan's limits and is predicted pass by
    pass. With it, a note where static batches of the best static plan are predicted faster."""
    from hrm.cli.plan_continuous import continuous_for_run, static_faster_note
    from planner.search import search

    if hardware.has_gpu:
        hardware = hardware.with_resources(cpu_memory_bytes=cpu, gpu_memory_bytes=gpu)
    else:
        from hrm.hardware.stand_in import stand_in_profile

        hardware = stand_in_profile(hardware.with_resources(cpu_memory_bytes=cpu), gpu)
    continuous, workload = args.batching == "continuous", spec.workload()
    result = search(
        spec.arch,
        hardware,
        workload,
        schedule=args.schedule or "cgopipe",
        weight_dtype=spec.dtype,
        kv_dtype=spec.kv_dtype,
        top_k=5 if continuous else 1,  # as hrm plan's: the continuous plan's candidates
        max_batch_size=len(spec.prompts),
    )
    if not continuous:
        return result.best, None
    lengths = [(len(p), spec.max_new(i)) for i, p in enumerate(spec.prompts)]
    planned = continuous_for_run(spec.arch, hardware, workload, lengths, list(result.top))
    return planned["plan"], static_faster_note(planned)


def prediction_profile(plan, hardware, device: str, warn):
    """The machine this run is predicted on, or None (with a note saying why). On a CPU only
    this host can be predicted: a GPU machine's plan is predicted with this host's stand-in
    model (--hardware naming a CPU-only profile, else a bundled measurement of this host);
    comparing an L4 with this CPU would give a meaningless error."""
    from hrm.hardware.stand_in import stand_in_profile
    from hrm.profiling.host_gemm import bundled_profile_of_this_host
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
    tp = plan.tensor_parallel  # each rank's share of the CPU stands in for one of its GPUs
    stand_in = stand_in_profile(
        profile, gpu_memory_bytes=(gpu_bytes or profile.cpu.memory_bytes) / tp
    )
    return stand_in.with_gpu_count(tp) if tp > 1 else stand_in
