"""Memory is counted before it is spent: a run that would not fit is refused in one line, with
how much it needs, how much there is and what to do, instead of being killed by the kernel
half-way through loading. The count is the planner's (planner/memory.py), the one a plan uses."""

from __future__ import annotations

import dataclasses

from hrm.errors import HrmError
from hrm.units import format_bytes


def available_host_bytes() -> float:
    """Memory this host can give now (MemAvailable; MemTotal where the kernel does not say)."""
    from hrm.profiling.cpu import host_facts

    facts = host_facts()
    return facts.available_memory_bytes or facts.memory_bytes


def host_budget(given: float | None) -> tuple[float, str]:
    """The host memory a run may use, and how to name it: what --cpu-mem gives, never more
    than is available now."""
    present = available_host_bytes()
    if given is not None and given <= present:
        return given, f"--cpu-mem gives {format_bytes(given, 3)}"
    return present, f"this host has {format_bytes(present, 3)} available"


def check_resident_run(spec, *, random_weights: bool) -> None:
    """`hrm run` without a plan holds the whole model on its device: refuse before loading when
    the planner's count of that run exceeds the memory present."""
    from planner import resident_run_memory

    on_gpu = spec.device.startswith("cuda")
    workload = spec.workload()

    def need(arch) -> tuple[float, float]:
        return resident_run_memory(
            arch, workload, batch_size=spec.batch_size, dtype=spec.compute_dtype, on_gpu=on_gpu
        )

    host, device = need(spec.arch)
    budget, named = host_budget(None)
    device_budget = _free_device_bytes(spec.device) if on_gpu else None
    if host <= budget and (device_budget is None or device <= device_budget):
        return
    short = (
        ("host", host, named)
        if host > budget
        else ("GPU", device, f"the GPU has {format_bytes(device_budget, 3)} free")
    )
    fixes = []
    if random_weights:
        fits = _layers_that_fit(spec.arch, need, budget, device_budget)
        if fits:
            fixes.append(f"--layers {fits} (the most that fit)")
    if spec.batch_size > 1:
        fixes.append("a smaller batch")
    fixes.append("an offloaded plan (hrm plan ... -o plan.json, then hrm run --plan plan.json)")
    raise HrmError(
        f"this run of {spec.arch.name} needs {format_bytes(short[1], 3)} of {short[0]} memory and "
        f"{short[2]}; try {', '.join(fixes[:-1])}{', or ' if len(fixes) > 1 else ''}{fixes[-1]}"
    )


def _layers_that_fit(arch, need, budget: float, device_budget: float | None) -> int:
    """The most layers of `arch` whose run fits (0: not even one)."""

    def fits(layers: int) -> bool:
        host, device = need(dataclasses.replace(arch, num_layers=layers))
        return host <= budget and (device_budget is None or device <= device_budget)

    lo, hi = 0, arch.num_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _free_device_bytes(device: str) -> float:
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return float(free)


def check_runs(arch, runs, *, what: str, layers_flag: bool) -> None:
    """A series of resident runs on the CPU, (batch, longest prompt, generation length, dtype)
    each, as `hrm validate` makes them: refused before anything is written when the largest
    would not fit in the memory available; with `layers_flag`, naming the --layers that fit."""
    from hrm.workload import Workload
    from planner import resident_run_memory

    def need(arch) -> tuple[float, float]:
        return max(
            resident_run_memory(
                arch,
                Workload(prompt_len_mean=longest, prompt_len_max=longest, gen_len=gen),
                batch_size=batch,
                dtype=dtype,
            )
            for batch, longest, gen, dtype in runs
        )

    host, _ = need(arch)
    budget, named = host_budget(None)
    if host <= budget:
        return
    fits = _layers_that_fit(arch, need, budget, None) if layers_flag else 0
    fix = f"--layers {fits} (the most that fit)" if fits else "a smaller model"
    raise HrmError(
        f"{what} needs {format_bytes(host, 3)} of host memory at its largest run and {named}; "
        f"try {fix}"
    )
