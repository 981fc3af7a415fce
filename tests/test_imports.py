"""One-way doors (docs/architecture.md): hrm loads neither torch nor pulp; planner and executor
stay apart."""

import subprocess
import sys

import pytest

HRM_MODULES = [
    "hrm",
    "hrm.arch",
    "hrm.hardware",
    "hrm.ops",
    "hrm.roofline",
    "hrm.roofline_report",
    "hrm.plots",
    "hrm.policy",
    "hrm.plan",
    "hrm.record",
    "hrm.workload",
    "hrm.units",
    "hrm.cli",
]


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", HRM_MODULES)
def test_hrm_imports_neither_torch_nor_pulp(module):
    loaded = _loaded_after(f"import {module}")
    assert "torch" not in loaded and "pulp" not in loaded


def test_cli_parser_builds_without_heavy_imports():
    loaded = _loaded_after("from hrm.cli import build_parser; build_parser()")
    assert not {"torch", "pulp", "matplotlib", "transformers"} & loaded
