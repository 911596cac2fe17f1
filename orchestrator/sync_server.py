"""The synchronous outer step (DiLoCo §1, and the ddp baseline): pure torch, no Ray.

Holds the global parameters (a flat buffer shared with the coordinator's model), the
version number and the optimizer; `close_round` turns one round's contributions into
one optimizer step. Rejected or dropped contributions never touch the parameters.
"""
from __future__ import annotations

import numpy as np
import torch

from orchestrator.aggregate import Contribution, WeightedMean
from orchestrator.flat_server import FlatServer, RoundOutcome
from orchestrator.robust import NormGuard

__all__ = ["RoundOutcome", "SyncServer"]


class SyncServer(FlatServer):
    def __init__(self, flat_params: torch.Tensor,
                 build_optimizer, drop_prob: float = 0.0, seed: int = 0, grad_clip: float | None = None,
                 guard: NormGuard | None = None) -> None:
        """`build_optimizer(param) -> (optimizer, scheduler | None)`; `flat_params` is updated in place."""
        super().__init__(flat_params, guard)
        self.optimizer, self.scheduler = build_optimizer(self.param)
        self.mean = WeightedMean(self.param.numel(), self.param.dtype)
        self.drop_prob = drop_prob
        self.grad_clip = grad_clip
        self.rng = np.random.default_rng(seed + 7919)

    def close_round(self, contributions: list[Contribution]) -> RoundOutcome:
        drop = (lambda: self.rng.random() < self.drop_prob) if self.drop_prob else None
        out = self.screen_round(self.mean, contributions, self.version, drop)
        if out.accepted:
            self._step(self.mean.mean())
            out.stepped = True
        self.version += 1
        out.version = self.version
        return out

    def _step(self, grad: torch.Tensor) -> None:
        if self.grad_clip is not None:
            norm = float(grad.norm())
            if norm > self.grad_clip:
                grad.mul_(self.grad_clip / norm)
        self.param.grad = grad
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.param.grad = None

    def set_lr(self, lr: float) -> None:
        """Change the outer learning rate (diloco; in ddp the schedule owns the lr)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        """Everything needed to continue bit-for-bit (params are saved by the coordinator)."""
        return {"version": self.version, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "rng": self.rng.bit_generator.state, "guard": self.guard_state()}

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.rng.bit_generator.state = state["rng"]
        self.load_guard_state(state["guard"])
