"""Token-weighted averaging of pseudo-gradients into one preallocated buffer, with the
checks that keep a bad update away from the global model."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Contribution:
    """One island's result for one round: Δ = θ_start − θ_end (or a gradient in ddp)."""

    island: int
    version: int
    delta: np.ndarray
    weight: float


def sqnorm(x: np.ndarray) -> float:
    """‖x‖² in one BLAS pass (NaN or inf in x make it non-finite; so does an overflow,
    which `all_finite` tells apart)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(x, x))


def all_finite(x: np.ndarray, sq: float) -> bool:
    """Whether x is finite, given its `sqnorm`: a finite ‖x‖² proves it without another
    pass; only a non-finite one (NaN, inf, or overflow of huge values) is checked elementwise."""
    return math.isfinite(sq) or bool(np.isfinite(x).all())


def reason_from(version: int, shape: tuple[int, ...], weight: float, finite, numel: int,
                expected_version: int | None) -> str | None:
    """Why a contribution must not touch the global model, or None, from its facts. With
    `expected_version` (synchronous rounds) a result from another version is refused;
    `finite()` is evaluated last, as it may read the whole vector. A sharded coordinator
    assembles the facts from its shards."""
    if expected_version is not None and version != expected_version:
        return f"stale: computed from version {version}, round is at {expected_version}"
    if tuple(shape) != (numel,):
        return f"wrong shape {tuple(shape)}, expected ({numel},)"
    if not weight > 0:
        return f"non-positive weight {weight}"
    if not finite():
        return "non-finite values (NaN or inf)"
    return None


def screen(c: Contribution, numel: int, expected_version: int | None, guard) -> str | None:
    """`reason_from` the contribution, then the statistical norm check of `guard` (a `NormGuard` or None);
    an accepted contribution's norm joins the guard's history."""
    sq = sqnorm(c.delta) if c.delta.shape == (numel,) else math.nan
    reason = reason_from(c.version, c.delta.shape, c.weight, lambda: all_finite(c.delta, sq), numel, expected_version)
    if reason is None and guard is not None:
        norm = math.sqrt(sq)
        reason = guard.check_norm(norm)
        if reason is None:
            guard.accept(norm)
    return reason


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
