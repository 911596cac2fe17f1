"""The statistical checks of robust aggregation: reject a pseudo-gradient whose norm, or
whose token weight per inner step, is far outside the recent distribution of admitted ones.

Pure logic (numpy only); admission (`engine/step/admission.py`) calls it after the shape,
weight and finiteness checks, and feeds it only the norms of updates it admits. The
threshold is relative to the median of recently admitted norms, which follows the
natural decay of pseudo-gradients over training.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..config import RobustConfig


class NormGuard:
    """Outliers by the recent distribution of admitted updates: ‖Δ‖ against the median norm,
    and the token weight per inner step against its median (an island reports its own
    weight; a huge one would let it outvote the others, so it is held to what the others
    report for the same work). A zero update is refused outright: it carries nothing, and
    admitted zeros would drag the median to 0, after which every real update would look
    like an outlier."""

    def __init__(self, cfg: RobustConfig) -> None:
        self.cfg = cfg
        self.norms: deque[float] = deque(maxlen=cfg.history)
        self.weights: deque[float] = deque(maxlen=cfg.history)  # token weight per inner step

    def check_norm(self, norm: float) -> str | None:
        """Why a pseudo-gradient of this norm is rejected, or None."""
        if norm == 0.0:
            return "zero update (norm 0)"
        return _outlier("norm", norm, self.norms, self.cfg.norm_ratio, self.cfg.min_history)

    def check_weight(self, per_step: float) -> str | None:
        """Why an update of this token weight per inner step is rejected, or None."""
        return _outlier("weight per step", per_step, self.weights, self.cfg.weight_ratio, self.cfg.min_history)

    def accept(self, norm: float, per_step: float) -> None:
        self.norms.append(norm)
        self.weights.append(per_step)


def _outlier(what: str, value: float, recent: deque[float], ratio: float | None, min_history: int) -> str | None:
    if ratio is not None and len(recent) >= min_history:
        median = float(np.median(recent))
        if value > ratio * median:
            return f"{what} {value:.4g} > {ratio:g} x recent median {median:.4g}"
    return None
