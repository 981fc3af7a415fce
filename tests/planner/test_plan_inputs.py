"""`hrm plan` plans what the user gives: a prompts file's lengths and count, a named policy to
write, a truncated model, and only lengths the model can hold."""

from __future__ import annotations

import json

import pytest

from hrm.plan import Plan
from tests.conftest import assert_one_line_error

L4 = ["--model", "mixtral-8x7b", "--hardware", "l4"]


def _prompts(tmp_path, lens):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [1] * n}) + "\n" for n in lens))
    return path


def test_a_prompts_file_gives_the_lengths_the_batch_cap_and_the_jobs_hours(run_cli, tmp_path):
    """200 prompts: the plan's N is at most 200 (it was 7680, 17x too fast), the workload is
    the file's mean and longest, and the job's hours follow from the plan's throughput."""
    lens = [10 + (i * 37) % 300 for i in range(200)]
    path = _prompts(tmp_path, lens)
    status, out, _ = run_cli("plan", *L4, "--prompts", path, "--gen-len", "64", "--json")
    assert status == 0
    data = json.loads(out)
    assert data["workload"]["prompt_len_mean"] == pytest.approx(sum(lens) / 200)
    assert data["workload"]["prompt_len_max"] == max(lens)
    assert data["policy"]["batch_size"] <= 200
    assert all(p["policy"]["batch_size"] <= 200 for p in data["top"])
    assert all(b["policy"]["batch_size"] <= 200 for b in data["baselines"] if b["policy"])
    job, rate = data["job"], data["predicted"]["throughput_tok_s"]
    assert job["prompts"] == 200 and job["tokens"] == 200 * 64
    assert job["hours"] == pytest.approx(200 * 64 / rate / 3600)
    uncapped = json.loads(
        run_cli(
            "plan",
            *L4,
            "--prompt-len",
            "150",
            "--max-prompt-len",
            "309",
            "--gen-len",
            "64",
            "--json",
        )[1]  # fmt: skip
    )
    assert uncapped["policy"]["batch_size"] > 200  # so the cap above is what held N down
    status, out, _ = run_cli("plan", *L4, "--prompts", path, "--gen-len", "64")
    assert status == 0 and "job: 200 prompts, 12800 generated tokens in" in out


def test_a_text_prompt_is_counted_with_the_checkpoints_tokenizer(run_cli, tmp_path):
    """The word-level test tokenizer makes "w5 w6 w7" three tokens."""
    from hrm.arch import BUNDLED_DIR
    from tests.executor.conftest import save_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "w5 w6 w7"}\n{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}\n')
    status, _, err = run_cli("plan", *L4, "--prompts", path, "--gen-len", "8")
    assert_one_line_error(status, err, "p.jsonl: 1 of its 2 prompts are text", "--tokenizer DIR")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    save_tokenizer(checkpoint)
    (checkpoint / "config.json").write_text((BUNDLED_DIR / "mixtral-8x7b.json").read_text())
    status, out, err = run_cli("plan", "--model", checkpoint, "--hardware", "l4", "--prompts",
                               path, "--gen-len", "8", "--json")  # fmt: skip
    assert status == 0, err
    workload = json.loads(out)["workload"]
    assert (workload["prompt_len_mean"], workload["prompt_len_max"]) == (5.0, 7)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--prompt-len", "77"], "--prompts gives the prompt lengths; leave out --prompt-len"),
        (["--max-prompt-len", "400"], "leave out --prompt-len and --max-prompt-len"),
    ],
)
def test_a_prompts_file_and_given_lengths_are_refused_together(run_cli, tmp_path, extra, fragment):
    path = _prompts(tmp_path, [5, 9])
    status, out, err = run_cli("plan", *L4, "--prompts", path, "--gen-len", "8", *extra)
    assert_one_line_error(status, err, fragment)
    assert out == ""


def test_a_blank_line_inside_a_prompts_file_is_refused(run_cli, tmp_path):
    """Skipping it would shift every later output line off its input line."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [1]}\n\n{"prompt_token_ids": [2]}\n\n\n')
    status, _, err = run_cli("plan", *L4, "--prompts", path, "--gen-len", "8")
    assert_one_line_error(status, err, "p.jsonl:2: a blank line")
    path.write_text('{"prompt_token_ids": [1]}\n{"prompt_token_ids": [2]}\n\n\n')
    assert run_cli("plan", *L4, "--prompts", path, "--gen-len", "8")[0] == 0


def test_without_lengths_or_a_file_the_plan_says_what_to_give(run_cli):
    status, _, err = run_cli("plan", *L4, "--gen-len", "8")
    assert_one_line_error(status, err, "give --prompt-len (the mean prompt length) or --prompts")


def test_a_named_policy_with_o_is_the_plan_written(run_cli, tmp_path):
    out_path = tmp_path / "plan.json"
    args = ["plan", *L4, "--prompt-len", "77", "--gen-len", "32", "-o", out_path]
    status, out, _ = run_cli(*args, "--policy", "N=512,mu=64,attn=cpu,ffn=gpu,w=0,kv=0")
    assert status == 0 and "(the named policy)" in out
    policy = Plan.load(out_path).policy
    assert (policy.batch_size, policy.micro_batch_size, policy.weights_gpu_fraction) == (512, 64, 0)
    run_cli(*args)
    assert Plan.load(out_path).policy.batch_size != 512  # the best, written without --policy


def test_a_named_policy_that_does_not_fit_is_not_written(run_cli, tmp_path):
    out_path = tmp_path / "plan.json"
    status, out, err = run_cli("plan", *L4, "--prompt-len", "77", "--gen-len", "32", "-o",
                               out_path, "--policy", "N=512,mu=64,w=0.5")  # fmt: skip
    assert_one_line_error(status, err, "--policy does not fit on l4: GPU memory", "short")
    assert out == "" and not out_path.exists()


def test_layers_plans_the_truncated_model_that_hrm_run_layers_runs(run_cli, tmp_path):
    out_path = tmp_path / "plan.json"
    status, _, _ = run_cli("plan", *L4, "--prompt-len", "8", "--gen-len", "4", "--layers", "2",
                           "-o", out_path)  # fmt: skip
    assert status == 0
    plan = Plan.load(out_path)
    assert plan.geometry["num_layers"] == 2
    status, _, err = run_cli("plan", *L4, "--prompt-len", "8", "--gen-len", "4", "--layers", "33")
    assert_one_line_error(status, err, "--layers 33: mixtral-8x7b has 32 layers; give 1 to 32")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["plan", *L4, "--prompt-len", "40000", "--gen-len", "8"], "40008 positions, more than"),
        (
            ["plan", *L4, "--prompt-len", "100", "--max-prompt-len", "32760", "--gen-len", "9"],
            "32769 positions, more than mixtral-8x7b's 32768",
        ),  # fmt: skip
        (["roofline", *L4, "--context", "40000"], "--context of 40000 tokens needs 40000"),
        (
            [
                "run",
                "--model",
                "mixtral-8x7b",
                "--random-weights",
                "--layers",
                "1",
                "--prompt-len",
                "32760",
                "--batch",
                "1",
                "--gen-len",
                "9",
            ],
            "32769 positions",
        ),  # fmt: skip
        (
            [
                "run",
                "--model",
                "mixtral-8x7b",
                "--random-weights",
                "--layers",
                "99",
                "--prompt-len",
                "4",
                "--batch",
                "1",
                "--gen-len",
                "2",
            ],
            "--layers 99: mixtral-8x7b has 32 layers",
        ),  # fmt: skip
    ],
)
def test_lengths_past_the_models_positions_are_refused_by_every_command(run_cli, tmp_path,
                                                                         monkeypatch, args,
                                                                         fragment):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(*args)
    assert_one_line_error(status, err, fragment)
    assert out == "" and not list(tmp_path.iterdir())


def test_a_sweep_where_nothing_fits_is_refused_and_draws_nothing(run_cli, tmp_path):
    plot = tmp_path / "s.png"
    status, out, err = run_cli("plan", "--model", "mixtral-8x7b", "--hardware", "ci-cpu",
                               "--prompt-len", "8", "--gen-len", "4", "--sweep", "cpu-mem",
                               "--sweep-values", "1GB,2GB", "--plot", plot)  # fmt: skip
    assert_one_line_error(status, err, "--sweep cpu-mem: no value fits", "GB short")
    assert out == "" and not plot.exists()


def test_a_plan_that_no_memory_binds_says_so_and_lists_no_empty_memory(run_cli, tmp_path):
    """Two prompts on an L4: everything on the CPU, GPU memory unused; it printed 'memory: cpu'
    with 93 of 173 GB used and a dangling colon after the empty GPU list."""
    status, out, _ = run_cli("plan", *L4, "--prompts", _prompts(tmp_path, [5, 9]), "--gen-len",
                             "8")  # fmt: skip
    assert status == 0
    assert "memory: none full" in out
    gpu_line = next(line for line in out.splitlines() if "GPU memory" in line)
    assert gpu_line.rstrip().endswith("usable: nothing")


def test_a_named_weights_fraction_rounded_to_whole_tensors_is_said(run_cli):
    """w=0.1 of Mixtral on an L4 places one layer's dense weights only (2.9%): it was silent."""
    args = ["plan", *L4, "--prompt-len", "77", "--gen-len", "32", "--policy", "N=512,mu=64,w=0.1"]
    status, out, _ = run_cli(*args)
    assert status == 0
    note = next(line for line in out.splitlines() if line.strip().startswith("note"))
    assert "w=0.1 is placed as 0.0289" in note
    data = json.loads(run_cli(*args, "--json")[1])["named_policy"]
    assert data["requested_weights_gpu_fraction"] == 0.1
    assert data["policy"]["weights_gpu_fraction"] == pytest.approx(0.0289, abs=1e-4)
    status, out, _ = run_cli("plan", *L4, "--prompt-len", "77", "--gen-len", "32", "--policy",
                             "N=512,mu=64,w=0")  # fmt: skip
    assert status == 0 and "is placed as" not in out


def _requests(tmp_path, pairs):
    """OpenAI completion requests of (prompt length, max_tokens)."""
    path = tmp_path / "batch.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": [1] * n, "max_tokens": m},
                }
            )
            + "\n"
            for i, (n, m) in enumerate(pairs)
        )  # fmt: skip
    )
    return path


def test_requests_own_lengths_are_planned_as_they_are(run_cli, tmp_path):
    """Without --gen-len: the longest max_tokens bounds every step, each request generates its
    own, and the job counts those tokens; --gen-len caps them."""
    pairs = [(40 + i % 50, (16, 64, 128)[i % 3]) for i in range(300)]
    status, out, err = run_cli("plan", *L4, "--prompts", _requests(tmp_path, pairs), "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["workload"]["gen_len"] == 128
    assert data["workload"]["gen_lens"] == [[16, 100], [64, 100], [128, 100]]
    assert data["job"]["tokens"] == 100 * (16 + 64 + 128)
    n = data["policy"]["batch_size"]
    assert data["predicted"]["generated_tokens"] == pytest.approx(n * (16 + 64 + 128) / 3, abs=1)
    status, out, _ = run_cli("plan", *L4, "--prompts", _requests(tmp_path, pairs), "--gen-len",
                             "64", "--json")  # fmt: skip
    capped = json.loads(out)
    assert capped["workload"]["gen_lens"] == [[16, 100], [64, 200]]
    assert capped["job"]["tokens"] == 100 * 16 + 200 * 64


def test_a_request_without_max_tokens_needs_gen_len(run_cli, tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": [1, 2]}}) + "\n")  # fmt: skip
    status, _, err = run_cli("plan", *L4, "--prompts", path)
    assert_one_line_error(status, err, "batch.jsonl:1: no max_tokens, and no --gen-len")
    status, _, err = run_cli("plan", *L4, "--prompt-len", "20")
    assert_one_line_error(status, err, "--gen-len")


def test_length_ranges_draw_a_job_as_a_prompts_file_would_give_it(run_cli, tmp_path):
    """--prompt-len and --gen-len LO-HI draw --requests requests uniformly, the same ones run
    after run; the plan is the plan of a prompts file of those lengths."""
    import random

    from hrm.cli.plan_job import DRAW_SEED

    args = ["plan", *L4, "--prompt-len", "80-120", "--gen-len", "32-256", "--requests", "300"]
    status, out, err = run_cli(*args, "--json")
    assert status == 0, err
    data = json.loads(out)
    rng = random.Random(DRAW_SEED)
    lengths = [(rng.randint(80, 120), rng.randint(32, 256)) for _ in range(300)]
    path = tmp_path / "drawn.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [1] * p, "max_tokens": g}) + "\n"
                            for p, g in lengths))  # fmt: skip
    status, same, err = run_cli("plan", *L4, "--prompts", path, "--json")
    assert status == 0, err
    assert json.loads(same)["policy"] == data["policy"] and data["job"]["prompts"] == 300
    assert data["job"]["tokens"] == sum(g for _, g in lengths)
    assert json.loads(run_cli(*args, "--json")[1])["predicted"] == data["predicted"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-len", "5-", "--gen-len", "8"], "--prompt-len '5-': give a number of tokens"),
        (["--prompt-len", "10-5", "--gen-len", "8"], "a range LO-HI of whole numbers with 1 <="),
        (["--prompt-len", "0-5", "--gen-len", "8"], "--prompt-len '0-5': give a number"),
        (["--prompt-len", "9", "--gen-len", "4.5"], "--gen-len '4.5': give a whole number"),
        (["--prompt-len", "9", "--gen-len", "8-x"], "--gen-len '8-x': give a whole number"),
        (["--prompt-len", "9", "--gen-len", "0"], "--gen-len must be positive, got 0"),
        (["--prompts", "x.jsonl", "--requests", "5"], "--prompts is the job; --requests"),
        (["--prompt-len", "9", "--gen-len", "2-8", "--requests", "0"], "--requests must be at"),
        (["--prompt-len", "2-9", "--max-prompt-len", "9", "--gen-len", "8"], "gives the longest"),
        (["--prompt-len", "2-9"], "--gen-len: give the tokens each sequence generates"),
    ],
)
def test_malformed_length_ranges_are_refused_in_one_line(run_cli, flags, message):
    assert_one_line_error(*run_cli("plan", *L4, *flags)[::2], message)
