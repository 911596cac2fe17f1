"""Robust aggregation guards: reject a pseudo-gradient whose norm is far outside the
recent distribution, and quarantine an island that keeps sending bad updates.

Pure logic (numpy only). NaN/inf and shape checks live in `aggregate.reason_from`;
this adds the statistical check. The threshold is relative to the median of recently
accepted norms, which follows the natural decay of pseudo-gradients over training.
"""
from __future__ import annotations

from collections import deque

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class RobustConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    norm_ratio: float | None = Field(10.0, gt=1, description="reject if ‖Δ‖ > ratio × median of recent norms; null disables")
    history: int = Field(32, ge=4, description="accepted norms kept for the median")
    min_history: int = Field(4, ge=1, description="norms needed before the check applies")
    quarantine_after: int = Field(3, ge=1, description="consecutive rejections that quarantine an island")


class NormGuard:
    def __init__(self, cfg: RobustConfig) -> None:
        self.cfg = cfg
        self.norms: deque[float] = deque(maxlen=cfg.history)

    def check_norm(self, norm: float) -> str | None:
        """Why a pseudo-gradient of this norm is rejected, or None."""
        ratio = self.cfg.norm_ratio
        if ratio is not None and len(self.norms) >= self.cfg.min_history:
            median = float(np.median(self.norms))
            if norm > ratio * median:
                return f"norm {norm:.4g} > {ratio:g} x recent median {median:.4g}"
        return None

    def accept(self, norm: float) -> None:
        self.norms.append(norm)


class Quarantine:
    """Counts consecutive rejections per island."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.streak: dict[int, int] = {}

    def record(self, island: int, rejected: bool) -> bool:
        """Returns True when this rejection puts the island in quarantine."""
        self.streak[island] = self.streak.get(island, 0) + 1 if rejected else 0
        return rejected and self.streak[island] == self.after
