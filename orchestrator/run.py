"""Entry point of a run: connect to (or start) Ray, place the coordinator, show progress."""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.config import RunConfig
from orchestrator.coordinator import Coordinator
from orchestrator.progress import ProgressPrinter
from workers.task import load_task


def init_ray(cfg: RunConfig) -> bool:
    """Connect to `ray.address` / $RAY_ADDRESS, or start a local instance sized for the
    islands. Returns True when this call started Ray (and so should shut it down)."""
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    needed = cfg.islands.count * cfg.islands.cpus
    num_cpus = cfg.ray.num_cpus or max(1, int(needed + 0.999))
    num_gpus = int(cfg.islands.count * cfg.islands.gpus + 0.999) if cfg.islands.gpus else None
    pythonpath = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    return True


def start_coordinator(cfg: RunConfig) -> Any:
    """The coordinator actor, pinned to this node so its outputs land where the user looks."""
    node_id = ray.get_runtime_context().get_node_id()
    return ray.remote(Coordinator).options(
        num_cpus=0, max_concurrency=4, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(cfg)


def run(cfg: RunConfig, poll_s: float = 0.5, show_progress: bool = True) -> dict[str, Any]:
    """Train to the end; returns the summary (also in `out_dir/summary.json`)."""
    load_task(cfg.task.factory, cfg.task.kwargs).prepare()  # build data caches once, before any actor
    started = init_ray(cfg)
    printer = ProgressPrinter() if show_progress else None
    try:
        coordinator = start_coordinator(cfg)
        done = coordinator.run.remote()
        while not ray.wait([done], timeout=poll_s)[0]:
            if printer:
                printer.update(ray.get(coordinator.progress.remote()))
        summary = ray.get(done)
        if printer:
            printer.update(ray.get(coordinator.progress.remote()))
            printer.close()
        return summary
    finally:
        if started:
            ray.shutdown()


def print_summary(summary: dict[str, Any], stream=sys.stdout) -> None:
    out = summary["out_dir"]
    stream.write(
        f"eval loss {summary['initial_eval_loss']:.4f} -> {summary['final_eval_loss']:.4f} | "
        f"{summary['tokens']:,} tokens in {summary['wall_seconds']:.1f}s ({summary['tokens_per_s']:,.0f} tok/s) | "
        f"{summary['bytes_communicated'] / 1e6:.1f} MB exchanged | {summary['outer_steps']} outer steps\n"
        f"results: {out}/summary.json, {out}/metrics.jsonl, model {out}/final.pt\n")
    stream.flush()
    time.sleep(0)  # keep output ordering with Ray's log forwarding
