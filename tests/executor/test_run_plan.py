"""`hrm run --plan` as a user runs it: outputs in input order, resume, the record, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import executor.run
from executor.checkpoint import read_arch
from tests.conftest import assert_one_line_error, record_flags
from tests.executor.conftest import PLAN_LENGTHS, ragged_prompts

LENGTHS = PLAN_LENGTHS
GENERATE = executor.run.generate
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("this_host")


def run_args(path, prompts, plan, *extra):
    return [
        "run",
        "--checkpoint",
        path,
        "--plan",
        plan,
        "--prompts",
        prompts,
        "--gen-len",
        "4",
        "--quiet",
        "--batching",  # static batches: what these tests are about (continuous: test_continuous*)
        "static",
        *extra,
    ]


def test_plan_run_matches_the_resident_run(run_cli, files):
    path, prompts, plan = files
    status, out, err = run_cli(*run_args(path, prompts, plan))
    assert status == 0, err
    status, resident, _ = run_cli(
        "run", "--checkpoint", path, "--prompts", prompts, "--gen-len", "4", "--quiet"
    )
    assert status == 0 and out == resident
    assert "standing in for the GPU" in err and "4 batches" in err


def test_record_holds_plan_prediction_queues_and_buffers(run_cli, files):
    path, prompts, plan = files
    status, out, err = run_cli(*run_args(path, prompts, plan, *record_flags()))
    assert status == 0, err
    record = json.loads(out)
    assert record["plan"]["policy"]["micro_batch_size"] == 2
    assert record["predicted"]["generated_tokens"] == 4 * len(LENGTHS)
    assert set(record["predicted"]["busy_s"]) == {"gpu", "cpu", "h2d", "d2h"}
    m = record["measured"]
    assert set(m["busy_fraction"]) == {"gpu", "cpu", "h2d", "d2h"}
    assert m["link_bytes"]["h2d"] > m["link_bytes"]["d2h"] > 0
    assert m["buffer_bytes"]["cpu"]["layer weights"] > 0
    assert record["environment"]["stand_in"] is True


def test_resume_after_a_kill_equals_an_uninterrupted_run(run_cli, files, tmp_path, monkeypatch):
    path, prompts, plan = files
    whole = tmp_path / "whole.jsonl"
    assert run_cli(*run_args(path, prompts, plan, "--output", whole))[0] == 0
    out = tmp_path / "out.jsonl"
    _kill_after(monkeypatch, 1)
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out))
    assert status == 130 and "interrupted" in err
    partial = tmp_path / "out.jsonl.partial"
    assert not out.exists() and len(partial.read_text().splitlines()) == 1 + 3
    monkeypatch.setattr(executor.run, "generate", GENERATE)
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out, "--resume"))
    assert status == 0, err
    assert "resumed: 1 batches" in err
    assert out.read_text() == whole.read_text() and not partial.exists()


def test_resume_refuses_another_runs_partial(run_cli, files, tmp_path):
    path, prompts, plan = files
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text(json.dumps({"hrm_partial": {"run": "0123456789abcdef"}}) + "\n")
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out, "--resume"))
    assert_one_line_error(status, err, "different run")
    assert not out.exists()


def edit_plan(plan_path, tmp_path, change):
    data = json.loads(plan_path.read_text())
    change(data)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    return edited


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda d: d["geometry"].update(hidden_size=128), "another model"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["workload"].update(prompt_len_max=4, prompt_len_mean=4), "longer than"),
        (lambda d: d["memory"]["cpu"].update({"kv cache": 1e15}), "CPU"),
        (lambda d: d["policy"].update(micro_batch_size=9), "micro_batch_size"),
    ],
)
def test_bad_plans_fail_before_loading(run_cli, files, tmp_path, change, fragment):
    path, prompts, plan = files
    out = tmp_path / "out.jsonl"
    edited = edit_plan(plan, tmp_path, change)
    status, _, err = run_cli(*run_args(path, prompts, edited, "--output", out))
    assert_one_line_error(status, err, fragment)
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_malformed_plan_file(run_cli, files, tmp_path):
    path, prompts, _ = files
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    status, _, err = run_cli(*run_args(path, prompts, bad))
    assert_one_line_error(status, err, "bad.json")


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (("--resume",), "--output"),
        (("--gpu-mem", "1GB"), "--gpu-mem"),
        (("--gen-len", "9"), "--gen-len 9"),
    ],
)
def test_bad_plan_arguments(run_cli, files, extra, fragment):
    path, prompts, plan = files
    args = run_args(path, prompts, plan)
    if extra[0] == "--gen-len":
        args[args.index("--gen-len") + 1] = extra[1]
        extra = ()
    status, _, err = run_cli(*args, *extra)
    assert_one_line_error(status, err, fragment)


def test_random_weights_run_a_plan_and_say_so(run_cli, tmp_path):
    status, out, err = run_cli(
        "run", "--model", "mixtral-8x7b", "--random-weights", "--layers", "1", "--hardware",
        "ci-cpu-amx", "--prompt-len", "4", "--batch", "2", "--gen-len", "2", "--quiet",
        *record_flags(),
    )  # fmt: skip
    assert status == 0, err
    record = json.loads(out)
    assert record["environment"]["checkpoint"] == "random weights (in memory)"
    assert record["workload"]["gen_len"] == 2 and record["predicted"] is not None


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--model", "mixtral-8x7b"), "--random-weights"),
        (("--model", "mixtral-8x7b", "--random-weights", "--layers", "0"), "--layers"),
    ],
)
def test_random_weight_arguments(run_cli, args, fragment):
    status, _, err = run_cli(
        "run", *args, "--prompt-len", "4", "--batch", "2", "--gen-len", "2", "--quiet"
    )
    assert_one_line_error(status, err, fragment)


def test_hardware_with_a_gpu_plans_first_and_caps_n_at_the_prompts(run_cli, files):
    """Planned for an L4, run by the CPU standing in for it: predicted with this host's
    stand-in (the profile `this_host` names), not as an L4. Under continuous batching (the
    default) it plans continuously, as `hrm plan --batching continuous` does: the run admits by
    that plan's limits and is predicted pass by pass; static batches plan static."""
    path, prompts, _ = files
    args = ("run", "--checkpoint", path, "--hardware", "l4", "--gpu-mem", "1.2MB", "--prompts",
            prompts, "--gen-len", "4", "--ignore-eos", "--quiet")  # fmt: skip
    status, out, err = run_cli(*args, *record_flags())
    assert status == 0, err
    record = json.loads(out)
    assert record["plan"]["policy"]["batch_size"] <= len(LENGTHS)
    assert record["plan"]["hardware"] == "l4" and record["predicted"] is not None
    assert record["hardware"] == "ci-cpu-avx512-stand-in"
    assert record["environment"]["prompts"] == len(LENGTHS)
    planned, ran = record["plan"]["continuous"], record["environment"]["continuous"]
    assert planned["requests"] == len(LENGTHS) and planned["max_running"] >= 1
    assert ran["passes"] == planned["passes"] == len(record["predicted"]["pass_seconds"])
    assert max(ran["pass_tokens"]) <= planned["token_budget"]
    status, out, err = run_cli(*args, *record_flags(), "--batching", "static")
    assert status == 0, err
    assert json.loads(out)["plan"].get("continuous") is None


def test_a_stand_in_gpu_takes_from_the_host_what_its_plan_places(run_cli, files, monkeypatch):
    """--hardware l4 on a host with less memory free than the L4's 24 GB: the stand-in GPU
    takes what the plan puts on it, not all 24 GB, so the run does not depend on the moment's
    free memory; where even that does not fit, one line says what it needs and what is free."""
    import hrm.cli.memory_check as memory_check

    path, prompts, _ = files
    args = ("run", "--checkpoint", path, "--hardware", "l4", "--prompts", prompts, "--gen-len",
            "4", "--quiet")  # fmt: skip
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 8e9)
    status, out, err = run_cli(*args)
    assert status == 0, err
    assert len(out.splitlines()) == len(LENGTHS)
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: 2e5)
    status, _, err = run_cli(*args)
    assert_one_line_error(status, err, "of host memory", "on the stand-in GPU",
                          "this host has 200 kB available")  # fmt: skip


def test_cuda_absent_is_refused_before_loading(run_cli, files):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    path, prompts, plan = files
    status, _, err = run_cli(*run_args(path, prompts, plan, "--device", "cuda"))
    assert_one_line_error(status, err, "no CUDA device")


@pytest.mark.parametrize("mode", ["inline", "threads", "deferred"])
def test_the_record_names_the_engine_mode_that_ran(run_cli, files, monkeypatch, mode):
    """HRM_ENGINE picks the mode; the tokens do not depend on it."""
    path, prompts, plan = files
    _, inline_out, _ = run_cli(*run_args(path, prompts, plan))
    monkeypatch.setenv("HRM_ENGINE", mode)
    status, out, err = run_cli(*run_args(path, prompts, plan, *record_flags()))
    assert status == 0, err
    assert json.loads(out)["environment"]["engine"] == mode
    status, out, err = run_cli(*run_args(path, prompts, plan))
    assert status == 0 and out == inline_out


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("HRM_ENGINE", "fast", "inline, threads, deferred"),
        ("HRM_ENGINE", "cuda", "inline, threads, deferred"),
        ("HRM_ENGINE_JITTER", "often", "integer seed"),
    ],
)
def test_a_bad_engine_variable_is_refused_before_loading(
    run_cli, files, monkeypatch, variable, value, fragment
):
    path, prompts, plan = files
    monkeypatch.setenv(variable, value)

    def never(*args, **kwargs):
        raise AssertionError("weights were loaded before the error")

    monkeypatch.setattr(executor.run, "placed_runtime", never)
    status, _, err = run_cli(*run_args(path, prompts, plan))
    assert_one_line_error(status, err, variable, fragment)


def test_resume_after_a_kill_that_tore_the_last_line(run_cli, files, tmp_path, monkeypatch):
    """A kill in the middle of a write leaves half a line: resume drops it, runs that batch
    again, and what it appends starts on a line of its own, so a second kill and resume still
    read every finished batch."""
    path, prompts, plan = files
    whole = tmp_path / "whole.jsonl"
    assert run_cli(*run_args(path, prompts, plan, "--output", whole))[0] == 0
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    _kill_after(monkeypatch, 2)
    assert run_cli(*run_args(path, prompts, plan, "--output", out))[0] == 130
    text = partial.read_text()
    partial.write_text(text[: len(text) - 20])  # the second batch's last line, torn
    _kill_after(monkeypatch, 2)
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out, "--resume"))
    assert status == 130, err
    lines = partial.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # none joined to the torn one
    assert len(lines) == 1 + 3 + 2 + 3 + 3  # the torn batch's two whole lines stay, unread
    monkeypatch.setattr(executor.run, "generate", GENERATE)
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out, "--resume"))
    assert status == 0, err
    assert "resumed: 3 batches" in err
    assert out.read_text() == whole.read_text()


def test_check_plan_refuses_a_gpu_or_a_model_too_small(files):
    """What only a CUDA run or a long prompt meets: the GPU memory given, and the model's
    positions (check_plan directly: the CPU stand-in holds both sides in host memory)."""
    import dataclasses

    from executor.run import check_plan
    from hrm.errors import HrmError
    from hrm.plan import Plan

    path, _, plan_path = files
    plan, arch = Plan.load(plan_path), read_arch(path)
    fits = dict(where="plan.json", gpu_bytes=plan.memory.gpu_bytes, host_bytes=1e12)
    check_plan(plan, arch, [9], 4, stand_in=False, **fits)
    with pytest.raises(HrmError, match="GPU memory"):
        check_plan(plan, arch, [9], 4, stand_in=False, **{**fits, "gpu_bytes": 1e3})
    check_plan(plan, arch, [9], 4, stand_in=True, **{**fits, "gpu_bytes": 1e3})  # host holds it
    short = dataclasses.replace(arch, max_position_embeddings=12)
    check_plan(plan, short, [8], 4, stand_in=False, **fits)
    with pytest.raises(HrmError, match="positions"):
        check_plan(plan, short, [9], 4, stand_in=False, **fits)


def _kill_after(monkeypatch, batches: int) -> None:
    """hrm run is interrupted (as by Ctrl-C) when it starts batch `batches` + 1."""
    calls = []

    def generate(*args, **kwargs):
        if len(calls) == batches:
            raise KeyboardInterrupt
        calls.append(1)
        return GENERATE(*args, **kwargs)

    monkeypatch.setattr(executor.run, "generate", generate)


def test_a_killed_runs_partial_is_kept_and_the_interrupt_says_how_to_resume(
    run_cli, files, tmp_path, monkeypatch
):
    path, prompts, plan = files
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    _kill_after(monkeypatch, 1)
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out))
    last = err.splitlines()[-1]  # after the note of the CPU GEMM path
    assert status == 130 and last.startswith("hrm run: interrupted; ")
    assert f"3 of 10 outputs are in {partial}" in last and "--resume" in last
    kept = partial.read_text()
    monkeypatch.undo()
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out))
    assert_one_line_error(status, err, "--resume", "--overwrite", str(partial))
    assert partial.read_text() == kept and not out.exists()
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out, "--overwrite"))
    assert status == 0, err
    assert len(out.read_text().splitlines()) == 10 and not partial.exists()
    status, _, err = run_cli(
        *run_args(path, prompts, plan, "--output", out, "--resume", "--overwrite")
    )
    assert_one_line_error(status, err, "give one")


def test_outputs_on_stdout_come_in_input_order_as_batches_finish(run_cli, files, monkeypatch):
    """Batches run longest first (indices {1, 6, 8}, then {0, 3, 4}); after two of them the
    first two lines in input order are out, and an interrupt leaves them there."""
    path, prompts, plan = files
    status, whole, _ = run_cli(*run_args(path, prompts, plan))
    assert status == 0
    _kill_after(monkeypatch, 2)
    status, out, err = run_cli(*run_args(path, prompts, plan))
    assert status == 130, err
    assert out.splitlines() == whole.splitlines()[:2]


def test_a_terminated_run_keeps_its_work_and_says_how_to_resume(files, tmp_path):
    """SIGTERM (a kill, a batch system's time limit) in a real process: exit 143, one line
    naming --resume, and the resumed run ends as an uninterrupted one would."""
    import os
    import signal
    import subprocess
    import sys
    import time

    path, _, plan = files
    prompts = tmp_path / "many.jsonl"
    lines = ragged_prompts([1 + i % 9 for i in range(300)], seed=9)
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in lines))
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    cmd = [sys.executable, "-m", "hrm", *map(str, run_args(path, prompts, plan, "--output", out))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and len(partial.read_text().splitlines()) > 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hrm run: terminated; ") and "--resume" in last and not out.exists()
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 300


def test_the_record_says_how_the_weights_were_held_during_the_run(files, monkeypatch):
    """Read before the runtime closes: closing unpins the arenas (on CUDA), and a record read
    after it said unpinned for every run."""
    from executor.api import RunSpec
    from executor.checkpoint import open_checkpoint
    from hrm.plan import Plan

    path, _, plan_path = files
    real = executor.run.placed_runtime

    def pinned_runtime(*args, **kwargs):  # as a CUDA run whose host pinned every arena
        runtime = real(*args, **kwargs)
        runtime.store.pinned = True
        return runtime

    monkeypatch.setattr(executor.run, "placed_runtime", pinned_runtime)
    checkpoint, plan = open_checkpoint(path, "float32"), Plan.load(plan_path)
    spec = RunSpec(checkpoint=None, arch=checkpoint.arch, prompts=((1, 2, 3),), gen_len=2,
                   dtype="float32", device="cpu")  # fmt: skip
    run = executor.run.execute(spec, plan.policy, plan.schedule, checkpoint=checkpoint, quiet=True)
    assert run.environment["pinned_weights"] is True
    assert run.environment["staged_weights"] is False


def test_overwrite_needs_an_output(run_cli, files):
    path, prompts, plan = files
    status, _, err = run_cli(*run_args(path, prompts, plan, "--overwrite"))
    assert_one_line_error(status, err, "--overwrite", "--output")


@pytest.mark.parametrize("w", ["0", "0.4"])
def test_a_model_with_dense_layers_is_planned_and_run_from_the_plan(
    run_cli, checkpoints, files, tmp_path, w
):
    """Qwen2-MoE with its layer 1 dense, planned by `hrm plan` and run by `hrm run --plan`: the
    tokens of the resident run, with the weights the plan counts on each side; a plan made
    for the model without that dense layer is refused as another model's."""
    _, prompts, _ = files
    path = checkpoints["qwen2_moe-dense"]
    plan = tmp_path / "plan.json"
    policy = f"N=3,mu=2,attn=cpu,ffn=gpu,w={w},kv=0"
    status, _, err = run_cli("plan", "--model", path, "--hardware", "l4", "--prompt-len", "9",
                             "--gen-len", "4", "--dtype", "float32", "--policy", policy,
                             "-o", plan)  # fmt: skip
    assert status == 0, err
    out = tmp_path / "out.jsonl"
    status, stdout, err = run_cli(*run_args(path, prompts, plan, "--json", "--output", out))
    assert status == 0, err
    record = json.loads(stdout)
    status, resident, _ = run_cli("run", "--checkpoint", path, "--prompts", prompts,
                                  "--gen-len", "4", "--quiet")  # fmt: skip
    assert status == 0 and out.read_text() == resident
    planned = json.loads(plan.read_text())
    assert (planned["memory"]["gpu"]["resident weights"] > 0) == (w != "0")
    buffers = record["measured"]["buffer_bytes"]
    assert buffers["cpu"]["layer weights"] == pytest.approx(
        planned["memory"]["cpu"]["layer weights"]
    )
    assert buffers["gpu"]["resident weights"] == pytest.approx(
        planned["memory"]["gpu"]["resident weights"]
    )
    assert buffers["gpu"]["paged buffer"] <= planned["memory"]["gpu"]["paged buffer"]
    other = edit_plan(plan, tmp_path, lambda d: d["geometry"].pop("dense_layers"))
    status, _, err = run_cli(*run_args(path, prompts, other))
    assert_one_line_error(status, err, "another model (dense_layers None in the plan")


def test_hrm_run_prints_the_note_on_stderr(run_cli, files, monkeypatch):
    """_best_plan's note about static batches (hrm/cli/plan_continuous.static_faster_note,
    tested on real plans in tests/planner/test_planner_passes.py) reaches stderr, not the
    answers."""
    import hrm.cli.plan_continuous as pc

    monkeypatch.setattr(pc, "static_faster_note", lambda *a: "note: static is faster here")
    path, prompts, _ = files
    args = ("--hardware", "l4", "--gpu-mem", "1.2MB", "--prompts", prompts, "--gen-len", "2")
    status, out, err = run_cli("run", "--checkpoint", path, *args, "--quiet")
    assert status == 0, err
    assert "note: static is faster here" in err and "static is faster" not in out
