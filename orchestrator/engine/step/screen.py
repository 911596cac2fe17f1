"""Screening a result before anything decodes or trusts it. A result crosses from another
process, often another node: its payload may be of an unknown codec, `None`, an integer
array whose squared norm overflows to 0, a 2-D slice, and its numbers may be infinite.
Each is refused here with a reason (and counts towards quarantine) instead of raising in
the coordinator, which would end the run. Slices that stay in the object store (a sliced
coordinator under Ray) are checked by the slice that decodes them (`OuterSlice.inspect`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from archipelago.workers.wire.compress import PayloadError, check_payload
from archipelago.workers.wire.fragments import Fragments
from archipelago.workers.wire.messages import RoundResult, Sliced

from ..state.flights import Work


@dataclass(frozen=True)
class Sizes:
    """How many values a pseudo-gradient holds: the whole vector, one fragment's, or one
    coordinator slice's."""

    numel: int
    fragments: Fragments | None = None
    slices: tuple[tuple[int, int], ...] | None = None

    def of(self, fragment: int | None) -> int:
        return self.numel if fragment is None or self.fragments is None else self.fragments.size(fragment)


def screen(result: RoundResult, work: Work, sizes: Sizes) -> str | None:
    """Why `result` (of `work`) cannot be used, or None if it can."""
    if result.fragment != work.fragment:
        return f"it is the pseudo-gradient of fragment {result.fragment}, its work was for {work.fragment}"
    if not isinstance(result.steps, int) or result.steps < 1:
        return f"it reports {result.steps!r} inner steps"
    for name in ("compute_s", "tail_s"):
        value = getattr(result, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"its {name} is {value!r}"
    try:
        if sizes.slices is None:
            check_payload(result.payload, sizes.of(work.fragment))
            return None
        sliced = result.payload
        if not isinstance(sliced, Sliced) or len(sliced) != len(sizes.slices):
            return f"a sliced coordinator takes {len(sizes.slices)} slices, not a {type(sliced).__name__}"
        for (lo, hi), part in zip(sizes.slices, sliced.parts):
            if isinstance(part, dict) or part is None:  # in this process; references are the slices' to check
                check_payload(part, hi - lo)
    except PayloadError as err:
        return str(err)
    return None
