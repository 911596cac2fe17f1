"""The verified hand-off (`workers/wire/handoff.py`): full parameters come with a digest of
what the coordinator published and of the order's position in the run; an island refuses
what does not match before training on it, and the engine replaces it, every batch still
trained once (the in-process pool flips a byte of a delivery: `FaultKind.CORRUPT`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
from archipelago.workers.wire.handoff import HandOffMismatch, params_digest, seal, verify
from archipelago.workers.wire.messages import WorkKind, WorkOrder
from tests.engine_scenarios import check_exactly_once, drive, scenario_cfg
from tests.helpers import events, in_process_engine


def test_the_digest_covers_the_parameters_and_the_orders_place_in_the_run():
    params = np.linspace(-1, 1, 1001, dtype=np.float32)
    order = WorkOrder(
        island=2, ticket=9, version=7, kind=WorkKind.TRAIN, steps=20, shards={3: 10, 1: 4},
        schedule_step=120, fragment=1, send_after=15,
    )  # fmt: skip
    sealed = seal(order, params_digest(params))
    verify(sealed, params)
    verify(replace(sealed, shards={1: 4, 3: 10}), params)  # the same hand-off (shard order does not matter)
    verify(sealed, [params[:500], params[500:]])  # as a sliced coordinator's
    flipped = params.copy()
    flipped.view(np.uint8)[2001] ^= 0x01
    with pytest.raises(HandOffMismatch, match="refused before training"):
        verify(sealed, flipped)  # one bit of the parameters
    for change in [
        {"version": 8},  # another version's order
        {"schedule_step": 0},  # a schedule at the start (a joiner's wrong lr)
        {"shards": {1: 0, 3: 10}},  # a data cursor from the beginning
        {"fragment": 0},  # a streaming joiner told to send another fragment
        {"send_after": 20},  # ... or at another step
        {"island": 3},  # an order meant for another island
    ]:
        with pytest.raises(HandOffMismatch, match="refused before training"):
            verify(replace(sealed, **change), params)


@pytest.mark.parametrize("mode", ["diloco", "streaming", "quorum"])
def test_a_corrupted_hand_off_is_refused_and_its_island_replaced(tmp_path, mode):
    """Island 1's first download (the full parameters, in every mode) arrives with a flipped
    byte: it raises before training, its work is lost (its batches go back), and its
    replacement receives a hand-off that verifies."""
    cfg = scenario_cfg(tmp_path, mode)
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CORRUPT, 1, order=1)])
    drive(engine)
    summary = engine.summary
    # exactly once: the refused work's batches were never read (the island refused before
    # reading), so its `lost` spans give back nothing; their next owner read them once
    unread = Counter(
        {
            (int(s), i): -1
            for e in events(cfg.out_dir)
            if e["kind"] == "lost" and "HandOffMismatch" in e["reason"]
            for s, (start, n) in e["spans"].items()
            for i in range(start, start + n)
        }
    )
    assert unread
    check_exactly_once(cfg, summary, unread)
    crashes = [e for e in events(cfg.out_dir) if e["kind"] == "crash"]
    assert [e["island"] for e in crashes] == [1] and "HandOffMismatch" in crashes[0]["reason"]
    assert summary["islands"]["1"]["state"] == "dead" and summary["islands"]["3"]["state"] == "training"
    assert summary["rounds_done"] == 6
