"""Islands that share a node fetch each version once: the coordinator `ray.put`s a version
once, and Ray's object manager pulls an object into a node's shared-memory store once,
however many of that node's workers ask for it; each island reads it there in place.
Measured from each node's object store (`cumulative_created_bytes`: everything created in
it, the versions it pulled and the results its islands returned) on a
`ray.cluster_utils.Cluster` whose head takes no island, one node with two islands and one
with one."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray._private.internal_api import node_stats
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import run
from archipelago.orchestrator.runtime.names import island_name
from tests.conftest import importable_checkout
from tests.helpers import toy_quadratic

pytestmark = pytest.mark.ray


def _created() -> dict[str, int]:
    """Bytes ever created in each live node's object store."""
    return {
        n["NodeID"]: node_stats(
            n["NodeManagerAddress"], n["NodeManagerPort"], False
        ).store_stats.cumulative_created_bytes
        for n in ray.nodes()
        if n["Alive"]
    }


def test_two_islands_on_a_node_fetch_each_version_once(tmp_path):
    ray.shutdown()
    with importable_checkout():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        pair, single = cluster.add_node(num_cpus=2), cluster.add_node(num_cpus=1)
        try:
            ray.init(address=cluster.address, log_to_driver=False)
            # 1 M float32 parameters: every version and result is 4 MB, in the object store
            sets = ["task.kwargs.dtype=float32", "task.kwargs.repeat=500000", "rounds=4", "inner_steps=4"]
            cfg = load_config(None, toy_quadratic(3, 0.0, *sets, "checkpoint.every_rounds=100", f"out_dir={tmp_path}"))
            placed: dict[int, str] = {}
            names = {island_name("pernode", i): i for i in range(3)}
            done = threading.Event()

            def watch() -> None:  # each island's node, read while the run holds its placement group
                while not done.is_set() and len(placed) < 3:
                    for group in placement_group_table().values():
                        # a group still pending names its bundle's node as "": only a placed one counts
                        node = group["bundles_to_node_id"].get(0, "") if group["name"] in names else ""
                        if group["state"] == "CREATED" and node:
                            placed[names[group["name"]]] = node
                    time.sleep(0.1)

            watcher = threading.Thread(target=watch)
            before = _created()
            watcher.start()
            try:
                summary = run(cfg, show_progress=False, run_id="pernode")
            finally:
                done.set()
                watcher.join()
            after = _created()
        finally:
            ray.shutdown()
            cluster.shutdown()
    islands = summary["islands"]
    assert sorted(placed.values()) == sorted([pair.node_id, pair.node_id, single.node_id])
    version_bytes = islands["0"]["bytes_received"]  # what one island was sent: every version it started from
    assert version_bytes >= 4 * 4_000_000 and all(s["bytes_received"] == version_bytes for s in islands.values())

    def fetched(node: str) -> int:
        """What a node's store took in besides its islands' own results: the versions it pulled."""
        results = sum(islands[str(i)]["bytes_sent"] for i, n in placed.items() if n == node)
        return after[node] - before.get(node, 0) - results

    # once per node (2 islands fetching apart would be 2x): within an object's headers
    for node in (pair.node_id, single.node_id):
        assert fetched(node) == pytest.approx(version_bytes, rel=0.01), (node, fetched(node), version_bytes)
