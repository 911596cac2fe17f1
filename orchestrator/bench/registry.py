"""The benchmark registry. A scenario is a function `(quick, work_dir) -> BenchResult`;
the entry point writes `<scenario>.json`, `.png` and `.md` and prints a one-line summary.
Scenarios: quality, hetero, overlap, datapath."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orchestrator.bench.report import BenchResult, write_docs_index, write_result

Scenario = Callable[[bool, Path], BenchResult]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = fn
        return fn
    return register


def _load_builtin() -> None:
    from orchestrator.bench import datapath, hetero, overlap, quality  # noqa: F401  (they register themselves)


def available() -> list[str]:
    _load_builtin()
    return sorted(SCENARIOS)


def run_bench(name: str, quick: bool, out: Path, docs: Path | None = None) -> BenchResult:
    _load_builtin()
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; available: {', '.join(sorted(SCENARIOS))}")
    out.mkdir(parents=True, exist_ok=True)
    result = SCENARIOS[name](quick, out / f"{name}-runs")
    write_result(result, out)
    if docs is not None:
        write_result(result, docs)
        write_docs_index(docs)
    return result
