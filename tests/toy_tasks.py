"""Tiny tasks for tests: the quadratic islands of ALGORITHMS.md vector D1, with optional
fault injection (an island that dies or stalls) for the integration tests."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn


class Point(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim, dtype=dtype))


class QuadraticTask:
    """Island i minimises f_i(x) = ½‖x − c_i‖²; one batch is just c_i."""

    def __init__(self, centers: list[list[float]], dtype: str = "float64",
                 crash_island: int | None = None, crash_after_batches: int = 0,
                 stall_island: int | None = None, stall_s: float = 0.0, batch_s: float = 0.0,
                 nan_island: int | None = None) -> None:
        self.dtype = getattr(torch, dtype)
        self.centers = torch.tensor(centers, dtype=self.dtype)
        self.crash_island, self.crash_after = crash_island, crash_after_batches
        self.stall_island, self.stall_s = stall_island, stall_s
        self.batch_s = batch_s  # every batch costs this long, like real compute (for speed tests)
        self.nan_island = nan_island  # this island's data is NaN: its pseudo-gradients are NaN

    def prepare(self) -> None:
        pass

    def build_model(self) -> nn.Module:
        return Point(self.centers.shape[1], self.dtype)

    def train_batches(self, island: int, num_islands: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
        n = 0
        while True:
            n += 1
            if island == self.crash_island and n > self.crash_after:
                os._exit(1)  # a real process death, as a crashed node would look
            if island == self.stall_island and n > 1:
                time.sleep(self.stall_s)
            if self.batch_s:
                time.sleep(self.batch_s)
            center = self.centers[island % len(self.centers)].clone()
            yield (center * float("nan"),) if island == self.nan_island else (center,)

    def eval_batches(self) -> Sequence[tuple[torch.Tensor, ...]]:
        return [(c.clone(),) for c in self.centers]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return 0.5 * ((model.x - batch[0]) ** 2).sum()

    def batch_weight(self, batch: tuple[torch.Tensor, ...]) -> int:
        return 1


def make_quadratic(**kwargs: object) -> QuadraticTask:
    return QuadraticTask(**kwargs)  # type: ignore[arg-type]
