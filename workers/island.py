"""An island: one model replica, its inner optimizer and its data stream.

A plain class, so unit tests drive it in-process and production wraps it with
`ray.remote`. Parameters arrive as a flat numpy array (one object-store read per
version) and leave as one flat numpy pseudo-gradient; the inner optimizer state and the
data position persist across rounds, as DiLoCo requires.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.compress import Payload, decode, encode, payload_nbytes
from workers.flat import FlatParams, slice_bounds
from workers.optim import InnerConfig, build_inner
from workers.task import load_task, to_device


@dataclass(frozen=True)
class IslandSpec:
    index: int
    num_islands: int
    seed: int
    task_factory: str
    task_kwargs: dict[str, Any]
    inner: InnerConfig
    total_inner_steps: int
    threads: int = 1
    device: str = "auto"
    slowdown: float = 1.0  # SIMULATION of a slower accelerator: each inner step takes this many times longer
    codec: str = "none"    # compression of what the island sends
    chunk: int = 4096
    num_shards: int = 0    # data shards of the run (0: one per island, island i owns shard i)
    start_step: int = 0    # a joining island's place in the run's inner schedule
    rewarmup_steps: int = 0
    coordinator_shards: int = 1  # S > 1: the pseudo-gradient leaves as S slices, one per shard


@dataclass(frozen=True)
class RoundResult:
    """What an island sends back: `payload` encodes Δ = θ_start − θ_end (a gradient in
    ddp mode) with the configured codec; `nbytes` is its size on the wire."""

    island: int
    version: int
    payload: Payload
    weight: int          # tokens (or examples) trained on this round
    steps: int
    mean_loss: float
    compute_s: float     # seconds training (simulated slowdown included)
    finished_at: float   # wall clock (time.time()) when the result was ready to send
    positions: dict[int, int]     # shard -> batches consumed after this round
    shard_tokens: dict[int, int]  # shard -> tokens (weight) trained this round
    sent_bytes: int | None = None  # set when `payload` holds references to the encoded slices

    def delta(self) -> Any:
        """Δ decoded to fp32, or its S slices as they came (each coordinator shard decodes its own)."""
        return self.payload if isinstance(self.payload, list) else decode(self.payload)

    @property
    def nbytes(self) -> int:
        if self.sent_bytes is not None:
            return self.sent_bytes
        parts = self.payload if isinstance(self.payload, list) else [self.payload]
        return sum(payload_nbytes(p) for p in parts)


class Island:
    def __init__(self, spec: IslandSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.spec = spec
        use_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.task = load_task(spec.task_factory, spec.task_kwargs)
        torch.manual_seed(spec.seed)
        self.model = self.task.build_model().to(self.device)
        self.flat = FlatParams(self.model)
        self.start = torch.empty_like(self.flat.data)
        self.optimizer, self.scheduler = build_inner(spec.inner, self.model.parameters(), spec.total_inner_steps,
                                                     spec.start_step, spec.rewarmup_steps)
        self.num_shards = spec.num_shards or spec.num_islands
        self.streams: dict[int, tuple[int, Any]] = {}  # shard -> (position, iterator at that position)
        self.turn = 0

    def _batch(self, assignment: dict[int, int]) -> tuple[int, Any]:
        """The next batch, taking the island's shards in turn; each shard's stream starts
        where the coordinator says it stands (the island re-seeks only if it differs)."""
        shards = sorted(assignment)
        shard = shards[self.turn % len(shards)]
        self.turn += 1
        pos, stream = self.streams.get(shard, (None, None))
        if pos != assignment[shard]:
            pos = assignment[shard]
            stream = self.task.train_batches(shard, self.num_shards, self.spec.seed, pos)
        batch = next(stream)
        self.streams[shard] = (pos + 1, stream)
        assignment[shard] = pos + 1
        return shard, batch

    def _default_assignment(self) -> dict[int, int]:
        """Without a coordinator (in-process use): the island's own contiguous block of
        shards, as the coordinator would assign it with all islands present."""
        k, n = self.spec.num_islands, self.num_shards
        own = [s for s in range(n) if s * k // n == self.spec.index]
        return {s: self.streams.get(s, (0, None))[0] for s in own}

    def describe(self) -> dict[str, Any]:
        import os
        import socket

        return {"island": self.spec.index, "device": str(self.device), "host": socket.gethostname(),
                "pid": os.getpid(), "numel": self.flat.numel}

    def _forward_backward(self, batch: Any) -> tuple[float, int]:
        batch = to_device(batch, self.device)
        self.flat.grad.zero_()
        loss = self.task.loss(self.model, batch)
        loss.backward()
        return float(loss.detach()), self.task.batch_weight(batch)

    def _clip(self) -> None:
        clip = self.spec.inner.grad_clip
        if clip is not None:
            norm = float(self.flat.grad.norm())
            if norm > clip:
                self.flat.grad.mul_(clip / norm)

    def _step(self) -> None:
        self.optimizer.step()

    def _seek_schedule(self, step: int) -> None:
        """Put the lr schedule at `step` (the scheduler continues from there)."""
        self.scheduler.last_epoch = step
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * fn(step)

    def _encode(self, x: torch.Tensor) -> Payload | list[Payload]:
        """The codec's payload; with S coordinator shards, S payloads of aligned slices."""
        values = x.cpu().numpy()
        if self.spec.coordinator_shards == 1:
            return encode(values, self.spec.codec, self.spec.chunk)
        return [encode(values[lo:hi], self.spec.codec, self.spec.chunk)
                for lo, hi in slice_bounds(values.size, self.spec.coordinator_shards, self.spec.chunk)]

    def run_round(self, version: int, params: np.ndarray, steps: int, start_delay_s: float = 0.0,
                  assignment: dict[int, int] | None = None, schedule_step: int | None = None) -> RoundResult:
        """DiLoCo inner phase: start from the global `params`, take `steps` inner steps on
        the shards of `assignment` ({shard: start position}; default: the island's own
        shard where it left off). `start_delay_s`: simulated time to download `params`.
        `schedule_step` moves the lr schedule to the run's global progress (async mode,
        where a fast island takes more steps than the schedule's length)."""
        if start_delay_s > 0:
            time.sleep(start_delay_s)
        if schedule_step is not None:
            self._seek_schedule(schedule_step)
        t0 = time.perf_counter()
        self.flat.load(params)
        self.start.copy_(self.flat.data)
        self.model.train()
        losses, weight = 0.0, 0
        assignment = dict(assignment) if assignment is not None else self._default_assignment()
        shard_tokens = {s: 0 for s in assignment}
        for _ in range(steps):
            t_step = time.perf_counter()
            shard, batch = self._batch(assignment)
            loss, w = self._forward_backward(batch)
            shard_tokens[shard] += w
            self._clip()
            self._step()
            self.scheduler.step()
            losses += loss
            weight += w
            if self.spec.slowdown > 1:
                time.sleep((self.spec.slowdown - 1) * (time.perf_counter() - t_step))
        payload = self._encode(self.start - self.flat.data)
        return RoundResult(self.spec.index, version, payload, weight, steps, losses / steps,
                           time.perf_counter() - t0, time.time(), assignment, shard_tokens)

    def gradient(self, version: int, params: np.ndarray, start_delay_s: float = 0.0,
                 assignment: dict[int, int] | None = None) -> RoundResult:
        """ddp step: the gradient of one batch at the global `params` (no local update)."""
        if start_delay_s > 0:
            time.sleep(start_delay_s)
        t0 = time.perf_counter()
        self.flat.load(params)
        self.model.train()
        assignment = dict(assignment) if assignment is not None else self._default_assignment()
        shard, batch = self._batch(assignment)
        loss, weight = self._forward_backward(batch)
        payload = self._encode(self.flat.grad.clone())
        return RoundResult(self.spec.index, version, payload, weight, 1, loss, time.perf_counter() - t0, time.time(),
                           assignment, {shard: weight})
