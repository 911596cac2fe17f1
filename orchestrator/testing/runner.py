"""A whole run in this process: the product's phases (warm start, then the run) with
the in-process pool for islands."""

from __future__ import annotations

from typing import Any

from orchestrator.config import RunConfig
from orchestrator.engine.build import PhasedRun
from orchestrator.testing.pool import InProcessPool


def run_in_process(cfg: RunConfig, run_id: str = "bench") -> dict[str, Any]:
    """`cfg` run to the end on the in-process island pool: the same engine, policies and
    island code as under Ray, with the islands as objects of this process taking turns
    and the virtual clock (`simulation.virtual_step_s`) for time — what a scenario of many
    simulated islands on two cores can afford. Its summary."""
    step_s = cfg.simulation.virtual_step_s
    if step_s is None:
        raise ValueError("an in-process run needs simulation.virtual_step_s (its clock is simulated)")
    return PhasedRun(cfg, run_id, lambda c, _rid: InProcessPool(c, step_s=step_s)).execute()
