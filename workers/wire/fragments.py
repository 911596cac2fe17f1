"""Streaming DiLoCo's fragments: P disjoint sets of positions in the flat parameter vector
that are synchronised on a staggered schedule (one every H/P inner steps, each every H).

Fragments follow the model's layers, strided over its blocks (fragment p holds blocks
p, p + P, p + 2P, ...) as the paper recommends: every fragment then spans the depth of
the network, and no fragment is only the embedding. Blocks are the children of the
model's largest `nn.ModuleList` (`blocks` of our GPT, `model.layers` of a Hugging Face
causal LM); a task that groups its modules otherwise says so with `FragmentedTask`.
The values outside the blocks (embeddings, final norm, head) are poured, in order, into
the fragments with fewest values, split at any position (a fragment is a set of
positions, not of whole tensors): fragments end up equal in bytes as nearly as the
blocks allow, and the peak bytes of an exchange are 1/P of the model's.

The island and the coordinator compute the same fragments from the same model, so only
indices agree, never bytes cross for them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn


@runtime_checkable
class FragmentedTask(Protocol):
    """A task whose model is grouped otherwise than by its largest `nn.ModuleList`."""

    def layer_groups(self, model: nn.Module) -> list[list[str]]:
        """Parameter names per layer group, in forward order (strided over P fragments)."""
        ...


class Fragments:
    """P sorted index arrays into the flat vector; together they cover it exactly once."""

    def __init__(self, index: list[np.ndarray], numel: int) -> None:
        covered = np.concatenate(index) if index else np.empty(0, np.int64)
        if covered.size != numel or np.unique(covered).size != numel:
            raise ValueError("fragments must cover every parameter exactly once")
        self.index, self.numel = index, numel
        self._torch: dict[torch.device, list[torch.Tensor]] = {}  # the index as tensors, once per device

    @property
    def count(self) -> int:
        return len(self.index)

    def size(self, fragment: int) -> int:
        return int(self.index[fragment].size)

    def positions(self, fragment: int | None, device: torch.device | str = "cpu") -> torch.Tensor | slice:
        """Where `fragment` lies in the flat vector (None: all of it), as an index tensor on
        `device`, built there once: every merge, Δ and outer step of a fragment indexes
        with it, so none converts or copies the index again."""
        if fragment is None:
            return slice(None)
        device = torch.device(device)
        if device not in self._torch:
            self._torch[device] = [torch.from_numpy(ix).to(device) for ix in self.index]
        return self._torch[device][fragment]


def positions(
    fragments: Fragments | None, fragment: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor | slice:
    """`fragments.positions(...)`, or the whole vector when there are no fragments."""
    return slice(None) if fragments is None else fragments.positions(fragment, device)


def _ranges(model: nn.Module) -> dict[str, tuple[int, int]]:
    """[lo, hi) of each trainable parameter in the flat vector (`FlatParams` order)."""
    out, offset = {}, 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = (offset, offset + p.numel())
            offset += p.numel()
    return out


def default_groups(model: nn.Module) -> list[list[str]]:
    """The children of the model's largest `nn.ModuleList`, as parameter-name groups."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda nm: len(nm[1]))
    prefix = f"{name}." if name else ""
    return [
        [f"{prefix}{i}.{n}" for n, p in block.named_parameters() if p.requires_grad] for i, block in enumerate(blocks)
    ]


def fragment_model(model: nn.Module, fragments: int, groups: list[list[str]] | None = None) -> Fragments:
    """P fragments of `model`'s flat parameters: layer groups strided, the rest poured."""
    ranges = _ranges(model)
    numel = max((hi for _, hi in ranges.values()), default=0)
    groups = default_groups(model) if groups is None else groups
    parts: list[list[np.ndarray]] = [[] for _ in range(fragments)]
    grouped: set[str] = set()
    for g, names in enumerate(groups):
        for n in names:
            if n not in ranges:
                raise ValueError(f"layer group {g} names {n!r}, which is not a trainable parameter of the model")
            parts[g % fragments].append(np.arange(*ranges[n], dtype=np.int64))
            grouped.add(n)
    rest = [np.arange(lo, hi, dtype=np.int64) for n, (lo, hi) in ranges.items() if n not in grouped]
    sizes = [sum(a.size for a in part) for part in parts]
    for part, piece in zip(parts, _pour(np.concatenate(rest) if rest else np.empty(0, np.int64), sizes)):
        part.append(piece)
    index = [np.sort(np.concatenate(part)) for part in parts]
    if not all(ix.size for ix in index):
        raise ValueError(
            f"mode.fragments = {fragments}, but the model's {numel} parameters fill only "
            f"{sum(bool(ix.size) for ix in index)} fragments: use fewer fragments"
        )
    return Fragments(index, numel)


def _pour(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Split `values` into consecutive pieces, one per fragment, raising the smallest
    fragments to a common level (water filling)."""
    n, lo, hi = values.size, min(sizes), max(sizes) + values.size
    while lo < hi:  # the lowest level that holds every value
        mid = (lo + hi) // 2
        if sum(max(0, mid - s) for s in sizes) >= n:
            hi = mid
        else:
            lo = mid + 1
    pieces, at = [], 0
    for s in sizes:
        take = min(max(0, lo - s), n - at)
        pieces.append(values[at : at + take])
        at += take
    return pieces
