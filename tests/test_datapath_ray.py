"""`bench datapath`'s coordinator probe on real Ray, small: the production aggregation fed
through the object store, back to back and paced as a run's rounds are. The bench's
findings rest on what this checks: Ray frees a round's results in batches (about once a
second), so rounds back to back land on store pages the coordinator has not touched (a
page fault per 64 KB), while rounds a second apart reuse the freed pages."""

from __future__ import annotations

import pytest

from orchestrator.bench.datapath_probes import coordinator_gbps

pytestmark = pytest.mark.ray

NUMEL = 1_000_000  # 4 MB per island: 64 faults per island per round when every page is fresh


def test_rounds_back_to_back_fault_on_fresh_store_pages_and_paced_rounds_reuse_them(ray_local):
    back_to_back = coordinator_gbps(2, NUMEL, 1, 3)
    paced = coordinator_gbps(2, NUMEL, 1, 3, broadcast=True, gap_s=1.5)
    assert back_to_back["page_faults"] >= 2 * NUMEL * 4 / 65536 / 2  # at least half the pages fresh
    assert paced["page_faults"] <= 8
    # the round with its broadcast: every island fetched, checked the digest and loaded it
    assert paced["round_seconds"] >= paced["seconds"] > 0
