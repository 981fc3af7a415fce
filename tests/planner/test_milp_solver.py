"""The MILP's two solvers (planner/milp.py): HiGHS in process, PuLP's bundled CBC where highspy is
missing. Both must find the same optimum, and HiGHS must leave stdout to hrm's own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hrm.errors import HrmError
from hrm.workload import Workload
from planner.evaluate import batch_model
from planner.milp import solve_placement, solver
from planner.search import fixed_binaries
from planner.setting import Setting
from tests.conftest import assert_one_line_error
from tests.planner.tiny_setup import gpu_profile, tiny_arch

CASES = [  # schedule, GPU memory, CPU memory, N, mu, the status: offloaded, resident, no fit
    ("cgopipe", 0.5e6, 3e6, 8, 4, "Optimal"),
    ("cgopipe", 3e6, 3e6, 8, 4, "Optimal"),
    ("gpu-attention", 2e6, 3e6, 8, 4, "Optimal"),
    ("serial", 0.8e6, 3e6, 8, 4, "Optimal"),
    ("cgopipe", 0.5e6, 1.2e6, 8, 4, "Infeasible"),
]


@pytest.mark.parametrize("schedule, gpu_mem, cpu_mem, n, mu, status", CASES)
def test_highs_and_cbc_find_the_same_optimum(monkeypatch, schedule, gpu_mem, cpu_mem, n, mu,
                                             status):  # fmt: skip
    hw = gpu_profile(gpu_memory_bytes=gpu_mem, cpu_memory_bytes=cpu_mem)
    wl = Workload(prompt_len_mean=64, prompt_len_max=64, gen_len=32)
    setting = Setting(arch=tiny_arch(), hardware=hw, workload=wl, schedule=schedule,
                      weight_dtype="float32", kv_dtype="float32")  # fmt: skip
    model = batch_model(setting, n, mu)
    results = {}
    for name in ("highs", "cbc"):
        monkeypatch.setenv("HRM_MILP_SOLVER", name)
        results[name] = solve_placement(model, fixed_binaries(hw, schedule))
    highs, cbc = results["highs"], results["cbc"]
    assert highs.status == cbc.status == status
    if cbc.optimal:
        assert highs.total_s == pytest.approx(cbc.total_s, rel=1e-7)
        assert (highs.attention_on_gpu, highs.ffn_on_gpu) == (cbc.attention_on_gpu, cbc.ffn_on_gpu)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # PuLP 3 on its CBC: gone in PuLP 4
def test_the_solver_is_highs_unless_told(monkeypatch):
    import pulp

    monkeypatch.delenv("HRM_MILP_SOLVER", raising=False)
    assert isinstance(solver(), pulp.HiGHS)
    monkeypatch.setenv("HRM_MILP_SOLVER", "cbc")
    assert isinstance(solver(), pulp.PULP_CBC_CMD)
    monkeypatch.setenv("HRM_MILP_SOLVER", "gurobi")
    with pytest.raises(HrmError, match="highs or cbc.*gurobi"):
        solver()


def test_an_unknown_solver_is_one_line(run_cli, monkeypatch):
    monkeypatch.setenv("HRM_MILP_SOLVER", "glpk")
    status, out, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "l4",
                               "--prompt-len", "98", "--gen-len", "32")  # fmt: skip
    assert_one_line_error(status, err, "HRM_MILP_SOLVER", "glpk")
    assert out == ""


def test_highs_prints_no_banner_on_stdout():
    """HiGHS writes a banner to fd 1 when a process makes its first solver; `hrm plan --json`'s
    stdout must still be one JSON document (a fresh process, so that the first one is made)."""
    out = subprocess.run(
        [sys.executable, "-m", "hrm", "plan", "--model", "mixtral-8x7b", "--hardware", "l4",
         "--prompt-len", "98", "--gen-len", "32", "--json"],
        capture_output=True, text=True, check=True,
        env={**os.environ, "HRM_MILP_SOLVER": "highs"},
    ).stdout  # fmt: skip
    assert "HiGHS" not in out
    json.loads(out)
