"""The CO2 outer step over rounds (ALGORITHMS §3): pure torch, no Ray.

Round t starts from version max(0, t − 2): islands never wait for the exchange of the
round they just finished, so round t+1 starts from the global produced by round t − 1,
and round t's pseudo-gradient is applied one round late. `close_round(t, …)` averages
the islands' Δ = x_s − θ_i (token-weighted), and steps `CO2Outer` with x_s = the
parameters round t started from (kept until applied, for the adaptive penalty).
"""
from __future__ import annotations

import torch

from orchestrator.aggregate import Contribution, WeightedMean
from orchestrator.co2 import CO2Outer
from orchestrator.config import OverlapConfig
from orchestrator.flat_server import FlatServer, RoundOutcome
from orchestrator.robust import NormGuard


def start_version(round_t: int, base: int = 0) -> int:
    """The global version round `round_t` (1-based) starts from. After a restart at
    version `base` the pipeline refills: round base+1 starts from base, like round 1."""
    return max(base, round_t - 2)


class OverlapServer(FlatServer):
    def __init__(self, flat_params: torch.Tensor, cfg: OverlapConfig, guard: NormGuard | None = None) -> None:
        super().__init__(flat_params, guard)
        self.co2 = CO2Outer(self.param.data, cfg.lr, cfg.momentum, cfg.clip, cfg.penalty,
                            cfg.penalty_p, cfg.penalty_lambda)
        self.mean = WeightedMean(self.param.numel(), self.param.dtype)
        self.base = 0
        self.starts: dict[int, torch.Tensor] = {0: flat_params.detach().clone()}
        self.last_gap = 1.0

    def gap_terms(self, round_t: int, contributions: list[Contribution]) -> tuple[float, float]:
        """(‖x − x_s‖², ‖Δ̄‖²) over this buffer, for the adaptive Λ of a sharded coordinator."""
        start = start_version(round_t, self.base)
        mean = WeightedMean(self.numel, self.param.dtype)
        for c in contributions:
            mean.add(c.delta, c.weight)
        moved = float(torch.sum((self.param.detach() - self.starts[start]) ** 2))
        return moved, float(torch.sum(mean.mean() ** 2))

    def close_round(self, round_t: int, contributions: list[Contribution], gap: float | None = None) -> RoundOutcome:
        """`gap`: the penalty Λ over the whole vector (a coordinator shard's slice)."""
        if round_t != self.version + 1:
            raise ValueError(f"round {round_t} closed out of order (version {self.version})")
        start = start_version(round_t, self.base)
        out = self.screen_round(self.mean, contributions, start)
        if out.accepted:
            self.last_gap = self.co2.step(self.mean.mean(), self.starts[start], gap)
            out.stepped = True
        self.version += 1
        self.starts[self.version] = self.param.detach().clone()
        for v in [v for v in self.starts if v < start_version(self.version + 1, self.base)]:
            del self.starts[v]
        out.version = self.version
        return out

    def set_lr(self, lr: float) -> None:
        self.co2.lr = lr

    def lr(self) -> float:
        return self.co2.lr

    def state_dict(self) -> dict:
        return {"version": self.version, "m": self.co2.m.clone(), "guard": self.guard_state()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved version; the pipeline refills from it (no stale round)."""
        self.version = self.base = state["version"]
        self.co2.m.copy_(state["m"])
        self.starts = {self.version: self.param.detach().clone()}
        self.load_guard_state(state["guard"])
