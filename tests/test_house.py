"""The house rules a reviewer would otherwise count by hand: no package file over 500 lines, no
function over 80, and a README section for every command."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = sorted(p for d in ("hrm", "planner", "executor", "bench") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_functions_stay_small(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 500, f"{path.name}: over 500 lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, f"{path.name}: functions over 80 lines: {', '.join(long)}"


def test_the_readme_has_a_section_for_every_command():
    from hrm.cli import SUBCOMMANDS

    headings = {
        line.removeprefix("## ").strip()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("## ")
    }
    assert {f"hrm {c}" for c in SUBCOMMANDS} <= headings
