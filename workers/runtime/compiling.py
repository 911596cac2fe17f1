"""How an island (and the bare loop it is measured against) compiles its model: whole, or
each of its repeated blocks in place where a loss reaches the body past the model.

A wrapper (`torch.compile(model)`) compiles only calls of the model itself. The Hugging
Face task's training loss does not call it: it runs the model's body (`model.base_model`)
and applies the output layer chunk by chunk (`tasks/chunked_loss.py`), so with a wrapper
that loss ran the whole transformer uncompiled (seen on an H200: GPT-2 small at 7 % MFU).
So a model with a body of its own (transformers' `base_model`) has each repeated block
compiled in place (`nn.Module.compile`, as torchtitan does), compiled however it is
reached; identical blocks share one compiled graph (their parameters are its inputs), so
a 12-layer model compiles one block, not twelve. Every other model is compiled whole: one
graph fused across its blocks, and one guard check a step rather than one a block, which a
small model's launch-bound step feels — the default GPT's bare loop on an H200 took 12.6 ms
a step compiled whole and 23 ms with its blocks compiled in place."""

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


def has_own_body(model: nn.Module) -> bool:
    """Whether `model` has a body a loss may call past it: transformers' `base_model`
    when it is not the model itself (a causal LM's transformer, under its output layer)."""
    body = getattr(model, "base_model", None)
    return isinstance(body, nn.Module) and body is not model


def compiled_forward(model: nn.Module, *, backend: Any = "inductor") -> nn.Module:
    """What the training step calls: a model with a body of its own with each repeated
    block compiled in place (returned itself); any other model, or one without repeated
    blocks, compiled whole (a wrapper)."""
    blocks = repeated_blocks(model) if has_own_body(model) else []
    if not blocks:
        return torch.compile(model, backend=backend)  # type: ignore[return-value]
    for block in blocks:
        block.compile(backend=backend)
    return model
