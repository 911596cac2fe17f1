"""The synchronous outer step (DiLoCo §1, and the ddp baseline): pure torch, no Ray.

Holds the global parameters (a flat buffer shared with the coordinator's model), the
version number and the optimizer; `close_round` turns one round's contributions into
one optimizer step. Rejected or dropped contributions never touch the parameters.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from orchestrator.aggregate import Contribution, WeightedMean, screen
from orchestrator.robust import NormGuard


@dataclass
class RoundOutcome:
    version: int                      # version after the round
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)
    stepped: bool = False


class SyncServer:
    def __init__(self, flat_params: torch.Tensor,
                 build_optimizer, drop_prob: float = 0.0, seed: int = 0, grad_clip: float | None = None,
                 guard: NormGuard | None = None) -> None:
        """`build_optimizer(param) -> (optimizer, scheduler | None)`; `flat_params` is updated in place."""
        self.param = torch.nn.Parameter(flat_params, requires_grad=True)  # shares storage
        self.optimizer, self.scheduler = build_optimizer(self.param)
        self.mean = WeightedMean(self.param.numel(), self.param.dtype)
        self.drop_prob = drop_prob
        self.grad_clip = grad_clip
        self.guard = guard
        self.rng = np.random.default_rng(seed + 7919)
        self.version = 0

    @property
    def numel(self) -> int:
        return self.param.numel()

    def params_numpy(self) -> np.ndarray:
        """The global parameters as numpy, for one `ray.put` per version (a view: put copies)."""
        return self.param.detach().numpy()

    def close_round(self, contributions: list[Contribution]) -> RoundOutcome:
        out = RoundOutcome(version=self.version)
        self.mean.reset()
        with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            for c in contributions:
                reason = screen(c, self.numel, self.version, self.guard)
                if reason is not None:
                    out.rejected[c.island] = reason
                elif self.drop_prob and self.rng.random() < self.drop_prob:
                    out.dropped.append(c.island)
                else:
                    self.mean.add(c.delta, c.weight)
                    out.accepted.append(c.island)
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
                "rng": self.rng.bit_generator.state, "guard": list(self.guard.norms) if self.guard else []}

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.rng.bit_generator.state = state["rng"]
        if self.guard is not None:
            self.guard.norms.extend(state["guard"])
