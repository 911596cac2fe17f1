"""Coordinator shards as Ray actors, spread over the cluster's nodes: each pulls its
slices of the islands' pseudo-gradients straight from the islands' object stores, and
publishes its slice of the new parameters for the islands to pull."""
from __future__ import annotations

import os
import sys
import uuid
from typing import Any

import numpy as np
import ray
import torch

from orchestrator.config import RunConfig
from orchestrator.launcher import NAMESPACE
from orchestrator.outer_shard import OuterShard
from workers.flat import slice_bounds
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
    """A shard that dies (its node was lost) takes part of the global state with it, so
    the coordinator process exits: Ray restarts it (`checkpoint.max_restarts`) and the new
    coordinator rebuilds every shard from its last checkpoint, as after any coordinator
    failure. Rounds since that checkpoint are redone; none is lost or doubled."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def _get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as err:
            print(f"coordinator shard lost ({type(err).__name__}); restarting the coordinator from its "
                  "checkpoint", file=sys.stderr, flush=True)
            os._exit(1)

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        return self._get([getattr(a, method).remote(*x) for a, x in zip(self.actors, args)])

    def params(self) -> list[ray.ObjectRef]:
        return [a.params.remote() for a in self.actors]

    def fetch(self, slices: list[ray.ObjectRef]) -> list[np.ndarray]:
        return self._get(slices)


def start_sharded_server(cfg: RunConfig, flat: torch.Tensor, guard: NormGuard | None,
                         run_id: str = "local") -> ShardedServer:
    """S shard actors (SPREAD over nodes, no CPU reserved: their work is a few vector ops
    per round) owned by the coordinator, so they go when it goes and a restarted
    coordinator rebuilds them from its checkpoint. Named `archipelago-<run>-shard-<k>-<id>`
    (the id differs per coordinator incarnation) so operators find them in `ray list actors`."""
    bounds = slice_bounds(flat.numel(), cfg.coordinator.shards, cfg.compression.chunk)
    params = flat.detach().numpy()
    incarnation = uuid.uuid4().hex[:6]
    actors = [ray.remote(RemoteOuterShard).options(
        name=f"archipelago-{run_id}-shard-{k}-{incarnation}", namespace=NAMESPACE, num_cpus=0,
        scheduling_strategy="SPREAD", max_concurrency=1).remote(cfg, b, params[b[0]:b[1]])
        for k, b in enumerate(bounds)]
    return ShardedServer(cfg, flat, bounds, RayShards(actors), guard)
