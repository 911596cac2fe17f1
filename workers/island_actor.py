"""The island as a Ray actor: `Island` plus what only makes sense under Ray. With a
sharded coordinator the global parameters arrive as S references (one per shard, fetched
together) and the pseudo-gradient leaves as S objects in this island's object store, so
each shard pulls its own slice from here and no single process relays the whole vector."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import ray

from workers.island import Island
from workers.messages import RoundResult, WorkOrder


def whole_params(params: Any) -> np.ndarray:
    """The global parameters, from one array or from S shards' slices (fetched together)."""
    return np.concatenate(ray.get(list(params))) if isinstance(params, list) else params


class RayIsland(Island):
    def run(self, order: WorkOrder, params: Any) -> RoundResult:
        result = super().run(order, whole_params(params))
        if not isinstance(result.payload, list):
            return result
        return dataclasses.replace(result, payload=[ray.put(p) for p in result.payload], sent_bytes=result.nbytes)
