"""CO2's staleness gap penalty Λ (Sun et al. 2024), a rule of its own beside the outer
rule's optimizer: the outer step asks it for Λ before each step, and it sets Λ in the
optimizer's param group (`gap`), as a scheduler sets `lr`; `CO2Outer` scales the update by
it. The penalty's formula is pure (`algorithms/outer.py`: `ConstantGap`, `AdaptiveGap`);
what lives here is the state it reads: an anchored penalty measures how far the
parameters moved since the version the update's round started from, so the versions
rounds in flight started from are kept (the planner's "round starts"). A sliced
coordinator sums each slice's squared parts (`terms`) and hands every slice the
whole-vector norms, so S slices take the same Λ."""

from __future__ import annotations

import torch

from ...algorithms.outer import GapPenalty


class Gap:
    """Λ for the steps on one buffer's parameter `param` (which stays the same tensor: the
    step is in place, so the kept versions and the parameters are compared where they are)."""

    def __init__(self, penalty: GapPenalty, param: torch.Tensor) -> None:
        self.penalty, self.param = penalty, param
        self.anchors: dict[int, torch.Tensor] = {0: param.detach().clone()} if penalty.anchored else {}

    @property
    def anchored(self) -> bool:
        return self.penalty.anchored

    def terms(self, merged: torch.Tensor, anchor: int) -> tuple[float, float]:
        """(‖x − x_s‖², ‖Δ̄‖²) over this buffer, for a sliced coordinator to sum."""
        moved = float(torch.sum((self.param.detach() - self.anchors[anchor]) ** 2))
        return moved, float(torch.sum(merged**2))

    def set(
        self,
        optimizer: torch.optim.Optimizer,
        grad: torch.Tensor,
        anchor: int | None,
        norms: tuple[float, float] | None,
    ) -> float:
        """Λ for the step on `grad`, set in `optimizer`'s param groups. `norms`: (‖x − x_s‖,
        ‖Δ̄‖) over the whole vector when this buffer is one slice of it, else measured here."""
        if norms is None and self.anchored:
            if anchor is None:
                raise ValueError("an anchored gap penalty needs the version its round started from (anchor)")
            moved = float(torch.linalg.vector_norm(self.param.detach() - self.anchors[anchor]))
            norms = (moved, float(torch.linalg.vector_norm(grad)))
        gap = self.penalty.gap(*(norms or (0.0, 0.0)))
        for group in optimizer.param_groups:
            group["gap"] = gap
        return gap

    def keep(self, version: int, keep_from: int) -> None:
        """Keep the parameters of `version` for the rounds that will start from it; drop
        those before `keep_from`, which no round in flight started from."""
        if self.anchored:
            self.anchors[version] = self.param.detach().clone()
            for v in [v for v in self.anchors if v < keep_from]:
                del self.anchors[v]

    def reset(self, version: int) -> None:
        """Resumed at `version`: every round from now on starts from it."""
        if self.anchored:
            self.anchors = {version: self.param.detach().clone()}
