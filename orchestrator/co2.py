"""CO2's outer step (Sun et al., ICLR 2024; ALGORITHMS §3): heavy-ball momentum on a
one-round-stale pseudo-gradient, with a staleness gap penalty and outer momentum clipping.

    m   ← β·m + Λ·Δ            Λ: staleness gap penalty, 0 < Λ ≤ 1
    m   ← clamp(m, −φ, φ)      element-wise; the authors' released code discards this
                               result (a silent no-op) — here it really clips
    x_n ← x_n − α·m

The clip sits between the momentum update and the parameter step, so this cannot be a
stock torch optimizer; it is three vectorised ops on the flat buffer, tested on C1/C2.
"""
from __future__ import annotations

from typing import Literal

import torch


def adaptive_gap(moved: float, delta_norm: float, lam: float, eps: float = 1e-8) -> float:
    """Λ = 1 / (1 + λ‖x_n − x_s‖ / (‖Δ‖ + ε)) from the two norms (a sharded coordinator
    sums their squares over its shards)."""
    return 1.0 / (1.0 + lam * moved / (delta_norm + eps))


class CO2Outer:
    def __init__(self, param: torch.Tensor, lr: float = 1.0, momentum: float = 0.0, clip: float | None = 1.0,
                 penalty: Literal["constant", "adaptive"] = "constant", p: float = 1.0, lam: float = 1.0,
                 eps: float = 1e-8) -> None:
        if p < 1:
            raise ValueError(f"penalty p must be >= 1, got {p}")
        self.param, self.lr, self.beta, self.clip = param, lr, momentum, clip
        self.penalty, self.p, self.lam, self.eps = penalty, p, lam, eps
        self.m = torch.zeros_like(param)

    def gap_penalty(self, delta: torch.Tensor, x_start: torch.Tensor) -> float:
        """Λ: `constant` = 1/p (the released code); `adaptive` = 1 / (1 + λ‖x_n − x_s‖ / (‖Δ‖ + ε)),
        which shrinks an update by how far the global model moved while it was in flight."""
        if self.penalty == "constant":
            return 1.0 / self.p
        return self.adaptive_gap(float(torch.linalg.vector_norm(self.param - x_start)),
                                 float(torch.linalg.vector_norm(delta)))

    def adaptive_gap(self, moved: float, delta_norm: float) -> float:
        return adaptive_gap(moved, delta_norm, self.lam, self.eps)

    @torch.no_grad()
    def step(self, delta: torch.Tensor, x_start: torch.Tensor, gap: float | None = None) -> float:
        """Apply Δ = x_start − x̄ (from the round that started at `x_start`); returns Λ.
        `gap`: Λ computed over the whole vector when this is one shard's slice."""
        gap = self.gap_penalty(delta, x_start) if gap is None else gap
        self.m.mul_(self.beta).add_(delta, alpha=gap)
        if self.clip is not None:
            self.m.clamp_(-self.clip, self.clip)
        self.param.sub_(self.m, alpha=self.lr)
        return gap
