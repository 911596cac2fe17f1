"""The statistical check of robust aggregation: reject a pseudo-gradient whose norm is far
outside the recent distribution of admitted ones.

Pure logic (numpy only); admission (`engine/admission.py`) calls it after the shape,
weight and finiteness checks, and feeds it only the norms of updates it admits. The
threshold is relative to the median of recently admitted norms, which follows the
natural decay of pseudo-gradients over training.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from orchestrator.config import RobustConfig


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
