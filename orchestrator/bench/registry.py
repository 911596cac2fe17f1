"""The benchmark registry. A scenario is a function `(quick, work_dir) -> BenchResult`;
the entry point writes `<scenario>.json`, `.png` and `.md` and prints a one-line summary.
Scenarios: quality, hetero, fleet, overlap, streaming, datapath, startup, warmstart, data,
compression, gpu (its CUDA rows need a GPU), coordinator, bareloop, head, testbed (root: network namespaces)."""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.report import BenchResult, require_plotting, write_docs_index, write_result

Scenario = Callable[..., BenchResult]  # (quick, work_dir, **options)
# name -> "module:function"; imported when run, so a scenario never imports the registry
SCENARIOS: dict[str, str] = {
    name: f"archipelago.orchestrator.bench.{name}:{name}"
    for name in (
        "quality",
        "hetero",
        "fleet",
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
        "head",
        "testbed",
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


def run_bench(name: str, quick: bool, out: Path, **options: Any) -> BenchResult:
    """Run scenario `name` (with its `options`: `fleet`'s spec); its report goes to `out`
    only (`publish` puts it in the docs)."""
    require_plotting()  # before the runs: a report without its plot would cost them all
    scenario = load(name)
    out.mkdir(parents=True, exist_ok=True)
    result = scenario(quick, out / f"{name}-runs", **options)
    write_result(result, out)
    return result


def publish(out: Path, docs: Path, names: list[str] | None = None, dirty_ok: bool = False) -> list[str]:
    """Copy the reports of `names` (default: every scenario with one in `out`) into `docs`
    and rebuild its `benchmarks.md`; the names published. A report must name the commit
    it measured, from a clean tree (unless `dirty_ok`): the published figures are then
    those of a commit anyone can check out. Nothing is copied if one report is refused."""
    names = names or [n for n in available() if (out / f"{n}.json").exists()]
    if not names:
        raise ValueError(f"no report in {out}")
    for name in names:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; available: {', '.join(available())}")
        report = json.loads((out / f"{name}.json").read_text())
        machine = report.get("machine", {})
        if not machine.get("commit"):
            raise ValueError(f"{name}: the report names no commit (measured outside a checkout)")
        if machine.get("clean") is False and not dirty_ok:
            raise ValueError(f"{name}: measured at {machine['commit'][:12]} with uncommitted changes (--dirty-ok)")
    docs.mkdir(parents=True, exist_ok=True)
    for name in names:
        for suffix in (".json", ".png", ".md"):
            shutil.copyfile(out / f"{name}{suffix}", docs / f"{name}{suffix}")
    write_docs_index(docs, available())
    return names
