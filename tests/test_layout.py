"""The layout's rules, read from the source: which package may import which, no cycles, light imports.

Data flows one way (producer -> api -> broker -> worker -> engine -> worker -> database): the API never
touches the engine or the worker, the engine and its kernels know nothing of the service, and `jobs/`, the
contract both sides share, depends on no other package of the project.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jobs", "api", "worker", "engine", "kernels", "migrations", "cli", "bench")

# package -> the project packages it may import (lazily inside functions too)
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "jobs": set(),
    "migrations": {"jobs"},
    "api": {"jobs"},
    "worker": {"jobs", "engine"},
    "cli": {"jobs", "api", "worker", "engine", "migrations"},
    "bench": {"jobs", "api", "worker", "engine", "kernels", "migrations", "cli"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages a module imports anywhere in its body (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names)
    return found & set(PACKAGES)


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the modules that import it."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for other in imported_packages(path) - {package}:
                graph[package].setdefault(other, []).append(str(path.relative_to(ROOT)))
    return graph


def test_packages_import_only_what_the_layout_allows():
    graph = package_graph()
    assert graph["worker"].keys() >= {"jobs", "engine"}  # the scan sees imports: the worker bridges both
    broken = {f"{package} -> {other}": modules for package, deps in graph.items()
              for other, modules in deps.items() if other not in ALLOWED[package]}
    assert broken == {}


def test_no_import_cycles_between_packages():
    graph = package_graph()
    try:
        tuple(TopologicalSorter({p: set(deps) for p, deps in graph.items()}).static_order())
    except CycleError as exc:
        raise AssertionError(f"packages import each other: {exc.args[1]}") from None


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_engine_config_is_light_to_import():
    assert loaded_after("import engine.config") & {"transformers", "triton"} == set()


def test_the_api_loads_neither_model_code_nor_the_worker():
    assert loaded_after("import api.app") & {"engine", "worker", "kernels", "torch", "triton"} == set()
