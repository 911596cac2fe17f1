"""The coordinator's side of the downlink (`workers/wire/sync.py`): the published copy islands
hold, one change per version, and which changes take an island from the version it holds
to the one its work starts from. An island too far behind (or new) gets the full copy
instead; so does every island after a coordinator restart (the engine forgets what each
holds), which is what keeps a restarted run from applying a change twice.

Two keepers of the copy: `Downlink`, one coordinator's, which encodes each change itself;
and `SlicedDownlink`, where every coordinator slice keeps its part of the copy and encodes
its part's change on its own node (`OuterSlice.change`), so neither the new parameters nor
the changes ever cross the head's card: the coordinator keeps only which versions' parts
exist and their size. Slices are cut on the codec's chunks, so S parts encode exactly what
one coordinator would (the same scales, the same rounding), and an island's copy is the
same bit for bit either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from archipelago.workers.wire.compress import encode
from archipelago.workers.wire.flat import as_tensor
from archipelago.workers.wire.fragments import Fragments, positions
from archipelago.workers.wire.sync import Change, apply_change


class HasParams(Protocol):
    """What the copy follows: the outer step's parameters (one coordinator's, or a slice's part)."""

    def params(self) -> Any: ...


class Shares(Protocol):
    """The island pool's `share` (`engine/pool.py`): a change put once for every island."""

    def share(self, change: Change) -> Any: ...


def _keep_last(changes: dict[int, Any], version: int, keep: int) -> None:
    """Forget the changes `keep` or more versions before `version`."""
    for old in [v for v in changes if v <= version - keep]:
        del changes[old]


def _route(changes: dict[int, Any], held: int | None, version: int, full_nbytes: int) -> list[Any] | None:
    """The changes from `held` to `version`, or None when the island needs the full copy
    (it holds nothing or a later version, a change is no longer kept, or the changes
    would cost more bytes than the copy)."""
    if held is None or held > version:
        return None
    wanted = [changes[v] for v in range(held + 1, version + 1) if v in changes]
    if len(wanted) < version - held:
        return None
    return wanted if sum(c.nbytes for c in wanted) < full_nbytes else None


class Downlink:
    def __init__(self, params: torch.Tensor, codec: str, chunk: int, fragments: Fragments | None, keep: int) -> None:
        """`params`: the outer parameters at the start; `keep`: versions of changes kept."""
        self.codec, self.chunk, self.fragments, self.keep = codec, chunk, fragments, keep
        self.copy = params.detach().clone()
        self.changes: dict[int, Change] = {}

    def reset(self, params: torch.Tensor) -> None:
        """After a restart: the copy is the outer parameters, and islands get it whole."""
        self.copy = params.detach().clone()
        self.changes.clear()

    def full_nbytes(self) -> int:
        return self.copy.numel() * self.copy.element_size()

    def published(self) -> Any:
        """The copy as the pool publishes it whole."""
        return self.copy.numpy()

    def step(self, version: int, outer: HasParams, fragment: int | None) -> Change:
        """The change to `version` after `outer`'s step of `fragment`; applied to the copy
        with the islands' own `apply_change`, so the copy is what they will hold."""
        where = positions(self.fragments, fragment)
        new = as_tensor(outer.params()).detach()[where]
        if self.codec == "none":
            change = Change(
                version=version, fragment=fragment, payload=encode(new.numpy().copy(), "none"), absolute=True
            )
        else:
            diff = (new - self.copy[where]).numpy()
            change = Change(
                version=version, fragment=fragment, payload=encode(diff, self.codec, self.chunk), absolute=False
            )
        apply_change(self.copy, change, where)
        self.changes[version] = change
        _keep_last(self.changes, version, self.keep)
        return change

    def advance(self, version: int, outer: HasParams, fragment: int | None, pool: Shares) -> list[Any]:
        """`step`, and the change as islands fetch it: shared once by the pool."""
        return [pool.share(self.step(version, outer, fragment))]

    def route(self, held: int | None, version: int) -> list[Change] | None:
        return _route(self.changes, held, version, self.full_nbytes())


@dataclass(frozen=True)
class PartedChange:
    """One version's change as the coordinator slices made it: each slice's part (a
    reference an island fetches from that slice's node, under Ray) and their bytes."""

    version: int
    parts: list[Any]
    nbytes: int


class CopyParts(Protocol):
    """What `SlicedDownlink` asks of the slices (`SlicedOuter`)."""

    def copy_nbytes(self) -> int: ...

    def change_parts(self, version: int) -> tuple[list[Any], int]: ...

    def copy_parts(self) -> list[Any]: ...

    def reset_copies(self) -> None: ...


class SlicedDownlink:
    """The published copy kept by the coordinator slices, each its part: a version's
    change is their parts, shared as they are (each already in its slice's object store)."""

    def __init__(self, slices: CopyParts, keep: int) -> None:
        self.slices, self.keep = slices, keep
        self.changes: dict[int, PartedChange] = {}

    def reset(self, params: torch.Tensor) -> None:
        """After a restart: every slice's copy is its parameters (loaded from the checkpoint)."""
        self.slices.reset_copies()
        self.changes.clear()

    def full_nbytes(self) -> int:
        return self.slices.copy_nbytes()

    def published(self) -> Sequence[Any]:
        return self.slices.copy_parts()

    def step(self, version: int, outer: HasParams, fragment: int | None) -> PartedChange:
        """The slices' change to `version` (they hold their parameters; no fragments here)."""
        parts, nbytes = self.slices.change_parts(version)
        change = PartedChange(version=version, parts=parts, nbytes=nbytes)
        self.changes[version] = change
        _keep_last(self.changes, version, self.keep)
        return change

    def advance(self, version: int, outer: HasParams, fragment: int | None, pool: Shares) -> list[Any]:
        """`step`, and the change as islands fetch it: its parts, where the slices put them."""
        return list(self.step(version, outer, fragment).parts)

    def route(self, held: int | None, version: int) -> list[PartedChange] | None:
        return _route(self.changes, held, version, self.full_nbytes())
