"""bench/bench_schedules.py's Python parts on a CPU (--dry-run): what bench/gpu_check.sh runs on
a GPU plans every schedule for both budgets and checks each plan against the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hrm.plan import SCHEDULES

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_plans_and_checks_every_schedule(tmp_path):
    out = tmp_path / "schedules.json"
    done = subprocess.run(
        [sys.executable, ROOT / "bench" / "bench_schedules.py", "--device", "cpu", "--dry-run",
         "--layers", "4", "--gpu-mem", "4GB,8GB", "--max-batch", "16", "-o", out],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["gpu_mem_bytes"], r["schedule"]) for r in rows} == {
        (b, s) for b in (4e9, 8e9) for s in SCHEDULES
    }
    # 4 and 8 GB, at most 16 sequences: a stand-in GPU and its host side needed 17 GB of this 24
    # GB host's memory at 64, which the suite's own process may hold by the time this runs
    paged = [r for r in rows if r["fits"] and r["gpu_mem_bytes"] == 4e9]
    assert paged and all(r["plan"]["policy"]["weights_gpu_fraction"] < 1 for r in paged)
