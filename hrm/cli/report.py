"""`hrm report RUN.json ... -o DIR`: predicted against measured over many runs (hrm/report.py)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="plot predicted against measured throughput over run records, with the model's error",
        description="Read RunRecords (hrm run --json, hrm validate) and write into DIR a "
        "predicted-vs-measured scatter, per-run bars of time and queue busy time, runs.csv and "
        "report.md with the mean absolute percentage error per schedule.",
    )
    p.add_argument("records", nargs="*", metavar="RUN.json", help="RunRecord files")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--title", default="Predicted against measured throughput")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hrm.io import check_writable_dir
    from hrm.report import load_records, summaries, write_report

    check_writable_dir(args.output)
    rows = load_records(args.records)
    page = write_report(rows, args.output, title=args.title)
    print(format_summary(summaries(rows)))
    print(f"wrote {page}")
    return 0


def format_summary(by_version) -> str:
    lines = []
    for version, by_schedule in by_version.items():
        for schedule, s in by_schedule.items():
            lines.append(
                f"model {version}, {schedule}: {s.settings} settings, MAPE {s.mape:.1%}, worst "
                f"{s.worst.error:+.1%} ({s.worst.name}: {s.worst.setting}); {s.runs} runs, "
                f"MAPE {s.run_mape:.1%}, worst {s.worst_run.error:+.1%} ({s.worst_run.name})"
            )
    return "\n".join(lines)
