"""Runs a table of configurations one after another on one Ray instance, so every
method of a scenario is measured side by side on the same machine in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from orchestrator.config_load import load_config
from orchestrator.runtime.driver import init_ray, run

Table = dict[str, tuple[str, list[str]]]  # name -> (description, overrides)


def run_methods(base: list[str], table: Table, work: Path) -> dict[str, dict[str, Any]]:
    """The summary of every method's run (its outputs are in `work/<name>`)."""
    summaries: dict[str, dict[str, Any]] = {}
    started = False
    try:
        for name, (_, overrides) in table.items():
            cfg = load_config(None, [*base, *overrides, f"out_dir={work / name}"])
            started = init_ray(cfg) or started
            summary = run(cfg, show_progress=False)
            summaries[name] = summary
            print(
                f"  {name:26s} final eval loss {summary['final_eval_loss']:.4f}  "
                f"{summary['bytes_communicated'] / 1e6:9.1f} MB  {summary['train_seconds']:.0f}s",
                flush=True,
            )
    finally:
        if started:
            ray.shutdown()
    return summaries
