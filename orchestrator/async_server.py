"""The asynchronous outer step (Async Local-SGD, ALGORITHMS §2): pure torch, no Ray.

Every submission is applied on arrival. `delayed_nesterov` (DN) is the paper's fix;
`naive` steps a stock torch Nesterov optimizer on every arrival (the baseline the paper
shows over-accelerating). Staleness = versions applied between the one the island
started from and now; beyond `max_staleness` a submission is rejected or down-weighted
by 1 / (1 + staleness − max_staleness), as configured.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
import torch

from orchestrator.aggregate import Contribution, screen
from orchestrator.config import AsyncConfig, OuterConfig
from orchestrator.delayed_nesterov import DelayedNesterov
from orchestrator.flat_server import FlatServer
from orchestrator.outer import build_outer
from orchestrator.robust import NormGuard


@dataclass(frozen=True)
class AsyncOutcome:
    island: int
    staleness: int
    accepted: bool
    scale: float = 1.0
    reason: str | None = None


class AsyncServer(FlatServer):
    def __init__(self, flat_params: torch.Tensor, outer: OuterConfig, cfg: AsyncConfig, num_islands: int,
                 guard: NormGuard | None = None) -> None:
        super().__init__(flat_params, guard)
        self.cfg = cfg
        self.g = torch.zeros_like(flat_params)
        if cfg.rule == "delayed_nesterov":
            self.dn: DelayedNesterov | None = DelayedNesterov(
                self.param.data, outer.lr, outer.momentum, cfg.delay or num_islands, cfg.c)
            self.optimizer: torch.optim.Optimizer | None = None
        else:
            self.dn = None
            self.optimizer = build_outer(outer, self.param)

    def submit(self, c: Contribution) -> AsyncOutcome:
        staleness = self.version - c.version
        reason = screen(c, self.numel, None, self.guard)
        if reason is None and staleness < 0:
            reason = f"from the future: version {c.version} > current {self.version}"
        scale = 1.0
        limit = self.cfg.max_staleness
        if reason is None and limit is not None and staleness > limit:
            if self.cfg.stale_policy == "reject":
                reason = f"staleness {staleness} > max_staleness {limit}"
            else:
                scale = 1.0 / (1 + staleness - limit)
        if reason is not None:
            return AsyncOutcome(c.island, staleness, False, 0.0, reason)
        with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            self.g.copy_(torch.from_numpy(c.delta))
        if scale != 1.0:
            self.g.mul_(scale)
        self._apply(self.g)
        self.version += 1
        return AsyncOutcome(c.island, staleness, True, scale)

    def _apply(self, g: torch.Tensor) -> None:
        if self.dn is not None:
            self.dn.step(g)
            return
        assert self.optimizer is not None
        self.param.grad = g
        self.optimizer.step()
        self.param.grad = None

    def state_dict(self) -> dict:
        return {"version": self.version, "dn": self.dn.state_dict() if self.dn is not None else None,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "guard": self.guard_state()}

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        if self.dn is not None:
            self.dn.load_state_dict(state["dn"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_guard_state(state["guard"])

    def set_lr(self, lr: float) -> None:
        if self.dn is not None:
            self.dn.lr = lr
        else:
            for group in self.optimizer.param_groups:  # type: ignore[union-attr]
                group["lr"] = lr

    def lr(self) -> float:
        return self.dn.lr if self.dn is not None else float(self.optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
