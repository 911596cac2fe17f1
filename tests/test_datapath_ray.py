"""`bench datapath`'s coordinator probe on real Ray, small: the production aggregation fed
through the object store, back to back and paced as a run's rounds are. Ray frees
unreferenced objects in batches, once a second by default: rounds closer than that land
on store pages the coordinator has not touched (a page fault per 64 KB), rounds further
apart reuse the freed pages. The Ray instances Archipelago starts flush every 100 ms
(`RAY_SYSTEM_CONFIG`), so rounds a quarter of a second apart reuse them too (with Ray's
default, most such rounds fault: the freeing comes at the next whole second)."""

from __future__ import annotations

import pytest
import ray

from archipelago.orchestrator.bench.datapath_probes import coordinator_gbps
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import init_ray

pytestmark = pytest.mark.ray

NUMEL = 1_000_000  # 4 MB per island: 64 faults per island per round when every page is fresh
FRESH = 2 * NUMEL * 4 / 65536  # the faults of a round of 2 islands on pages never touched


def test_with_ray_s_default_back_to_back_rounds_fault_on_fresh_pages_and_paced_ones_do_not(ray_local):
    back_to_back = coordinator_gbps(2, NUMEL, 1, 3)
    paced = coordinator_gbps(2, NUMEL, 1, 3, broadcast=True, gap_s=1.5)
    assert back_to_back["page_faults"] >= FRESH / 2
    assert paced["page_faults"] <= 8
    # the round with its broadcast: every island fetched, checked the digest and loaded it
    assert paced["round_seconds"] >= paced["seconds"] > 0
    # where it went, each part timed where it ran: the coordinator's step, put and digest and
    # the islands' calls follow one another inside the round; each island's check and load
    # inside its call
    inside = sum(paced[f"round_{k}_seconds"] for k in ("step", "put", "digest", "islands"))
    assert 0 < inside <= paced["round_seconds"]
    for part in ("put", "digest", "island_check", "island_load"):
        assert paced[f"round_{part}_seconds"] > 0
    assert paced["round_island_check_seconds"] + paced["round_island_load_seconds"] <= paced["round_islands_seconds"]
    assert paced["round_islands_cpu_seconds"] > 0


def test_the_ray_archipelago_starts_reuses_the_pages_of_rounds_a_quarter_second_apart():
    ray.shutdown()  # the shared instance has Ray's defaults; the next test that needs it restarts it
    assert init_ray(load_config(None, ["ray.num_cpus=2", "warm_start.steps=0"]))
    try:
        assert coordinator_gbps(2, NUMEL, 1, 5, gap_s=0.25)["page_faults"] <= 8  # the median round
    finally:
        ray.shutdown()
