"""The layout's rules, read from the source: which package may import which, no cycles, light imports.

Data flows one way (producer -> api -> broker -> worker -> engine -> worker -> database): the API never
touches the engine or the worker, the engine and its kernels know nothing of the service, and `jobs/`, the
contract both sides share, depends on no other package of the project. The broker's room (`broker/`) and the
database's (`store/`) build on the contract; the contract knows neither.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jobs", "store", "broker", "process", "api", "worker", "engine", "kernels", "migrations", "cli", "bench")

# package -> the project packages it may import (lazily inside functions too)
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "jobs": set(),
    "process": set(),
    "store": {"jobs"},
    "broker": {"jobs", "store"},
    "migrations": {"jobs", "store"},
    "api": {"jobs", "store", "broker", "process"},
    "worker": {"jobs", "store", "broker", "process", "engine"},
    "cli": {"jobs", "store", "broker", "process", "api", "worker", "engine", "migrations"},
    "bench": {"jobs", "store", "broker", "process", "api", "worker", "engine", "kernels", "migrations", "cli"},
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


def test_the_contract_imports_no_broker_client():
    """`jobs/` is what both sides agree on; talking to the broker is `broker/`'s work."""
    clients = {"celery", "kombu", "redis"}
    found = {}
    for path in sorted((ROOT / "jobs").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if used := sorted({m.split(".")[0] for m in imported_modules(tree, "jobs")} & clients):
            found[str(path.relative_to(ROOT))] = used
    assert found == {}
    assert {m.split(".")[0] for m in imported_modules(ast.parse("from kombu import Queue"), "jobs")} & clients


def test_the_contract_makes_no_database_engine():
    found = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "jobs").rglob("*.py"))
             if re.search(r"\b(create_engine|sessionmaker)\b", path.read_text())]
    assert found == []


def lines_matching(pattern: str) -> dict[str, int]:
    """Source file -> how many of its lines match `pattern`, over every package."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if n := sum(1 for line in path.read_text().splitlines() if re.search(pattern, line)):
                found[str(path.relative_to(ROOT))] = n
    return found


def test_whether_the_broker_is_redis_is_decided_once():
    assert lines_matching(r"startswith\(\(?[\"']rediss?(://)?[\"']") == {"broker/redis_layout.py": 1}


def test_the_liveness_of_workers_is_stated_once():
    """The router, the health probe and the sweep all ask `store.workers.alive`."""
    assert lines_matching(r"heartbeat_at\s*[<>]=?\s*db_now\(") == {"store/workers.py": 1}
    assert lines_matching(r"def live_workers\b") == {"store/workers.py": 1}


def test_the_fence_of_a_runs_writes_is_stated_once():
    """A run's write counts only while its job is `running` under the run's lease (`worker.fence.holds`)."""
    assert lines_matching(r"lease_id\s*==.*status\s*==\s*RUNNING") == {"worker/fence.py": 1}


def test_migrations_import_no_application_code():
    """A revision must make what it made whatever the application becomes: it imports nothing of the project but
    the frozen helpers beside it (`migrations.*`), never `jobs`, whose tables, schemas and counts move on."""
    revisions = sorted((ROOT / "migrations" / "versions").glob("*.py"))
    assert len(revisions) >= 14
    broken = {str(path.relative_to(ROOT)): sorted(imported_packages(path) - {"migrations"}) for path in revisions}
    assert {path: found for path, found in broken.items() if found} == {}


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


ROUTES = ROOT / "api" / "routes"
# what a route would call to handle a transaction or run SQL itself: the service layer (`api/service/`) does it
SESSION_WORK = {"commit", "rollback", "begin", "begin_nested", "flush", "execute", "scalar", "scalars"}


def imported_modules(tree: ast.AST, package: str) -> set[str]:
    """Every module `tree` imports (absolute names; relative ones resolved against `package`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from api.routes import jobs`
    return found


def route_modules() -> dict[str, ast.AST]:
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text(), str(path)) for path in sorted(ROUTES.glob("*.py"))}


def test_routes_leave_sql_and_transactions_to_the_service_layer():
    modules = route_modules()
    found = {}
    for name, tree in modules.items():
        sql = {m for m in imported_modules(tree, "api.routes") if m.split(".")[0] == "sqlalchemy"}
        calls = {node.func.attr for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SESSION_WORK}
        if sql or calls:
            found[name] = sorted(sql | calls)
    assert len(modules) >= 5 and found == {}


def test_no_route_module_imports_another():
    found = {name: sorted(m for m in imported_modules(tree, "api.routes") if m.startswith("api.routes."))
             for name, tree in route_modules().items()}
    assert {name: modules for name, modules in found.items() if modules} == {}


# literals that hold sampling field names as data, not as a list of the fields
SAMPLING_DATA = {("cli/tiny_model.py", "QWEN3_GENERATION_CONFIG")}  # Qwen3's published generation_config.json


def sampling_name_lists(path: Path, names: set[str]) -> list[tuple[int, list[str]]]:
    """(line, names) of each tuple, list or set literal, or dict's keys, in `path` naming 3 or more of `names`."""
    relative = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), str(path))
    data = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and (relative, t.id) in SAMPLING_DATA for t in node.targets)
            for inner in ast.walk(node.value)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        else:
            continue
        named = sorted({item.value for item in items if isinstance(item, ast.Constant) and item.value in names})
        if len(named) >= 3 and id(node) not in data:
            found.append((node.lineno, named))
    return found


def test_sampling_fields_are_listed_only_where_they_are_defined():
    from jobs.schemas import Sampling

    names = set(Sampling.model_fields)
    defined = {"jobs/schemas.py", "engine/interface.py"}  # `Sampling`, and the engine's `SamplingParams`
    found = {str(path.relative_to(ROOT)): lists for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in defined and (lists := sampling_name_lists(path, names))}
    assert len(names) >= 8 and found == {}


# The engine's rooms: `core` decides what a step runs, `model` runs a `StepPlan` (engine.step) and reads nothing
# else of a request, `runtime` drives any `StepEngine` through the contract of `engine.interface`.
# sub-package or module -> the engine modules it must not import (each with everything under it)
ENGINE_FORBIDDEN = {
    "engine.core": ("engine.model", "engine.runtime", "engine.llm_engine", "engine.builder", "engine.parts",
                    "engine.hf_backend"),
    "engine.model": ("engine.runtime", "engine.llm_engine", "engine.builder", "engine.parts", "engine.hf_backend",
                     # nothing that holds the scheduler's sequences: the plan is the model's only input
                     "engine.core.sequence", "engine.core.scheduler", "engine.core.step_rows",
                     "engine.core.block_manager"),
}
# The ground floor, which every other engine module may build on: module -> the only engine modules it imports.
GROUND_FLOOR = {
    "engine.interface": (),  # what crosses to the worker
    "engine.attention_policy": (),
    "engine.config": ("engine.attention_policy",),
}
# sub-package or module -> the only engine modules it may import
ENGINE_ONLY = {
    "engine.runtime": ("engine.interface", "engine.runtime"),
    "engine.step": ("engine.interface",),
    **GROUND_FLOOR,
}


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def engine_modules() -> dict[str, ast.AST]:
    """Dotted name -> syntax tree of every module of the engine."""
    found = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(path.read_text(), str(path))
    return found


def engine_rule_breaks(modules: dict[str, ast.AST]) -> dict[str, list[str]]:
    """Module -> the engine modules it imports against `ENGINE_FORBIDDEN` / `ENGINE_ONLY`."""
    broken = {}
    for name, tree in modules.items():
        package = name.rsplit(".", 1)[0]
        imported = {m for m in imported_modules(tree, package) if within(m, ("engine",)) and m != "engine"}
        bad = set()
        for room, forbidden in ENGINE_FORBIDDEN.items():
            if within(name, (room,)):
                bad |= {m for m in imported if within(m, forbidden)}
        for room, allowed in ENGINE_ONLY.items():
            if within(name, (room,)):
                bad |= {m for m in imported if not within(m, allowed)}
        if bad:
            broken[name] = sorted(bad)
    return broken


def test_the_engines_rooms_import_only_what_their_rules_allow():
    modules = engine_modules()
    assert {"engine.core.scheduler", "engine.model.step_executor", "engine.runtime.engine_thread",
            "engine.step"} <= modules.keys()
    assert engine_rule_breaks(modules) == {}


def test_each_engine_rule_catches_an_import_that_breaks_it():
    breaking = [
        ("engine.core.scheduler", "from engine.model.sampler import sample"),
        ("engine.core.sequence", "import engine.runtime.loop_gaps"),
        ("engine.core.block_manager", "from engine import llm_engine"),
        ("engine.core.step_cost", "from engine.parts import build"),
        ("engine.core.scheduler", "from engine.builder import start_runner"),
        ("engine.core.kv_cache", "from engine.hf_backend import HFEngine"),
        ("engine.model.step_executor", "from engine.core.sequence import Sequence"),
        ("engine.model.sampler", "from engine.core import scheduler"),
        ("engine.model.dense_decode", "from ..core.step_rows import step_plan"),
        ("engine.model.kv_plan", "from engine.core.block_manager import BlockManager"),
        ("engine.model.decoder", "from engine.runtime.engine_thread import EngineThread"),
        ("engine.model.attention_batch", "import engine.llm_engine"),
        ("engine.model.loader", "from engine.parts import build"),
        ("engine.model.cuda_graphs", "from engine.hf_backend import HFEngine"),
        ("engine.runtime.engine_thread", "from engine.core.sequence import Sequence"),
        ("engine.runtime.engine_process", "from engine.model import sampler"),
        ("engine.runtime.loop_gaps", "from engine.config import EngineConfig"),
        ("engine.step", "from engine.core.step_cost import Work"),
        ("engine.interface", "from engine.step import StepPlan"),
        ("engine.interface", "from engine.config import EngineConfig"),
        ("engine.config", "from engine.model.kv_plan import plan_kv"),
        ("engine.config", "from engine.interface import Request"),
        ("engine.attention_policy", "from engine.config import EngineConfig"),
    ]
    missed = [(name, source) for name, source in breaking if not engine_rule_breaks({name: ast.parse(source)})]
    assert missed == []
    allowed = [("engine.core.scheduler", "from engine.step import StepPlan"),
               ("engine.model.step_executor", "from engine.core.kv_cache import KVCache"),
               ("engine.runtime.engine_process", "from .engine_thread import EngineThread"),
               ("engine.config", "from engine.attention_policy import parse_policy")]
    assert [name for name, source in allowed if engine_rule_breaks({name: ast.parse(source)})] == []


# what the worker may import of the engine: its contract, and the one way to build and start an engine
WORKER_SEES_OF_THE_ENGINE = ("engine.interface", "engine.builder")


def engine_imports_outside_the_interface(tree: ast.AST) -> list[str]:
    found = {m for m in imported_modules(tree, "worker") if within(m, ("engine",)) and m != "engine"}
    return sorted(m for m in found if not within(m, WORKER_SEES_OF_THE_ENGINE))


def test_the_worker_sees_of_the_engine_only_its_interface_and_builder():
    found = {str(path.relative_to(ROOT)): modules for path in sorted((ROOT / "worker").rglob("*.py"))
             if (modules := engine_imports_outside_the_interface(ast.parse(path.read_text(), str(path))))}
    assert found == {}
    assert engine_imports_outside_the_interface(ast.parse("from engine.runtime.engine_thread import EngineDead"))
    assert engine_imports_outside_the_interface(ast.parse("from engine import llm_engine"))
    assert not engine_imports_outside_the_interface(ast.parse("from engine import builder"))


def interactive_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare against the interactive threshold, or compare a priority with a number."""
    def names(node: ast.AST) -> set[str]:
        return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
                if isinstance(n, ast.Attribute | ast.Name)}

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        threshold = any("interactive_priority" in names(o) for o in operands)
        against_a_number = (any("priority" in names(o) for o in operands)
                            and any(isinstance(o, ast.Constant) and isinstance(o.value, int) for o in operands))
        if threshold or against_a_number:
            found.append(node.lineno)
    return found


def test_the_interactive_line_is_drawn_in_one_place():
    found = {str(path.relative_to(ROOT)): lines for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             if (lines := interactive_comparisons(ast.parse(path.read_text(), str(path))))}
    assert found == {"jobs/queues.py": found.get("jobs/queues.py", [])} and found["jobs/queues.py"]
    assert interactive_comparisons(ast.parse("urgent = job.priority >= 7")) == [1]
    assert interactive_comparisons(ast.parse("urgent = p >= settings.interactive_priority")) == [1]


def test_the_priority_range_is_written_once():
    """`jobs.priority` bounds a priority; everything else takes `Priority`, `LOWEST`, `HIGHEST` or `LEVELS`."""
    assert lines_matching(r"^LOWEST, HIGHEST = ") == {"jobs/priority.py": 1}
    assert lines_matching(r"\b(le|max)\s*=\s*9\b|range\(10\)|\b9 - priority") == {}
    assert lines_matching(r"\bHeader\(") == {"api/http/priority.py": 1}  # the X-Convoq-Priority header


def test_a_job_s_later_options_are_listed_once():
    assert lines_matching(r"\(\"n\", \"response_format\", \"logprobs\"") == {"jobs/schemas.py": 1}


MAX_MODULE_LINES = 400  # past this a module holds more than one concept: split it by what it holds
SIZED = tuple(p for p in PACKAGES if p != "bench")  # benchmarks are scripts read top to bottom; tests/ is apart


def long_modules(packages: tuple[str, ...], limit: int) -> dict[str, int]:
    """Module of `packages` -> its number of lines, for each one longer than `limit`."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if (n := len(path.read_text().splitlines())) > limit:
                found[str(path.relative_to(ROOT))] = n
    return found


def test_no_module_outside_the_benchmarks_and_tests_is_over_400_lines():
    assert long_modules(SIZED, MAX_MODULE_LINES) == {}
    assert {"jobs", "store", "broker", "api", "worker", "engine", "kernels", "cli"} <= set(SIZED)
    assert long_modules(("worker", "engine", "api"), 250)  # the count sees modules


# what sits in `api/` itself: everything else is in a room (`http`, `streams`, `schemas`, `service`, `routes`)
API_FLAT = {"__init__.py", "app.py"}


def test_the_api_keeps_its_modules_in_rooms():
    flat = {path.name for path in (ROOT / "api").glob("*.py")}
    rooms = {path.name for path in (ROOT / "api").iterdir() if (path / "__init__.py").is_file()}
    assert flat == API_FLAT
    assert rooms == {"http", "streams", "schemas", "service", "routes"}


def plain_models(tree: ast.AST) -> list[str]:
    """Classes made straight from pydantic's `BaseModel`: what the API answers is, a job's parts are `Strict`."""
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(isinstance(base, ast.Name) and base.id == "BaseModel" for base in node.bases)]


def test_the_contract_holds_no_wire_model_of_the_api():
    """`jobs/` is what the worker needs too; what the API answers (`JobOut`, `BatchOut`, lists, errors) is
    `api/schemas/`."""
    found = {str(path.relative_to(ROOT)): models for path in sorted((ROOT / "jobs").rglob("*.py"))
             if (models := plain_models(ast.parse(path.read_text(), str(path))))}
    assert found == {"jobs/schemas.py": ["Strict"]}
    assert plain_models(ast.parse("class BatchOut(BaseModel):\n    id: int")) == ["BatchOut"]


# xgrammar's specifics (its grammars, structural tags, compiler and matchers) live beside the engine's grammar
# code; the sampler applies the masks its matchers fill
XGRAMMAR_ROOMS = r"engine/grammar\w*\.py|engine/model/sampler\.py"


def xgrammar_importers(modules: dict[str, ast.AST]) -> set[str]:
    return {name for name, tree in modules.items()
            if any(m.split(".")[0] == "xgrammar" for m in imported_modules(tree, name.split("/")[0]))}


def test_only_the_engines_grammar_code_imports_xgrammar():
    modules = {str(path.relative_to(ROOT)): ast.parse(path.read_text(), str(path))
               for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}
    found = xgrammar_importers(modules)
    assert "engine/grammar.py" in found
    assert {name for name in found if not re.fullmatch(XGRAMMAR_ROOMS, name)} == set()
    assert xgrammar_importers({"worker/bridge.py": ast.parse("from xgrammar.structural_tag import OrFormat")})


def concept_map_paths(page: str) -> list[str]:
    """The files and folders the architecture page's map of concepts names: the second column of the first table
    under its "Where each concept lives" heading."""
    after = page.split("## Where each concept lives", 1)[1]
    table = after[after.index("\n|"):].split("\n\n", 1)[0]
    return [path for row in table.strip().splitlines()[2:]
            for path in re.findall(r"`([\w/]+(?:\.py)?/?)`", row.split("|")[2]) if "/" in path]


def test_the_architecture_map_of_concepts_names_files_that_exist():
    paths = concept_map_paths((ROOT / "docs" / "architecture.md").read_text())
    assert len(paths) >= 25
    assert [path for path in paths if not (ROOT / path).exists()] == []
    assert concept_map_paths("## Where each concept lives\n\nOne file each:\n\n| a | b |\n|---|---|\n"
                             "| x | `jobs/gone.py` |\n\nAfter.\n") == ["jobs/gone.py"]
