"""Rows of `context + 1` tokens as a training batch: inputs and next-token targets, the
one shape every text source (packed corpus, prepared shards, stream) hands an island.
torch is imported by the call that makes a batch, so preparing data (the command's
`prepare()`) never imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def as_batch(rows: np.ndarray, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) as int64; `pin`: in page-locked memory when CUDA is there, so a GPU island
    copies them without a staging copy."""
    import torch

    w = torch.from_numpy(rows.astype(np.int64, copy=False))
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    if pin and torch.cuda.is_available():
        return x.pin_memory(), y.pin_memory()
    return x, y
