"""A run's progress where no one watches a terminal (nohup, a scheduler, a pipe): a line at a
steady interval with the requests done, the rate and the ETA; nothing with --quiet. It printed
nothing until the end."""

from __future__ import annotations

import json

import hrm.progress
from hrm.progress import RunProgress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_continuous_requests_count_as_each_ends(monkeypatch, capsys):
    """Requests of continuous batching end one by one, in any order: each counts as done when it
    ends, and what it gave up of its max_tokens counts toward the ETA at once."""
    monkeypatch.setattr(hrm.progress, "LINE_INTERVAL_S", 30.0)
    clock = Clock()
    bar = RunProgress(tokens=30, requests=3, quiet=False, clock=clock)
    bar.step("pass", 3)
    bar.request_done(1, 10)  # stopped on its first token: 9 given up
    clock.now += 30
    bar.step("pass", 2)  # 5 made, 14 counted, 30 s
    bar.close()
    assert capsys.readouterr().err.splitlines() == [
        "progress: 1/3 requests done, 5 tokens (at most 30), 0.2 tok/s, ETA 34 s"
    ]


def test_a_line_every_interval_with_requests_rate_and_eta(monkeypatch, capsys):
    """Two batches of 2 requests, 10 tokens at most each; the first batch's requests stop after
    4 of its 10 tokens, so its share counts whole for the ETA and 4 for the rate."""
    monkeypatch.setattr(hrm.progress, "LINE_INTERVAL_S", 30.0)
    clock = Clock()
    bar = RunProgress(tokens=20, requests=4, quiet=False, clock=clock)
    clock.now += 10
    bar.step("prefill", 2)  # 10 s in: too soon for a line
    assert capsys.readouterr().err == ""
    clock.now += 30
    bar.step("decode", 2)
    bar.batch_done(2, 10)  # 40 s in: the line came with the step, 30 s after the start
    clock.now += 40
    bar.step("prefill", 2)  # 80 s: 40 s after the last line
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "progress: 0/4 requests done, 4 tokens (at most 20), 0.1 tok/s, ETA 2 min 40 s",
        "progress: 2/4 requests done, 6 tokens (at most 20), 0.1 tok/s, ETA 53 s",
    ]


def test_quiet_prints_no_line(monkeypatch, capsys):
    monkeypatch.setattr(hrm.progress, "LINE_INTERVAL_S", 0.0)
    bar = RunProgress(tokens=4, requests=1, quiet=True)
    bar.step("prefill", 1)
    bar.batch_done(1, 4)
    bar.close()
    assert capsys.readouterr().err == ""


def test_hrm_run_reports_progress_on_a_log(monkeypatch, run_cli, tmp_path, mixtral_with_tokenizer):
    """stderr captured (not a terminal): progress lines before the summary, the last with every
    request done; with --quiet none."""
    monkeypatch.setattr(hrm.progress, "LINE_INTERVAL_S", 0.0)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [5 + i, 6]}) + "\n" for i in range(3)))
    args = ["run", "--checkpoint", mixtral_with_tokenizer, "--prompts", path]
    status, out, err = run_cli(*args, "--gen-len", "3", "--ignore-eos")
    assert status == 0, err
    lines = [line for line in err.splitlines() if line.startswith("progress: ")]
    assert lines and lines[-1].startswith("progress: 3/3 requests done, 9 tokens (at most 9)")
    assert "ETA 0" in lines[-1]
    status, out, err = run_cli(*args, "--gen-len", "3", "--quiet")
    assert status == 0 and "progress:" not in err
