"""A preemption notice's partial contribution, part by part: the island stops before the
step that would not end in time and sends what it trained; the ledger keeps that prefix
of the reservation and gives the rest back; the engine merges it weighted by its tokens
and refuses a short result no notice asked for. (The whole chain under a fleet's faults,
in every mode: `test_fleet.py`; on Ray, a node drained: `test_cluster_ray.py`.)"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch

from archipelago.orchestrator.bench.simulation.chaos import Strike, TimedFault
from archipelago.orchestrator.bench.simulation.pool import InProcessPool
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.orchestrator.engine.state.ledger import DataLedger
from archipelago.workers.runtime.island import Island
from archipelago.workers.runtime.rounds import Stopped
from archipelago.workers.wire.messages import WorkKind, WorkOrder, batch_counts
from tests.engine_scenarios import check_exactly_once, check_rounds_recorded, drive, scenario_cfg
from tests.helpers import events, in_process_engine
from tests.toy_tasks import READS

# 1 simulated s per inner step, a heartbeat every ½ s (`test_heartbeats.py`)
BEATS = ("elastic.hang_after_steps=3", "elastic.progress_every_s=0.5", "elastic.hang_floor_s=1")


def _island(tmp_path, *extra: str) -> tuple[Island, str]:
    cfg = scenario_cfg(tmp_path, "diloco", "islands.count=1", *extra)
    return Island(island_spec(cfg, 0)), cfg.task.kwargs["record"]


def _order(ticket: int, steps: int = 10) -> WorkOrder:
    # three shards from position 0: step j reads shard (j % 3), as the ledger would hand them out
    return WorkOrder(island=0, ticket=ticket, version=0, kind=WorkKind.TRAIN, steps=steps, shards={0: 0, 1: 0, 2: 0})


def test_a_stopped_work_sends_the_prefix_it_trained_as_a_shorter_order_would(tmp_path):
    stopped, record = _island(tmp_path)
    params = np.zeros(2)
    stopped.stop(ticket=7, after_steps=4)
    result = stopped.run(_order(7), params)
    assert result.steps == 4
    assert result.positions == batch_counts([0, 1, 2], 0, 4) == {0: 2, 1: 1, 2: 1}  # read what it trained, no more
    assert result.shard_tokens == {0: 2, 1: 2, 2: 3} and result.weight == 7  # a batch of shard s weighs s + 1
    assert READS[record] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    whole, _ = _island(tmp_path)  # the same island, told to train four steps
    expected = whole.run(_order(7, steps=4), params)
    assert torch.equal(torch.as_tensor(result.delta()), torch.as_tensor(expected.delta()))
    assert stopped.run(_order(8), params).steps == 10  # the note was for ticket 7: the next work is whole


def test_a_notice_before_the_first_step_leaves_nothing_to_send(tmp_path):
    island, record = _island(tmp_path)
    island.stop(ticket=3)  # no time given: no step after the one in progress, and none is
    with pytest.raises(Stopped):
        island.run(_order(3), np.zeros(2))
    assert READS.get(record, []) == []


def test_a_notice_with_time_left_lets_the_steps_that_fit_run(tmp_path):
    """Steps of about 50 ms, a notice of 0.12 s: the steps that end by then run (at least
    the first, whose pace is unknown), the rest do not."""
    island, _ = _island(tmp_path, "task.kwargs.batch_s=0.05")
    island.stop(ticket=1, within_s=0.12)
    result = island.run(_order(1), np.zeros(2))
    assert 1 <= result.steps < 10, result.steps


def test_the_ledger_keeps_a_stopped_works_prefix_and_gives_the_rest_back():
    ledger = DataLedger(4)
    r = ledger.reserve(1, 0, [0], steps=10)  # shards 0..3: 3, 3, 2, 2 batches
    assert r.spans == {0: (0, 3), 1: (0, 3), 2: (0, 2), 3: (0, 2)}
    back = ledger.shorten(1, 5)  # steps 0..4 read shards 0, 1, 2, 3, 0
    assert back == {0: (2, 1), 1: (1, 2), 2: (1, 1), 3: (1, 1)}
    assert ledger.position == [2, 1, 1, 1]
    assert ledger.check(1, {0: 2, 1: 1, 2: 1, 3: 1}, {0: 2, 1: 2, 2: 3, 3: 4}) is None
    ledger.commit(1, {0: 2, 1: 2, 2: 3, 3: 4})
    # the island's next work goes on with the round-robin where the five steps left it
    assert ledger.reserve(2, 0, [0], steps=3).spans == {0: (2, 0), 1: (1, 1), 2: (1, 1), 3: (1, 1)}


def test_the_ledger_does_not_shorten_what_is_not_its_shards_newest_or_not_shorter():
    ledger = DataLedger(1)
    ledger.reserve(1, 0, [0], steps=4)
    ledger.reserve(2, 0, [0], steps=4)  # overlap: the next round already continues shard 0
    assert ledger.shorten(1, 2) is None and ledger.position == [8]
    assert ledger.shorten(2, 4) is None and ledger.shorten(2, 5) is None and ledger.shorten(99, 1) is None
    assert ledger.shorten(2, 0) == {0: (4, 4)} and ledger.position == [4]


class _Unasked(InProcessPool):
    """Island 0's first work is told to stop after one step by nobody the engine knows."""

    def dispatch(self, order, params, changes=()):
        if order.island == 0 and order.ticket == 0:
            self.islands[0].stop(ticket=order.ticket, after_steps=1)
        super().dispatch(order, params, changes)


def test_a_short_result_no_notice_asked_for_is_refused_and_its_batches_retrained(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco")
    engine, _ = in_process_engine(cfg)
    pool = _Unasked(cfg)
    engine.pool = engine.inflight.pool = engine.fleet.pool = pool
    drive(engine)
    log = events(cfg.out_dir)
    rejected = [e for e in log if e["kind"] == "rejection" and e["island"] == 0]
    assert rejected and "no notice stopped it" in rejected[0]["reason"], rejected
    assert not [e for e in log if e["kind"] == "partial"]
    # its whole reservation went back (a lost work's), of which it had read the first batch only
    (lost,) = [e for e in log if e["kind"] == "lost" and e["ticket"] == 0]
    first = min(int(s) for s in lost["spans"])
    unread = Counter({(int(s), start): -1 for s, (start, _) in lost["spans"].items() if int(s) != first})
    check_exactly_once(cfg, engine.summary, unread)


def test_a_partial_contribution_weighs_its_tokens(tmp_path):
    """The stopped island's update enters the outer step with the tokens it trained: its
    island's tokens in the summary are exactly its partial's."""
    cfg = scenario_cfg(tmp_path, "quorum")
    engine, _ = in_process_engine(cfg, step_s=1.0, chaos=[TimedFault(at=2.0, kind=Strike.PREEMPT, notice=1.5)])
    drive(engine)
    check_exactly_once(cfg, engine.summary)
    (partial,) = [e for e in events(cfg.out_dir) if e["kind"] == "partial"]
    assert (partial["steps"], partial["of"]) == (3, 4)  # steps end at 1, 2, 3 s; the node goes at 3.5 s
    i = partial["island"]
    island = engine.summary["islands"][str(i)]
    assert island["rounds_contributed"] == 1
    # island i holds shards 4i..4i+3 (12 shards, 3 islands), one batch each a round; a batch of shard s weighs s + 1
    not_reached = [int(s) for s in partial["spans"]]
    assert len(not_reached) == 1
    assert island["tokens"] == sum(s + 1 for s in range(4 * i, 4 * i + 4)) - sum(s + 1 for s in not_reached)


def test_a_schedulers_notice_with_its_time_stops_the_work_at_the_steps_that_fit(tmp_path):
    """`POST /v1/islands/{id}/preempt?notice_s=2.5` as the engine takes it: the island's
    round of four 1-s steps has just begun; the two steps that end within 2.5 s are sent,
    the other two batches go back; a notice with a time that is not one is refused."""
    from archipelago.orchestrator.engine.commands import Preempt, Refusal

    cfg = scenario_cfg(tmp_path, "diloco")
    engine, _ = in_process_engine(cfg, step_s=1.0)

    def notices(e):
        assert e.submit(Preempt(island=1, notice_s=float("nan"))).reason == Refusal.INVALID
        e.submit(Preempt(island=1, notice_s=2.5))

    drive(engine, at={1: notices})
    check_exactly_once(cfg, engine.summary)
    (partial,) = [e for e in events(cfg.out_dir) if e["kind"] == "partial"]
    assert (partial["island"], partial["steps"], partial["of"]) == (1, 2, 4), partial
    assert engine.summary["islands"]["1"]["state"] == "drained"


class _Calls:
    """A Ray method's `.remote`, recording its calls (the pool's arithmetic is under test, not Ray)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return object()  # an object reference stands for the call


class _Actor:
    def __init__(self) -> None:
        self.run, self.stop = _Calls(), _Calls()


def test_the_virtual_clock_pool_counts_the_steps_that_fit_and_tells_the_island_the_count(tmp_path):
    """On Ray's virtual clock the island's own clock runs at another pace: the pool counts
    the steps that fit (1 s each here; the work begins after a 2-s download at 0) and tells
    the island the count; the result is due when the last of them ends. A stop that leaves
    every step to run, or that comes after a streaming order's send point, asks nothing."""
    from archipelago.orchestrator.bench.simulation.config import SimulationConfig
    from archipelago.orchestrator.bench.simulation.ray_pool import VirtualClockPool
    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.runtime.island_actors import IslandHandle

    cfg = load_config(None, ["islands.count=2", f"out_dir={tmp_path}"])
    pool = VirtualClockPool(cfg, "run", sim=SimulationConfig(virtual_step_s=1))
    network = pool.transfers(10)
    actor = _Actor()
    pool.handles[1] = IslandHandle(index=1, actor=actor, group=None)

    def dispatch(order):  # its parameters arrive 2 s after it is handed out
        network.arrivals[1] = pool.vt + 2.0
        return pool.dispatch(order, None)

    work = dataclasses.replace(_order(5, steps=10), island=1)
    ref = dispatch(work)
    assert pool.finish[ref] == 12.0
    pool.vt = 4.5  # steps 1 and 2 done, the third in progress
    pool.stop(1, 5, 3.0)  # the node goes at 7.5: steps 3, 4 and 5 end by then
    assert actor.stop.calls == [(5, None, 5)] and pool.finish[ref] == 7.0
    pool.stop(1, 5, 100.0)  # a later notice with room for every step: nothing to ask
    streaming = dataclasses.replace(work, ticket=6, send_after=3)
    dispatch(streaming)  # begins at 6.5
    pool.vt = 11.0  # 4.5 of its steps in: past its send point, its pseudo-gradient has left
    pool.stop(1, 6, None)
    assert len(actor.stop.calls) == 1
    downloading = dispatch(dataclasses.replace(streaming, ticket=7))  # begins at 13
    pool.stop(1, 7, None)  # no step begun, no time given: none is taken (the island raises `Stopped`)
    assert actor.stop.calls[-1] == (7, None, 0) and pool.finish[downloading] == 13.0


def _slowed_island(tmp_path, mode: str, *extra: str):
    """Three islands of 1-s steps, H = 16 (streaming: segments of 8), heartbeats every ½ s,
    deadlines far off; once round 1 is recorded, island 0 runs 8× slower from its next work
    on (sized by its old speed: 8-s steps, within its 12 step times, not hung)."""
    cfg = scenario_cfg(
        tmp_path,
        mode,
        "rounds=3",
        "inner_steps=16",
        "round_timeout_s=100",
        *BEATS,
        "elastic.hang_after_steps=12",
        *extra,
    )
    engine, pool = in_process_engine(cfg, step_s=1.0)
    drive(engine, at={1: lambda _: pool.slow.__setitem__(0, (8.0, math.inf))})
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    return cfg, engine.summary


@pytest.mark.parametrize("mode", ["quorum", "sync_dylu", "streaming_quorum"])
def test_at_the_budgets_end_a_straggler_is_stopped_and_its_rest_trained_by_the_idle_islands(tmp_path, mode):
    """Every step handed out, islands 1 and 2 idle: island 0's last work, at ⅛ step/s, is
    stopped after its step in progress (`straggler`, then its `partial`) and the idle
    islands train the rest — the run ends at least a fifth sooner, each batch trained once,
    every round recorded. With `elastic.tail_stop: null` the last step waits for it."""
    cfg, summary = _slowed_island(tmp_path, mode)
    log = events(cfg.out_dir)
    (straggler,) = [e for e in log if e["kind"] == "straggler"]
    assert straggler["island"] == 0 and straggler["keep_s"] > 2 * straggler["instead_s"], straggler
    (partial,) = [e for e in log if e["kind"] == "partial"]
    assert partial["island"] == 0 and partial["ticket"] == straggler["ticket"] and partial["steps"] < partial["of"]
    waited_cfg, waited = _slowed_island(tmp_path, mode, "elastic.tail_stop=null")
    assert not [e for e in events(waited_cfg.out_dir) if e["kind"] in ("straggler", "partial")]
    assert summary["clock_seconds"] <= 0.8 * waited["clock_seconds"], (
        summary["clock_seconds"],
        waited["clock_seconds"],
    )
    # the same budget of steps, trained either way (the batches read differ: their shards weigh differently)
    assert sum(summary["shards"]["position"]) == sum(waited["shards"]["position"]) == 3 * 3 * 16


def test_per_arrival_steps_wait_for_the_straggler(tmp_path):
    """Delayed Nesterov steps on every arrival: a stopped straggler's prefix and its rest's
    shares would each be a small late step (the tail stop cost its final loss more than the
    seconds it saved), so its budget's end is never `spent` and nothing is stopped."""
    cfg, _ = _slowed_island(tmp_path, "async")
    assert not [e for e in events(cfg.out_dir) if e["kind"] in ("straggler", "partial")]


def test_a_work_about_to_end_is_left_to_end(tmp_path):
    """Without a late island the fleet's last works end together: none is stopped."""
    cfg = scenario_cfg(tmp_path, "quorum", "rounds=4", *BEATS)
    engine, _ = in_process_engine(cfg, step_s=1.0)
    drive(engine)
    assert not [e for e in events(cfg.out_dir) if e["kind"] in ("straggler", "partial")]


@pytest.mark.parametrize("mode", ["quorum", "sync_dylu"])
def test_a_stopped_straggler_trains_the_rest_when_the_idle_islands_die_and_none_can_be_placed(tmp_path, mode):
    """The islands meant to train a stopped straggler's rest die on that work and no
    replacement can be placed: the straggler was kept out of the budget for good while the
    fleet counted it as able to train, so the run spun (40,000 simulated seconds, its event
    log growing). Now an island stopped as a straggler trains again once no other live island
    can: the run ends (164 simulated s in quorum mode, 55 s without the failures) before the
    straggler alone could have trained the whole budget, every batch trained once."""
    from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind

    cfg = scenario_cfg(
        tmp_path, mode, "rounds=3", "inner_steps=16", "round_timeout_s=100", *BEATS, "elastic.hang_after_steps=12"
    )
    limit = 3 * 3 * 16 * 8.0  # the whole budget trained by the straggler alone, at its slowed pace
    engine, pool = in_process_engine(cfg, step_s=1.0)
    drive(engine, at={1: lambda _: pool.slow.__setitem__(0, (8.0, math.inf))}, until=1)
    struck = False
    while engine.step():
        if not struck and any(e.kind.value == "straggler" for e in engine.outputs.events.recent):
            struck = True  # the rest's islands die on the work that follows; nothing new can be placed
            pool.faults += [Fault(FaultKind.CRASH, i, pool.orders.get(i, 0) + 1) for i in (1, 2)]
            pool.unplaceable |= set(range(3, 64))
        assert pool.t <= limit, f"still running at {pool.t:.0f} simulated s"
    assert struck and engine.summary["state"] == "finished"
    check_exactly_once(cfg, engine.summary)
    check_rounds_recorded(cfg, engine.summary)
    log = events(cfg.out_dir)
    assert {e["island"] for e in log if e["kind"] == "crash"} == {1, 2} and len(log) < 200
