"""The data ledger: shard assignment and exactly-once positions across membership changes."""

from __future__ import annotations

import pytest

from archipelago.orchestrator.engine.state.ledger import DataLedger, assign
from archipelago.orchestrator.engine.types import LedgerError
from archipelago.workers.wire.messages import batch_counts


def test_assignment_is_contiguous_complete_and_deterministic():
    a = assign(8, [3, 0, 5])
    assert a == {0: [0, 1, 2], 3: [3, 4, 5], 5: [6, 7]}
    assert sorted(s for v in a.values() for s in v) == list(range(8))
    assert assign(4, [0, 1, 2, 3]) == {0: [0], 1: [1], 2: [2], 3: [3]}
    assert assign(4, [7]) == {7: [0, 1, 2, 3]}


def test_positions_advance_when_work_is_handed_out_and_lost_work_is_retrained_once():
    ledger = DataLedger(4)
    islands = [0, 1, 2, 3]
    r = ledger.reserve(1, 2, islands, steps=10)
    assert r.starts == {2: 0} and ledger.position[2] == 10
    assert ledger.check(1, {2: 10}, {2: 640}) is None
    ledger.commit(1, {2: 640})
    r = ledger.reserve(2, 2, islands, steps=5)
    assert r.starts == {2: 10}
    assert ledger.rollback(2) is not None and ledger.position[2] == 10  # island 2 died: its batches go back
    # blocks are recomputed and shard 2's new owner continues at position 10
    assert ledger.reserve(3, 1, [0, 1, 3], steps=4).starts == {2: 10}
    assert ledger.tokens[2] == 640


def test_a_shard_in_flight_is_never_handed_to_another_island():
    ledger = DataLedger(2)
    ledger.reserve(1, 0, [0, 1], steps=3)  # island 0 trains shard 0
    r = ledger.reserve(2, 1, [1], steps=3)  # island 0 left the schedule: shard 0 is island 1's now
    assert r.starts == {1: 0}  # ... but it is still in flight with island 0
    assert ledger.reserve(3, 2, [2], steps=1) is None  # no free shard for a third island: it idles
    ledger.commit(1, {0: 3})
    # island 1 gets shard 0 once island 0's work resolved, and continues its own after its earlier round
    assert ledger.reserve(4, 1, [1], steps=2).starts == {0: 3, 1: 3}


def test_the_ledger_refuses_miscounts_and_checkpoints_committed_work_only():
    ledger = DataLedger(2)
    ledger.reserve(1, 0, [0], steps=4)
    assert "shard 0" in ledger.check(1, {0: 1, 1: 2}, {0: 10, 1: 20})  # read 1 of the 2 batches of shard 0
    assert "shards [3]" in ledger.check(1, {0: 2, 1: 2}, {0: 20, 3: 20})  # tokens on a shard it was not given
    assert "malformed" in ledger.check(1, {0: "x", 1: 2}, {})
    assert ledger.check(1, {0: 2, 1: 2}, {0: 20, 1: 20}) is None
    with pytest.raises(LedgerError):  # a ticket not in flight is the engine's bug, not the island's
        ledger.check(99, {}, {})
    ledger.reserve(2, 0, [0], steps=2)  # the next round, while round 1 waits for its close
    state = ledger.state_dict()
    assert state["position"] == [0, 0] and state["tokens"] == [0, 0]
    ledger.commit(1, {0: 20, 1: 20})
    assert ledger.state_dict()["position"] == [2, 2]
    restored = DataLedger(1)
    restored.load_state_dict(ledger.state_dict())
    assert restored.position == [2, 2] and restored.tokens == [20, 20]


def test_batch_counts_round_robin():
    assert batch_counts([3, 1, 2], turn=0, steps=7) == {1: 3, 2: 2, 3: 2}
    assert batch_counts([3, 1, 2], turn=1, steps=7) == {1: 2, 2: 3, 3: 2}
    assert sum(batch_counts([0, 5], 3, 11).values()) == 11


def test_an_island_without_coordinator_takes_the_block_the_coordinator_would_assign():
    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.engine.specs import island_spec
    from archipelago.workers.runtime.island import Island

    for shards, islands in ((12, 3), (5, 3), (8, 2)):
        cfg = load_config(
            None,
            [
                "task.factory=tests.toy_tasks:make_quadratic",
                "warm_start.steps=0",
                "task.kwargs.centers=[[1.0]]",
                f"islands.count={islands}",
                f"data_shards={shards}",
            ],
        )
        for i in range(islands):
            assert sorted(Island(island_spec(cfg, i)).order(0, 1).shards) == assign(shards, list(range(islands)))[i]
