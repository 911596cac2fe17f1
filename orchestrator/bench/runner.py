"""Runs a table of configurations one after another on one Ray instance, so every
method of a scenario is measured side by side on the same machine in one process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray

from orchestrator.config_load import load_config
from orchestrator.runtime.driver import init_ray, run

log = logging.getLogger(__name__)

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
            log.info(
                "  %-26s final eval loss %.4f  %9.1f MB  %.0fs",
                name,
                summary["final_eval_loss"],
                summary["bytes_communicated"] / 1e6,
                summary["train_seconds"],
            )
    finally:
        if started:
            ray.shutdown()
    return summaries
