"""No finished answer is lost: one writer per --output (two real processes), a finished output is
replaced only with --overwrite, an input is never the output, --json keeps the answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.output_files import OutputLock, check_not_an_input, partial_files
from hrm.errors import HrmError
from tests.conftest import assert_one_line_error
from tests.executor.conftest import ragged_prompts
from tests.executor.test_run_plan import run_args

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """The subprocesses' environment, read when they start (a mutation test sets its mutant in
    it after this module is imported)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


# a run that holds its output for a few seconds: generation slowed by a sleep per batch
SLOW_RUN = """
import sys, time
import executor.run as r
real = r.generate
def slow(*a, **k):
    time.sleep(float(sys.argv[1]))
    return real(*a, **k)
r.generate = slow
from hrm.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def write_prompts(path: Path, lengths, seed: int = 3) -> Path:
    rows = ragged_prompts(lengths, seed=seed)
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in rows))
    return path


def slow_run(sleep: float, *args) -> subprocess.Popen:
    cmd = [sys.executable, "-c", SLOW_RUN, str(sleep), *map(str, args)]
    return subprocess.Popen(cmd, env=env(), cwd=ROOT, text=True, stderr=subprocess.PIPE)


def hrm(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hrm", *map(str, args)]
    return subprocess.run(cmd, env=env(), cwd=ROOT, text=True, capture_output=True, timeout=300)


def kill_after_first_batch(monkeypatch):
    """A run's second batch raises KeyboardInterrupt (a Ctrl-C between batches); returns the
    real generate, to put back."""
    import executor.run

    real, calls = executor.run.generate, []

    def killed_after_one(*a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(executor.run, "generate", killed_after_one)
    return real


@pytest.mark.parametrize("extra", [(), ("--overwrite",)])
def test_a_second_run_into_a_live_output_is_refused_naming_the_first(checkpoints, tmp_path, extra):
    """Two real processes: while the first writes OUT, the second (with or without
    --overwrite) stops in one line naming the first's pid, and the first's answers are whole."""
    prompts = write_prompts(tmp_path / "p.jsonl", (3, 5, 4))
    out = tmp_path / "out.jsonl"
    args = ("run", "--checkpoint", checkpoints["mixtral-single"], "--prompts", prompts,
            "--gen-len", "3", "--quiet", "--output", out, "--batching", "static")  # fmt: skip
    first = slow_run(4.0, *args)  # (the sleep is per static batch)
    lock = tmp_path / "out.jsonl.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    second = hrm(*args, *extra)
    assert_one_line_error(second.returncode, second.stderr, "being written by another hrm run "
                          f"(process {first.pid} on {os.uname().nodename}); wait for it to "
                          "finish, or choose another --output")  # fmt: skip
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert len(out.read_text().splitlines()) == 3
    assert not lock.exists() and not partial_files(out)


def test_a_killed_holder_leaves_no_lock_behind(tmp_path):
    """The kernel drops a dead process's lock: a lock file a SIGKILL left does not block."""
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from executor.output_files import OutputLock; OutputLock(Path(sys.argv[1])); "
         "print('held', flush=True); time.sleep(60)", str(out)],
        env=env(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(HrmError, match=f"process {holder.pid}"):
        OutputLock(out)
    holder.kill()
    holder.wait()
    left = tmp_path / "out.jsonl.lock"
    assert left.exists() and not left.stat().st_mode & 0o111  # a data file, not a program
    lock = OutputLock(out)
    assert json.loads(left.read_text()) == {"pid": os.getpid(), "host": os.uname().nodename}
    lock.release()
    lock.release()  # twice is once
    assert not left.exists()


def test_a_lock_file_removed_as_it_was_opened_is_not_the_one_locked(tmp_path):
    """The holder before us removes the file between our open and our lock: we hold a lock on
    a file no one else can find, so we must see that and open the live one."""
    from executor.output_files import _same_file

    path = tmp_path / "x.lock"
    path.write_text("")
    fd = os.open(path, os.O_RDWR)
    try:
        assert _same_file(fd, path)
        path.unlink()
        assert not _same_file(fd, path)
        path.write_text("")  # another run's new file at the same path
        assert not _same_file(fd, path)
    finally:
        os.close(fd)


def test_partial_files_are_found_in_group_order(tmp_path):
    out = tmp_path / "o.jsonl"
    for name in ("o.jsonl.partial.10", "o.jsonl.partial.2", "o.jsonl.partial", "o.jsonl.partialx",
                 "o.jsonl.partial.a", "p.jsonl.partial.1"):  # fmt: skip
        (tmp_path / name).write_text("")
    assert [p.name for p in partial_files(out)] == [
        "o.jsonl.partial", "o.jsonl.partial.2", "o.jsonl.partial.10"
    ]  # fmt: skip


def test_a_finished_output_is_replaced_only_with_overwrite(run_cli, checkpoints, tmp_path):
    """A run of other prompts into a finished OUT is refused and OUT kept; --overwrite
    replaces it; --resume with nothing to resume is refused too."""
    path = checkpoints["mixtral-single"]
    out = tmp_path / "out.jsonl"
    common = ("run", "--checkpoint", path, "--gen-len", "2", "--quiet", "--output", out)
    first = write_prompts(tmp_path / "a.jsonl", (3, 4))
    assert run_cli(*common, "--prompts", first)[0] == 0
    kept = out.read_text()
    other = write_prompts(tmp_path / "b.jsonl", (5, 2, 6), seed=4)
    for extra in ((), ("--resume",)):
        status, _, err = run_cli(*common, "--prompts", other, *extra)
        assert_one_line_error(status, err, "holds the answers of a finished run", "--overwrite")
        assert out.read_text() == kept
    assert run_cli(*common, "--prompts", other, "--overwrite")[0] == 0
    assert len(out.read_text().splitlines()) == 3


def _same_file_ways(tmp_path: Path, prompts: Path):
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    hard = tmp_path / "hard.jsonl"
    os.link(prompts, hard)
    via = tmp_path / "sub"
    via.mkdir()
    return [prompts, link, hard, via / ".." / prompts.name]


def test_the_prompts_are_never_the_output(run_cli, checkpoints, tmp_path):
    """--prompts X --output X, through a symlink, a hard link or another spelling of the path,
    and --prompts naming the output's partial file: refused, the input untouched."""
    prompts = write_prompts(tmp_path / "p.jsonl", (3, 4))
    before = prompts.read_text()
    common = ("run", "--checkpoint", checkpoints["mixtral-single"], "--gen-len", "2", "--quiet")
    for out in _same_file_ways(tmp_path, prompts):
        for extra in ((), ("--overwrite",), ("--resume",)):
            status, _, err = run_cli(*common, "--prompts", prompts, "--output", out, *extra)
            assert_one_line_error(status, err, "is the same file as --output: the run would "
                                  "write over its input; choose another --output")  # fmt: skip
            assert prompts.read_text() == before
    partial = tmp_path / "o.jsonl.partial"
    partial.write_text(before)
    status, _, err = run_cli(*common, "--prompts", partial, "--output", tmp_path / "o.jsonl",
                             "--overwrite")  # fmt: skip
    assert_one_line_error(status, err, "same file as --output's o.jsonl.partial")
    assert partial.read_text() == before
    lock = tmp_path / "o.jsonl.lock"  # a lock file a killed run left, given as the prompts
    lock.write_text(before)
    status, _, err = run_cli(*common, "--prompts", lock, "--output", tmp_path / "o.jsonl",
                             "--overwrite")  # fmt: skip
    assert_one_line_error(status, err, "same file as --output's o.jsonl.lock")
    assert lock.read_text() == before


def test_a_plan_or_profile_is_never_the_output(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    with pytest.raises(HrmError, match="--plan .* is the same file as --output"):
        check_not_an_input(plan, {"--prompts": None, "--plan": str(plan)})
    check_not_an_input(tmp_path / "new.jsonl", {"--plan": str(plan), "--hardware": "l4"})


def test_json_without_output_is_refused_not_dropped(run_cli, checkpoints):
    status, out, err = run_cli("run", "--checkpoint", checkpoints["mixtral-single"],
                               "--prompt-len", "3", "--batch", "2", "--json")  # fmt: skip
    assert_one_line_error(status, err, "--json prints the run record", "--output")
    assert out == ""


def test_a_partial_file_of_any_group_is_refused_without_resume_and_read_with_it(
    run_cli, files, tmp_path, monkeypatch
):
    """Partial files named for data-parallel groups (as a killed torchrun leaves them: one with
    a batch, one killed before its header) block a plain run, naming them, and a single process
    --resume goes on from them and removes them all."""
    import executor.run

    path, prompts, plan = files
    out, whole = tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    assert run_cli(*run_args(path, prompts, plan, "--output", whole))[0] == 0
    real = kill_after_first_batch(monkeypatch)
    assert run_cli(*run_args(path, prompts, plan, "--output", out))[0] == 130
    monkeypatch.setattr(executor.run, "generate", real)
    (tmp_path / "out.jsonl.partial").rename(tmp_path / "out.jsonl.partial.1")
    (tmp_path / "out.jsonl.partial.0").write_text("")
    status, _, err = run_cli(*run_args(path, prompts, plan, "--output", out))
    assert_one_line_error(status, err, "out.jsonl.partial.0", "out.jsonl.partial.1", "--resume")
    status, record, err = run_cli(*run_args(path, prompts, plan, "--output", out, "--resume",
                                            "--json"))  # fmt: skip
    assert status == 0, err
    assert out.read_text() == whole.read_text()
    assert json.loads(record)["environment"]["batches_resumed"] == 1
    assert not partial_files(out) and not (tmp_path / "out.jsonl.lock").exists()


def test_a_bf16_run_resumed_gives_the_uninterrupted_answers_bit_for_bit(
    run_cli, checkpoints, tmp_path, monkeypatch
):
    """bf16 (where a GEMM path or a batch's make-up shows in the bits): killed after its first
    batch and resumed, the output equals an uninterrupted run's, byte for byte."""
    import executor.run
    from executor.checkpoint import read_arch
    from hrm.hardware import resolve_hardware
    from hrm.policy import Policy
    from hrm.workload import Workload
    from planner import predict

    path = checkpoints["mixtral-single"]
    prompts = write_prompts(tmp_path / "p.jsonl", (3, 7, 2, 5, 6, 4, 8), seed=11)
    policy = Policy(batch_size=3, micro_batch_size=2, attention_on_gpu=False, ffn_on_gpu=True,
                    weights_gpu_fraction=0.0, kv_gpu_fraction=0.0, weight_dtype="bfloat16",
                    kv_dtype="bfloat16")  # fmt: skip
    workload = Workload(prompt_len_mean=5.0, prompt_len_max=8, gen_len=5)
    plan = predict(read_arch(path), resolve_hardware("l4"), workload, policy, "cgopipe")
    plan_path = plan.save(tmp_path / "plan.json")
    common = ("run", "--checkpoint", path, "--plan", plan_path, "--prompts", prompts,
              "--gen-len", "5", "--ignore-eos", "--quiet", "--batching", "static")  # fmt: skip
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert run_cli(*common, "--output", whole)[0] == 0
    real = kill_after_first_batch(monkeypatch)
    assert run_cli(*common, "--output", out)[0] == 130
    monkeypatch.setattr(executor.run, "generate", real)
    assert run_cli(*common, "--output", out, "--resume")[0] == 0
    assert out.read_bytes() == whole.read_bytes()
