"""The search is exact over its grid: it agrees with the MILP solved at every grid point. The
MILP itself is checked apart from the search, against an enumeration of policies through
predict()."""

from __future__ import annotations

import numpy as np
import pytest

from hrm.errors import HrmError
from hrm.plan import Plan
from hrm.policy import Policy
from hrm.units import format_bytes
from hrm.workload import Workload
from planner import predict
from planner.cost import queue_terms, schedule_terms
from planner.layer_seconds import micro_batch_seconds
from planner.search import (
    MU_GRID,
    bracket_row,
    fixed_binaries,
    largest_batch,
    placements,
    search,
    solve_point,
)
from planner.setting import Setting

REL = 1e-6


def brute_force(setting: Setting) -> list[float]:
    """Throughput of the MILP's optimum at every (N = m*mu, mu) of the grid, best first."""
    allowed = fixed_binaries(setting.hardware, setting.schedule)
    n_hi = largest_batch(setting)
    values = []
    for mu in (mu for mu in MU_GRID if mu <= n_hi):
        for n in range(mu, n_hi + 1, mu):
            plan = solve_point(setting, n, mu, allowed)
            if plan is not None:
                values.append(plan.predicted.throughput_tok_s)
    return sorted(values, reverse=True)


CASES = [
    # (schedule, GPU memory, CPU memory, PCIe): GPU attention competes with CPU attention, the
    # cache with the weights for GPU memory, and the CPU memory caps the batch
    ("cgopipe", 1.5e6, 2.0e6, 1e8),
    ("cgopipe", 3.0e6, 1.6e6, 1e9),
    ("gpu-attention", 2.5e6, 2.0e6, 3e8),
    ("serial", 1.5e6, 2.0e6, 1e8),
    ("overlap", 1.5e6, 2.0e6, 1e8),
]


@pytest.mark.parametrize("schedule, gpu_mem, cpu_mem, pcie", CASES)
def test_search_equals_brute_force(arch, make_gpu_profile, schedule, gpu_mem, cpu_mem, pcie):
    hw = make_gpu_profile(gpu_memory_bytes=gpu_mem, cpu_memory_bytes=cpu_mem, link_bytes_per_s=pcie)
    wl = Workload(prompt_len_mean=12, prompt_len_max=16, gen_len=6)
    setting = Setting(
        arch=arch,
        hardware=hw,
        workload=wl,
        schedule=schedule,
        weight_dtype="float32",
        kv_dtype="float32",
    )
    result = search(
        arch, hw, wl, schedule=schedule, weight_dtype="float32", kv_dtype="float32", top_k=3
    )
    everything = brute_force(setting)
    assert len(everything) > 20, "the instance should have a real grid"
    found = [p.predicted.throughput_tok_s for p in result.top]
    assert found == pytest.approx(everything[:3], rel=REL)


def test_the_best_plan_does_not_depend_on_how_many_are_listed():
    """Rows skipped against the closed form's feasible throughputs are opened again where the
    MILP found less: on mixtral-8x7b and the bundled l4, top_k=1 gave N=1056 mu=96 (176.8
    tok/s) where top_k=5 found N=1216 mu=64 (190.0), so `--hardware l4,t4` showed the worse."""
    from hrm.arch import resolve_model
    from hrm.hardware import resolve_hardware

    arch, hw = resolve_model("mixtral-8x7b"), resolve_hardware("l4")
    wl = Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=128)
    best = [search(arch, hw, wl, top_k=k).best.predicted.throughput_tok_s for k in (1, 2, 5)]
    assert best == pytest.approx([best[2]] * 3, rel=REL)


def test_closed_forms_bracket_the_milp(arch, make_gpu_profile, workload):
    hw = make_gpu_profile(gpu_memory_bytes=2.5e6)
    setting = Setting(arch=arch, hardware=hw, workload=workload, schedule="gpu-attention")
    mu = 2
    mb = micro_batch_seconds(setting, mu)
    terms = schedule_terms(setting.schedule, queue_terms(setting, mb), hw)
    m = np.arange(1, 8)
    low = bracket_row(setting, mu, m, (1, 1), terms, threshold=np.inf)  # no frontier search
    exact = bracket_row(setting, mu, m, (1, 1), terms, threshold=-np.inf)
    allowed = fixed_binaries(hw, "gpu-attention")
    for i, k in enumerate(m):
        plan = solve_point(setting, int(k * mu), mu, allowed, whole_tensors=False)
        milp = plan.predicted.throughput_tok_s if plan else -np.inf
        assert low.feasible[i] <= milp * (1 + REL) and milp <= low.bound[i] * (1 + REL)
        assert exact.feasible[i] == pytest.approx(milp, rel=REL)


def test_top_plans_are_consistent(arch, make_gpu_profile, workload):
    hw = make_gpu_profile()
    result = search(arch, hw, workload, top_k=4)
    values = [p.predicted.throughput_tok_s for p in result.top]
    assert values == sorted(values, reverse=True)
    assert len({(p.policy.batch_size, p.policy.micro_batch_size) for p in result.top}) == 4
    for plan in result.top:
        # the reported plan is what `predict` says of its policy, and it round-trips through JSON
        again = predict(arch, hw, workload, plan.policy, plan.schedule)
        assert again.predicted.total_s == pytest.approx(plan.predicted.total_s, rel=1e-12)
        assert Plan.from_dict(plan.to_dict()) == plan
        assert plan.memory.gpu_bytes <= plan.memory.gpu_capacity_bytes
        assert plan.memory.cpu_bytes <= plan.memory.cpu_capacity_bytes


def test_cpu_only_machine_runs_everything_on_the_cpu(arch, make_cpu_profile, workload):
    result = search(arch, make_cpu_profile(), workload, top_k=2)
    p = result.best.policy
    assert not p.attention_on_gpu and not p.ffn_on_gpu
    assert p.weights_gpu_fraction == p.kv_gpu_fraction == 0.0
    assert result.best.memory.gpu_bytes == 0.0
    assert placements(make_cpu_profile(), "cgopipe") == [(0, 0)]
    with pytest.raises(HrmError, match="no GPU"):
        search(arch, make_cpu_profile(), workload, schedule="gpu-attention")


def test_workload_that_fits_nowhere_says_which_memory_and_how_much(arch, make_gpu_profile):
    """The shortfall named is what the least a sequence needs (N = mu = 1, the layers on the
    GPU with nothing resident, in the machine's bfloat16: the CPU cannot hold the model here)
    lacks of the usable GPU."""
    hw = make_gpu_profile(gpu_memory_bytes=5e5, cpu_memory_bytes=5e5)
    wl = Workload(prompt_len_mean=16, prompt_len_max=32, gen_len=4)
    least = Policy(batch_size=1, micro_batch_size=1, attention_on_gpu=False, ffn_on_gpu=True,
                   weights_gpu_fraction=0.0, kv_gpu_fraction=0.0, weight_dtype="bfloat16",
                   kv_dtype="bfloat16")  # fmt: skip
    need = predict(arch, hw, wl, least, "cgopipe").memory.gpu_bytes
    short = f"{(need - 4.5e5) / 1e3:.4g} kB short"
    needs = f"needs {format_bytes(need)} of GPU memory, 450 kB is usable"
    with pytest.raises(HrmError, match=rf"{needs} \(90% of the total\), {short}; try --gpu-mem"):
        search(arch, hw, wl)


def test_a_host_too_small_is_named_with_its_fix(arch, make_gpu_profile):
    """The GPU holds the whole model; the host cannot hold even what stays there (embedding,
    a sequence's hidden states): CPU memory is named, with what one sequence needs of it and the
    flag that gives more."""
    hw = make_gpu_profile(gpu_memory_bytes=1.5e6, cpu_memory_bytes=1e4)
    wl = Workload(prompt_len_mean=16, prompt_len_max=32, gen_len=4)
    with pytest.raises(HrmError) as err:
        search(arch, hw, wl)
    message = str(err.value)
    assert "of CPU memory, 9 kB is usable (90% of the total)" in message
    assert message.endswith("try --cpu-mem or more CPU memory, or shorter prompts")
    need = float(message.split("needs ")[1].split(" kB")[0]) * 1e3
    short = float(message.split("total), ")[1].split(" kB")[0]) * 1e3
    assert need == pytest.approx(9e3 + short, rel=1e-3)


def enumerated_best(setting: Setting, n: int, mu: int, steps: int = 11) -> float:
    """The best throughput that predict() gives any fitting policy at (N, mu): every placement
    the schedule allows x r_w and r_c on a grid of `steps` values each, independent of the
    MILP."""
    best = 0.0
    grid = np.linspace(0.0, 1.0, steps)
    for ffn, attn in placements(setting.hardware, setting.schedule):
        for rw in grid:
            for rc in grid if attn else [0.0]:
                policy = Policy(
                    batch_size=n, micro_batch_size=mu, attention_on_gpu=bool(attn),
                    ffn_on_gpu=bool(ffn), weights_gpu_fraction=float(rw) if ffn else 0.0,
                    kv_gpu_fraction=float(rc), weight_dtype="float32", kv_dtype="float32",
                )  # fmt: skip
                plan = predict(setting.arch, setting.hardware, setting.workload, policy,
                               setting.schedule)  # fmt: skip
                m = plan.memory
                if m.gpu_bytes <= m.gpu_capacity_bytes and m.cpu_bytes <= m.cpu_capacity_bytes:
                    best = max(best, plan.predicted.throughput_tok_s)
    return best


# (schedule, GPU memory, CPU memory, PCIe, (N, mu) points): the MILP there puts attention on the
# CPU and the FFN on the GPU; part of the KV cache on the GPU; everything on the CPU
GRID_CASES = [
    ("cgopipe", 1.5e6, 2.0e6, 1e8, ((16, 8), (32, 8), (96, 8))),
    ("gpu-attention", 1.3e6, 2.0e6, 3e8, ((4, 2), (16, 4), (32, 4))),
    ("overlap", 0.8e6, 2.0e6, 1e8, ((4, 2), (16, 8))),
]


@pytest.mark.parametrize("schedule, gpu_mem, cpu_mem, pcie, points", GRID_CASES)
def test_the_milp_is_at_least_as_good_as_any_policy_on_a_grid(
    arch, make_gpu_profile, schedule, gpu_mem, cpu_mem, pcie, points
):
    """At a few (N, mu) the MILP's placement against an enumeration through predict(): never
    beaten by a grid point, and never far above the best of them (a grid of tenths)."""
    hw = make_gpu_profile(gpu_memory_bytes=gpu_mem, cpu_memory_bytes=cpu_mem, link_bytes_per_s=pcie)
    wl = Workload(prompt_len_mean=12, prompt_len_max=16, gen_len=6)
    setting = Setting(arch=arch, hardware=hw, workload=wl, schedule=schedule,
                      weight_dtype="float32", kv_dtype="float32")  # fmt: skip
    allowed = fixed_binaries(hw, schedule)
    for n, mu in points:
        plan = solve_point(setting, n, mu, allowed, whole_tensors=False)
        assert plan is not None, (n, mu)
        grid_best = enumerated_best(setting, n, mu)
        milp = plan.predicted.throughput_tok_s
        assert grid_best > 0 and milp >= grid_best * (1 - REL), (n, mu)
        assert milp <= grid_best * 1.5, (n, mu)


def test_the_milp_keeps_the_placement_within_the_cpu_memory(arch):
    """1.2 MB of host memory cannot hold what the tiny model leaves there at any placement the
    MILP may choose at N=8 under cgopipe: it says Infeasible, where without the CPU row it
    would offer a placement; 3 MB holds it."""
    from planner.evaluate import batch_model
    from planner.milp import solve_placement
    from tests.planner.tiny_setup import gpu_profile

    wl = Workload(prompt_len_mean=64, prompt_len_max=64, gen_len=32)

    def solve(cpu_memory_bytes):
        hw = gpu_profile(gpu_memory_bytes=0.5e6, cpu_memory_bytes=cpu_memory_bytes)
        setting = Setting(arch=arch, hardware=hw, workload=wl, schedule="cgopipe",
                          weight_dtype="float32", kv_dtype="float32")  # fmt: skip
        return solve_placement(batch_model(setting, 8, 4), fixed_binaries(hw, "cgopipe"))

    assert solve(1.2e6).status == "Infeasible"
    assert solve(3e6).optimal


def test_the_milp_keeps_what_the_schedule_fixes(arch):
    """A GPU that holds the whole tiny model: free, the MILP puts everything there; told A_g = 0
    or F_g = 0 as well (what a schedule or machine fixes), it keeps them so."""
    from planner.evaluate import batch_model
    from planner.milp import solve_placement
    from tests.planner.tiny_setup import gpu_profile

    wl = Workload(prompt_len_mean=64, prompt_len_max=64, gen_len=32)
    hw = gpu_profile(gpu_memory_bytes=3e6, cpu_memory_bytes=3e6)
    setting = Setting(arch=arch, hardware=hw, workload=wl, schedule="cgopipe",
                      weight_dtype="float32", kv_dtype="float32")  # fmt: skip
    model = batch_model(setting, 8, 4)
    free = solve_placement(model, {"attention_on_gpu": None, "ffn_on_gpu": None})
    assert free.optimal and free.ffn_on_gpu and free.attention_on_gpu
    cpu_attention = solve_placement(model, {"attention_on_gpu": False, "ffn_on_gpu": None})
    assert cpu_attention.optimal and cpu_attention.ffn_on_gpu and not cpu_attention.attention_on_gpu
    on_cpu = solve_placement(model, {"attention_on_gpu": False, "ffn_on_gpu": False})
    assert on_cpu.optimal and not on_cpu.ffn_on_gpu and not on_cpu.attention_on_gpu


def test_a_solvers_fraction_is_clipped_and_rounded_down():
    """r_w and r_c as the MILP reports them: an unset or zero value is 0 (not 1: a plan with
    nothing resident says so), values past [0, 1] are clipped, and rounding is down to 1e-9 so
    that a placement never holds more than the memory the solver fitted."""
    from planner.milp import _fraction

    assert _fraction(None) == 0.0 and _fraction(0.0) == 0.0 and _fraction(-1e-12) == 0.0
    assert _fraction(1.0 + 1e-9) == 1.0 and _fraction(0.5) == 0.5
    assert _fraction(0.3 + 4e-10) == 0.3 and _fraction(0.7 - 1e-12) < 0.7
