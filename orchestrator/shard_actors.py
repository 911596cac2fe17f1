"""Coordinator shards as Ray actors, spread over the cluster's nodes: each pulls its
slices of the islands' pseudo-gradients straight from the islands' object stores, and
publishes its slice of the new parameters for the islands to pull."""
from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch

from orchestrator.config import RunConfig
from orchestrator.outer_shard import OuterShard, slice_bounds
from orchestrator.robust import NormGuard
from orchestrator.sharded_server import ShardedServer
from workers.compress import Payload


class RemoteOuterShard(OuterShard):
    def inspect(self, key: Any, parts: list[tuple[int, int, Payload]]):
        """The payloads arrive as references (nested, so Ray leaves them to us): one
        `ray.get` fetches all of this shard's slices at once, island to shard directly."""
        payloads = ray.get([p for _, _, p in parts])
        return super().inspect(key, [(i, v, p) for (i, v, _), p in zip(parts, payloads)])


class RayShards:
    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        return ray.get([getattr(a, method).remote(*x) for a, x in zip(self.actors, args)])

    def params(self) -> list[ray.ObjectRef]:
        return [a.params.remote() for a in self.actors]

    def fetch(self, slices: list[ray.ObjectRef]) -> list[np.ndarray]:
        return ray.get(slices)

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


def start_sharded_server(cfg: RunConfig, flat: torch.Tensor, guard: NormGuard | None) -> ShardedServer:
    """S shard actors (SPREAD over nodes, no CPU reserved: their work is a few vector ops
    per round) owned by the coordinator, so they go when it goes and a restarted
    coordinator rebuilds them from its checkpoint."""
    bounds = slice_bounds(flat.numel(), cfg.coordinator.shards, cfg.compression.chunk)
    params = flat.detach().numpy()
    actors = [ray.remote(RemoteOuterShard).options(num_cpus=0, scheduling_strategy="SPREAD",
                                                   max_concurrency=1).remote(cfg, b, params[b[0]:b[1]])
              for b in bounds]
    return ShardedServer(cfg, flat, bounds, RayShards(actors), guard)
