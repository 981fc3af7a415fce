"""`hrm report` given a plan says so, and the numbers people read in summaries read as numbers:
a mean prompt length to a tenth, never -0%, "a KV cache in int4"."""

from __future__ import annotations

from hrm.formats import kv_format_problem
from hrm.record import Measurement, RunRecord
from hrm.report import load_records
from hrm.units import format_duration, format_percent
from tests.conftest import assert_one_line_error


def test_a_plan_given_to_report_is_named_a_plan(run_cli, tmp_path):
    """It was "unknown key 'policy'", as if the record were broken."""
    plan = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "l4",
                             "--prompt-len", "64", "--gen-len", "64", "-o", plan)  # fmt: skip
    assert status == 0, err
    out = tmp_path / "report"
    status, _, err = run_cli("report", plan, "-o", out)
    assert_one_line_error(status, err, "plan.json: a plan (hrm plan -o), not a run record",
                          f"hrm run --plan {plan} --output OUT.jsonl --json")  # fmt: skip
    assert not out.exists()


def test_a_settings_mean_prompt_length_reads_to_a_tenth(tmp_path):
    RunRecord(
        model="m",
        hardware="h",
        workload={"prompt_len_mean": 377 / 6, "prompt_len_max": 80, "gen_len": 8},
        plan=None,
        predicted={"throughput_tok_s": 1.0},
        measured=Measurement(prefill_s=0.5, decode_s=0.5, generated_tokens=1),
        environment={"batch_size": 6, "dtype": "float32", "device": "cpu"},
    ).save(tmp_path / "r.json")
    (row,) = load_records([tmp_path / "r.json"])
    assert "prompts 62.8/80 gen 8" in row.setting  # was 62.8333


def test_a_share_just_below_zero_reads_zero_percent():
    assert format_percent(-1e-9) == "0%" and format_percent(-0.004) == "0%"
    assert format_percent(0.456) == "46%" and format_percent(1.0) == "100%"


def test_a_compact_kv_cache_is_named_without_a_wrong_article():
    problem = kv_format_problem("int4", 6)
    assert problem.startswith("a KV cache in int4 needs a head_dim") and "a int4" not in problem


def test_a_duration_reads_in_a_persons_units():
    """A job's time read "in 8.05e-08 h"."""
    cases = {0: "0 s", 3e-4: "under 1 ms", 0.0123: "12 ms", 2.5: "2.5 s", 45.2: "45 s",
             200: "3 min 20 s", 7500: "2 h 05 min"}  # fmt: skip
    assert {s: format_duration(s) for s in cases} == cases
