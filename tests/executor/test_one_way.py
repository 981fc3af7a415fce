"""executor imports hrm and torch, never the planner (docs/architecture.md: one-way doors)."""

import subprocess
import sys


def test_executor_never_imports_the_planner():
    code = (
        "import sys, executor.api, executor.checkpoint, executor.generate, executor.model; "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "torch" in loaded and "hrm" in loaded
    assert not any(m == "planner" or m.startswith("planner.") for m in loaded)
