"""The asynchronous loop (Async Local-SGD): every island loops on its own — pull the
latest version, train H_i steps, submit — and the coordinator applies each submission on
arrival, never waiting for the others.

The token budget equals the synchronous run's (`rounds × islands × inner_steps` inner
steps in total), so modes compare at equal tokens. One metrics record is written per
`islands.count` arrivals (one round's worth). With DyLU each island's H_i follows its
measured speed. A submission whose island died is dropped and its unfinished steps go
back to the budget; if nothing arrives within `round_timeout_s`, the islands in flight
are marked late and their results, when they come, are discarded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from orchestrator.sharded_server import ShardedServer
from orchestrator.async_server import AsyncServer
from orchestrator.dylu import SpeedTracker

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator


@dataclass
class _Flight:
    island: int
    version: int
    steps: int


def run_async(co: "Coordinator") -> None:
    cfg, server = co.cfg, co.server
    assert isinstance(server, (AsyncServer, ShardedServer))
    k, h_max = cfg.islands.count, cfg.inner_steps
    remaining = cfg.rounds * k * h_max - co.completed_steps  # after a restart: what is left
    speeds = SpeedTracker(cfg.asynchronous.speed_smoothing)
    for i in co.members.schedulable():
        speeds.add(i)
    inflight: dict[ray.ObjectRef, _Flight] = {}

    def dispatch(i: int) -> None:
        nonlocal remaining
        if not co.controls.boundary(co):
            return
        h_max = cfg.inner_steps  # may change between submissions
        h = speeds.steps(h_max)[i] if cfg.asynchronous.dylu else h_max
        h = min(h, remaining)
        if h <= 0:
            return
        sent = co.count_dispatch(i)
        if sent is None:
            return  # more islands than data shards: this one idles
        download_s, shards = sent
        progress = co.completed_steps // k  # the run's position in each island's lr schedule
        ref = co.handles[i].actor.run_round.remote(server.version, co.params_ref(), h, download_s, shards, progress)
        inflight[ref] = _Flight(i, server.version, h)
        remaining -= h
        co.members.islands[i].inner_steps = h

    for i in co.members.schedulable():
        dispatch(i)
    rnd, completed, per_round = co.rounds_done, co.completed_steps, k * h_max
    t_round, tokens_before = time.perf_counter(), co.tokens
    window: dict[str, list] = {"staleness": [], "contributed": [], "rejected": []}
    losses: dict[int, float] = {}

    def close(rnd: int) -> None:
        nonlocal t_round, tokens_before, window, losses
        co.close_record(rnd, t_round, tokens_before, losses, {
            **window, "inner_steps": {str(i): s.inner_steps for i, s in co.members.islands.items()}})
        t_round, tokens_before = time.perf_counter(), co.tokens
        window = {"staleness": [], "contributed": [], "rejected": []}
        losses = {}

    while inflight:
        waited = co.wait(list(inflight), 1)
        if waited is None:
            return  # stopped now: the submissions in flight are abandoned
        ready = waited[0]
        if not ready:  # nobody delivered in time: leave the islands in flight behind
            for ref, flight in inflight.items():
                co.mark_late(flight.island, ref)
            inflight.clear()
        else:
            flight = inflight.pop(ready[0])
            result = co.fetch(ready[0], flight.island)
            if result is None:
                remaining += flight.steps  # the dead island's steps go back to the budget
            else:
                completed += flight.steps
                _apply(co, server, speeds, result, window, losses)
        co.free_overdue()
        busy = {f.island for f in inflight.values()}
        co.supervisor.tick(busy)
        if not inflight and remaining > 0 and not co.members.schedulable() and not co.controls.stopping.is_set():
            co.wait_for_islands(busy)
        for i in co.members.schedulable():
            if i not in busy:
                speeds.add(i)
                dispatch(i)
        if completed // per_round > rnd:
            rnd = min(completed // per_round, cfg.rounds)
            close(rnd)
    if rnd < cfg.rounds:
        close(cfg.rounds)


def _apply(co: "Coordinator", server: "AsyncServer | ShardedServer", speeds: SpeedTracker, result, window: dict, losses: dict) -> None:
    """Apply one arrival and account for it (staleness, speed, tokens, bytes)."""
    speeds.observe(result.island, result.steps, result.compute_s)
    time.sleep(max(0.0, co.delivered_at(result) - time.time()))  # crossing the simulated link
    out = server.submit(co.contribution(result))
    co.count_result(result, out.accepted, out.reason)
    stats = co.members.islands[result.island]
    stats.observe_staleness(out.staleness)
    if out.accepted and out.scale < 1.0:
        stats.downweighted += 1
    stats.steps_per_s = speeds.speeds.get(result.island, 0.0)
    losses[result.island] = result.mean_loss
    window["staleness"].append(out.staleness)
    if out.accepted:
        window["contributed"].append(result.island)
    else:
        window["rejected"].append({"island": result.island, "reason": out.reason})
