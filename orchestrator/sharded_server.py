"""The outer step over S coordinator shards (`coordinator.shards > 1`), with the interface
of the single-coordinator servers so the loops do not care which one runs.

Bytes never pass through here: each island puts its pseudo-gradient as S slices, and
each shard pulls its own slices straight from the island (in parallel, over as many
nodes as there are shards). The coordinator only sees a few numbers per contribution:
it screens over the whole vector (stale, shape, weight, finite, norm guard, drop), then
tells every shard which islands to average with which weights. Norms are sums of the
shards' squared norms; everything else is elementwise, so S shards equal one coordinator.
"""
from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from orchestrator.aggregate import Contribution, reason_from
from orchestrator.async_server import AsyncOutcome
from orchestrator.co2 import adaptive_gap
from orchestrator.config import RunConfig
from orchestrator.flat_server import RoundOutcome
from orchestrator.outer_shard import SliceStats
from orchestrator.overlap_server import start_version
from orchestrator.robust import NormGuard


class ShardCalls(Protocol):
    """How the shards are reached: in-process objects (tests) or Ray actors (runs)."""

    def call(self, method: str, args: list[tuple]) -> list[Any]:
        """`method(*args[k])` on shard k, all shards at once; their results in order."""
        ...

    def params(self) -> list[Any]:
        """Each shard's parameter slice (a reference an island can fetch, under Ray)."""
        ...

    def fetch(self, slices: list[Any]) -> list[np.ndarray]:
        ...


class ShardedServer:
    def __init__(self, cfg: RunConfig, flat: torch.Tensor, bounds: list[tuple[int, int]], calls: ShardCalls,
                 guard: NormGuard | None) -> None:
        """`flat`: the coordinator's copy of the parameters (for evaluation and checkpoints),
        refreshed from the shards by `refresh`."""
        self.cfg, self.flat, self.bounds, self.calls, self.guard = cfg, flat, bounds, calls, guard
        self.numel = flat.numel()
        self.version = self.base = 0
        self.last_gap = 1.0
        self.rng = np.random.default_rng(cfg.seed + 7919)  # the single server's drop stream
        self._keys = itertools.count()
        self._published: tuple[int, list[Any]] | None = None

    def _all(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every shard."""
        return self.calls.call(method, [args] * len(self.bounds))

    # -- screening over the whole vector --------------------------------------------------
    def _inspect(self, contributions: list[Contribution]) -> tuple[int, list[list[SliceStats]]]:
        key = next(self._keys)
        stats = self.calls.call("inspect", [(key, [(c.island, c.version, c.delta[k]) for c in contributions])
                                            for k in range(len(self.bounds))])
        return key, [[stats[k][j] for k in range(len(self.bounds))] for j in range(len(contributions))]

    def _reason(self, c: Contribution, parts: list[SliceStats], expected: int | None) -> str | None:
        reason = reason_from(c.version, (sum(p.size for p in parts),), c.weight,
                             lambda: all(p.finite for p in parts), self.numel, expected)
        if reason is None and self.guard is not None:
            norm = math.sqrt(sum(p.sqnorm for p in parts))
            reason = self.guard.check_norm(norm)
            if reason is None:
                self.guard.accept(norm)
        return reason

    def _screen(self, contributions: list[Contribution], expected: int | None,
                drop: Callable[[], bool] | None = None) -> tuple[int, RoundOutcome, dict[int, float]]:
        key, stats = self._inspect(contributions)
        out, weights = RoundOutcome(version=self.version), {}
        for c, parts in zip(contributions, stats):
            reason = self._reason(c, parts, expected)
            if reason is not None:
                out.rejected[c.island] = reason
            elif drop is not None and drop():
                out.dropped.append(c.island)
            else:
                weights[c.island] = c.weight
                out.accepted.append(c.island)
        return key, out, weights

    # -- the three outer steps ----------------------------------------------------------
    def close_round(self, *args: Any) -> RoundOutcome:
        """Sync: `close_round(contributions)`; overlap: `close_round(round_t, contributions)`."""
        if self.cfg.mode == "overlap":
            return self._close_overlap(*args)
        drop_prob = self.cfg.outer.drop_prob
        key, out, weights = self._screen(args[0], self.version,
                                         (lambda: self.rng.random() < drop_prob) if drop_prob else None)
        self._all("close", key, weights)
        return self._stepped(out)

    def _close_overlap(self, round_t: int, contributions: list[Contribution]) -> RoundOutcome:
        if round_t != self.version + 1:
            raise ValueError(f"round {round_t} closed out of order (version {self.version})")
        key, out, weights = self._screen(contributions, start_version(round_t, self.base))
        ov = self.cfg.overlap
        gap = 1.0 / ov.penalty_p
        if weights and ov.penalty == "adaptive":
            terms = self._all("gap_terms", key, weights, round_t)
            gap = adaptive_gap(math.sqrt(sum(t[0] for t in terms)), math.sqrt(sum(t[1] for t in terms)),
                               ov.penalty_lambda)
        if weights:
            self.last_gap = gap
        self._all("close", key, weights, round_t, gap)
        return self._stepped(out)

    def _stepped(self, out: RoundOutcome) -> RoundOutcome:
        out.stepped = bool(out.accepted)
        self.version += 1
        out.version = self.version
        return out

    def submit(self, c: Contribution) -> AsyncOutcome:
        key, (parts,) = self._inspect([c])
        reason = self._reason(c, parts, None)
        if reason is not None:
            self._all("discard", key)
            return AsyncOutcome(c.island, self.version - c.version, False, 0.0, reason)
        outcome = self._all("submit", key, c.island, c.weight)[0]
        if outcome["accepted"]:
            self.version += 1
        return AsyncOutcome(c.island, **outcome)

    # -- parameters, settings, state ------------------------------------------------------
    def params_slices(self) -> list[Any]:
        """The current global parameters as S slices, published once per version."""
        if self._published is None or self._published[0] != self.version:
            self._published = (self.version, self.calls.params())
        return self._published[1]

    def refresh(self) -> None:
        """Copy the shards' parameters into the coordinator's model (before eval/checkpoint)."""
        with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            for (lo, hi), part in zip(self.bounds, self.calls.fetch(self.params_slices())):
                self.flat[lo:hi].copy_(torch.from_numpy(np.asarray(part)))

    def set_lr(self, lr: float) -> None:
        self._all("set_lr", lr)

    def lr(self) -> float:
        return float(self._all("lr")[0])

    def state_dict(self) -> dict:
        return {"version": self.version, "shards": self._all("state_dict"),
                "guard": list(self.guard.norms) if self.guard else [], "rng": self.rng.bit_generator.state,
                "bounds": self.bounds}

    def load_state_dict(self, state: dict) -> None:
        """Restore every shard from the checkpoint (`flat` already holds its parameters)."""
        if [tuple(b) for b in state["bounds"]] != self.bounds:
            raise ValueError(f"checkpoint has coordinator shards {state['bounds']}, this run {self.bounds}")
        self.calls.call("load", [(self.flat[lo:hi].numpy().copy(), st)
                                 for (lo, hi), st in zip(self.bounds, state["shards"])])
        self.version = self.base = state["version"]
        self.rng.bit_generator.state = state["rng"]
        if self.guard is not None:
            self.guard.norms.extend(state["guard"])
        self._published = None
