"""The coordinator's side of the downlink (`workers/wire/sync.py`): the published copy islands
hold, one `Change` per version, and which changes take an island from the version it
holds to the one its work starts from. An island too far behind (or new) gets the full
copy instead; so does every island after a coordinator restart (the engine forgets
what each holds), which is what keeps a restarted run from applying a change twice.
"""

from __future__ import annotations

import torch

from archipelago.workers.wire.compress import encode
from archipelago.workers.wire.fragments import Fragments, positions
from archipelago.workers.wire.sync import Change, apply_change


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

    def step(self, version: int, params: torch.Tensor, fragment: int | None) -> Change:
        """The change to `version` after an outer step of `fragment`; applied to the copy
        with the islands' own `apply_change`, so the copy is what they will hold."""
        where = positions(self.fragments, fragment)
        new = params.detach()[where]
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
        for old in [v for v in self.changes if v <= version - self.keep]:
            del self.changes[old]
        return change

    def route(self, held: int | None, version: int) -> list[Change] | None:
        """The changes from `held` to `version`, or None when the island needs the full copy
        (it holds nothing or a later version, a change is no longer kept, or the changes
        would cost more bytes than the copy)."""
        if held is None or held > version:
            return None
        changes = [self.changes.get(v) for v in range(held + 1, version + 1)]
        if any(c is None for c in changes):
            return None
        found = [c for c in changes if c is not None]
        return found if sum(c.nbytes for c in found) < self.full_nbytes() else None
