"""The benchmark registry. A scenario is a function `(quick, work_dir) -> BenchResult`;
the entry point writes `<scenario>.json`, `.png` and `.md` and prints a one-line summary.
Scenarios: quality, hetero, goodput, overlap, streaming, datapath, startup, warmstart, data,
compression, gpu (its CUDA rows need a GPU), coordinator, bareloop."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from orchestrator.bench.report import BenchResult, require_plotting, write_docs_index, write_result

Scenario = Callable[[bool, Path], BenchResult]
# name -> "module:function"; imported when run, so a scenario never imports the registry
SCENARIOS: dict[str, str] = {
    name: f"orchestrator.bench.{name}:{name}"
    for name in (
        "quality",
        "hetero",
        "goodput",
        "overlap",
        "streaming",
        "datapath",
        "startup",
        "warmstart",
        "data",
        "compression",
        "gpu",
        "coordinator",
        "bareloop",
    )
}


def available() -> list[str]:
    return sorted(SCENARIOS)


def load(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; available: {', '.join(sorted(SCENARIOS))}")
    module, _, function = SCENARIOS[name].partition(":")
    fn: Scenario = getattr(importlib.import_module(module), function)
    return fn


def run_bench(name: str, quick: bool, out: Path, docs: Path | None = None) -> BenchResult:
    require_plotting()  # before the runs: a report without its plot would cost them all
    scenario = load(name)
    out.mkdir(parents=True, exist_ok=True)
    result = scenario(quick, out / f"{name}-runs")
    write_result(result, out)
    if docs is not None:
        write_result(result, docs)
        write_docs_index(docs, available())
    return result
