"""One contiguous buffer behind all of a model's parameters (and one behind its grads).

Parameters become views into a single flat tensor, so loading the global model, taking a
pseudo-gradient or exporting it as numpy is one vectorised op over one buffer instead of
a Python loop over parameters, and the buffer goes through Ray's object store as a numpy
array (zero-copy to read) rather than as pickled tensors.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np
import torch
from torch import nn


class ParamStore(Protocol):
    """What an island needs of its parameters, whether one flat buffer (`FlatParams`) or
    shards across the island's workers (`archipelago.workers.runtime.fsdp.ShardedParams`)."""

    numel: int

    def load(self, values: np.ndarray | torch.Tensor) -> None: ...
    def full(self) -> torch.Tensor: ...
    def full_grad(self) -> torch.Tensor: ...
    def zero_grad(self) -> None: ...
    def clip_grad(self, max_norm: float) -> None: ...
    def numpy(self) -> np.ndarray: ...


def as_tensor(values: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A tensor over `values` without a copy (object-store arrays are read-only; we only
    read them, so torch's warning about it is silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.as_tensor(values)


class FlatParams:
    """Rebinds every parameter of `model` to a slice of one flat buffer, and every grad to
    a slice of a second flat buffer. Build it after moving the model to its device.
    `grads=False` (a model that is only evaluated or stepped from outside: the coordinator,
    the evaluation actor): no gradient buffer, which would hold as many bytes as the
    parameters for nothing (0.43 GiB at 114 M parameters, on the head)."""

    def __init__(self, model: nn.Module, *, grads: bool = True) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        device = params[0].device
        self.numel = sum(p.numel() for p in params)
        self.data = torch.empty(self.numel, dtype=params[0].dtype, device=device)
        self.grad = torch.zeros_like(self.data) if grads else torch.empty(0, dtype=self.data.dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.data[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.data[offset : offset + n].view_as(p)
                if grads:
                    p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n

    def load(self, values: np.ndarray | torch.Tensor) -> None:
        """Overwrite all parameters from a flat array of the same length."""
        src = as_tensor(values)
        if src.shape != (self.numel,):
            raise ValueError(f"flat parameters have shape {tuple(src.shape)}, expected ({self.numel},)")
        with torch.no_grad():
            self.data.copy_(src)

    def full(self) -> torch.Tensor:
        """The whole flat parameter vector (here the live buffer itself)."""
        return self.data

    def full_grad(self) -> torch.Tensor:
        return self.grad

    def zero_grad(self) -> None:
        self.grad.zero_()

    def parameter(self, lo: int = 0, hi: int | None = None) -> nn.Parameter:
        """One parameter over [lo, hi) of the buffer, its grad the same slice of the grads:
        an elementwise optimizer (AdamW, SGD) given it steps the model's parameters in a
        few kernels over one tensor instead of a few per tensor."""
        owned = nn.Parameter(self.data[lo:hi])  # a view: stepping it steps the model
        owned.grad = self.grad[lo:hi]
        return owned

    def clip_grad(self, max_norm: float) -> None:
        """Scale the gradient to norm `max_norm` if it is longer: the norm stays on the
        device (no host sync per step: on a GPU `float(norm)` stalled the step's queue), and
        the scale is 1 when it is not longer."""
        norm = self.grad.norm()
        self.grad.mul_(torch.clamp(max_norm / norm, max=1.0))

    def numpy(self) -> np.ndarray:
        """A host copy of the parameters (a copy: the result must not alias live weights)."""
        return self.data.detach().cpu().numpy().copy()


def slice_bounds(numel: int, shards: int, align: int) -> list[tuple[int, int]]:
    """S contiguous [lo, hi) slices of `numel`, boundaries on multiples of `align` (the
    codec chunk, so a slice encodes exactly as its part of the whole vector would)."""
    blocks = -(-numel // align)
    cuts = [min(numel, (blocks * k // shards) * align) for k in range(shards + 1)]
    return [(cuts[k], cuts[k + 1]) for k in range(shards)]
