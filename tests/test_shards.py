"""Shard assignment and position accounting across membership changes."""
from __future__ import annotations

from orchestrator.shards import ShardBook, assign


def test_assignment_is_contiguous_complete_and_deterministic():
    a = assign(8, [3, 0, 5])
    assert a == {0: [0, 1, 2], 3: [3, 4, 5], 5: [6, 7]}
    assert sorted(s for v in a.values() for s in v) == list(range(8))
    assert assign(4, [0, 1, 2, 3]) == {0: [0], 1: [1], 2: [2], 3: [3]}
    assert assign(4, [7]) == {7: [0, 1, 2, 3]}


def test_positions_only_advance_on_returned_results():
    book = ShardBook(4)
    islands = [0, 1, 2, 3]
    start = book.assignment(2, islands)
    assert start == {2: 0}
    book.commit({2: 10}, {2: 640})
    # island 2 dies; blocks are recomputed and shard 2's new owner continues at position 10
    assert book.assignment(1, [0, 1, 3]) == {2: 10}
    assert book.assignment(0, [0, 1, 3]) == {0: 0, 1: 0}
    book.commit({2: 5}, {2: 0})  # a stale, smaller position never moves a shard back
    assert book.position[2] == 10 and book.tokens[2] == 640
    restored = ShardBook(1)
    restored.load(book.state())
    assert restored.state() == book.state()


def test_an_island_without_coordinator_takes_the_block_the_coordinator_would_assign():
    from orchestrator.config_load import load_config
    from orchestrator.launcher import island_spec
    from workers.island import Island

    for shards, islands in ((12, 3), (5, 3), (8, 2)):
        cfg = load_config(None, ["task.factory=tests.toy_tasks:make_quadratic", "task.kwargs.centers=[[1.0]]",
                                 f"islands.count={islands}", f"data_shards={shards}"])
        for i in range(islands):
            assert sorted(Island(island_spec(cfg, i))._default_assignment()) == assign(shards, list(range(islands)))[i]
