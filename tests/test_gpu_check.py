"""bench/gpu_check.sh --dry-run: the GPU check's Python steps at tiny sizes, the CPU standing in
for the GPU, so that the day a GPU is lent the script's own code has already run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hrm.plan import SCHEDULES

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_measures_every_schedule_and_the_baseline(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", ROOT / "bench" / "gpu_check.sh", "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((out / "gpu_check.json").read_text())["rows"]
    names = [r["schedule"] for r in rows]
    assert names == [*SCHEDULES, "cgopipe int4", "cgopipe disk", "cgopipe static",
                     "cgopipe continuous", "cgopipe continuous planned",
                     "transformers+accelerate"]  # fmt: skip
    assert all(r["measured"]["throughput_tok_s"] > 0 for r in rows), rows
    paged = [r for r in rows if "plan" in r and r["plan"]["policy"]["weights_gpu_fraction"] < 1]
    assert paged, "the dry run's budget pages no weights"
    int4 = next(r for r in rows if r["schedule"] == "cgopipe int4")
    assert int4["plan"]["policy"]["weight_dtype"] == "int4"
    half = next(r for r in rows if r["schedule"] == "cgopipe")
    assert 0 < int4["measured"]["link_bytes"]["h2d"] < half["measured"]["link_bytes"]["h2d"]
    disk = next(r for r in rows if r["schedule"] == "cgopipe disk")  # the same pages, part read
    assert disk["plan"]["policy"]["weights_disk_fraction"] > 0
    assert disk["measured"]["link_bytes"]["h2d"] == half["measured"]["link_bytes"]["h2d"]
    assert 0 < disk["measured"]["link_bytes"]["disk"] < disk["measured"]["link_bytes"]["h2d"]
    static, continuous = (next(r for r in rows if r.get("batching") == m)
                          for m in ("static", "continuous"))  # fmt: skip
    assert static["measured"]["generated_tokens"] == continuous["measured"]["generated_tokens"]
    assert continuous["passes"] > 0
    planned = next(r for r in rows if r.get("batching") == "continuous planned")
    assert planned["measured"]["generated_tokens"] == static["measured"]["generated_tokens"]
    assert planned["predicted_tok_s"] > 0 and planned["max_running"] >= 1
    table = (out / "table.txt").read_text()
    assert all(name in table for name in names) and "/ transformers+accelerate" in table
    assert "cgopipe continuous / static" in table
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "log.txt" in files, files
