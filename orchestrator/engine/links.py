"""What moving bytes and the coordinator's own work cost on the run's clock: a seam.

On a cluster a transfer takes the time it takes — an island waits for its download, a
result is in the coordinator's hands when it arrives, the outer step ends when it ends — so
the engine charges nothing for them (`INSTANT`, every real pool's). A simulated fleet runs
on a virtual clock on which nothing takes time unless it is priced: its pool hands the
engine a `Transfers` that prices the links, the head's network card and the coordinator's
step (`IslandPool.transfers`; the pool owns the clock, and these are its costs), and the
engine reads the prices here only: where a result counts as delivered (the pacings order
arrivals by it), what fits in a preemption's notice, and when a new version is ready.
"""

from __future__ import annotations

from typing import Protocol


class Transfers(Protocol):
    def download(self, island: int, nbytes: int, *, bootstrap: bool, ready: float) -> float:
        """When `island` has the `nbytes` of parameters (or their changes) it is sent of a
        version ready at `ready` (`bootstrap`: its first full copy), on the run's clock."""

    def upload_s(
        self, island: int, nbytes: int, *, islands: list[int], sent: float, compute_s: float, book: bool = True
    ) -> float:
        """Seconds from `sent` until `island`'s result of `nbytes` is in the coordinator's
        hands (`islands`: those training beside it; `compute_s`: the work's compute, which a
        collective may overlap). `book`: the transfer happens (False: a quote only)."""

    def stepped(self, *, at: float, merged: int, values: int) -> float:
        """When the version the coordinator steps at `at` from `merged` updates of `values`
        parameters each is ready for the islands."""


class Instant:
    """Every transfer and step as the real clock has it: nothing is added."""

    def download(self, island: int, nbytes: int, *, bootstrap: bool, ready: float) -> float:
        return ready

    def upload_s(
        self, island: int, nbytes: int, *, islands: list[int], sent: float, compute_s: float, book: bool = True
    ) -> float:
        return 0.0

    def stepped(self, *, at: float, merged: int, values: int) -> float:
        return at


INSTANT = Instant()
