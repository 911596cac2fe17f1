"""A streaming order's τ steps trained after its result has left (`workers/runtime/order_steps.py`),
without Ray: the island answers at the send point, reports the whole order, and ends in
exactly the state it would have reached training the tail before answering."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import apply_overrides
from archipelago.orchestrator.engine.specs import island_spec
from archipelago.workers.runtime.island import Island
from archipelago.workers.wire.compress import decode, encode
from archipelago.workers.wire.messages import WorkKind, WorkOrder
from archipelago.workers.wire.sync import Change
from tests.helpers import TINY_LM

CFG = RunConfig.model_validate(
    apply_overrides(
        {},
        [
            *TINY_LM,
            "islands.count=2",
            "task.kwargs.n_layers=4",
            "rounds=3",
            "inner_steps=8",
            "mode=streaming",
            "mode.fragments=2",
            "mode.tau=2",
            "compression.downlink=int8",
        ],
    )
)


def _orders(island: Island) -> list[tuple[WorkOrder, np.ndarray | None]]:
    """Three segments of 4 steps, Δ taken after 2, each later one merging a change."""
    orders: list[tuple[WorkOrder, np.ndarray | None]] = []
    for version in range(3):
        fragment = version % 2
        changes = ()
        if version:
            values = np.linspace(-0.01, 0.01, island.fragments.size(1 - fragment), dtype=np.float32)
            changes = (
                Change(version=version, fragment=1 - fragment, payload=encode(values, "int8", 64), absolute=False),
            )
        order = WorkOrder(
            island=0,
            ticket=version,
            version=version,
            kind=WorkKind.TRAIN,
            steps=4,
            shards={0: 4 * version},
            fragment=fragment,
            send_after=2,
            changes=changes,
        )
        orders.append((order, island.flat.numpy().copy() if version == 0 else None))
    return orders


def test_a_detached_tail_answers_at_the_send_point_and_ends_where_an_inline_one_does():
    spec = island_spec(CFG, 0)
    inline, detached = Island(spec), Island(spec)
    for order, params in _orders(inline):
        a = inline.run(order, params)
        b = detached.run(order, params, detach_tail=True)
        assert detached.identity()["busy"]  # answered with its τ steps still training
        assert a.tail_steps == b.tail_steps == 2 and b.tail_s == 0.0 < a.tail_s
        np.testing.assert_array_equal(decode(a.payload), decode(b.payload))
        assert (a.positions, a.shard_tokens, a.weight, a.steps) == (b.positions, b.shard_tokens, b.weight, b.steps)
        assert a.stream_states == b.stream_states
        assert np.isfinite(b.mean_loss) and b.compute_s > 0
    detached.settle()
    assert not detached.identity()["busy"]
    assert torch.equal(inline.flat.full(), detached.flat.full())
    assert torch.equal(inline.copy, detached.copy)
    assert inline.inner_steps_done == detached.inner_steps_done == 12
    for p, q in zip(inline.optimizer.state.values(), detached.optimizer.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p if isinstance(p[k], torch.Tensor))


def test_a_tail_that_fails_fails_the_next_order_not_the_process():
    spec = island_spec(CFG, 0)
    island = Island(spec)
    (first, params), (second, _), _ = _orders(island)
    island.run(first, params, detach_tail=True)

    def broken(batch):
        raise RuntimeError("device lost in the tail")

    island.forward_backward = broken  # the tail's steps now fail
    with pytest.raises(RuntimeError, match="device lost in the tail"):
        island.run(second, None, detach_tail=True)
    assert island.tail is None  # waited for and reported once


def test_an_order_that_saves_its_inner_state_trains_its_tail_before_answering(tmp_path):
    spec = dataclasses.replace(island_spec(CFG, 0), state_folder=str(tmp_path))
    island = Island(spec)
    (order, params), *_ = _orders(island)
    result = island.run(dataclasses.replace(order, save_state=True), params, detach_tail=True)
    assert island.tail is None and result.tail_s > 0 and result.saved_state is not None
    assert island.inner_steps_done == 4
