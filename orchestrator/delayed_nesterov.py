"""Delayed Nesterov (Liu et al., 2024, arXiv 2401.09135; ALGORITHMS §2).

Applying Nesterov momentum on every asynchronous arrival over-accelerates. DN updates the
momentum only every N arrivals, from the mean of the N pseudo-gradients accumulated
since, and in between applies each pseudo-gradient with weight 1/N (plus a fraction c of
the momentum). With c = 0, after every N-th arrival θ equals one synchronous Nesterov
step (torch SGD, nesterov=True) on the mean of those N pseudo-gradients.

This rule cannot be a stock torch optimizer (its momentum is updated on a different
clock than its parameters), so it is written out here: a few vectorised ops on the flat
buffer, unit-tested against vector A1 and the synchronous-equivalence property.
"""
from __future__ import annotations

import torch


class DelayedNesterov:
    def __init__(self, param: torch.Tensor, lr: float, momentum: float, delay: int, c: float = 0.0) -> None:
        if delay < 1:
            raise ValueError(f"delay N must be >= 1, got {delay}")
        if not 0.0 <= c <= 1.0 / delay:
            raise ValueError(f"c must be in [0, 1/N] = [0, {1 / delay:g}], got {c}")
        self.param, self.lr, self.beta, self.n, self.c = param, lr, momentum, delay, c
        self.m = torch.zeros_like(param)
        self.acc = torch.zeros_like(param)
        self.t = 0

    @torch.no_grad()
    def step(self, g: torch.Tensor) -> None:
        """Apply one arrival's pseudo-gradient `g` to `param` in place."""
        self.acc.add_(g)
        if (self.t + 1) % self.n == 0:
            self.m.mul_(self.beta).add_(self.acc, alpha=1.0 / self.n)
            self.param.sub_(self.m, alpha=self.lr * (1 - self.c * self.n + self.c) * self.beta)
            self.acc.zero_()
        elif self.c:
            self.param.sub_(self.m, alpha=self.lr * self.c * self.beta)
        self.param.sub_(g, alpha=self.lr / self.n)
        self.t += 1

    def state_dict(self) -> dict[str, object]:
        return {"m": self.m.clone(), "acc": self.acc.clone(), "t": self.t}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.m.copy_(state["m"])  # type: ignore[arg-type]
        self.acc.copy_(state["acc"])  # type: ignore[arg-type]
        self.t = int(state["t"])  # type: ignore[arg-type]
