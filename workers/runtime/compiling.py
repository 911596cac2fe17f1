"""How an island (and the bare loop it is measured against) compiles its model: each of the
model's repeated blocks compiled in place, as torchtitan does, rather than one wrapper
around the whole model.

A wrapper (`torch.compile(model)`) compiles only calls of the model itself. The Hugging
Face task's training loss does not call it: it runs the model's body (`model.base_model`)
and applies the output layer chunk by chunk (`tasks/chunked_loss.py`), so with a wrapper
that loss ran the whole transformer uncompiled — the compiled path a GPU run expects was
never taken (seen on an H200: GPT-2 small at 7 % MFU). A block compiled in place
(`nn.Module.compile`) is compiled however it is reached. Identical blocks share one
compiled graph (their parameters are its inputs), so a 12-layer model compiles one block,
not twelve. A model without repeated blocks is compiled whole."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the elements of its largest `nn.ModuleList` (by
    parameters) whose elements, two or more, are all of one class; [] if it has none."""
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        blocks = list(module)
        if len({type(b) for b in blocks}) != 1:
            continue
        size = sum(p.numel() for b in blocks for p in b.parameters())
        if size > best_size:
            best, best_size = blocks, size
    return best


def compiled_forward(model: nn.Module, *, backend: Any = "inductor") -> nn.Module:
    """What the training step calls: `model` with each repeated block compiled in place
    (returned itself), or, without such blocks, `model` compiled whole (a wrapper)."""
    blocks = repeated_blocks(model)
    if not blocks:
        return torch.compile(model, backend=backend)  # type: ignore[return-value]
    for block in blocks:
        block.compile(backend=backend)
    return model
