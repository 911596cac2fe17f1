"""An island of N workers (`islands.workers`): N accelerators of one node (N CPU processes
in tests), placed together by a STRICT_PACK placement group, doing ordinary data
parallelism on the inner steps while only the island's one pseudo-gradient leaves it.

Every worker holds the full model in the island's flat parameter buffer and reads the
island's batch stream; worker r trains on the r-th 1/N of each batch, and one all-reduce
of the flat gradient buffer (gloo on CPU, NCCL on GPU) makes every worker's gradient the
whole batch's. So an island of N workers takes exactly the steps one worker would take on
the N-times-larger batch.

The inner optimizer state is sharded ZeRO-1 style over the same flat buffer: worker r
owns a contiguous 1/N slice, keeps the AdamW/SGD state of that slice only, steps it, and
broadcasts it to the others (N broadcasts per step, no per-parameter loop). The inner
optimizers are elementwise, so a sliced step is the full step. This is torch's
`ZeroRedundancyOptimizer` idea without its per-parameter partitioning and bucket views,
which would fight the flat buffer every other part of Archipelago shares.

Rank 0 is the island the coordinator talks to; it forwards each round to the others.
Each worker is an `IslandActor` holding a `GroupIsland` (`workers/runtime/island_actor.py`).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from ..tasks.task import Batch, split_batch
from ..wire.flat import FlatParams, slice_bounds
from ..wire.messages import RoundResult, WorkOrder
from ..wire.spec import Sharding
from .compiling import compiled_forward
from .fsdp import ShardedParams, shard_model
from .island import Island
from .island_spec import IslandSpec
from .optim import build_inner


def group_address() -> str:
    """A `tcp://ip:port` rendezvous on this node for `torch.distributed.init_process_group`."""
    with socket.socket() as s:
        s.bind(("", 0))
        return f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"


class GroupIsland(Island):
    def __init__(self, spec: IslandSpec) -> None:
        super().__init__(spec)
        self.rank, self.world = 0, 1
        self.bounds = (0, self.flat.numel)
        self.followers: list[Any] = []
        self.group_error: str | None = None

    # -- forming the group --------------------------------------------------------------
    def form_group(self, followers: list[Any]) -> None:
        """Rank 0: start the process group with `followers` as ranks 1..N-1. A failure
        is kept and raised by `describe`, the call that tells the coordinator it is ready."""
        try:
            address = group_address()
            world = len(followers) + 1
            joined = [f.join_group.remote(address, r + 1, world) for r, f in enumerate(followers)]
            self.join_group(address, 0, world)
            ray.get(joined)
            self.followers = followers
        except Exception as err:
            self.group_error = f"island of {len(followers) + 1} workers could not form: {err}"

    def join_group(self, address: str, rank: int, world: int) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=300)
        )
        self.rank, self.world = rank, world
        spec = self.spec
        if self.sharded:
            layout = ShardedParams.layout(self.model)
            shard_model(self.model, self.device.type, world)
            self.flat = ShardedParams(self.model, layout, rank, world)
            self.start = torch.empty(self.flat.numel)  # host memory: the device holds shards only
            self.forward_model = (
                compiled_forward(self.model) if spec.inner.compiles_on(self.device.type) else self.model
            )
            params: Any = self.model.parameters()
        else:
            assert isinstance(self.flat, FlatParams)
            self.bounds = slice_bounds(self.flat.numel, world, 1)[rank]
            lo, hi = self.bounds
            params = [self.flat.parameter(lo, hi)]
        self.optimizer, self.scheduler = build_inner(
            spec.inner, params, spec.total_inner_steps, spec.start_step, spec.rewarmup_steps
        )

    @property
    def sharded(self) -> bool:
        """FSDP2 over the group (a group of one has nothing to shard)."""
        return self.spec.sharding == Sharding.FSDP and self.world > 1

    # -- one data-parallel inner step -----------------------------------------------------
    def forward_backward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        if self.world == 1:
            return super().forward_backward(batch)
        weight = self.task.batch_weight(batch)  # the island's whole batch
        loss, _ = self._local_pass(self._worker_share(batch))
        if not self.sharded:  # FSDP2's backward reduce-scatters the mean gradient itself
            assert isinstance(self.flat, FlatParams)
            dist.all_reduce(self.flat.grad)
            self.flat.grad.div_(self.world)
        mean_loss = loss.reshape(1).clone()  # on the device: no host read per step
        dist.all_reduce(mean_loss)
        return mean_loss[0] / self.world, weight

    def _worker_share(self, batch: Batch) -> Batch:
        return split_batch(batch, self.rank, self.world, "islands.workers") if self.world > 1 else batch

    def probe(self, steps: int = 2) -> float | None:
        """None for an FSDP2 island: its forward pass needs every worker, and only rank 0
        is asked (its first round measures the speed)."""
        return None if self.sharded else super().probe(steps)

    def _step(self) -> None:
        self.optimizer.step()  # this worker's slice (ZeRO-1) or shards (FSDP2) only
        if self.world > 1 and not self.sharded:
            assert isinstance(self.flat, FlatParams)
            for r, (lo, hi) in enumerate(slice_bounds(self.flat.numel, self.world, 1)):
                dist.broadcast(self.flat.data[lo:hi], src=r)

    # -- rounds: rank 0 drives the others ------------------------------------------------
    def run(self, order: WorkOrder, params: np.ndarray | None, *, detach_tail: bool = False) -> RoundResult:
        """Run the order on every worker at once (the collectives pair up); rank 0's result.
        A streaming tail is trained before answering (`detach_tail` is not taken): the
        workers' collectives pair up step by step, within each worker's one call."""
        shared = ray.put(params) if self.followers else None  # one copy on this node for all workers
        follow = [f.follow.remote(order, shared) for f in self.followers]
        result = super().run(order, params)
        ray.get(follow)
        return result

    def stop(self, *, ticket: int, within_s: float | None = None, after_steps: int | None = None) -> None:
        """Refused: every worker must stop at the same step, and only rank 0 hears the
        notice (agreeing on it would cost a collective per step). An island of several
        workers finishes its work or loses it; the coordinator never asks it to stop."""
        raise NotImplementedError("an island of several workers cannot stop mid-work")

    def follow(self, order: WorkOrder, params: np.ndarray) -> None:
        """Ranks 1..N-1: the plain island step (their result is rank 0's, so nothing returns)."""
        Island.run(self, order, params)

    def attach(self) -> dict[str, Any]:
        """A group's round is not given up on rank 0 alone (its followers' collectives would
        hang): the new coordinator's work waits for it."""
        return self.identity()

    def describe(self) -> dict[str, Any]:
        if self.group_error:
            raise RuntimeError(self.group_error)
        lo, hi = self.bounds
        described = {**super().describe(), "workers": self.world, "sharding": self.spec.sharding.value}
        return described if self.sharded else {**described, "optimizer_slice": [lo, hi]}
