"""`hrm plan` and `hrm run` with a compact weight format, as a user runs them: resident and
planned runs, the record's dtypes and link bytes, and the bad inputs."""

from __future__ import annotations

import json

import pytest

from executor.checkpoint import read_arch
from hrm.hardware import resolve_hardware
from hrm.policy import Policy
from hrm.workload import Workload
from planner import predict
from tests.conftest import assert_one_line_error, record_flags
from tests.executor.test_run_plan import edit_plan, run_args

pytestmark = pytest.mark.usefixtures("this_host")


def _plan(path, tmp_path, fmt: str, kv: str = "bfloat16"):
    policy = Policy(
        batch_size=3, micro_batch_size=2, attention_on_gpu=False, ffn_on_gpu=True,
        weights_gpu_fraction=0.0, kv_gpu_fraction=0.0, weight_dtype=fmt, kv_dtype=kv,
    )  # fmt: skip
    workload = Workload(prompt_len_mean=5.4, prompt_len_max=9, gen_len=4)
    plan = predict(read_arch(path), resolve_hardware("l4"), workload, policy, "cgopipe")
    return plan.save(tmp_path / f"plan-{fmt}.json")


def test_a_planned_int4_run_moves_compact_pages_and_says_what_it_computed_in(
    run_cli,
    files,
    tmp_path,
):
    path, prompts, _ = files
    records = {}
    for fmt in ("bfloat16", "int4"):
        status, out, err = run_cli(
            *run_args(path, prompts, _plan(path, tmp_path, fmt), *record_flags())
        )
        assert status == 0, err
        records[fmt] = json.loads(out)
    env = records["int4"]["environment"]
    assert env["dtype"] == "int4" and env["compute_dtype"] == "bfloat16"
    gpu = records["int4"]["measured"]["buffer_bytes"]["gpu"]
    assert gpu["dequantized layer"] > gpu["paged buffer"] / 2 > 0
    assert "dequantized layer" in records["int4"]["plan"]["memory"]["gpu"]
    link = [r["measured"]["link_bytes"]["h2d"] for r in (records["bfloat16"], records["int4"])]
    # the tiny model's w2 (96 inputs) and norms stay 16-bit: between int4's 0.28 and 1
    assert 0.28 < link[1] / link[0] < 0.7


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_resident_run_in_a_compact_format(run_cli, files, fmt):
    path, prompts, _ = files
    args = ["run", "--checkpoint", path, "--prompts", prompts, "--gen-len", "4", "--quiet"]
    status, out, err = run_cli(*args, "--dtype", fmt)
    assert status == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 10 and all(len(line["output_token_ids"]) == 4 for line in lines)
    status, record, err = run_cli(*args, "--dtype", fmt, *record_flags())
    assert status == 0, err
    assert json.loads(record)["environment"]["compute_dtype"] == "bfloat16"


def test_hrm_plan_int4_writes_a_plan_that_runs(run_cli, files, tmp_path):
    path, prompts, _ = files
    plan = tmp_path / "plan.json"
    status, _, err = run_cli(
        "plan", "--model", str(path), "--hardware", "l4", "--prompts", str(prompts),
        "--gen-len", "4", "--dtype", "int4", "-o", str(plan),
    )  # fmt: skip
    assert status == 0, err
    policy = json.loads(plan.read_text())["policy"]
    assert policy["weight_dtype"] == "int4" and policy["kv_dtype"] == "bfloat16"
    status, out, err = run_cli(*run_args(path, prompts, plan))
    assert status == 0, err
    assert len(out.splitlines()) == 10


@pytest.mark.parametrize(
    ("policy", "fragment"),
    [
        ({"weight_dtype": "float8"}, "float8"),
        ({"weight_dtype": "int8", "kv_dtype": "float32"}, "KV cache in float32"),
    ],
)
def test_plans_in_formats_the_executor_lacks_are_refused_before_loading(
    run_cli,
    files,
    tmp_path,
    policy,
    fragment,
):
    path, prompts, plan = files
    edited = edit_plan(plan, tmp_path, lambda d: d["policy"].update(policy))
    out = tmp_path / "out.jsonl"
    status, _, err = run_cli(*run_args(path, prompts, edited, "--output", out))
    assert_one_line_error(status, err, fragment)
    assert not out.exists()


def test_an_unknown_format_is_one_line(run_cli, files):
    path, prompts, _ = files
    status, _, err = run_cli(
        "run", "--checkpoint", path, "--prompts", prompts, "--gen-len", "4", "--dtype", "int3"
    )
    assert status == 2 and "int3" in err and "Traceback" not in err


def test_a_compact_kv_cache_planned_and_run(run_cli, files, tmp_path):
    path, prompts, _ = files
    plan = tmp_path / "plan.json"
    status, _, err = run_cli(
        "plan", "--model", str(path), "--hardware", "l4", "--prompts", str(prompts),
        "--gen-len", "4", "--dtype", "int8", "--kv-dtype", "int4", "-o", str(plan),
    )  # fmt: skip
    assert status == 0, err
    status, out, err = run_cli(*run_args(path, prompts, plan, *record_flags()))
    assert status == 0, err
    env = json.loads(out)["environment"]
    assert (env["dtype"], env["kv_dtype"], env["compute_dtype"]) == ("int8", "int4", "bfloat16")
    # resident, and a --kv-dtype that disagrees with the plan
    args = ["run", "--checkpoint", path, "--prompts", prompts, "--gen-len", "4", "--quiet"]
    status, out, err = run_cli(*args, "--kv-dtype", "int8")
    assert status == 0 and len(out.splitlines()) == 10, err
    status, _, err = run_cli(*run_args(path, prompts, plan, "--kv-dtype", "int8"))
    assert_one_line_error(status, err, "--kv-dtype int8 differs from the plan's int4")


def test_a_kv_format_the_run_cannot_keep_is_one_line(run_cli, files, tmp_path):
    """head_dim 96: over the group of 64 and not a multiple of it; a float KV dtype other than
    the one the layers compute in."""
    path, prompts, _ = files
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, head_dim=96)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(config))
    status, _, err = run_cli(
        "plan", "--model", str(odd), "--hardware", "l4", "--prompt-len", "8", "--gen-len", "4",
        "--kv-dtype", "int8",
    )  # fmt: skip
    assert_one_line_error(status, err, "head_dim", "96", "group of 64")
    status, _, err = run_cli(
        "run", "--checkpoint", path, "--prompts", prompts, "--gen-len", "4",
        "--dtype", "bfloat16", "--kv-dtype", "float32",
    )  # fmt: skip
    assert_one_line_error(status, err, "--kv-dtype float32", "bfloat16")
