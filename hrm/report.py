"""Predicted against measured over many runs: the model's error, where it comes from, as figures.

`hrm report RUN.json ...` and `hrm validate` read RunRecords and write, into one directory:
`scatter.png` (predicted against measured throughput, log-log, y = x and a +-10% band, a colour per
schedule, a marker per model), `run-N.png` (per run: prefill and decode seconds and each queue's
busy seconds, predicted beside measured), `runs.csv` (one row per run), `settings.csv` and
`report.md` linking them, with the mean absolute percentage error (MAPE) and the worst case per
schedule and overall.

The error is stated per setting: runs of the same model, profile name, schedule, policy and
workload are repeats of one setting, and the setting's error is the median of its runs' errors,
each run against its own prediction (hrm validate's passes each have their own profile). A shared
VM moves under single runs (two identical runs in one sweep differed 1.66x, docs/decisions.md,
2026-12-04); `hrm validate` interleaves repeats so that the median sees the host at several
moments. Each run's own error, its MAPE and the worst run are reported beside it. Records made by
different versions of the cost model are reported apart, never averaged together. pandas and
matplotlib are imported inside.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hrm.errors import HrmError
from hrm.io import check_writable_dir, load_json
from hrm.plan import QUEUES
from hrm.record import RunRecord

BAND = 0.10  # the scatter's band around y = x


@dataclass(frozen=True, kw_only=True)
class Row:
    """One run, flattened for the table, the CSV and the error summary."""

    name: str
    model: str
    schedule: str
    model_version: str
    setting: str
    predicted_tok_s: float
    measured_tok_s: float
    record: RunRecord

    @property
    def host_speed(self) -> tuple[float | None, float | None]:
        """The host's GEMM speed over its profile's, checked right before and after the run
        (`hrm validate` records them; None where a check was not taken)."""
        checks = self.record.environment.get("host_speed") or {}
        return checks.get("before"), checks.get("after")

    @property
    def host_speed_text(self) -> str:
        return " → ".join("?" if v is None else f"{v:.0%}" for v in self.host_speed)

    @property
    def error(self) -> float:
        """Signed relative error (predicted - measured) / measured, as RunRecord has it."""
        return (self.predicted_tok_s - self.measured_tok_s) / self.measured_tok_s

    @property
    def repeat_key(self) -> tuple:
        """What makes two runs repeats of one setting: everything that sets the prediction
        except the moment the profile was taken."""
        r = self.record
        policy = json.dumps((r.plan or {}).get("policy"), sort_keys=True)
        return (self.model_version, self.model, r.hardware, self.schedule, self.setting, policy)


@dataclass(frozen=True, kw_only=True)
class Repeats:
    """One setting's repeats, judged by the median of their errors: each run against the
    prediction made for it, so that no run is set against another moment's profile."""

    runs: tuple[Row, ...]

    @property
    def name(self) -> str:
        """The runs' common name (validate's `NAME-1`, `NAME-2` give NAME), else the first's."""
        names = [r.name for r in self.runs]
        if len(names) == 1:
            return names[0]
        return os.path.commonprefix(names).rstrip("-_. ") or f"{names[0]} and repeats"

    @property
    def setting(self) -> str:
        return self.runs[0].setting

    @property
    def schedule(self) -> str:
        return self.runs[0].schedule

    @property
    def error(self) -> float:
        return statistics.median(r.error for r in self.runs)


@dataclass(frozen=True, kw_only=True)
class ErrorSummary:
    settings: int
    runs: int
    mape: float  # mean of |error| over settings (each the median of its runs' errors)
    worst: Repeats  # the setting with the largest |error|
    run_mape: float  # mean of |error| over single runs
    worst_run: Row  # the run with the largest |error|


def load_records(paths: Sequence[str | os.PathLike]) -> list[Row]:
    """Every record, checked: strict keys, a prediction and a measured throughput in each."""
    if not paths:
        raise HrmError(
            "no run records given; pass RUN.json files "
            "(hrm run --output OUT.jsonl --json > RUN.json)"
        )
    rows = []
    for path in paths:
        record = _load_record(path)
        if not record.predicted:
            raise HrmError(
                f"{path}: the record has no prediction; make it with hrm run --hardware PROFILE"
            )
        if not record.measured.throughput_tok_s > 0:
            raise HrmError(f"{path}: the record measured no throughput (no tokens generated)")
        rows.append(_row(Path(path).stem, record))
    return rows


def _load_record(path: str | os.PathLike) -> RunRecord:
    """A RunRecord file; a plan (hrm plan -o), the likeliest other JSON here, is named as one."""
    data = load_json(path)
    if isinstance(data, dict) and "policy" in data and "measured" not in data:
        raise HrmError(
            f"{path}: a plan (hrm plan -o), not a run record; run it with hrm run --plan "
            f"{path} --output OUT.jsonl --json > RUN.json and report RUN.json"
        )
    return RunRecord.from_dict(data, where=str(path))


def _row(name: str, record: RunRecord) -> Row:
    env, wl = record.environment, record.workload
    schedule = record.plan["schedule"] if record.plan else "resident"
    policy = (record.plan or {}).get("policy") or {}
    micro = f" mu={policy['micro_batch_size']}" if "micro_batch_size" in policy else ""
    setting = (
        f"N={env.get('batch_size', '?')}{micro} prompts {round(wl['prompt_len_mean'], 1):g}"
        f"{' (p)' if wl.get('padding') else ''}/{wl['prompt_len_max']} gen {wl['gen_len']} "
        f"{env.get('dtype', '?')} {env.get('device', '?')}"
    )
    return Row(
        name=name,
        model=record.model,
        schedule=schedule,
        model_version=str(env.get("model_version", "unknown")),
        setting=setting,
        predicted_tok_s=float(record.predicted["throughput_tok_s"]),
        measured_tok_s=record.measured.throughput_tok_s,
        record=record,
    )


def settings_of(rows: Sequence[Row]) -> list[Repeats]:
    """The rows grouped into settings (Row.repeat_key), in the order each first appears."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.repeat_key, []).append(r)
    return [Repeats(runs=tuple(g)) for g in groups.values()]


def summarize(rows: Sequence[Row]) -> ErrorSummary:
    settings = settings_of(rows)
    return ErrorSummary(
        settings=len(settings),
        runs=len(rows),
        mape=sum(abs(s.error) for s in settings) / len(settings),
        worst=max(settings, key=lambda s: abs(s.error)),
        run_mape=sum(abs(r.error) for r in rows) / len(rows),
        worst_run=max(rows, key=lambda r: abs(r.error)),
    )


def summaries(rows: Sequence[Row]) -> dict[str, dict[str, ErrorSummary]]:
    """{model version: {schedule or "all": summary}}: versions are never pooled."""
    out: dict[str, dict[str, ErrorSummary]] = {}
    for version in sorted({r.model_version for r in rows}):
        mine = [r for r in rows if r.model_version == version]
        groups = {
            s: [r for r in mine if r.schedule == s] for s in sorted({r.schedule for r in mine})
        }
        out[version] = {**{s: summarize(g) for s, g in groups.items()}, "all": summarize(mine)}
    return out


def write_report(
    rows: Sequence[Row], directory: str | os.PathLike, *, title: str, notes: Sequence[str] = ()
) -> Path:
    """All files into `directory`, built in a temporary folder first: nothing partial is left.
    `notes`: markdown lines for the page (the conditions of the runs)."""
    out = check_writable_dir(directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out if out.is_dir() else out.parent))
    try:
        _write_all(rows, tmp, title, notes)
        out.mkdir(parents=True, exist_ok=True)
        for item in tmp.iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "report.md"


def _write_all(rows: Sequence[Row], tmp: Path, title: str, notes: Sequence[str]) -> None:
    import pandas as pd

    frame = pd.DataFrame(
        [
            {
                "run": r.name,
                "model": r.model,
                "schedule": r.schedule,
                "model_version": r.model_version,
                "setting": r.setting,
                "predicted_tok_s": r.predicted_tok_s,
                "measured_tok_s": r.measured_tok_s,
                "error": r.error,
                "predicted_prefill_s": r.record.predicted["prefill_s"],
                "measured_prefill_s": r.record.measured.prefill_s,
                "predicted_decode_s": r.record.predicted["decode_s"],
                "measured_decode_s": r.record.measured.decode_s,
                "host_speed_before": r.host_speed[0],
                "host_speed_after": r.host_speed[1],
            }
            for r in rows
        ]
    )
    frame.to_csv(tmp / "runs.csv", index=False)
    pd.DataFrame(
        [
            {
                "setting_name": s.name,
                "model_version": s.runs[0].model_version,
                "schedule": s.schedule,
                "setting": s.setting,
                "runs": " ".join(r.name for r in s.runs),
                "run_errors": " ".join(f"{r.error:.4f}" for r in s.runs),
                "error": s.error,
            }
            for s in settings_of(rows)
        ]
    ).to_csv(tmp / "settings.csv", index=False)
    plot_scatter(rows, tmp / "scatter.png", title)
    for i, r in enumerate(rows):
        plot_run(r, tmp / f"run-{i + 1}.png")
    (tmp / "report.md").write_text(markdown(rows, title, notes))


def markdown(rows: Sequence[Row], title: str, notes: Sequence[str] = ()) -> str:
    lines = [f"# {title}", "", "![predicted against measured](scatter.png)", "", *notes]
    checked = any(r.host_speed != (None, None) for r in rows)
    for version, by_schedule in summaries(rows).items():
        lines += [
            f"## Cost model version {version}",
            "",
            "Each setting's error is the median of its repeats' errors, each run against its own "
            "prediction; the last two columns take the runs one by one.",
            "",
            "| schedule | settings | runs | MAPE | worst | worst setting | MAPE per run | "
            "worst run |",
            "|---|---:|---:|---:|---:|---|---:|---|",
        ]
        for schedule, s in by_schedule.items():
            host = f" (host speed {s.worst_run.host_speed_text})" if checked else ""
            lines.append(
                f"| {schedule} | {s.settings} | {s.runs} | {s.mape:.1%} | {s.worst.error:+.1%} | "
                f"{s.worst.name}: {s.worst.setting} | {s.run_mape:.1%} | "
                f"{s.worst_run.error:+.1%} {s.worst_run.name}{host} |"
            )
        lines.append("")
    settings = settings_of(rows)
    if len(settings) < len(rows):
        lines += [
            "## Settings",
            "",
            "| setting | schedule | its runs' errors | error (median) |",
            "|---|---|---|---:|",
        ]
        for s in settings:
            errors = ", ".join(f"{r.error:+.1%}" for r in s.runs)
            lines.append(f"| {s.name} | {s.schedule} | {errors} | {s.error:+.1%} |")
        lines.append("")
    speed_head, speed_rule = (" host speed |", "---:|") if checked else ("", "")
    lines += [
        "## Runs",
        "",
        "| run | model | schedule | setting | predicted tok/s | measured tok/s | error |"
        f"{speed_head} detail |",
        f"|---|---|---|---|---:|---:|---:|{speed_rule}---|",
    ]
    for i, r in enumerate(rows):
        speed = f" {r.host_speed_text} |" if checked else ""
        lines.append(
            f"| {r.name} | {r.model} | {r.schedule} | {r.setting} | {r.predicted_tok_s:.1f} | "
            f"{r.measured_tok_s:.1f} | {r.error:+.1%} |{speed} [bars](run-{i + 1}.png) |"
        )
    lines += [
        "",
        "Error = (predicted - measured) / measured. Data: `runs.csv` (runs), `settings.csv` "
        "(settings).",
    ]
    if checked:
        lines.append(
            "Host speed: the host's rate at one GEMM point of its profile, timed right before "
            "and right after the run, over the profile's rate there."
        )
    lines.append("")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scatter(rows: Sequence[Row], path: Path, title: str) -> None:
    plt = _pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.5, 5.5), dpi=120)
    values = [v for r in rows for v in (r.predicted_tok_s, r.measured_tok_s)]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    x = np.geomspace(lo, hi, 50)
    ax.plot(x, x, "k-", lw=1, label="y = x")
    ax.fill_between(x, x * (1 - BAND), x * (1 + BAND), color="gray", alpha=0.2, label="±10%")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^vP*X"
    schedules = sorted({r.schedule for r in rows})
    models = sorted({r.model for r in rows})
    for r in rows:
        ax.plot(
            r.measured_tok_s,
            r.predicted_tok_s,
            markers[models.index(r.model) % len(markers)],
            color=colors[schedules.index(r.schedule) % len(colors)],
            alpha=0.8,
        )
    for s in schedules:  # legend entries: colour per schedule, marker per model
        ax.plot([], [], "o", color=colors[schedules.index(s) % len(colors)], label=s)
    for m in models:
        ax.plot([], [], markers[models.index(m) % len(markers)], color="gray", label=m)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    _plain_log_labels(ax)
    ax.set_xlabel("measured throughput (tok/s)")
    ax.set_ylabel("predicted throughput (tok/s)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _plain_log_labels(ax) -> None:
    """Log axes labelled 1, 2, 5, 10, 20, ...: matplotlib's default labels every minor tick in
    scientific notation when a plot spans under two decades, and they ran into each other."""
    import math

    from matplotlib.ticker import FuncFormatter

    def label(value, _position) -> str:
        if value <= 0:
            return ""
        lead = value / 10 ** math.floor(math.log10(value))
        return f"{value:g}" if round(lead, 6) in (1, 2, 5) else ""

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(label))
        axis.set_minor_formatter(FuncFormatter(label))


def plot_run(row: Row, path: Path) -> None:
    """Prefill and decode seconds, and each queue's busy seconds, predicted beside measured."""
    plt = _pyplot()
    record = row.record
    predicted, measured = record.predicted, record.measured
    total_predicted = predicted["prefill_s"] + predicted["decode_s"]
    total_measured = measured.prefill_s + measured.decode_s
    busy_predicted = predicted.get("busy_s") or (record.plan or {}).get("busy_s") or {}
    labels = ["prefill", "decode", *(f"{q} busy" for q in QUEUES)]
    ours = [predicted["prefill_s"], predicted["decode_s"]]
    theirs = [measured.prefill_s, measured.decode_s]
    for q in QUEUES:
        ours.append(busy_predicted.get(q, 0.0) if busy_predicted else float("nan"))
        fraction = measured.busy_fraction.get(q)
        theirs.append(fraction * total_measured if fraction is not None else float("nan"))
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, label=f"predicted ({total_predicted:.2f} s)")
    ax.bar([x + 0.2 for x in xs], theirs, width=0.4, label=f"measured ({total_measured:.2f} s)")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"{row.name}: {row.setting} ({row.error:+.0%})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
