"""MoE-Lens's stage-1 bound (planner/bound.py) against its formula, and where `hrm plan` and
`hrm roofline` print it."""

from __future__ import annotations

import json

import pytest

from hrm.arch import resolve_model
from hrm.hardware import resolve_hardware
from hrm.workload import Workload
from planner.bound import pme, stage1_bound
from planner.memory import WeightBytes


@pytest.mark.parametrize(
    ("p", "g", "value"), [(98, 32, 260 / (228 * 32)), (926, 128, 2108 / (1980 * 128))]
)
def test_pme_is_the_formula(p, g, value):
    assert pme(p, g) == pytest.approx(value)


@pytest.mark.parametrize(("hardware", "p", "g", "binds"), [
    ("l4", 98, 32, "the GPU's compute"),
    ("t4", 926, 128, "the KV memory and the link"),
])  # fmt: skip
def test_the_bound_is_min_of_memory_over_the_stream_and_the_gpu(hardware, p, g, binds):
    arch, hw = resolve_model("mixtral-8x7b"), resolve_hardware(hardware)
    b = stage1_bound(arch, hw, Workload(prompt_len_mean=p, prompt_len_max=p, gen_len=g),
                     "float16", "float16")  # fmt: skip
    w = WeightBytes.of(arch, "float16")
    free = 0.9 * hw.cpu.total_memory_bytes - (w.num_layers * w.stored + w.embedding + w.head)
    m = free / arch.kv_bytes_per_token("float16")
    delta = w.num_layers * w.stored / hw.h2d_bytes_per_s
    t_gpu = hw.gpu.matmul_flops_per_s("float16", 4096) / (2 * arch.active_params)
    assert (b.kv_tokens, b.stream_s, b.gpu_tokens_per_s) == pytest.approx((m, delta, t_gpu))
    assert b.tokens_per_s == pytest.approx(min(pme(p, g) * m / delta, t_gpu))
    assert b.generated_per_s == pytest.approx(b.tokens_per_s * g / (p + g))
    assert b.binds == binds


def test_plan_and_roofline_print_the_bound_and_the_plans_share(run_cli, tmp_path):
    status, out, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "l4",
                               "--prompt-len", "98", "--gen-len", "32", "--json")  # fmt: skip
    assert status == 0, err
    data = json.loads(out)
    bound, best = data["stage1_bound"], data["predicted"]["throughput_tok_s"]
    assert bound["plan_share"] == pytest.approx(best / bound["generated_per_s"])
    assert 0 < bound["plan_share"] <= 1
    status, out, err = run_cli("roofline", "--model", "mixtral-8x7b", "--hardware", "t4",
                               "--prompt-len", "926", "--gen-len", "128",
                               "-o", tmp_path / "r.png")  # fmt: skip
    assert status == 0, err
    assert (
        "MoE-Lens stage-1 bound: PME 0.0083" in out and "bound by the KV memory and the link" in out
    )
