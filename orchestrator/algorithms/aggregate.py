"""Token-weighted averaging of pseudo-gradients into one preallocated buffer, and the two
numbers admission needs of a vector (its squared norm, whether it is finite) in one pass.
The one aggregator of every pacing and of every coordinator slice. Pure numpy/torch."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch


def sqnorm(x: np.ndarray) -> float:
    """‖x‖² in one BLAS pass (NaN or inf in x make it non-finite; so does an overflow,
    which `all_finite` tells apart)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(x, x))


def all_finite(x: np.ndarray, sq: float) -> bool:
    """Whether x is finite, given its `sqnorm`: a finite ‖x‖² proves it without another
    pass; only a non-finite one (NaN, inf, or overflow of huge values) is checked elementwise."""
    return math.isfinite(sq) or bool(np.isfinite(x).all())


class WeightedMean:
    """Σ w_i Δ_i / Σ w_i, accumulated in place (one vectorised op per contribution)."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.sum = torch.zeros(numel, dtype=dtype)
        self.total = 0.0

    def reset(self) -> None:
        self.total = 0.0  # the next `add` overwrites the buffer: no zeroing pass

    def add(self, delta: np.ndarray, weight: float) -> None:
        with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(delta).to(self.sum.dtype)
        if self.total == 0.0:
            torch.mul(src, weight, out=self.sum)
        else:
            self.sum.add_(src, alpha=weight)
        self.total += weight

    def mean(self) -> torch.Tensor:
        if self.total <= 0:
            raise ValueError("no contributions to average")
        return self.sum.div_(self.total)
