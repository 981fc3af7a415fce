"""`hrm plan` plans what the machine and the executor can run, and a comparison shows each
machine's own best plan (issue 47: float8 planned on a T4 at 197 tok/s; l4 x 1 at 176.8 tok/s in
a comparison against 190.0 on its own)."""

from __future__ import annotations

import dataclasses
import json

from hrm.hardware import resolve_hardware
from tests.conftest import assert_one_line_error

MTBENCH = ["--prompt-len", "77", "--max-prompt-len", "418", "--gen-len", "128"]


def _plan(run_cli, *args):
    return run_cli("plan", "--model", "mixtral-8x7b", *MTBENCH, *args)


def test_a_comparison_shows_each_machines_own_best(run_cli):
    status, out, err = _plan(run_cli, "--hardware", "l4", "--json")
    assert status == 0, err
    alone = json.loads(out)
    status, out, err = _plan(run_cli, "--hardware", "l4,t4", "--json")
    assert status == 0, err
    l4 = next(o for o in json.loads(out)["options"] if o["machine"] == "l4")
    assert l4["plan"]["policy"] == alone["policy"]
    assert l4["throughput_tok_s"] == alone["predicted"]["throughput_tok_s"]


def test_float8_on_a_machine_without_it_is_refused_in_one_line(run_cli, tmp_path):
    out_path = tmp_path / "plan.json"
    status, out, err = _plan(run_cli, "--hardware", "t4", "--dtype", "float8", "-o", out_path)
    assert_one_line_error(status, err, "--dtype float8: t4's NVIDIA T4 has no float8 rate",
                          "the executor runs no float8 weights")  # fmt: skip
    assert out == "" and not out_path.exists()
    status, out, err = _plan(run_cli, "--hardware", "l4,t4", "--dtype", "float8")
    assert status == 0, err
    rows = [line for line in out.splitlines() if "GPU " in line and "cannot plan" in line]
    assert len(rows) == 2 and "no float8 rate" in rows[0]


def test_a_dtype_only_the_profile_rates_is_a_what_if_never_written(run_cli, tmp_path):
    """A profile that rates float8 prices it; the executor still runs none, so the plan is
    shown as a what-if and -o is refused."""
    l4 = resolve_hardware("l4")
    gpu = dataclasses.replace(
        l4.gpu, peak_flops_per_s={**l4.gpu.peak_flops_per_s, "float8": 242e12}
    )
    fp8 = dataclasses.replace(l4, name="l4-fp8", gpu=gpu).save(tmp_path / "l4-fp8.yaml")
    status, out, err = _plan(run_cli, "--hardware", fp8, "--dtype", "float8")
    assert status == 0, err
    assert out.splitlines()[-1].startswith("what-if: the executor runs no float8 weights")
    status, out, err = _plan(run_cli, "--hardware", fp8, "--dtype", "float8", "--json")
    assert json.loads(out)["what_if"].startswith("the executor runs no float8 weights")
    out_path = tmp_path / "plan.json"
    status, out, err = _plan(run_cli, "--hardware", fp8, "--dtype", "float8", "-o", out_path)
    assert_one_line_error(status, err, "-o: the executor runs no float8 weights", "what-if")
    assert not out_path.exists()


def test_a_kv_cache_dtype_the_executor_does_not_keep_is_a_what_if(run_cli, tmp_path):
    status, out, err = _plan(run_cli, "--hardware", "l4", "--kv-dtype", "float16")
    assert status == 0, err
    assert "what-if: a KV cache in float16 cannot be run" in out
    status, out, err = _plan(run_cli, "--hardware", "l4", "--kv-dtype", "float16", "-o",
                             tmp_path / "plan.json")  # fmt: skip
    assert_one_line_error(status, err, "-o: a KV cache in float16 cannot be run")
    status, out, err = _plan(run_cli, "--hardware", "l4", "--kv-dtype", "int8")
    assert status == 0 and "what-if" not in out, err


def test_hrm_run_refuses_a_what_if_plan_in_one_true_line(run_cli, tmp_path):
    """A float8 plan (hand-made, or written before plans were checked) named --dtype, which the
    user never gave."""
    plan = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", "mixtral-8x7b", "--layers", "1", "--hardware",
                             "l4", "--prompt-len", "4", "--gen-len", "2", "-o", plan)  # fmt: skip
    assert status == 0, err
    data = json.loads(plan.read_text())
    data["policy"]["weight_dtype"] = "float8"
    plan.write_text(json.dumps(data))
    out = tmp_path / "out.jsonl"
    status, _, err = run_cli("run", "--model", "mixtral-8x7b", "--random-weights", "--layers",
                             "1", "--plan", plan, "--prompt-len", "4", "--batch", "2",
                             "--gen-len", "2", "--output", out, "--quiet")  # fmt: skip
    assert_one_line_error(status, err, f"{plan}: a what-if plan: the executor runs no float8")
    assert "--dtype" not in err and not out.exists()


def _chat_requests(path):
    body = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 8}
    line = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": body}
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "custom_id": "s"}) + "\n")
    return path


def test_the_readme_workflow_plans_chat_requests_with_a_tokenizer(run_cli, tmp_path):
    """`hrm plan --model mixtral-8x7b --hardware me.yaml --prompts batch.jsonl -o plan.json`
    with chat requests failed on line 1 for want of a tokenizer; it now asks for --tokenizer
    in one line, and plans with it (token ids need none)."""
    from transformers import AutoTokenizer

    from tests.executor.conftest import save_tokenizer

    me = resolve_hardware("l4").save(tmp_path / "me.yaml")
    batch, plan = _chat_requests(tmp_path / "batch.jsonl"), tmp_path / "plan.json"
    args = ["plan", "--model", "mixtral-8x7b", "--hardware", me, "--prompts", batch, "-o", plan]
    status, out, err = run_cli(*args)
    assert_one_line_error(status, err, "batch.jsonl: 2 of its 2 prompts are text",
                          "--model mixtral-8x7b has no tokenizer", "--tokenizer DIR")  # fmt: skip
    assert out == "" and not plan.exists()
    checkpoint = tmp_path / "checkpoint"
    save_tokenizer(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
    tokenizer.save_pretrained(checkpoint)
    status, out, err = run_cli(*args, "--tokenizer", checkpoint)
    assert status == 0, err
    assert json.loads(plan.read_text())["workload"]["prompt_len_max"] == 4  # w5 w6 w7 w1
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    status, out, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", me, "--prompts",
                               ids, "--gen-len", "8")  # fmt: skip
    assert status == 0, err


def test_a_tokenizer_folder_that_is_not_one_is_one_line(run_cli, tmp_path):
    batch = _chat_requests(tmp_path / "batch.jsonl")
    base = ["plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--prompts", batch]
    status, _, err = run_cli(*base, "--tokenizer", tmp_path / "nowhere")
    assert_one_line_error(status, err, "--tokenizer", "nowhere: no such folder")
    status, _, err = run_cli(*base, "--tokenizer", tmp_path)
    assert_one_line_error(status, err, f"--tokenizer {tmp_path} has no tokenizer")
    status, _, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--prompt-len",
                             "8", "--gen-len", "8", "--tokenizer", tmp_path)  # fmt: skip
    assert_one_line_error(status, err, "--tokenizer counts the text of --prompts")
