"""A whole simulated run in this process: the product's phases (warm start, then the run)
with the in-process pool for islands."""

from __future__ import annotations

from typing import Any

from archipelago.orchestrator.bench.simulation.config import Clock, SimulationConfig, planned_head
from archipelago.orchestrator.bench.simulation.pool import InProcessPool
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.build import PhasedRun


def run_in_process(cfg: RunConfig, sim: SimulationConfig, run_id: str = "bench") -> dict[str, Any]:
    """`cfg` run to the end on the in-process island pool on the fleet `sim`: the same
    engine, policies and island code as under Ray, with the islands as objects of this
    process taking turns and the virtual clock for time — what a scenario of many simulated
    islands on two cores can afford. Its summary. Codecs left `auto` are chosen as a run's
    plan chooses them, at the simulated head's card (else an island's link) and the nominal
    size (else the model's own)."""
    if sim.clock == Clock.REAL:
        raise ValueError("simulation.clock real runs on Ray (run_simulated): the in-process pool's islands take turns")
    cfg = planned_head(cfg, sim)
    return PhasedRun(cfg, run_id, lambda c, _rid: InProcessPool(c, sim), ablation=sim.ablation()).execute()
