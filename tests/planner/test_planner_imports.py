"""planner imports hrm and never executor or torch; predicting one policy needs no PuLP."""

import subprocess
import sys


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_planner_stays_on_its_side_of_the_door():
    loaded = _loaded_after("import planner.search, planner.baselines, planner.sweep")
    assert "torch" not in loaded and not any(m.startswith("executor") for m in loaded)


def test_predict_does_not_load_pulp():
    assert "pulp" not in _loaded_after("from planner import predict")
