"""`hrm run --batching continuous` as a user runs it: a plan and a prompts file, the answers
in input order, each appended to OUT.partial as it ends so that a killed run loses only what
was running, `--resume`, and the refusals (one line, exit 2, before any weight is loaded)."""

from __future__ import annotations

import json

import pytest

from executor import passes
from tests.conftest import assert_one_line_error


def _run(run_cli, files, out, *extra):
    path, prompts, plan = files
    return run_cli("run", "--checkpoint", path, "--prompts", prompts, "--plan", plan,
                   "--gen-len", "4", "--output", out, "--quiet", *extra)  # fmt: skip


def test_a_continuous_run_answers_what_the_static_one_does(run_cli, files, tmp_path):
    """Continuous (the default) and static give the same answers, byte for byte."""
    status, _, err = _run(run_cli, files, tmp_path / "static.jsonl", "--batching", "static")
    assert status == 0, err
    status, _, err = _run(run_cli, files, tmp_path / "cont.jsonl", "--max-tokens-per-pass", "7")
    assert status == 0, err
    assert (tmp_path / "cont.jsonl").read_text() == (tmp_path / "static.jsonl").read_text()


def test_a_killed_run_keeps_every_finished_answer_and_resume_goes_on(run_cli, files, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    out = tmp_path / "out.jsonl"
    status, _, err = _run(run_cli, files, tmp_path / "whole.jsonl", "--batching", "continuous")
    assert status == 0, err
    real, seen = passes.run_passes, []

    def killed_after_three(*args, on_finish, **kw):
        def finish(i, ids, reason):
            on_finish(i, ids, reason)
            seen.append(i)
            if len(seen) == 3:
                raise KeyboardInterrupt

        return real(*args, on_finish=finish, **kw)

    monkeypatch.setattr("executor.run.run_passes", killed_after_three)
    status, _, err = _run(run_cli, files, out, "--batching", "continuous")
    assert status != 0 and "3 of 10 outputs are in" in err
    lines = (tmp_path / "out.jsonl.partial").read_text().splitlines()
    assert json.loads(lines[0])["hrm_partial"]["batching"] == "continuous"
    assert sorted(json.loads(line)["index"] for line in lines[1:]) == sorted(seen)
    monkeypatch.setattr("executor.run.run_passes", real)
    status, _, err = _run(run_cli, files, out, "--batching", "continuous", "--resume")
    assert status == 0, err
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()
    assert not (tmp_path / "out.jsonl.partial").exists()


@pytest.mark.parametrize(("first", "then"), [("static", "continuous"), ("continuous", "static")])
def test_a_partial_file_resumes_in_its_own_batching_only(run_cli, files, tmp_path, first, then):
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    header = {"run": "x"} | ({"batching": "continuous"} if first == "continuous" else {})
    partial.write_text(json.dumps({"hrm_partial": header}) + "\n")
    status, _, err = _run(run_cli, files, out, "--batching", then, "--resume")
    assert_one_line_error(status, err, f"holds a {first} batching run's answers",
                          f"--batching {first}")  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--batching", "rolling"], "invalid choice: 'rolling'"),
        (
            ["--batching", "continuous", "--max-tokens-per-pass", "0"],
            "a pass carries 1 to 21 tokens",
        ),
        (
            ["--batching", "continuous", "--max-tokens-per-pass", "22"],
            "a pass carries 1 to 21 tokens",
        ),
        (["--batching", "static", "--max-tokens-per-pass", "8"], "is for --batching continuous"),
    ],
)
def test_bad_batching_flags_are_refused_before_loading(run_cli, files, tmp_path, monkeypatch,
                                                       flags, says):  # fmt: skip
    # where the run driver calls it (executor.run binds its own name at import)
    monkeypatch.setattr("executor.run.load_weights", lambda *a, **k: pytest.fail("loaded"))
    status, out, err = _run(run_cli, files, tmp_path / "out.jsonl", *flags)
    assert_one_line_error(status, err, says)
    assert out == "" and not list(tmp_path.glob("out.jsonl*"))


def test_data_and_tensor_parallel_runs_give_one_processes_answers(files, tmp_path):
    """Two data-parallel groups each run every other request through passes of their own; two
    tensor-parallel ranks take the same admissions (the rule is deterministic and each rank
    samples the same gathered logits): both give one process's static output, and each is
    predicted: the groups side by side, each its share of the requests pass by pass."""
    from tests.executor.test_data_parallel import _tp_plan, hrm, torchrun
    from tests.executor.test_run_plan import run_args

    path, prompts, plan = files
    predicted = ("--hardware", "l4", "--ignore-eos", "--json")
    one = hrm(*run_args(path, prompts, plan, "--output", tmp_path / "one.jsonl", "--ignore-eos"))
    assert one.returncode == 0, one.stderr
    for name, done in (
        ("dp.jsonl", lambda out: torchrun(2, *run_args(path, prompts, plan, "--output", out,
                                                       "--batching", "continuous", *predicted))),
        ("tp.jsonl", lambda out: hrm(*run_args(path, prompts, _tp_plan(path, tmp_path, 2),
                                               "--output", out, "--batching", "continuous",
                                               *predicted))),
    ):  # fmt: skip
        result = done(tmp_path / name)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / name).read_text() == (tmp_path / "one.jsonl").read_text()
        record = json.loads(result.stdout)
        made, ranks = record["measured"]["generated_tokens"], record["environment"]["ranks"]
        assert record["predicted"]["generated_tokens"] == made > 0
        assert record["predicted"]["passes"] in [r["passes"] for r in ranks]


def test_a_prompt_longer_than_the_plan_runs_where_its_kv_fits_and_else_is_named(
    run_cli, files, tmp_path, checkpoints
):
    """The plan (N=3, prompts of 9, 4 new) counts 3 x 13 KV tokens, 48 in blocks of 16: a
    20-token prompt is cut into passes and runs, with the tokens it has alone; a 50-token one
    could never be admitted and is named before any weight is loaded."""
    from executor.checkpoint import open_checkpoint
    from executor.generate import generate
    from executor.model import MoEModel
    from tests.executor.conftest import ragged_prompts

    path, _, plan = files
    long_ok, too_long = ragged_prompts([20, 50], seed=3)
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": long_ok}) + "\n")
    out = tmp_path / "out.jsonl"
    status, _, err = run_cli("run", "--checkpoint", path, "--prompts", prompts, "--plan", plan,
                             "--gen-len", "4", "--output", out, "--quiet", "--batching",
                             "continuous")  # fmt: skip
    assert status == 0, err
    model = MoEModel(open_checkpoint(path, "float32"))
    alone = generate(model, [long_ok], 4).output_token_ids[0]
    assert json.loads(out.read_text())["output_token_ids"] == alone
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n"
                               for p in (long_ok, too_long)))  # fmt: skip
    status, _, err = run_cli("run", "--checkpoint", path, "--prompts", prompts, "--plan", plan,
                             "--gen-len", "4", "--output", tmp_path / "x.jsonl", "--batching",
                             "continuous")  # fmt: skip
    assert_one_line_error(status, err, "request 2 (a prompt of 50 tokens and up to 4 new) needs "
                          "64 tokens of KV cache; the run holds 48")  # fmt: skip


def test_a_continuous_run_is_predicted_pass_by_pass(run_cli, files, tmp_path):
    """`hrm run --hardware` predicts a continuous run by replaying its admission rule: the
    predicted passes are the measured ones, and hrm report takes the record."""
    path, prompts, plan = files
    record = tmp_path / "run.json"
    flags = ["--hardware", "l4", "--batching", "continuous", "--json"]
    status, out, err = run_cli("run", "--checkpoint", path, "--prompts", prompts, "--plan", plan,
                               "--gen-len", "4", "--output", tmp_path / "o.jsonl", "--quiet",
                               *flags)  # fmt: skip
    assert status == 0, err
    data = json.loads(out)
    measured = data["environment"]["continuous"]
    assert data["predicted"]["passes"] == measured["passes"] > 0
    assert data["predicted"]["mean_sequences_per_pass"] == measured["mean_sequences_per_pass"]
    assert data["predicted"]["generated_tokens"] == data["measured"]["generated_tokens"]
    record.write_text(out)
    status, _, err = run_cli("report", record, "-o", tmp_path / "rep")
    assert status == 0, err


def test_a_plans_continuous_limits_are_what_the_run_admits(run_cli, files, tmp_path):
    """A plan of `hrm plan --batching continuous` names how many requests run at once (more
    than its N) and a pass's tokens: the run admits by them, its answers are the static run's,
    and the prediction replays the same passes, each beside its measured seconds."""
    path, prompts, plan = files
    data = json.loads(plan.read_text())
    data["continuous"] = {"max_running": 5, "token_budget": 11, "requests": 10, "passes": 1,
                          "peak_running": 3, "peak_kv_blocks": 1,
                          "predicted": data["predicted"]}  # fmt: skip
    plan.write_text(json.dumps(data))
    status, _, err = _run(run_cli, files, tmp_path / "static.jsonl", "--batching", "static")
    assert status == 0, err
    status, out, err = _run(run_cli, files, tmp_path / "cont.jsonl", "--hardware", "l4", "--json")
    assert status == 0, err
    assert (tmp_path / "cont.jsonl").read_text() == (tmp_path / "static.jsonl").read_text()
    record = json.loads(out)
    env, predicted = record["environment"], record["predicted"]
    assert (env["max_running"], env["token_budget"]) == (5, 11)
    assert max(env["continuous"]["pass_tokens"]) <= 11 + 5
    assert predicted["passes"] == env["continuous"]["passes"]
    assert len(predicted["pass_seconds"]) == len(env["continuous"]["pass_seconds"])
    status, _, err = _run(run_cli, files, tmp_path / "x.jsonl", "--max-tokens-per-pass", "24")
    assert_one_line_error(status, err, "a pass carries 1 to 23 tokens under this plan (5 decodes")
