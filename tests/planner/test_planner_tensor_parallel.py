"""Tensor parallelism over several GPUs, and options side by side with their cost per token."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_setup import gpu_profile, tiny_arch

from hrm.errors import HrmError
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.hardware.parts import Interconnect
from hrm.workload import Workload
from planner.compare import Option, cost_per_million_tokens, parse_prices
from planner.layer_seconds import micro_batch_seconds
from planner.search import NoPolicyFits, search
from planner.setting import Setting
from planner.transfers import all_reduce_seconds
from tests.conftest import assert_one_line_error

WORKLOAD = Workload(prompt_len_mean=16, prompt_len_max=32, gen_len=4)
MTBENCH = ["--prompt-len", "77", "--max-prompt-len", "418", "--gen-len", "128"]


def wide_arch():
    """tiny_arch with 8 query and 4 KV heads, so that 1, 2 and 4 GPUs all divide it."""
    return dataclasses.replace(tiny_arch(), num_attention_heads=8, num_key_value_heads=4)


def test_the_ring_all_reduce_is_pinned_to_its_hand_derived_value():
    four = gpu_profile(gpu_count=4, link_bytes_per_s=1e8)
    # 2 (g - 1) (alpha + S / (g B)): 6 steps of NCCL's PCIe step latency (2.8 us) and 1e6/4 bytes
    # at 1e8 B/s, over PCIe peer to peer
    pcie = 6 * (2.8e-6 + 1e6 / 4 / 1e8)
    assert float(all_reduce_seconds(four, 1e6)) == pytest.approx(pcie)
    nvlink = dataclasses.replace(four, interconnect=Interconnect(kind="nvlink", bytes_per_s=1e10))
    assert float(all_reduce_seconds(nvlink, 1e6)) == pytest.approx(6 * (2.27e-6 + 2.5e-5))
    measured = Interconnect(kind="nvlink", bytes_per_s=1e10, step_latency_s=1e-3)
    measured_four = dataclasses.replace(four, interconnect=measured)
    # a tiny message costs the latency alone: 6 steps of 1 ms
    assert float(all_reduce_seconds(measured_four, 2)) == pytest.approx(6e-3, rel=1e-6)
    assert float(all_reduce_seconds(gpu_profile(gpu_count=1), 1e6)) == 0.0
    # per layer and micro-batch of b sequences: two all-reduces of b * h * 2 bytes in decode,
    # of b * S * h * 2 in prefill (S = 32 padded-free prefill length is the mean 16 here)
    arch = wide_arch()
    mb = micro_batch_seconds(Setting(arch=arch, hardware=four, workload=WORKLOAD), 3)
    decode = 2 * 6 * (2.8e-6 + (3 * 64 * 2) / 4 / 1e8)
    prefill = 2 * 6 * (2.8e-6 + (3 * WORKLOAD.prefill_len * 64 * 2) / 4 / 1e8)
    assert mb.gpu_all_reduce[1:] == pytest.approx(np.full(3, decode))
    assert mb.gpu_all_reduce[0] == pytest.approx(prefill)


def test_one_gpu_has_no_all_reduce_and_shared_links_share_bandwidth():
    one = Setting(arch=wide_arch(), hardware=gpu_profile(gpu_count=1), workload=WORKLOAD)
    assert not micro_batch_seconds(one, 4).gpu_all_reduce.any()
    four = gpu_profile(gpu_count=4, link_bytes_per_s=1e8)
    assert four.h2d_bytes_per_s == 4e8 and four.link_lanes == 4
    shared = dataclasses.replace(four, link=dataclasses.replace(four.link, shared=True))
    assert shared.h2d_bytes_per_s == 1e8 and shared.link_lanes == 1


def test_a_head_count_that_does_not_divide_is_named():
    arch = tiny_arch()  # 2 KV heads
    with pytest.raises(HrmError, match="num_key_value_heads = 2 does not divide by 4 GPUs"):
        Setting(arch=arch, hardware=gpu_profile(gpu_count=4), workload=WORKLOAD)
    odd = dataclasses.replace(wide_arch(), intermediate_size=130)
    with pytest.raises(HrmError, match="intermediate_size = 130"):
        Setting(arch=odd, hardware=gpu_profile(gpu_count=4), workload=WORKLOAD)


def _free_comm(count: int, gpu_mem: float, link: float) -> HardwareProfile:
    hw = gpu_profile(gpu_count=count, gpu_memory_bytes=gpu_mem, link_bytes_per_s=link)
    return dataclasses.replace(
        hw, interconnect=Interconnect(kind="nvlink", bytes_per_s=1e30, step_latency_s=0.0)
    )


@settings(max_examples=25, deadline=None)
@given(
    gpu_mem=st.floats(min_value=3e5, max_value=4e6),
    link=st.floats(min_value=1e7, max_value=1e10),
    gen=st.integers(min_value=2, max_value=16),
    count=st.sampled_from([1, 2]),
)
def test_with_free_communication_doubling_the_gpus_never_lowers_the_best(gpu_mem, link, gen, count):
    arch, workload = wide_arch(), Workload(prompt_len_mean=16, prompt_len_max=32, gen_len=gen)

    def best(g: int) -> float:
        try:
            plan = search(arch, _free_comm(g, gpu_mem, link), workload).best
        except NoPolicyFits:
            return 0.0
        return plan.predicted.throughput_tok_s

    assert best(2 * count) >= best(count) * (1 - 1e-6)


def test_fewer_gpus_of_a_machine_and_more_as_a_what_if():
    hw = resolve_hardware("4xt4")
    two = hw.with_gpu_count(2)
    assert two.gpu.count == 2 and two.name == "4xt4@2gpu" and two.gpu.memory_bytes == 16e9
    assert hw.with_gpu_count(4) is hw
    eight = hw.with_gpu_count(8)
    assert eight.gpu.count == 8 and eight.cpu == hw.cpu and eight.link == hw.link
    assert eight.h2d_bytes_per_s == 2 * hw.h2d_bytes_per_s  # a link each
    with pytest.raises(HrmError, match="--gpus 0: give a positive GPU count"):
        hw.with_gpu_count(0)


def test_the_readme_multi_gpu_example_plans_what_ifs_with_scaled_prices(run_cli):
    """Two L4s on a one-L4 profile: planned, marked what-if, priced at twice the machine's
    price, and faster than one (twice the GPU memory and two links)."""
    status, out, _ = run_cli(
        "plan", "--model", "mixtral-8x7b", "--hardware", "t4,l4", "--gpus", "1,2", *MTBENCH,
        "--price", "t4=0.35,l4=0.70", "--json",
    )  # fmt: skip
    assert status == 0
    options = {(o["machine"], o["gpus"]): o for o in json.loads(out)["options"]}
    assert set(options) == {("t4", 1), ("t4", 2), ("l4", 1), ("l4", 2)}
    assert [options["l4", g]["what_if"] for g in (1, 2)] == [False, True]
    assert options["l4", 2]["price_per_hour"] == pytest.approx(1.40)
    assert options["t4", 2]["price_per_hour"] == pytest.approx(0.70)
    assert options["l4", 2]["throughput_tok_s"] > options["l4", 1]["throughput_tok_s"]
    status, out, _ = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--gpus",
                             "1,2", *MTBENCH)  # fmt: skip
    assert status == 0 and "l4, 2 GPUs (what-if)" in out and "l4, 1 GPU " in out


def test_one_machine_takes_a_bare_price(run_cli):
    assert parse_prices("0.9", ["l4"]) == {"l4": 0.9}
    status, out, _ = run_cli(
        "plan", "--model", "mixtral-8x7b", "--hardware", "l4", *MTBENCH, "--price", "0.9", "--json"
    )
    assert status == 0 and json.loads(out)["options"][0]["price_per_hour"] == 0.9


def test_cost_per_token_combines_throughput_and_price():
    assert cost_per_million_tokens(0.36, 100.0) == pytest.approx(1.0)  # 360 000 tokens per $0.36
    plan = search(wide_arch(), gpu_profile(), WORKLOAD).best
    option = Option(machine="m", gpus=1, plan=plan, price_per_hour=2.0)
    tput = plan.predicted.throughput_tok_s
    assert option.cost_per_million_tokens == pytest.approx(2.0 / (3600 * tput) * 1e6)
    assert option.dataset_seconds(1e6) == pytest.approx(1e6 / tput)
    assert option.dataset_cost(1e6) == pytest.approx(1e6 / tput / 3600 * 2.0)
    assert Option(machine="m", gpus=1, plan=plan).cost_per_million_tokens is None
    assert parse_prices("t4=0.35, l4=0.7", ["t4", "l4"]) == {"t4": 0.35, "l4": 0.7}


def test_gpus_and_a_hardware_list_print_and_serialise_every_option(run_cli, tmp_path):
    status, out, _ = run_cli(
        "plan", "--model", "mixtral-8x22b", "--hardware", "4xt4", "--gpus", "1,2,4", *MTBENCH,
        "--json",
    )  # fmt: skip
    assert status == 0
    data = json.loads(out)
    assert [(o["machine"], o["gpus"]) for o in data["options"]] == [
        ("4xt4", 4), ("4xt4", 2), ("4xt4", 1),
    ]  # fmt: skip
    assert data["fastest"] == "4xt4, 4 GPUs"
    tputs = [o["throughput_tok_s"] for o in data["options"]]
    assert tputs == sorted(tputs, reverse=True) and all(t > 0 for t in tputs)
    assert all(o["plan"]["policy"]["batch_size"] > 0 for o in data["options"])
    # the paper's super-linear scaling from 2 to 4 T4s: more GPU memory, more resident weights
    assert tputs[0] > 2 * tputs[1]
    plot = tmp_path / "cost.png"
    status, out, _ = run_cli(
        "plan", "--model", "mixtral-8x7b", "--hardware", "t4,l4,ci-cpu", *MTBENCH,
        "--price", "t4=0.35,l4=0.70", "--dataset-tokens", "1e6", "--plot", plot,
    )  # fmt: skip
    assert status == 0 and plot.stat().st_size > 0
    lines = out.splitlines()
    assert "t4, 1 GPU" in lines[2] and "cheapest" in lines[2]  # the cheaper per token first
    assert any("l4, 1 GPU" in line and "fastest" in line for line in lines)
    assert any("ci-cpu (CPU only)" in line and "does not fit" in line for line in lines)
    assert "job h" in lines[1] and "job: 1e+06 generated tokens" in lines[-2]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--hardware", "t4,l4", "--price", "0.9"], "with several machines name each"),
        (["--hardware", "l4", "--price", "free"], "'free' is not a number"),
        (["--hardware", "4xt4", "--gpus", "3"], "num_attention_heads = 32 does not divide by 3"),
        (["--hardware", "4xt4", "--gpus", "0"], "--gpus: expected positive GPU counts"),
        (["--hardware", "t4,l4", "--price", "a100-80g=3"], "'a100-80g' is not in --hardware"),
        (["--hardware", "t4,l4", "--price", "t4=-1"], "the price must be positive"),
        (["--hardware", "t4,l4", "--price", "t4=cheap"], "'cheap' is not a number"),
        (["--hardware", ","], "--hardware: give at least one machine"),
        (["--hardware", "t4,,l4"], "an empty name in the list"),
        (["--hardware", "t4,l4", "-o", "plan.json"], "-o and --sweep take one machine"),
        (["--hardware", "t4,l4", "--dataset-tokens", "0"], "--dataset-tokens must be positive"),
        (["--hardware", "t4,ci-cpu", "--gpus", "1"], "ci-cpu has no GPU"),
    ],
)
def test_bad_comparisons_are_one_line(run_cli, tmp_path, monkeypatch, extra, fragment):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli("plan", "--model", "mixtral-8x7b", *MTBENCH, *extra)
    assert_one_line_error(status, err, fragment)
    assert out == "" and not list(tmp_path.iterdir())


def test_a_prompts_file_sizes_the_job(run_cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3]}\n' * 2)
    status, out, _ = run_cli(
        "plan", "--model", "mixtral-8x7b", "--hardware", "t4,l4", "--gen-len", "128",
        "--price", "t4=0.35", "--prompts", prompts, "--json",
    )  # fmt: skip
    assert status == 0
    options = json.loads(out)["options"]
    assert all(o["dataset_tokens"] == 4 * 128 for o in options)
    assert all(o["plan"]["policy"]["batch_size"] <= 4 for o in options)
    t4 = next(o for o in options if o["machine"] == "t4")
    assert t4["dataset_cost"] == pytest.approx(t4["dataset_seconds"] / 3600 * 0.35)
    assert next(o for o in options if o["machine"] == "l4")["dataset_cost"] is None
    prompts.write_text('{"text": 1}\n')
    status, _, err = run_cli(
        "plan", "--model", "mixtral-8x7b", "--hardware", "t4,l4", "--gen-len", "8", "--prompts",
        prompts,
    )  # fmt: skip
    assert_one_line_error(status, err, "p.jsonl:1: give exactly one of")
