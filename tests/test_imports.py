"""One-way doors (docs/architecture.md): hrm loads neither torch nor pulp; planner and executor
stay apart."""

import subprocess
import sys

import pytest


def _hrm_modules() -> list[str]:
    """Every module of the hrm package (its __main__ runs the CLI, so it is left out)."""
    import pkgutil

    import hrm

    found = pkgutil.walk_packages(hrm.__path__, prefix="hrm.")
    return ["hrm", *sorted(m.name for m in found if not m.name.endswith("__main__"))]


HRM_MODULES = _hrm_modules()


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_walk_finds_every_hrm_module():
    assert len(HRM_MODULES) > 40 and {"hrm.cli.run", "hrm.profiling.cpu", "hrm.api"} < set(
        HRM_MODULES
    )


@pytest.mark.parametrize("module", HRM_MODULES)
def test_hrm_imports_neither_torch_nor_pulp(module):
    loaded = _loaded_after(f"import {module}")
    assert "torch" not in loaded and "pulp" not in loaded


def test_cli_parser_builds_without_heavy_imports():
    loaded = _loaded_after("from hrm.cli import build_parser; build_parser()")
    assert not {"torch", "pulp", "matplotlib", "transformers"} & loaded


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at module level or inside a function."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    modules = {}
    for package in ("hrm", "planner", "executor"):
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[module] |= {o for o in map(owner, names) if o not in (None, module)}
    return graph


def test_no_import_circles_even_through_imports_inside_functions():
    """A circle hidden in a function-level import is still a circle: the modules cannot be
    understood, or moved, one at a time."""
    graph = _import_graph()
    assert "executor.engine" in graph["executor.runtime"]  # the graph sees the imports

    def reaches(start: str, goal: str) -> list[str] | None:
        seen, todo = set(), [[start]]
        while todo:
            path = todo.pop()
            for nxt in sorted(graph[path[-1]]):
                if nxt == goal:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(path + [nxt])
        return None

    circles = [reaches(m, m) for m in sorted(graph)]
    assert not any(circles), " -> ".join(next(c for c in circles if c))
