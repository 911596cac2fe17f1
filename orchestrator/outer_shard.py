"""One coordinator shard: a contiguous slice of the flat parameter vector, with its slice
of the outer optimizer state (the ZeRO idea applied to the outer step). Pure torch; the
coordinator drives S of them through `ShardedServer`, as Ray actors in a run.

A round takes two calls: `inspect` decodes the slices the islands sent and returns the
per-slice statistics the coordinator needs to screen each contribution over the whole
vector (finite? squared norm), then `close`/`submit` averages and steps the accepted
ones. Every outer rule is elementwise apart from norms, which are summed over shards,
so S shards compute what one coordinator does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from orchestrator.aggregate import Contribution, all_finite, sqnorm
from orchestrator.config import RunConfig
from orchestrator.servers import build_server
from workers.compress import Payload, decode


@dataclass(frozen=True)
class SliceStats:
    size: int
    finite: bool
    sqnorm: float


class OuterShard:
    def __init__(self, cfg: RunConfig, bounds: tuple[int, int], params: np.ndarray) -> None:
        torch.set_num_threads(cfg.coordinator.threads)
        self.lo, self.hi = bounds
        self.param = torch.from_numpy(np.array(params))  # a private copy
        self.server = build_server(cfg, self.param, guard=None, whole=False)
        self.pending: dict[Any, list[tuple[int, int, np.ndarray]]] = {}

    def inspect(self, key: Any, parts: list[tuple[int, int, Payload]]) -> list[SliceStats]:
        """Decode (island, version, payload) slices and keep them for the step of `key`."""
        decoded = [(i, v, decode(p)) for i, v, p in parts]
        self.pending[key] = decoded
        norms = [sqnorm(d) for _, _, d in decoded]
        return [SliceStats(d.size, all_finite(d, sq), sq) for (_, _, d), sq in zip(decoded, norms)]

    def _accepted(self, key: Any, weights: dict[int, float], keep: bool = False) -> list[Contribution]:
        """The slices of `key` from the islands in `weights`, as contributions with their weights."""
        parts = self.pending[key] if keep else self.pending.pop(key)
        return [Contribution(i, v, d, weights[i]) for i, v, d in parts if i in weights]

    def close(self, key: Any, weights: dict[int, float], round_t: int | None = None,
              gap: float | None = None) -> None:
        """Average the accepted slices (island -> weight) and step (sync; overlap with `round_t`)."""
        contributions = self._accepted(key, weights)
        if round_t is None:
            self.server.close_round(contributions)
        else:
            self.server.close_round(round_t, contributions, gap)

    def gap_terms(self, key: Any, weights: dict[int, float], round_t: int) -> tuple[float, float]:
        """Partial sums for CO2's adaptive penalty (the slices stay for `close`)."""
        return self.server.gap_terms(round_t, self._accepted(key, weights, keep=True))

    def submit(self, key: Any, island: int, weight: float) -> dict[str, Any]:
        """Apply one async arrival; the outcome (staleness policy) is the same on every shard."""
        (c,) = self._accepted(key, {island: weight})
        out = self.server.submit(c)
        return {"staleness": out.staleness, "accepted": out.accepted, "scale": out.scale, "reason": out.reason}

    def discard(self, key: Any) -> None:
        self.pending.pop(key, None)

    def params(self) -> np.ndarray:
        return self.param.numpy()

    def set_lr(self, lr: float) -> None:
        self.server.set_lr(lr)

    def lr(self) -> float:
        return self.server.lr()

    def state_dict(self) -> dict:
        return self.server.state_dict()

    def load(self, params: np.ndarray, state: dict) -> None:
        self.param.copy_(torch.from_numpy(np.asarray(params)))
        self.server.load_state_dict(state)


class LocalShards:
    """`ShardCalls` over in-process shards (unit tests; a single-process run)."""

    def __init__(self, cfg: RunConfig, params: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        self.shards = [OuterShard(cfg, b, params[b[0]:b[1]]) for b in bounds]

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        return [getattr(s, method)(*a) for s, a in zip(self.shards, args)]

    def params(self) -> list[np.ndarray]:
        return [s.params().copy() for s in self.shards]

    def fetch(self, slices: list[np.ndarray]) -> list[np.ndarray]:
        return slices
