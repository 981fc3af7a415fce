"""`hrm profile` on the command line: bad input is one line and exit 2, good input a profile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hrm.cli import main
from hrm.cli.profile import format_comparison
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.profiling import PRESETS
from tests.test_profile import TINY_ARCH, TINY_PLAN


def _fails_with_one_line(capsys, argv: list[str], expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert expected in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["profile", "-o", "no/such/dir/p.yaml"], "does not exist"),
        (["profile", "-o", "{tmp}"], "is a directory"),
        (["profile", "-o", "{tmp}/p.txt"], "name the output FILE.yaml"),
        (["profile", "-o", "{tmp}/p.yaml", "--model", "no-such-model"], "no-such-model"),
        (["profile", "-o", "{tmp}/p.yaml", "--compare", "no-such-gpu"], "no-such-gpu"),
        (["profile", "-o", "{tmp}/p.yaml", "--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, expected):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse usage errors exit from inside parse_args
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert expected in err
    assert list(tmp_path.iterdir()) == []


def test_unwritable_directory_is_refused_before_measuring(capsys, tmp_path):
    """/proc takes no new file, not even from root (CI runs as root, where permission bits
    would not stop it)."""
    _fails_with_one_line(capsys, ["profile", "-o", "/proc/p.yaml"], "not writable")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_cuda_requested_but_absent_is_one_line_and_exit_2(capsys, tmp_path):
    output = tmp_path / "p.yaml"
    _fails_with_one_line(capsys, ["profile", "--device", "cuda", "-o", str(output)], "--device cpu")
    assert not output.exists()


def test_a_quick_run_writes_a_measured_cpu_profile(capsys, tmp_path, monkeypatch):
    config = json.loads(Path("hrm/model_configs/mixtral-8x7b.json").read_text())
    config.update(hidden_size=TINY_ARCH.hidden_size, intermediate_size=TINY_ARCH.intermediate_size)
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setitem(PRESETS, "quick", TINY_PLAN)
    output = tmp_path / "box.yaml"
    argv = ["profile", "--quick", "--device", "cpu", "--model", str(tmp_path / "config.json")]
    assert main([*argv, "-o", str(output), "--compare", "t4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {output}" in out and "t4 (datasheet)" in out
    profile = HardwareProfile.load(output)
    assert profile.name == "box" and profile.source == "measured" and not profile.has_gpu
    assert set(profile.cpu.launch_overhead) == {"bfloat16"}  # a quick profile's
    assert set(profile.cpu.elementwise_rate) == {"bfloat16"}
    # the compact formats' dequantization on each device; their KV attention: the full sweep's
    assert set(profile.cpu.dequantize_rates) == {"int8", "int4"}
    assert "int8" not in profile.cpu.attention_curves
    # latent attention's decode stage, at DeepSeek-V2-Lite's heads (Mixtral's model has none)
    latent, plain = profile.cpu.latent_attention_curves, profile.cpu.attention_curves
    assert set(latent) == set(plain) and "bfloat16" in latent
    assert latent["bfloat16"].points != plain["bfloat16"].points
    assert "executor overhead (bfloat16)" in out
    # two processes' gloo all-reduce: what tp ranks on this host pay, alpha and beta
    ring = profile.interconnect
    assert ring.kind == "gloo" and ring.latency_s > 0 and ring.bytes_per_s > 0
    assert "all-reduce (gloo)" in out and "median_s_by_bytes" in profile.provenance["all_reduce"]
    assert profile.provenance["command"] == " ".join(["hrm", *argv, "-o", str(output)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["box.yaml", "config.json"]


def test_comparison_lists_every_figure_of_both_profiles_with_ratios():
    table = format_comparison(resolve_hardware("l4"), resolve_hardware("t4"))
    lines = table.splitlines()
    assert "t4 (datasheet)" in lines[0]
    link = next(line for line in lines if line.startswith("link h2d"))
    assert link.split()[-1].endswith("x")
    cpu_only = dataclasses.replace(resolve_hardware("t4"), gpu=None, link=None)
    rows = format_comparison(cpu_only, resolve_hardware("t4")).splitlines()
    gpu_row = next(line for line in rows if line.startswith("gpu memory "))
    assert gpu_row.split()[-1] == "-"


def test_bundled_ci_cpu_profile_drives_plan_and_roofline(run_cli, tmp_path):
    """The measured CPU-only profile (curves, no GPU) is accepted like a datasheet one."""
    from transformers import MixtralConfig

    config = tmp_path / "config.json"
    MixtralConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
    ).to_json_file(config)
    plan = ["plan", "--hardware", "ci-cpu", "--prompt-len", "64", "--gen-len", "16", "--json"]
    status, out, err = run_cli(*plan, "--model", config)
    assert status == 0, err
    data = json.loads(out)
    assert not data["policy"]["ffn_on_gpu"] and data["predicted"]["throughput_tok_s"] > 0
    chart = tmp_path / "roofline.png"
    status, _, err = run_cli("roofline", "--model", config, "--hardware", "ci-cpu", "-o", chart)
    assert status == 0, err
    assert chart.stat().st_size > 0
    # Mixtral 8x7B (93 GB in bf16) does not fit its 25 GB: said in one line
    status, _, err = run_cli(*plan, "--model", "mixtral-8x7b")
    assert status == 2 and err.count("\n") == 1 and "cpu" in err.lower(), err
