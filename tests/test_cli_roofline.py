import json
import os

import pytest
import yaml

from hrm.arch import bundled_model_names
from hrm.hardware import bundled_profile_names, resolve_hardware
from tests.conftest import assert_one_line_error

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("hardware", bundled_profile_names())
@pytest.mark.parametrize("model", bundled_model_names())
def test_draws_every_bundled_model_on_every_profile(run_cli, tmp_path, model, hardware):
    out = tmp_path / "chart.png"
    status, stdout, _ = run_cli("roofline", "--model", model, "--hardware", hardware, "-o", out)
    assert status == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 20_000
    assert f"{model} on {hardware}" in stdout


def test_json_numbers(run_cli, tmp_path):
    status, stdout, _ = run_cli(
        "roofline", "--hardware", "l4", "--batch", "64,1024", "--json", "-o", tmp_path / "r.png"
    )
    assert status == 0
    report = json.loads(stdout)
    assert report["turning"]["p1"] == pytest.approx(81.25)
    assert report["turning"]["p2"] == pytest.approx(7562.5)
    ffn = {p["batch"]: p for p in report["points"] if p["op"] == "expert_ffn"}
    attention = [p for p in report["points"] if p["op"] == "attention"]
    assert ffn[64]["better_on"] == "cpu" and ffn[1024]["better_on"] == "gpu"
    assert all(p["better_on"] == "cpu" for p in attention)  # far left of P1


def test_cpu_only_profile(run_cli, tmp_path):
    data = resolve_hardware("l4").to_dict()
    del data["gpu"], data["link"]
    profile = tmp_path / "cpu.yaml"
    profile.write_text(yaml.safe_dump(data))
    status, stdout, _ = run_cli("roofline", "--hardware", profile, "-o", tmp_path / "cpu.png")
    assert status == 0 and "no GPU" in stdout
    assert (tmp_path / "cpu.png").exists()


def _bad_profile(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--hardware", "l5"], "unknown hardware profile 'l5'"),
        (["--hardware", "missing/dir/profile.yaml"], "no such file"),
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--batch", "64,-1"], "--batch"),
        (["--batch", "lots"], "--batch"),
        (["--kv-dtypes", "int3"], "unknown dtype 'int3'"),
        (["--dtype", "bfloat16,float16"], "expected one dtype"),
        (["--context", "0"], "--context"),
    ],
)
def test_bad_arguments(run_cli, tmp_path, args, fragment):
    out = tmp_path / "r.png"
    status, _, err = run_cli("roofline", *args, "-o", out)
    assert_one_line_error(status, err, fragment)
    assert not out.exists()


def test_bad_files(run_cli, tmp_path):
    out = tmp_path / "r.png"
    malformed = _bad_profile(tmp_path, "gpu: [unclosed\n")
    assert_one_line_error(
        *run_cli("roofline", "--hardware", malformed, "-o", out)[::2], "malformed YAML"
    )
    negative = _bad_profile(
        tmp_path,
        yaml.safe_dump(
            {
                **resolve_hardware("l4").to_dict(),
                "cpu": {**resolve_hardware("l4").to_dict()["cpu"], "memory": "-1 GB"},
            }
        ),
    )
    assert_one_line_error(
        *run_cli("roofline", "--hardware", negative, "-o", out)[::2], "cpu: memory"
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert_one_line_error(
        *run_cli("roofline", "--model", config, "-o", out)[::2], "unsupported model_type"
    )
    config.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "num_hidden_layers": 2,
                "hidden_size": -8,
                "intermediate_size": 8,
                "num_attention_heads": 2,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "vocab_size": 9,
            }
        )
    )
    assert_one_line_error(*run_cli("roofline", "--model", config, "-o", out)[::2], "hidden_size")
    config.write_text("{")
    assert_one_line_error(*run_cli("roofline", "--model", config, "-o", out)[::2], "malformed JSON")
    assert not out.exists()


def test_unwritable_directory(run_cli, tmp_path):
    # /sys refuses new files even to root; a 0o500 directory refuses everyone else.
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    target = "/sys/r.png" if os.geteuid() == 0 else locked / "r.png"
    status, _, err = run_cli("roofline", "-o", target)
    assert_one_line_error(status, err, "not writable")


def test_unwritable_output_paths(run_cli, tmp_path):
    status, _, err = run_cli("roofline", "-o", tmp_path / "no" / "such" / "dir" / "r.png")
    assert_one_line_error(status, err, "does not exist")
    status, _, err = run_cli("roofline", "-o", tmp_path)
    assert_one_line_error(status, err, "is a directory")


def test_usage_errors_are_one_line(run_cli):
    status, _, err = run_cli("roofline", "--context", "many")
    assert_one_line_error(status, err, "--context")
    status, _, err = run_cli("frobnicate")
    assert_one_line_error(status, err, "invalid choice")


@pytest.mark.parametrize("name", ["r.txt", "noext", "r.png.bak"])
def test_an_output_that_is_no_chart_format_is_refused_before_any_work(run_cli, tmp_path, name):
    status, out, err = run_cli("roofline", "-o", tmp_path / name)
    assert_one_line_error(status, err, f"-o {tmp_path / name}: a chart is written as .png")
    assert out == "" and not list(tmp_path.iterdir())


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_the_chart_takes_the_format_its_name_says(run_cli, tmp_path, suffix):
    out = tmp_path / f"r{suffix}"
    assert run_cli("roofline", "-o", out)[0] == 0
    head = out.read_bytes()[:5]
    assert head == (b"%PDF-" if suffix == ".pdf" else b"<?xml")


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_outputs_take_the_users_umask(run_cli, tmp_path, umask):
    """mkstemp makes 0600 files and the rename kept that mode: teammates could not read plots,
    plans or profiles. Every atomic write now takes the umask, as open() would."""
    before = os.umask(umask)
    try:
        assert run_cli("roofline", "-o", tmp_path / "r.png")[0] == 0
    finally:
        os.umask(before)
    assert (tmp_path / "r.png").stat().st_mode & 0o777 == 0o666 & ~umask


def test_version(run_cli):
    from hrm import __version__

    status, out, _ = run_cli("--version")
    assert status == 0 and out.strip() == f"hrm {__version__}"
