"""Benches whose shapes the user sets count their runs' host memory before building anything:
one line and exit status 2 when it would not fit, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "args", "fragment"),
    [
        # 10^6 prompts of 4000 tokens: tens of TB for any host
        ("bench_prediction_by_op.py", ["--quick", "--batch", "1000000", "--prompt-len", "4000",
                                       "--hardware", "ci-cpu"], "give a smaller --batch"),
        # 32 sequences of 2 million positions: hundreds of GB of KV cache
        ("bench_engine_modes.py", ["--prompt-len", "4", "--gen-len", "2000000"],
         "give a smaller --prompt-len or --gen-len"),
    ],
)  # fmt: skip
def test_a_bench_that_would_not_fit_is_refused_before_it_builds_anything(
    tmp_path, script, args, fragment
):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, ROOT / "bench" / script, *args, "--output", out],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "host memory" in lines[0] and fragment in lines[0]
    assert "Traceback" not in proc.stderr and not out.exists()
