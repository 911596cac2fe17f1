"""Guard rails on the architecture: no import cycle among the project's modules (imports
inside functions and under `TYPE_CHECKING` count too), and the pure layers — algorithms,
engine and policies — import neither Ray nor FastAPI, so they run and are tested anywhere."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("orchestrator", "workers", "api")
PURE = (
    "archipelago.orchestrator.algorithms",
    "archipelago.orchestrator.engine",
    "archipelago.orchestrator.config",
    "archipelago.orchestrator.config_load",
)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(("archipelago", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, wherever the import statement stands."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = MODULES
    graph = {}
    for name in modules:
        deps = set()
        for full in IMPORTS[name]:
            imported = full
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                deps.add(imported)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


# Parsed once, when the module is collected: CPython 3.11's `ast.parse` can fail with
# "AST constructor recursion depth mismatch" once another test (hypothesis) has moved the
# recursion limit, and there is no reason to parse every file more than once anyway.
MODULES = _modules()
IMPORTS = {name: _imports(path, name) for name, path in MODULES.items()}
GRAPH = _graph()
PRINTING = sorted(
    name
    for name, path in MODULES.items()
    if any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
        for node in ast.walk(ast.parse(path.read_text()))
    )
)


def test_no_import_cycle_among_the_projects_modules():
    graph = GRAPH
    assert len(graph) > 30 and "archipelago.orchestrator.engine.engine" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _reach(name: str) -> set[str]:
    """Every project module `name` imports, directly or through others."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in GRAPH.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_pure_layers_reach_neither_ray_nor_fastapi_even_transitively():
    """Followed through every module they import: a pure module that imported a helper
    that imported Ray would pass a direct-imports check and still need Ray to run."""
    offenders = {}
    for name in MODULES:
        if name.startswith(PURE):
            reach = _reach(name) | {name}
            bad = {m for r in reach for m in IMPORTS[r] if m.split(".")[0] in ("ray", "fastapi", "uvicorn")}
            layers = {
                r for r in reach if r.startswith(("archipelago.orchestrator.runtime", *NOT_PRODUCT, "archipelago.api"))
            }
            if bad or layers:
                offenders[name] = sorted(bad | layers)
    assert not offenders, offenders


def test_the_reach_check_follows_imports_through_other_modules():
    assert "archipelago.orchestrator.engine.types" in _reach(
        "archipelago.orchestrator.engine.engine"
    )  # via admission, fleet, ...
    assert "archipelago.orchestrator.engine.engine" not in _reach("archipelago.orchestrator.engine.types")


NOT_PRODUCT = ("archipelago.orchestrator.bench", "archipelago.orchestrator.bench.simulation")


def test_nothing_in_the_product_imports_the_benchmarks_or_the_testing_package():
    """The benchmarks and the in-process pool, its faults and chaos are layers above the
    product: the command finds `bench` through its entry point, tests and benches import
    `testing`, and the product runs (and installs) without either."""
    offenders = {
        name: sorted(m for m in IMPORTS[name] if m.startswith(NOT_PRODUCT))
        for name in MODULES
        if not name.startswith(NOT_PRODUCT)
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert any(
        m.startswith("archipelago.orchestrator.bench.simulation")
        for m in IMPORTS["archipelago.orchestrator.bench.fleet"]
    )


def test_the_runs_config_the_work_order_and_the_island_spec_carry_no_simulation():
    """A simulated fleet is read beside a run's config (`archipelago.orchestrator.bench.simulation.config`) and
    priced by the simulation's own pools: no model of the run's config refers to the
    simulation's (its JSON schema names them), and neither the order an island is handed nor
    the spec it is built from has a field only a simulation would set."""
    import dataclasses

    from archipelago.orchestrator.bench.simulation.config import SimulationConfig
    from archipelago.orchestrator.bench.simulation.links import LinkConfig
    from archipelago.orchestrator.config import RunConfig
    from archipelago.workers.runtime.island_spec import IslandSpec
    from archipelago.workers.wire.messages import WorkOrder

    defs = RunConfig.model_json_schema().get("$defs", {})
    assert (
        not {SimulationConfig.__name__, LinkConfig.__name__} & set(defs) and "simulation" not in RunConfig.model_fields
    )
    simulated = set(SimulationConfig.model_fields) | {"simulated", "start_delay_s"}
    for cls in (WorkOrder, IslandSpec):
        assert not simulated & {f.name for f in dataclasses.fields(cls)}, cls


def test_bench_is_a_registered_subcommand():
    from importlib.metadata import entry_points

    from archipelago.orchestrator.cli import COMMANDS

    assert [p.value for p in entry_points(group=COMMANDS, name="bench")] == [
        "archipelago.orchestrator.bench.command:register"
    ]


def test_the_package_reports_through_logging_not_print():
    assert not PRINTING, PRINTING


MODE_REGISTRY = "archipelago.orchestrator.modes"
MODE_NAMES = {"diloco", "ddp", "async", "overlap", "streaming"}


def _mode_dispatch(tree: ast.AST) -> list[int]:
    """Lines that ask which mode a run is in: a comparison with a `Mode` member or with a
    mode's name, a table keyed by `Mode` members, a `match` on a `.mode`, a test of the
    class of a `.mode` (its settings: `isinstance(cfg.mode, AsyncSettings)`; the registry's
    `settings_of` reads them for a row). (A mode's name alone is also a benchmark row's:
    only compared with a `.mode` is it one.)"""

    def member(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and (
            (isinstance(node.value, ast.Name) and node.value.id == "Mode") or member(node.value)
        )

    def names_a_mode(node: ast.AST) -> bool:
        return member(node) or (isinstance(node, ast.Constant) and node.value in MODE_NAMES)

    def reads_mode(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and (node.attr == "mode" or reads_mode(node.value))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            elements = [e for s in sides if isinstance(s, ast.Tuple | ast.List | ast.Set) for e in s.elts]
            if any(member(s) for s in [*sides, *elements]) or (
                any(reads_mode(s) for s in sides) and any(names_a_mode(s) for s in [*sides, *elements])
            ):
                lines.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass", "type")
            and any(reads_mode(a) for a in node.args)
        ):
            lines.append(node.lineno)
        table = isinstance(node, ast.Dict) and any(k is not None and member(k) for k in node.keys)
        if table or (isinstance(node, ast.Match) and reads_mode(node.subject)):
            lines.append(node.lineno)
    return lines


def test_no_module_but_the_mode_registry_asks_which_mode_a_run_is_in():
    """A mode is one row of `orchestrator/modes.py`; everything else reads the row's
    capabilities (`mode_of(cfg).lag`, `.pseudo_gradients`, ...), so adding a mode never
    means finding the places that compare its name."""
    found = {
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name != MODE_REGISTRY
        for line in _mode_dispatch(ast.parse(path.read_text()))
    }
    assert not found, f"dispatch on a mode's name outside {MODE_REGISTRY}: {sorted(found)}"


def test_the_mode_dispatch_check_finds_each_form():
    for source in (
        "if cfg.mode == Mode.DDP: pass",
        "x = cfg.mode != Mode.STREAMING",
        "x = cfg.mode in (Mode.ASYNC, Mode.OVERLAP)",
        "x = cfg.mode.value == 'ddp'",
        "x = 'streaming' == self.cfg.mode",
        "x = {Mode.ASYNC: 'asynchronous'}",
        "match cfg.mode:\n    case _: pass",
        "x = isinstance(cfg.mode, AsyncSettings)",
        "x = type(self.cfg.mode) is StreamingSettings",
        "x = cfg.mode.name == 'ddp'",
    ):
        assert _mode_dispatch(ast.parse(source)), source
    for source in (
        "data['mode'] = Mode.DDP.value",
        "x = cfg.warm_start.mode == WarmStartMode.DDP",
        "x = a == 'ddp'",
        "x = {'ddp': 1}",
    ):
        assert not _mode_dispatch(ast.parse(source)), source


ENGINE = "archipelago.orchestrator.engine"
SHARED = (f"{ENGINE}.state", f"{ENGINE}.types")  # the floor every family stands on


def _family(name: str) -> str | None:
    """A module's family in the engine: its sub-package, or itself at the top level."""
    return name[len(ENGINE) + 1 :].split(".")[0] if name.startswith(ENGINE + ".") else None


def _family_edges(graph: dict[str, set[str]], family: Callable[[str], str | None] = _family) -> set[tuple[str, str]]:
    """The imports between `family`'s groups of modules, as (importer, imported)."""
    return {
        (a, b)
        for name, imported in graph.items()
        for target in imported
        if (a := family(name)) and (b := family(target)) and a != b
    }


def test_no_two_families_of_the_engine_import_each_other_both_ways():
    """Each family (fleet, work, pacing, step, outputs, commands, ...) imports the others one
    way only: the run's shared state is a floor of its own (`engine/state/`) that every
    family reads, so no family reaches into another's for it."""
    edges = _family_edges(GRAPH)
    both = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not both, f"families that import each other both ways: {both}"


def test_the_state_floor_imports_no_family_above_it():
    above = {
        (name, target)
        for name, imported in GRAPH.items()
        if name.startswith(SHARED)
        for target in imported
        if target.startswith(ENGINE + ".") and not target.startswith(SHARED)
    }
    assert not above, f"the state floor imports families above it: {sorted(above)}"


def test_the_two_way_check_finds_a_pair():
    graph = {f"{ENGINE}.fleet.fleet": {f"{ENGINE}.work.inflight"}, f"{ENGINE}.work.inflight": {f"{ENGINE}.fleet.x"}}
    edges = _family_edges(graph)
    assert ("fleet", "work") in edges and ("work", "fleet") in edges


LAB = ("archipelago.orchestrator.bench", "archipelago.orchestrator.bench.simulation")


def _top_family(name: str) -> str | None:
    """A module's top-level family: `api`, or a sub-package of `orchestrator` or `workers`
    (`orchestrator.plan`, `workers.data`, ...), the modules at their top level each their own.
    The lab (bench, simulation) is no family of the product's."""
    parts = name.split(".")
    if name.startswith(LAB) or len(parts) < 2 or parts[0] != "archipelago":
        return None
    if parts[1] == "api":
        return "api"
    return ".".join(parts[1:3]) if len(parts) > 2 else parts[1]


def test_no_two_top_level_families_import_each_other_both_ways():
    """The families above the engine import one way: the runtime plans (`runtime` → `plan`)
    and serves the API (`runtime` → `api`) — the API speaks to a protocol, the runtime hands
    it the Ray one (`runtime/run_handle.py`), and a rehearsal measures the evaluation actor's
    Ray-free body (`engine/outputs/evaluation.py`); tasks read the data layer, which holds
    the embedded corpus (`workers/data/corpus.py`) rather than reaching back into tasks.
    Before: api↔runtime, plan↔runtime, data↔tasks."""
    edges = _family_edges(GRAPH, _top_family)
    both = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not both, f"top-level families that import each other both ways: {both}"


def test_the_top_level_two_way_check_finds_a_pair():
    graph = {
        "archipelago.api.handle": {"archipelago.orchestrator.runtime.names"},
        "archipelago.orchestrator.runtime.control_plane": {"archipelago.api.server"},
        "archipelago.orchestrator.bench.gpu": {"archipelago.api.handle"},
    }
    edges = _family_edges(graph, _top_family)
    assert ("api", "orchestrator.runtime") in edges and ("orchestrator.runtime", "api") in edges
    assert not any("bench" in a or "bench" in b for a, b in edges)


def test_imports_within_a_top_level_package_are_relative():
    """Tools that read an import as a path (farm-studio, an IDE without the package
    installed) resolve `from ..engine.types import X` but not `archipelago.orchestrator.…`,
    whose folders are not under `archipelago/`: within `orchestrator/`, `workers/` and `api/`
    the product imports relatively (docs/development.md); across them, and from the lab, by
    name."""
    absolute = []
    for name, path in MODULES.items():
        top = name.split(".")[1]
        if name.startswith(LAB):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").startswith(f"archipelago.{top}")
                and not (node.module or "").startswith(LAB)
            ):
                absolute.append(f"{path.relative_to(REPO)}:{node.lineno}")
            elif isinstance(node, ast.Import):
                absolute += [
                    f"{path.relative_to(REPO)}:{node.lineno}"
                    for a in node.names
                    if a.name.startswith(f"archipelago.{top}.") and not a.name.startswith(LAB)
                ]
    assert not absolute, f"imports by name within their own top-level package: {absolute[:10]}"
