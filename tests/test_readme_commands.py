"""Every command the README shows runs as written, in the order a reader meets them, in a folder
holding what the commands name: DIR and ./Qwen3-30B-A3B (one tiny checkpoint with a tokenizer),
batch.jsonl (a text prompt and token ids, each with its max_tokens) and reports/.

Only sizes are small: the bundled mixtral-8x7b config is read at small widths by the commands
that would otherwise load or time 2 real layers of it (`hrm profile --quick`, `hrm run
--random-weights`, `hrm validate --quick`), `hrm profile --quick` sweeps the tiny preset, and the
host's last-level cache reads 8 MiB (a profile sizes its arrays by it: 1.3 GB each on this 480
MiB-L3 VM). The plan commands run on the real configs. The install commands are CI's own
(`.ci/run`), and the test command is this suite."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hrm.profiling import PRESETS
from tests.test_profile import TINY_PLAN

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"mixtral-8x7b": {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 2048}}
HEAVY = ("hrm profile", "hrm validate", "--random-weights", "hrm report")


def readme_commands() -> list[str]:
    """The README's commands in the order a reader meets them: each line of a bash block, and
    each `hrm ...` of the workflow's steps, joined where the text wraps them; an install's `&&`
    tail is the command."""
    text = (ROOT / "README.md").read_text()
    workflow = text.index("## The workflow")
    end = text.index("\n## ", workflow + 1)
    found = [(m.start(), line) for m in re.finditer(r"```bash\n(.*?)```", text, re.S)
             for line in m.group(1).splitlines() if line.strip()]  # fmt: skip
    found += [(workflow + m.start(), " ".join(m.group(1).split()))
              for m in re.finditer(r"`(hrm [^`]+)`", text[workflow:end])]  # fmt: skip
    commands = []
    for _, command in sorted(found):
        command = command.split(" && ")[-1]
        if command.startswith("python -m pytest") or " ... " in command or " -" not in command:
            continue  # this suite; a synopsis (`hrm report RUN.json ... -o DIR`); a name alone
        commands.append(command)
    return list(dict.fromkeys(commands))


def test_the_readme_lists_the_commands_this_test_knows():
    """A command added to the README is run here (the test fails until it is)."""
    commands = readme_commands()
    assert len(commands) >= 10, commands
    assert any(c.startswith("hrm profile --quick -o me.yaml") for c in commands)
    assert any(c.startswith("torchrun ") for c in commands)
    assert all(c.startswith(("hrm ", "torchrun ")) for c in commands), commands


@pytest.fixture
def reader_folder(tmp_path, monkeypatch):
    """A folder with what the README's commands name, as the reader's would be."""
    from tests.executor.conftest import _qwen_family_config, save_model, save_tokenizer

    checkpoint = save_model(_qwen_family_config("qwen3_moe"), tmp_path / "DIR", seed=2)
    save_tokenizer(checkpoint)
    (tmp_path / "Qwen3-30B-A3B").symlink_to(checkpoint)
    rows = [{"prompt": "w1 w2 w3", "max_tokens": 3}, {"prompt_token_ids": [5, 6, 7, 8],
            "max_tokens": 2}]  # fmt: skip
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reports").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _small_bundled(tmp_path: Path) -> Path:
    """The bundled configs, mixtral-8x7b's at small widths."""
    import hrm.arch

    folder = tmp_path / "small-configs"
    folder.mkdir()
    for source in hrm.arch.BUNDLED_DIR.glob("*.json"):
        config = json.loads(source.read_text())
        config.update(SMALL.get(source.stem, {}))
        (folder / source.name).write_text(json.dumps(config))
    return folder


def test_every_readme_command_runs_as_written(reader_folder, run_cli, monkeypatch):
    """Each command in turn; one that writes an --output an earlier one wrote (the README shows
    them as alternatives) runs with the earlier answers moved aside, and gives the same ones."""
    import hrm.arch
    import hrm.profiling.cpu

    small = _small_bundled(reader_folder)
    monkeypatch.setitem(PRESETS, "quick", dataclasses.replace(TINY_PLAN, name="quick"))
    monkeypatch.setattr(hrm.profiling.cpu, "_last_level_cache_bytes", lambda: 8 * 2**20)
    for command in readme_commands():
        argv = shlex.split(command)
        output = Path(argv[argv.index("--output") + 1]) if "--output" in argv else None
        earlier = (
            output.rename(output.with_suffix(".earlier")) if output and output.exists() else None
        )
        if argv[0] == "torchrun":
            _torchrun(argv)
        else:
            with monkeypatch.context() as m:
                if any(h in command for h in HEAVY):
                    m.setattr(hrm.arch, "BUNDLED_DIR", small)
                args = [x for a in argv[1:] for x in (sorted(glob.glob(a)) if "*" in a else [a])]
                status, out, err = run_cli(*args)
            # validate exits 1 where its sweep's error passes --max-mape: a finding, not a crash
            assert status in ((0, 1) if args[0] == "validate" else (0,)), f"{command}: {err}"
            _check_what_it_made(command, out)
        if earlier is not None:
            assert output.read_text() == earlier.read_text(), command


def _torchrun(argv: list[str]) -> None:
    """torchrun as the README starts it, on a free port (tests may run side by side)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--master-port={port}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, *argv[1:]], env=env, text=True, capture_output=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr


def _check_what_it_made(command: str, out: str) -> None:
    """Each command's product is there: the plan, profile, answers, figures."""
    if " -o " in command:
        target = Path(command.split(" -o ")[1].split()[0])
        assert target.exists(), command
    if "--output answers.jsonl" in command:
        answers = [json.loads(line) for line in Path("answers.jsonl").read_text().splitlines()]
        assert [len(a["output_token_ids"]) for a in answers] == [3, 2]
    if command.startswith("hrm plan") and " -o " not in command:
        assert "tok/s" in out
    if "--random-weights" in command and command.startswith("hrm run"):
        assert len(out.splitlines()) == 8  # --batch 8: an answer a line on stdout
