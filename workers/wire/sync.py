"""The downlink: how an island's copy of the global parameters follows the coordinator's
without the full model crossing the link every round.

The coordinator keeps a *published copy*: what islands hold. After each outer step it
sends the change of that copy (the whole vector, or one fragment under Streaming
DiLoCo) as a `Change`, and applies to its own copy exactly what islands apply with
`apply_change`, so the two never drift. Under a lossy codec the change is the encoded
difference between the outer parameters and the published copy, so what one change
rounds away is sent with the next (error feedback for free); lossless changes carry the
new values themselves, so a copy is bit-identical to the outer parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compress import decode
from .flat import as_tensor
from .spec import Payload, payload_nbytes


@dataclass(frozen=True, kw_only=True)
class Change:
    """Version `version` of the published copy, from version − 1."""

    version: int
    fragment: int | None  # None: the whole vector
    payload: Payload
    absolute: bool  # the payload holds the new values, not a difference
    # a coordinator slice's part [lo, hi) of the vector: each slice sends its part's change,
    # and a version is all of them (None: the whole vector, or a fragment)
    span: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return payload_nbytes(self.payload)


class ChangeOutOfOrder(RuntimeError):
    """A change that does not continue the version a copy holds: applying it could apply an
    update twice or skip one, so the island refuses the work (the engine releases it like
    any island whose code raised, and its replacement starts from the full copy)."""


def apply_change(copy: torch.Tensor, change: Change, positions: torch.Tensor | slice) -> None:
    """Apply `change` to `copy` (a flat tensor) at `positions` (its fragment's, on its device)."""
    values = as_tensor(decode(change.payload)).to(copy.device, copy.dtype)
    if change.absolute:
        copy[positions] = values
    else:
        copy[positions] += values


def whole_version(parts: list[Change], numel: int) -> list[Change]:
    """One version's change: a whole one, or every coordinator slice's part of it, which
    together must cover the vector once (a part missing would leave a stretch of the copy
    a version behind, silently)."""
    spans = sorted(c.span for c in parts if c.span is not None)
    if not spans:
        if len(parts) != 1:
            raise ChangeOutOfOrder(f"{len(parts)} changes to version {parts[0].version}")
        return parts
    covered = [lo for lo, _ in spans] == [0, *(hi for _, hi in spans[:-1])] and spans[-1][1] == numel
    if len(spans) != len(parts) or not covered:
        raise ChangeOutOfOrder(f"the slices' parts of version {parts[0].version} cover {spans} of {numel} values")
    return parts
