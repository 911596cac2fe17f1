"""What every outer-step server shares (sync, async, overlap): the global parameters as one
flat `Parameter` sharing the coordinator model's storage, the version, the norm guard,
and screening a round's contributions into the token-weighted mean. Pure torch."""
from __future__ import annotations

from collections.abc import Callable
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


class FlatServer:
    def __init__(self, flat_params: torch.Tensor, guard: NormGuard | None) -> None:
        self.param = torch.nn.Parameter(flat_params, requires_grad=True)  # shares storage
        self.guard = guard
        self.version = 0

    @property
    def numel(self) -> int:
        return self.param.numel()

    def params_numpy(self) -> np.ndarray:
        """The global parameters as numpy, for one `ray.put` per version (a view: put copies)."""
        return self.param.detach().numpy()

    def screen_round(self, mean: WeightedMean, contributions: list[Contribution], expected_version: int,
                     drop: Callable[[], bool] | None = None) -> RoundOutcome:
        """Reject what must not touch the model, drop what `drop()` says, average the rest into `mean`."""
        out = RoundOutcome(version=self.version)
        mean.reset()
        for c in contributions:
            reason = screen(c, self.numel, expected_version, self.guard)
            if reason is not None:
                out.rejected[c.island] = reason
            elif drop is not None and drop():
                out.dropped.append(c.island)
            else:
                mean.add(c.delta, c.weight)
                out.accepted.append(c.island)
        return out

    def guard_state(self) -> list[float]:
        return list(self.guard.norms) if self.guard else []

    def load_guard_state(self, norms: list[float]) -> None:
        if self.guard is not None:
            self.guard.norms.extend(norms)
