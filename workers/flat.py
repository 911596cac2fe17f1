"""One contiguous buffer behind all of a model's parameters (and one behind its grads).

Parameters become views into a single flat tensor, so loading the global model, taking a
pseudo-gradient or exporting it as numpy is one vectorised op over one buffer instead of
a Python loop over parameters, and the buffer goes through Ray's object store as a numpy
array (zero-copy to read) rather than as pickled tensors.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn


class FlatParams:
    """Rebinds every parameter of `model` to a slice of one flat buffer, and every grad to
    a slice of a second flat buffer. Build it after moving the model to its device."""

    def __init__(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        device = params[0].device
        self.numel = sum(p.numel() for p in params)
        self.data = torch.empty(self.numel, dtype=params[0].dtype, device=device)
        self.grad = torch.zeros_like(self.data)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.data[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.data[offset : offset + n].view_as(p)
                p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n

    def load(self, values: np.ndarray | torch.Tensor) -> None:
        """Overwrite all parameters from a flat array of the same length."""
        with warnings.catch_warnings():  # object-store arrays are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.as_tensor(values)
        if src.shape != (self.numel,):
            raise ValueError(f"flat parameters have shape {tuple(src.shape)}, expected ({self.numel},)")
        with torch.no_grad():
            self.data.copy_(src)

    def numpy(self) -> np.ndarray:
        """A host copy of the parameters (a copy: the result must not alias live weights)."""
        return self.data.detach().cpu().numpy().copy()


def slice_bounds(numel: int, shards: int, align: int) -> list[tuple[int, int]]:
    """S contiguous [lo, hi) slices of `numel`, boundaries on multiples of `align` (the
    codec chunk, so a slice encodes exactly as its part of the whole vector would)."""
    blocks = -(-numel // align)
    cuts = [min(numel, (blocks * k // shards) * align) for k in range(shards + 1)]
    return [(cuts[k], cuts[k + 1]) for k in range(shards)]
