"""Token-weighted averaging of pseudo-gradients into one preallocated buffer, and the two
numbers admission needs of a vector (its squared norm, whether it is finite), computed in
the same pass over memory. The one aggregator of every pacing and of every coordinator
slice. Pure numpy/torch."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

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


CHUNK = 1 << 18  # elements per block: 1 MB of fp32, so the blocks of a step's operands stay in cache


def blocks(n: int) -> Iterator[slice]:
    """The blocks of a vector of `n` elements. Running every operation of a step on one
    block before the next reads each operand from memory once (a step of several
    vectorised ops over whole vectors reads and writes each of them once per op); the
    arithmetic per element is unchanged, so the result is bitwise the whole-vector one."""
    return (slice(lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK))


class WeightedMean:
    """Σ w_i Δ_i / Σ w_i into one buffer, reused from step to step."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.numel, self.dtype = numel, dtype
        self._sum: torch.Tensor | None = None

    @property
    def sum(self) -> torch.Tensor:
        """The buffer, allocated at its first use: a coordinator whose every step takes the
        one pass (`OnePass`, which needs no mean) never holds it."""
        if self._sum is None:
            self._sum = torch.zeros(self.numel, dtype=self.dtype)
        return self._sum

    def fill(self, parts: Sequence[tuple[np.ndarray, float]], sqnorms: list[float] | None = None) -> torch.Tensor:
        """The weighted mean of `parts` (in their order: float sums depend on it), block by
        block: each Δ_i is read once and the buffer written once. With `sqnorms` (one
        entry per part, filled in), each Δ_i's squared norm is summed from the same reads,
        so screening an update costs no pass of its own."""
        total = sum(w for _, w in parts)
        if total <= 0:
            raise ValueError("no contributions to average")
        with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            sources = [(torch.from_numpy(np.asarray(d)), w) for d, w in parts]
        dtype = self.sum.dtype
        for block in blocks(self.sum.numel()):
            out = self.sum[block]
            for i, (src, w) in enumerate(sources):
                piece = src[block]
                if sqnorms is not None:
                    sqnorms[i] += sqnorm(piece.numpy())
                if i == 0:
                    torch.mul(piece.to(dtype), w, out=out)
                else:
                    out.add_(piece.to(dtype), alpha=w)
            out.div_(total)
        return self.sum

    def radial_directional(
        self, parts: Sequence[tuple[np.ndarray, float]], sqnorms: Sequence[float] | None = None
    ) -> torch.Tensor:
        """Radial-Directional Averaging (Decoupled DiLoCo, arXiv 2604.21428): r̄ · û with
        r̄ = Σ w_i ‖Δ_i‖ / Σ w_i and û the unit vector along Σ w_i Δ_i/‖Δ_i‖ — the norms
        and the directions averaged apart, so pseudo-gradients that point different ways
        do not shrink the step as their mean does. Two reads of each Δ_i: its norm must be
        known before its direction is weighted — one read when `sqnorms` (each Δ_i's squared
        norm, as `sqnorm` gives it) is known already: the coordinator's screen measured it.
        A zero Δ_i adds to the mean norm only; with no direction at all the result is zero."""
        if sqnorms is None:
            sqnorms = [sqnorm(np.asarray(d)) for d, _ in parts]
        norms = [math.sqrt(q) for q in sqnorms]
        total = sum(w for _, w in parts)
        if total <= 0:
            raise ValueError("no contributions to average")
        radius = sum(w * r for (_, w), r in zip(parts, norms)) / total
        units = [(d, w / r) for (d, w), r in zip(parts, norms) if r > 0]
        if not units:
            return self.sum.zero_()
        direction = self.fill(units)  # along Σ w_i Δ_i/‖Δ_i‖ (its own total divides it)
        length = float(direction.norm())
        return direction.mul_(radius / length) if length > 0 else direction.zero_()
