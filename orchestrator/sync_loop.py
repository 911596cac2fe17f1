"""The synchronous loop (diloco, ddp): every round, hand each island its work for the
current version, wait for the round (never past its deadline), step the server once
(diloco) or `inner_steps` times (ddp), and record. The next step is dispatched before a
round's record is closed, so evaluation runs while the islands train."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from orchestrator.flat_server import RoundOutcome
from orchestrator.sharded_server import ShardedServer
from orchestrator.sync_server import SyncServer
from workers.island import RoundResult

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator


def _dispatch(co: "Coordinator") -> dict[ray.ObjectRef, int] | None:
    """Hand every schedulable island its work for the current version (None: stopping)."""
    if not co.controls.boundary(co):
        return None
    co.free_overdue()
    co.supervisor.tick(set(co.overdue))
    if not co.members.schedulable():
        co.wait_for_islands(set(co.overdue))
    version, params_ref = co.server.version, co.params_ref()
    calls = {}
    for i in co.members.schedulable():
        actor = co.handles[i].actor
        sent = co.count_dispatch(i)
        if sent is None:
            continue  # more islands than data shards: this one idles
        download_s, shards = sent
        if co.cfg.mode == "ddp":
            calls[actor.gradient.remote(version, params_ref, download_s, shards)] = i
        else:
            calls[actor.run_round.remote(version, params_ref, co.cfg.inner_steps, download_s, shards)] = i
        co.members.islands[i].inner_steps = co.cfg.inner_steps
    return calls

def _collect(co: "Coordinator", calls: dict[ray.ObjectRef, int]) -> tuple[list[RoundResult], RoundOutcome] | None:
    """Wait for the round (never past its deadline) and step the server (None: aborted)."""
    assert isinstance(co.server, (SyncServer, ShardedServer))
    waited = co.wait(list(calls), len(calls))
    if waited is None:
        return None
    ready, pending = waited
    results = [r for ref in ready if (r := co.fetch(ref, calls[ref])) is not None]
    for ref in pending:
        i = calls[ref]
        co.mark_late(i, ref)
    if results:  # the round closes once every result has crossed its (simulated) link
        time.sleep(max(0.0, max(co.delivered_at(r) for r in results) - time.time()))
    outcome = co.server.close_round([co.contribution(r) for r in results])
    for r in results:
        co.count_result(r, r.island in outcome.accepted, outcome.rejected.get(r.island))
        co.members.islands[r.island].observe_staleness(0)  # a synchronous round is never stale
    return results, outcome

def run_sync(co: "Coordinator") -> None:
    """Rounds of diloco (one outer step each) or ddp (inner_steps optimizer steps each).
    The next step is dispatched before a round's record is closed, so evaluation runs
    while the islands train instead of between rounds. A stop ends after the round."""
    calls = _dispatch(co)
    for rnd in range(co.rounds_done + 1, co.cfg.rounds + 1):
        if calls is None:
            break
        t_round, tokens_before = time.perf_counter(), co.tokens
        losses: dict[int, list[float]] = {}
        outcomes = []
        steps = co.cfg.inner_steps if co.cfg.mode == "ddp" else 1
        for j in range(steps):
            collected = _collect(co, calls)
            if collected is None:
                return
            results, outcome = collected
            last = rnd == co.cfg.rounds and j == steps - 1
            calls = None if last else _dispatch(co)
            outcomes.append(outcome)
            for r in results:
                losses.setdefault(r.island, []).append(r.mean_loss)
            if calls is None:
                break
        co.close_record(rnd, t_round, tokens_before, {i: sum(v) / len(v) for i, v in losses.items()}, {
            "contributed": sorted({i for o in outcomes for i in o.accepted}),
            "rejected": {str(i): why for o in outcomes for i, why in o.rejected.items()},
            "dropped": sorted({i for o in outcomes for i in o.dropped}),
        })
