"""`hrm report` over RunRecords and `hrm validate` end to end on a tiny checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hrm.record import Measurement, RunRecord
from hrm.report import load_records, summaries
from tests.conftest import assert_one_line_error, record_flags

ARGS = ["--prompt-len", "5", "--batch", "3", "--gen-len", "3", "--ignore-eos", "--quiet"]


def hand_record(
    path, predicted: float, measured: float, *, version="v1", schedule=None, host_speed=None,
    batch=1,
):  # fmt: skip
    """A record whose throughputs are `predicted` and `measured` tok/s (1 s prefill + decode);
    records alike in all but throughput are repeats of one setting."""
    extra = {"host_speed": host_speed} if host_speed else {}
    record = RunRecord(
        model="m",
        hardware="h",
        workload={"prompt_len_mean": 4, "prompt_len_max": 4, "gen_len": 2, "padding": False},
        plan={"schedule": schedule, "busy_s": {}} if schedule else None,
        predicted={
            "throughput_tok_s": predicted,
            "prefill_s": 0.5,
            "decode_s": 0.5,
            "generated_tokens": int(predicted),
        },  # fmt: skip
        measured=Measurement(prefill_s=0.5, decode_s=0.5, generated_tokens=int(measured)),
        environment={"model_version": version, "batch_size": batch, "dtype": "float32", **extra},
    )
    record.save(path)
    return path


def test_mape_and_worst_case_by_hand(tmp_path):
    paths = [
        hand_record(tmp_path / "a.json", 110, 100, batch=1),  # +10%
        hand_record(tmp_path / "b.json", 80, 100, batch=2),  # -20%
        hand_record(tmp_path / "c.json", 100, 100, batch=3),  # 0
        hand_record(tmp_path / "d.json", 150, 100, version="v2"),  # another model: apart
    ]
    by_version = summaries(load_records(paths))
    v1 = by_version["v1"]["all"]
    assert v1.runs == v1.settings == 3 and v1.mape == pytest.approx(0.1)
    assert v1.worst.name == v1.worst_run.name == "b"
    assert v1.worst.error == v1.worst_run.error == pytest.approx(-0.2)
    assert v1.run_mape == pytest.approx(0.1)
    assert by_version["v2"]["all"].mape == pytest.approx(0.5)
    assert set(by_version["v1"]) == {"resident", "all"}


def test_repeats_of_a_setting_count_once_at_the_median_of_their_errors(tmp_path):
    """Three repeats at +10%, +50%, -5% (each against its own prediction: the passes of hrm
    validate have their own profiles) are one setting at +10%; another batch size is another
    setting; the runs one by one keep their own MAPE and worst case."""
    paths = [
        hand_record(tmp_path / "s-1.json", 110, 100),
        hand_record(tmp_path / "s-2.json", 120, 80),
        hand_record(tmp_path / "s-3.json", 95, 100),
        hand_record(tmp_path / "t-1.json", 80, 100, batch=8),
        hand_record(tmp_path / "t-2.json", 100, 100, batch=8),
    ]
    rows = load_records(paths)
    summary = summaries(rows)["v1"]["all"]
    assert (summary.settings, summary.runs) == (2, 5)
    assert summary.worst.name == "s" and summary.worst.error == pytest.approx(0.10)
    # t: the median of -20% and 0 is their mean
    assert summary.mape == pytest.approx((0.10 + 0.10) / 2)
    assert summary.worst_run.name == "s-2" and summary.worst_run.error == pytest.approx(0.5)
    assert summary.run_mape == pytest.approx((0.1 + 0.5 + 0.05 + 0.2 + 0) / 5)
    from hrm.report import markdown

    page = markdown(rows, "t")
    assert "| s | resident | +10.0%, +50.0%, -5.0% | +10.0% |" in page
    assert "| resident | 2 | 5 | 10.0% | +10.0% | s: N=1 " in page
    assert "| 17.0% | +50.0% s-2 |" in page


def test_the_scatters_log_axes_are_labelled_1_2_5_in_plain_numbers():
    """Not matplotlib's scientific labels on every minor tick, which overlapped under two
    decades."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hrm.report import _plain_log_labels

    fig, ax = plt.subplots()
    ax.set_xscale("log")
    ax.set_xlim(15, 700)
    _plain_log_labels(ax)
    fig.canvas.draw()
    ticks = ax.xaxis.get_major_ticks() + ax.xaxis.get_minor_ticks()
    labels = {t.label1.get_text() for t in ticks if 15 <= t.get_loc() <= 700}
    plt.close(fig)
    assert labels - {""} == {"20", "50", "100", "200", "500"}


def test_report_gives_each_runs_host_speed_where_validate_checked_it(tmp_path):
    from hrm.report import markdown

    around = {"dtype": "float32", "before": 0.95, "after": 0.71}
    checked = hand_record(tmp_path / "a.json", 130, 100, host_speed=around)
    only_before = {"dtype": "float32", "before": 1.2}
    half = hand_record(tmp_path / "b.json", 100, 100, host_speed=only_before, batch=2)
    plain = hand_record(tmp_path / "c.json", 100, 100, batch=3)
    page = markdown(load_records([checked, half, plain]), "t")
    assert "| error | host speed | detail |" in page
    assert "| +30.0% | 95% → 71% | [bars](run-1.png) |" in page
    assert "| +0.0% | 120% → ? | [bars](run-2.png) |" in page
    assert "| +0.0% | ? → ? | [bars](run-3.png) |" in page
    # the worst run names the host's speed around it
    assert "| +30.0% a (host speed 95% → 71%) |" in page
    # records without checks (hrm run's own) keep the table as it was
    assert "host speed" not in markdown(load_records([plain]), "t")


def test_report_writes_figures_page_and_csv_from_real_runs(run_cli, checkpoints, tmp_path):
    paths = []
    for i, dtype in enumerate(("float32", "bfloat16")):
        status, out, _ = run_cli(
            "run", "--checkpoint", checkpoints["dbrx"], *ARGS, "--dtype", dtype,
            "--hardware", "ci-cpu", *record_flags(),
        )  # fmt: skip
        assert status == 0
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(out)
    out_dir = tmp_path / "report"
    status, out, err = run_cli("report", *paths, "-o", out_dir)
    assert status == 0, err
    names = {p.name for p in out_dir.iterdir()}
    assert {"report.md", "runs.csv", "scatter.png", "run-1.png", "run-2.png"} <= names
    assert all((out_dir / n).stat().st_size > 0 for n in names)
    page = (out_dir / "report.md").read_text()
    # two dtypes: two settings, no repeats, so no table of settings
    assert "| resident | 2 | 2 |" in page and "run0" in page and "MAPE" in page
    assert "## Settings" not in page
    assert (out_dir / "settings.csv").read_text().count("\n") == 3
    csv = (out_dir / "runs.csv").read_text().splitlines()
    assert csv[0].startswith("run,model,schedule") and len(csv) == 3
    assert "MAPE" in out


def test_validate_quick_runs_end_to_end_and_fails_past_its_mape(run_cli, checkpoints, tmp_path):
    out_dir = tmp_path / "val"
    status, out, err = run_cli(
        "validate", "--checkpoint", checkpoints["mixtral-single"], "--quick", "--repeats", "1",
        "--max-mape", "1.5", "--quiet", "--profile-every", "pass", "-o", out_dir,
    )  # fmt: skip
    # 1.5: four times the MAPE seen on this tiny checkpoint with one repeat (19-34%), and below
    # what predictions five times too fast give (+400% each)
    assert status == 0, err
    runs = sorted((out_dir / "runs").glob("*.json"))
    # resident: 2 batches x 2 prompt shapes x 1 generation length; offloaded on the CPU standing
    # in for the GPU: 4 schedules and cgopipe's continuous batching of a mixed job; all in
    # bfloat16 (the full sweep adds float32 to both)
    assert len(runs) == 4 + 5
    records = [json.loads(r.read_text()) for r in runs]
    (passes,) = [r for r in records if r["environment"].get("batching") == "continuous"]
    assert passes["predicted"]["passes"] == passes["environment"]["continuous"]["passes"] > 1
    # 2 x 16 requests of max_tokens 2, 4, 8 in turn (the quick shape's g 8), none stopped early
    assert passes["measured"]["generated_tokens"] == sum((2, 4, 8)[i % 3] for i in range(32))
    assert len(passes["predicted"]["pass_seconds"]) == passes["predicted"]["passes"]
    schedules = {r["plan"]["schedule"] for r in records if r["plan"]}
    assert schedules == {"cgopipe", "serial", "overlap", "gpu-attention"}
    assert {r["environment"]["dtype"] for r in records if r["plan"]} == {"bfloat16"}
    assert {r["environment"]["dtype"] for r in records} == {"bfloat16"}
    assert all(r["environment"]["stand_in"] for r in records if r["plan"])
    assert all(r["predicted"]["throughput_tok_s"] > 0 for r in records)
    record = records[0]
    assert record["predicted"]["throughput_tok_s"] > 0 and record["measured"]["generated_tokens"]
    # profiled before the sweep (the warm-up pass's GEMM paths) and again before the timed pass,
    # which its records name; the page gives each timed pass's profile
    assert {r["environment"]["profile"] for r in records} == {"hardware-pass1.yaml"}
    assert (out_dir / "hardware-pass1.yaml").is_file() and (out_dir / "scatter.png").is_file()
    assert not (out_dir / "hardware.yaml").exists()
    page = (out_dir / "report.md").read_text()
    assert "pass 1 (hardware-pass1.yaml): bfloat16 " in page
    # after that profile, one untimed run of the first setting, and how much slower it ran
    assert "untimed run of bfloat16-b1-p16u-g8 came before the timed ones" in page
    assert "slower than that setting's timed runs by: pass 1 " in page
    # the untimed warm-up pass leaves no records, only its note beside the spread
    assert "Conditions" in page and "untimed warm-up pass" in page
    # every timed run was preceded by the host speed check, in each dtype the profile timed
    assert "Host speed during the sweep" in page
    assert "last-level cache " in page.split("## Conditions")[1].split("\n\n")[1]
    assert "bfloat16 " in page.split("Host speed during the sweep")[1].split("\n")[0]
    # and followed by it: each record keeps both checks, the page shows them beside the error
    for r in records:
        assert r["environment"]["host_speed"]["dtype"] == r["environment"]["dtype"]
        assert r["environment"]["host_speed"]["before"] > 0
        assert r["environment"]["host_speed"]["after"] > 0
    assert "| error | host speed | detail |" in page
    # the same sweep against a threshold it misses: status 1, and it says so
    status, out, err = run_cli(
        "validate", "--checkpoint", checkpoints["mixtral-single"], "--quick", "--repeats", "1",
        "--max-mape", "0.0001", "--quiet", "--hardware", out_dir / "hardware-pass1.yaml",
        "-o", tmp_path / "val2",
    )  # fmt: skip
    assert status == 1 and "exceeds --max-mape" in err
    assert "settings (median of their runs): MAPE" in out
    # the one profile it was given, and no profile named in its records
    assert (tmp_path / "val2" / "hardware.yaml").is_file()
    assert (
        "profile"
        not in json.loads(next((tmp_path / "val2" / "runs").glob("*.json")).read_text())[
            "environment"
        ]
    )


def test_bad_report_inputs_are_one_line_and_write_nothing(run_cli, tmp_path):
    good = hand_record(tmp_path / "good.json", 110, 100)
    bad_key = tmp_path / "bad.json"
    bad_key.write_text(json.dumps({**json.loads(good.read_text()), "color": "red"}))
    no_prediction = tmp_path / "none.json"
    no_prediction.write_text(json.dumps({**json.loads(good.read_text()), "predicted": None}))
    (tmp_path / "file").write_text("x")
    out = tmp_path / "out"
    for args, fragment in (
        ([bad_key], "unknown key 'color'"),
        ([], "no run records given"),
        ([no_prediction], "none.json: the record has no prediction"),
        ([tmp_path / "missing.json"], "missing.json"),
    ):
        status, _, err = run_cli("report", *args, "-o", out)
        assert_one_line_error(status, err, fragment)
        assert not out.exists()
    status, _, err = run_cli("report", good, "-o", tmp_path / "file")
    assert_one_line_error(status, err, "exists and is not a directory")
    status, _, err = run_cli("report", good, "-o", tmp_path / "no" / "such" / "dir")
    assert_one_line_error(status, err, "does not exist")


def test_validate_refuses_a_profile_of_another_machine(run_cli, checkpoints, tmp_path):
    status, _, err = run_cli(
        "validate", "--checkpoint", checkpoints["dbrx"], "--hardware", "l4", "-o", tmp_path / "v"
    )
    assert_one_line_error(status, err, "l4 is a datasheet profile", "to profile it first")
    assert not (tmp_path / "v").exists()
    status, _, err = run_cli("validate", "--model", "dbrx", "-o", tmp_path / "v")
    assert_one_line_error(status, err, "give --checkpoint DIR, or --model M --random-weights")
    status, _, err = run_cli(
        "validate", "--checkpoint", checkpoints["dbrx"], "--hardware", "l4",
        "--profile-every", "pass", "-o", tmp_path / "v",
    )  # fmt: skip
    assert_one_line_error(status, err, "--profile-every pass profiles this host before each pass")
    assert not (tmp_path / "v").exists()


def test_validate_refuses_bad_counts_and_fractions(run_cli, checkpoints, tmp_path):
    """--repeats has no default of its own now (3 full, 2 quick), so 0 must still be refused."""
    for flag, value, fragment in (
        ("--repeats", "0", "--repeats must be at least 1, got 0"),
        ("--max-mape", "0", "--max-mape is a fraction"),
        ("--threads", "0", "--threads must be at least 1, got 0"),
    ):
        status, _, err = run_cli(
            "validate", "--checkpoint", checkpoints["dbrx"], flag, value, "-o", tmp_path / "v"
        )
        assert_one_line_error(status, err, fragment)
        assert not (tmp_path / "v").exists()


def test_host_speed_summary_by_hand():
    """Ratios per dtype and their correlation with the runs' errors, from hand-made values."""
    from hrm.profiling.host_speed import HostSpeedCheck
    from hrm.profiling.matmul import GemmShape

    check = HostSpeedCheck(
        shape=GemmShape(model="m", hidden=8, intermediate=16),
        expected={"bfloat16": 1e11, "float32": 5e10},
    )
    check.ratios = {
        "a-1": ("bfloat16", 1.0), "a-2": ("bfloat16", 2.0), "b-1": ("float32", 0.5),
    }  # fmt: skip
    # a host at twice its profile's speed doubles the measured rate: error 1/2 - 1
    (line, blank) = check.summary({"a-1": 0.0, "a-2": -0.5, "b-1": 1.0})
    assert blank == ""
    assert "(8x16, 64 rows)" in line
    assert "bfloat16 100%-200% (median 150%); float32 50%-50% (median 50%)." in line
    # Pearson over (1, 2, 0.5) and (0, -0.5, 1): deviations (-1/6, 5/6, -2/3) and
    # (-1/6, -2/3, 5/6), sum of products -13/12 over sqrt(7/6 * 7/6): -13/14 = -0.93
    assert "Correlation of each run's error with its share (before and after it): -0.93" in line
    # with a check after a run, its share is the mean of the two around it: here (2 + 1) / 2.
    # Pearson over (1, 1.5, 0.5) and (0, -0.5, 1): deviations (0, 1/2, -1/2) and
    # (-1/6, -2/3, 5/6), sum of products -3/4 over sqrt(1/2 * 7/6): -0.98
    check.after = {"a-2": 1.0}
    assert check.share("a-2") == 1.5 and check.share("a-1") == 1.0
    assert check.of_run("a-2") == {"dtype": "bfloat16", "before": 2.0, "after": 1.0}
    assert check.of_run("a-1") == {"dtype": "bfloat16", "before": 1.0}
    assert check.of_run("z-1") is None
    (line, _) = check.summary({"a-1": 0.0, "a-2": -0.5, "b-1": 1.0})
    assert "bfloat16 100%-200%" in line and "(before and after it): -0.98" in line
    # without checks (no curve of the run's dtype) the report says nothing of host speed
    assert HostSpeedCheck(shape=check.shape, expected={}).summary({}) == []


def test_host_speed_check_times_the_profiles_point():
    """The check's reference is the profile's rate at CHECK_TOKENS for each dtype it timed; a
    check keeps a positive ratio under the run's name, and a dtype without a curve is skipped."""
    from hrm.arch import resolve_model
    from hrm.hardware import resolve_hardware
    from hrm.hardware.parts import Curve
    from hrm.profiling.host_speed import CHECK_TOKENS, HostSpeedCheck
    from hrm.profiling.matmul import GemmShape

    profile = resolve_hardware("ci-cpu")
    check = HostSpeedCheck.for_profile(resolve_model("mixtral-8x7b"), profile, ["float32", "x"])
    assert (check.shape.hidden, check.shape.intermediate) == (4096, 14336)
    assert check.expected == {"float32": profile.cpu.matmul_curves["float32"].at(CHECK_TOKENS)}
    small = HostSpeedCheck(shape=GemmShape(model="t", hidden=256, intermediate=512),
                           expected={"float32": 1e10})  # fmt: skip
    small.check("r-1", "float32")
    small.check("r-2", "bfloat16")
    small.check("r-1", "float32", after=True)
    assert list(small.ratios) == ["r-1"] and small.ratios["r-1"][0] == "float32"
    assert small.ratios["r-1"][1] > 0 and list(small.after) == ["r-1"] and small.after["r-1"] > 0
    # against a fresh profile (--profile-every pass): later checks use its rates, the ratios
    # taken so far stay
    slower = dataclasses.replace(
        profile,
        cpu=dataclasses.replace(
            profile.cpu,
            matmul_curves={"float32": Curve(points=((1, 1e9), (CHECK_TOKENS, 2e9)))},
        ),
    )
    moved = small.against(slower)
    assert moved.expected == {"float32": 2e9} and moved.rates_of(slower) == {"float32": 2e9}
    assert moved.ratios == small.ratios and moved.after == small.after
    moved.check("r-3", "float32")
    assert "r-3" in small.ratios  # one record of the sweep's checks, whichever profile


@pytest.mark.parametrize("name", ["mixtral-single", "qwen2_moe"])
def test_validates_random_checkpoint_is_a_real_checkpoint_of_the_model(checkpoints, tmp_path, name):
    """Written by transformers from the model's own config, read back by the executor: weights
    drawn as transformers draws them (N(0, 0.02)), norms 1, biases 0 (a tensor left as the
    uninitialised memory `to_empty` gives would show here)."""
    import argparse

    import torch

    from executor.checkpoint import open_checkpoint
    from hrm.cli.validate_inputs import save_random_checkpoint

    args = argparse.Namespace(model=str(checkpoints[name] / "config.json"), layers=2, quiet=True)
    weights = open_checkpoint(save_random_checkpoint(args, tmp_path), "float32").weights
    assert len(weights.layers) == 2
    layer = weights.layers[1]
    assert torch.equal(layer.attn_norm, torch.ones_like(layer.attn_norm))
    assert float(layer.wq.std()) == pytest.approx(0.02, rel=0.1)
    assert float(layer.experts[3].w2.std()) == pytest.approx(0.02, rel=0.1)
    assert float(weights.lm_head.std()) == pytest.approx(0.02, rel=0.1)
    if name == "qwen2_moe":
        assert not layer.bq.any() and float(layer.shared_gate.std()) > 0


def test_the_quick_warm_up_runs_every_resident_setting_and_each_batching_modes_first():
    """oneDNN builds a kernel per GEMM row count, and each resident setting meets its own: the
    quick sweep's warm-up runs all of them; offloaded runs share theirs within a batching mode,
    so the first of each mode. The full sweep warms every run; a timed pass runs every run."""
    from hrm.cli.validate import _mode, _warmed

    resident = [(1, 16), (1, 64), (16, 16), (16, 64)]
    offloaded = [("bfloat16", "cgopipe", "static"), ("bfloat16", "cgopipe", "continuous"),
                 ("bfloat16", "serial", "static"), ("bfloat16", "overlap", "static")]  # fmt: skip
    assert _warmed(resident, None, "quick") == resident
    assert _warmed(offloaded, None, "quick", _mode) == offloaded[:2]
    assert _warmed(offloaded, None, "full", _mode) == offloaded
    assert _warmed(offloaded, 0, "quick", _mode) == offloaded
