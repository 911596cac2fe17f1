"""The island pool's reads of Ray's placement state on a real local instance."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.island_actors import IslandHandle
from archipelago.orchestrator.runtime.island_pool import RayIslandPool
from tests.helpers import toy_quadratic

pytestmark = pytest.mark.ray


def test_an_islands_nodes_are_remembered_once_placed_never_while_its_group_is_pending(ray_local, tmp_path):
    """A placement group still pending (or being rescheduled after its node died) names its
    bundle's node as "": remembered, the island's preemption notice could never be matched
    to the node being drained (what the pool reads the nodes for)."""
    pool = RayIslandPool(load_config(None, toy_quadratic(1, 0.0, f"out_dir={tmp_path}")), "nodes")
    pending = placement_group([{"CPU": 64}])  # more than the instance has: never placed
    placed = placement_group([{"CPU": 1}])
    try:
        ray.get(placed.ready(), timeout=60)
        assert pool._nodes_of(0, IslandHandle(0, None, pending)) == set()
        assert 0 not in pool.nodes  # asked again at the next read
        node = ray.get_runtime_context().get_node_id()
        assert pool._nodes_of(1, IslandHandle(1, None, placed)) == {node} == pool.nodes[1]
    finally:
        remove_placement_group(pending)
        remove_placement_group(placed)
