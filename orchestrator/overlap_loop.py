"""The overlap loop (CO2): an island hands over its round-t result and at once starts
round t+1 from the global of the outer step that used round t−1, so the exchange of
round t (upload, averaging, outer step, download) hides behind round t+1's computation.

Round t closes when every island given round t has delivered (its result crossed its
simulated link); closing it publishes version t. An island whose next round needs a
version not yet published waits (that wait is the part of communication CO2 could not
hide, `comm_time > compute_time`). Token budget and records: as in the sync loop.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from orchestrator.sharded_server import ShardedServer
from orchestrator.overlap_server import OverlapServer, start_version
from workers.island import RoundResult

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator


def run_overlap(co: "Coordinator") -> None:
    cfg, server = co.cfg, co.server
    assert isinstance(server, (OverlapServer, ShardedServer))
    inflight: dict[ray.ObjectRef, tuple[int, int]] = {}     # ref -> (island, round)
    expected: dict[int, set[int]] = {}                      # round -> islands working on it
    results: dict[int, list[RoundResult]] = {}
    next_round = {i: server.version + 1 for i in co.members.schedulable()}
    held = {i: -1 for i in next_round}                      # version each island holds
    published_at = {server.version: 0.0}
    waiting: set[int] = set()

    def dispatch(i: int) -> None:
        t = next_round[i]
        if t > cfg.rounds or not co.controls.boundary(co):
            return
        s = start_version(t, server.base)
        if server.version < s:
            waiting.add(i)
            return
        waiting.discard(i)
        shards = co.shards.assignment(i, co.members.schedulable())
        if not shards:
            return  # more islands than data shards: this one idles
        delay = 0.0
        if held.get(i, -1) != s:  # a new global to download (in the background while round t−1 ran)
            sent = co.count_dispatch(i)
            assert sent is not None
            delay = max(0.0, published_at[s] + sent[0] - time.time())
            held[i] = s
        ref = co.handles[i].actor.run_round.remote(s, co.params_ref(), cfg.inner_steps, delay, shards)
        inflight[ref] = (i, t)
        expected.setdefault(t, set()).add(i)
        co.members.islands[i].inner_steps = cfg.inner_steps

    def forget(i: int) -> None:
        for islands in expected.values():
            islands.discard(i)
        waiting.discard(i)

    for i in list(next_round):
        dispatch(i)
    t_round, tokens_before = time.perf_counter(), co.tokens
    while server.version < cfg.rounds:
        t = server.version + 1
        done = results.setdefault(t, [])
        if co.controls.stopping.is_set() and not inflight and not (expected.get(t) and expected[t] <= {r.island for r in done}):
            break
        busy = {isl for isl, _ in inflight.values()}
        co.supervisor.tick(busy)
        if not expected.get(t) and not done:
            co.wait_for_islands(busy)
            for j in co.members.schedulable():
                if j not in busy:
                    next_round[j] = t
                    dispatch(j)
            continue
        if expected.get(t, set()) <= {r.island for r in done}:
            _close(co, server, t, done, t_round, tokens_before)
            published_at[server.version] = time.time()
            t_round, tokens_before = time.perf_counter(), co.tokens
            for i in sorted(waiting):
                dispatch(i)
            continue
        waited = co.wait(list(inflight), 1)
        if waited is None:
            return  # stopped now: the rounds in flight are abandoned
        ready = waited[0]
        if not ready:  # nobody delivered in time: leave the islands in flight behind
            for ref, (i, _) in inflight.items():
                co.mark_late(i, ref)
                forget(i)
            inflight.clear()
            continue
        i, t_done = inflight.pop(ready[0])
        result = co.fetch(ready[0], i)
        if result is None:
            forget(i)
            continue
        results.setdefault(t_done, []).append(result)
        next_round[i] = t_done + 1
        if co.members.islands[i].state == "training":
            dispatch(i)
        co.free_overdue()
        for j in co.members.schedulable():
            if j not in {isl for isl, _ in inflight.values()} and j not in waiting and next_round.get(j, 0) <= t_done:
                next_round[j] = server.version + 2  # re-admitted: starts from the newest version
                dispatch(j)


def _close(co: "Coordinator", server: "OverlapServer | ShardedServer", t: int, done: list[RoundResult], t_round: float,
           tokens_before: int) -> None:
    """Close round t once all its results have crossed their links."""
    if done:
        time.sleep(max(0.0, max(co.delivered_at(r) for r in done) - time.time()))
    outcome = server.close_round(t, [co.contribution(r) for r in done])
    staleness = (t - 1) - start_version(t, server.base)
    for r in done:
        co.count_result(r, r.island in outcome.accepted, outcome.rejected.get(r.island))
        co.members.islands[r.island].observe_staleness(staleness)
    co.close_record(t, t_round, tokens_before, {r.island: r.mean_loss for r in done}, {
        "contributed": outcome.accepted, "rejected": {str(i): w for i, w in outcome.rejected.items()},
        "staleness": staleness, "gap_penalty": server.last_gap,
    })
