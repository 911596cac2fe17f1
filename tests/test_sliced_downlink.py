"""A lossy downlink through coordinator slices (`compression.downlink` with
`coordinator.shards` > 1): each slice keeps its part of the islands' published copy and
encodes its part's change on its own node, so the head's card carries neither the new
parameters nor their changes. Slices are cut on the codec's chunks, so the parts encode
exactly what one coordinator would: islands train from, and the run ends with, the same
bits either way."""

from __future__ import annotations

import numpy as np
import pytest

from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.commands import AddIslands
from archipelago.workers.wire.compress import encode
from archipelago.workers.wire.spec import payload_nbytes
from archipelago.workers.wire.sync import Change, ChangeOutOfOrder, whole_version
from tests.engine_scenarios import check_exactly_once, drive, scenario_cfg
from tests.helpers import in_process_engine

# a 40-value model (4 islands' centers), so 2 slices cut on 16-value chunks hold 16 and 24
CENTERS = (
    "[" + ",".join("[" + ",".join(f"{((i * 7 + j) % 5 - 2) / 2:g}" for j in range(40)) + "]" for i in range(4)) + "]"
)
SLICED = ["compression.downlink=int8", "compression.chunk=16", f"task.kwargs.centers={CENTERS}"]


def _run(tmp_path, mode: str, slices: int) -> tuple[np.ndarray, dict, list]:
    cfg = scenario_cfg(tmp_path / f"{mode}-{slices}", mode, *SLICED, f"coordinator.shards={slices}")
    engine, pool = in_process_engine(cfg)
    drive(engine, at={2: lambda e: e.submit(AddIslands(count=1))})  # a joiner takes the copy whole
    check_exactly_once(cfg, engine.summary)
    return engine.flat.data.numpy().copy(), engine.summary, pool.dispatched


@pytest.mark.parametrize("mode", ["diloco", "async", "overlap"])
def test_a_lossy_downlink_through_slices_is_one_coordinators_bit_for_bit(tmp_path, mode):
    """Two slices each keeping and changing their part of the copy: the same final
    parameters to the bit as one coordinator keeping all of it, a joiner mid-run included
    (the slices' copy parts whole, as many bytes as one copy); every order after the first
    carries changes cut in the slices' spans, both parts of each version, and the downlink's
    bytes are one coordinator's but for each part's own framing."""
    one, one_summary, _ = _run(tmp_path, mode, 1)
    two, two_summary, orders = _run(tmp_path, mode, 2)
    assert np.array_equal(one, two)
    assert two_summary["final_eval_loss"] == one_summary["final_eval_loss"]
    assert two_summary["islands"]["3"]["rounds_contributed"] >= 1
    spans = {c.span for order in orders for c in order.changes}
    assert spans == {(0, 16), (16, 40)}, spans
    for order in orders:
        versions = [c.version for c in order.changes]
        assert all(versions.count(v) == 2 for v in versions)  # a version is both slices' parts
    # the same bytes, but for each part's own framing (its chunk size: 4 bytes), once a version
    part = [payload_nbytes(encode(np.zeros(n), "int8", 16)) for n in (16, 24, 40)]
    versions = sum(len(order.changes) // 2 for order in orders)
    assert versions > 0 and two_summary["bytes_bootstrap"] == one_summary["bytes_bootstrap"]
    assert two_summary["bytes_received"] == one_summary["bytes_received"] + (part[0] + part[1] - part[2]) * versions


def test_a_restarted_sliced_coordinator_sends_its_islands_the_copy_whole(tmp_path):
    """After a coordinator restart the engine forgets what each island holds: the slices'
    copies are their restored parameters, every island gets them whole, then changes
    again, and the run ends with the same bits as one coordinator restarted alike."""
    ends = {}
    for slices in (1, 2):
        cfg = scenario_cfg(tmp_path / f"r{slices}", "diloco", *SLICED, f"coordinator.shards={slices}", "rounds=8")
        first, pool = in_process_engine(cfg, run_id="sliced")
        drive(first, until=4)
        pool.coordinator_lost()
        sent = len(pool.dispatched)
        second = build_engine(cfg, pool, run_id="sliced")
        drive(second)
        assert second.summary["state"] == "finished" and second.summary["rounds_done"] == 8
        ends[slices] = second.flat.data.numpy().copy()
        after = list(pool.dispatched)[sent:]
        firsts = {}
        for order in after:
            firsts.setdefault(order.island, order)
        assert all(not o.changes for o in firsts.values()) and any(o.changes for o in after)
    assert np.array_equal(ends[1], ends[2])


def test_a_version_missing_a_slices_part_is_refused():
    """An island applies a version only whole: both parts, covering the vector once."""

    def part(lo: int, hi: int) -> Change:
        payload = encode(np.zeros(hi - lo, dtype=np.float32), "int8", 16)
        return Change(version=3, fragment=None, payload=payload, absolute=False, span=(lo, hi))

    assert len(whole_version([part(32, 64), part(0, 32)], 64)) == 2
    for parts in ([part(0, 32)], [part(0, 32), part(0, 32)], [part(0, 32), part(40, 64)]):
        with pytest.raises(ChangeOutOfOrder, match="cover"):
            whole_version(parts, 64)
