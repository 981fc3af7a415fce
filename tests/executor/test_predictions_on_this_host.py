"""A run is predicted only on the machine it runs on: on a CPU, a GPU machine's plan is
predicted with this host's CPU standing in for the GPU, or not at all (it printed "+1528%
against measured" for an L4 plan run here)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from executor.checkpoint import read_arch
from hrm.cli import run_plan
from hrm.hardware import resolve_hardware
from hrm.policy import Policy
from hrm.profiling import host_gemm
from hrm.workload import Workload
from planner import predict
from tests.conftest import assert_one_line_error, record_flags

OWN = "ci-cpu-avx512"  # any measured CPU-only profile stands for "this host" here


def _plan(checkpoint, tmp_path, machine: str):
    policy = Policy(batch_size=2, micro_batch_size=1, attention_on_gpu=False, ffn_on_gpu=True,
                    weights_gpu_fraction=0.0, kv_gpu_fraction=0.0, weight_dtype="float32",
                    kv_dtype="float32")  # fmt: skip
    workload = Workload(prompt_len_mean=6, prompt_len_max=6, gen_len=2)
    plan = predict(read_arch(checkpoint), resolve_hardware(machine), workload, policy, "cgopipe")
    return plan.save(tmp_path / "plan.json")


def _run(run_cli, checkpoint, plan, *extra):
    return run_cli("run", "--checkpoint", checkpoint, "--plan", plan, "--prompt-len", "6",
                   "--batch", "2", "--gen-len", "2", "--quiet", *record_flags(),
                   *extra)  # fmt: skip


@pytest.mark.parametrize("own", [None, OWN])
def test_a_gpu_plan_on_the_cpu_is_predicted_by_this_hosts_stand_in_or_not_at_all(
    checkpoints, tmp_path, run_cli, monkeypatch, own
):
    monkeypatch.setattr(
        host_gemm, "bundled_profile_of_this_host", lambda: own and resolve_hardware(own)
    )
    checkpoint = checkpoints["mixtral-single"]
    status, out, err = _run(run_cli, checkpoint, _plan(checkpoint, tmp_path, "l4"))
    assert status == 0, err
    record = json.loads(out)
    if own is None:
        assert record["predicted"] is None and "note: no prediction: the plan is for l4" in err
    else:
        assert record["hardware"] == f"{OWN}-stand-in" and record["predicted"] is not None


def test_hardware_naming_a_cpu_only_profile_predicts_its_stand_in(checkpoints, tmp_path, run_cli):
    checkpoint = checkpoints["mixtral-single"]
    plan = _plan(checkpoint, tmp_path, "l4")
    status, out, err = _run(run_cli, checkpoint, plan, "--hardware", OWN)
    assert status == 0, err
    record = json.loads(out)
    assert record["hardware"] == f"{OWN}-stand-in" and record["predicted"]["decode_s"] > 0


def test_a_plan_made_on_a_stand_in_profile_runs_and_is_predicted_on_it(
    checkpoints, tmp_path, run_cli
):
    """hrm plan --hardware CPU-ONLY --gpu-mem SIZE plans the CPU standing in for a GPU, as
    hrm validate does; it refused ('has no GPU') before."""
    checkpoint = checkpoints["mixtral-single"]
    plan = tmp_path / "plan.json"
    status, out, err = run_cli("plan", "--model", checkpoint, "--hardware", OWN, "--gpu-mem",
                               "1MB", "--prompt-len", "6", "--gen-len", "2", "--policy",
                               "N=2,mu=1,attn=cpu,ffn=gpu,w=0,kv=0", "-o", plan)  # fmt: skip
    assert status == 0, err
    assert json.loads(plan.read_text())["hardware"] == f"{OWN}-stand-in"
    status, out, err = _run(run_cli, checkpoint, plan)
    assert status == 0, err
    assert json.loads(out)["hardware"] == f"{OWN}-stand-in"


def test_a_plan_for_several_gpus_without_its_tensor_parallel_is_refused(
    checkpoints, tmp_path, run_cli
):
    """A plan written before plans carried tensor_parallel, for a machine of 2 GPUs: made
    again, not run on one device against a prediction for two."""
    checkpoint = checkpoints["mixtral-single"]
    path = _plan(checkpoint, tmp_path, "2xt4")
    data = json.loads(path.read_text())
    assert data.pop("tensor_parallel") == 2
    del data["machine"]  # nor the machine, which came later
    path.write_text(json.dumps(data))
    status, _, err = _run(run_cli, checkpoint, path)
    assert_one_line_error(
        status, err, "the plan is for 2 GPUs in tensor parallel (2xt4)", "--gpus N -o plan.json"
    )
    one = resolve_hardware("2xt4").with_gpu_count(1)
    assert (
        run_plan.plan_machine(type("P", (), {"hardware": one.name, "machine": None})()).gpu_count
        == 1
    )


def test_plan_with_one_gpu_count_writes_a_plan_for_that_many(run_cli, tmp_path):
    out = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "2xt4", "--gpus",
                             "1", "--prompt-len", "8", "--gen-len", "4", "-o", out)  # fmt: skip
    assert status == 0, err
    plan = json.loads(out.read_text())
    assert (plan["hardware"], plan["tensor_parallel"]) == ("2xt4@1gpu", 1)
    status, _, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "4xt4", "--gpus",
                             "2", "--prompt-len", "8", "--gen-len", "4", "-o", out)  # fmt: skip
    assert status == 0, err
    plan = json.loads(out.read_text())
    assert (plan["hardware"], plan["tensor_parallel"]) == ("4xt4@2gpu", 2)


def test_a_tensor_parallel_plan_that_does_not_divide_the_model_is_refused(
    checkpoints, tmp_path, run_cli
):
    """Its tensor_parallel decides, whatever machine it names: 4 does not divide the tiny
    Mixtral's 2 key/value heads."""
    checkpoint = checkpoints["mixtral-single"]
    path = _plan(checkpoint, tmp_path, "l4")
    data = json.loads(path.read_text()) | {"tensor_parallel": 4}
    path.write_text(json.dumps(data))
    status, _, err = _run(run_cli, checkpoint, path)
    assert_one_line_error(status, err, "num_key_value_heads = 2 does not divide by 4 GPUs")


def test_a_plan_made_on_a_profile_file_runs_without_that_file(checkpoints, tmp_path, run_cli):
    """The plan stores its profile: made with --hardware me.yaml, it stored only "me", and
    `hrm run --plan` could not open the machine once the file was elsewhere (no prediction)."""
    checkpoint = checkpoints["mixtral-single"]
    mine = tmp_path / "me.yaml"
    dataclasses.replace(resolve_hardware(OWN), name="me").save(mine)
    plan = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", checkpoint, "--hardware", mine, "--gpu-mem",
                             "1MB", "--prompt-len", "6", "--gen-len", "2", "--policy",
                             "N=2,mu=1,attn=cpu,ffn=gpu,w=0,kv=0", "-o", plan)  # fmt: skip
    assert status == 0, err
    assert json.loads(plan.read_text())["machine"]["name"] == "me-stand-in"
    mine.unlink()
    status, out, err = _run(run_cli, checkpoint, plan, "--output", tmp_path / "answers.jsonl")
    assert status == 0, err
    record = json.loads(out)
    assert record["hardware"] == "me-stand-in" and record["predicted"]["decode_s"] > 0
