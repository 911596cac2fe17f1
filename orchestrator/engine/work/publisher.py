"""Publishing the global parameters and working out what each island downloads.

Each version is put in the pool once (`ray.put` under Ray); under a one-round lag the one
before is kept, as a round starts from it. What an island receives for its work is the
full parameters of its version, or — in modes that track a published copy (a lossy or
fragmented downlink) — only the changes since the version it holds. The bytes either way
cross its link, so its work starts that much later (on a simulated clock, when the pool's
prices say it arrives: `Transfers.download`).

Where islands follow the copy through changes, the full copy is put only when an island
needs it (a joiner, a replacement, one whose changes are no longer kept), not every
version: under Streaming DiLoCo a version comes every H/P steps, and putting the whole
model each time cost the coordinator a copy of every byte per fragment step for nothing.
Only a pacing with a lag (`overlap`'s one round) can start work from a version before
the newest, so there the copy is still put every version. Each change is shared once too (`share`:
one `ray.put`), and every island's order names it rather than carrying a pickled copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from archipelago.workers.wire.fragments import Fragments
from archipelago.workers.wire.handoff import params_digest

from ...config import RunConfig
from ..links import Transfers
from ..pool import IslandPool
from ..state.flights import Work
from ..step.downlink import Downlink, SlicedDownlink
from ..step.outer import Outer


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """What an island receives for its work."""

    params: Any  # the published parameters of its version, or None when changes suffice
    params_digest: str | None  # of `params` as published (None: changes, or remote slices)
    changes: tuple[Any, ...]  # the changes since the version it holds, as the pool shared them
    nbytes: int  # on its link
    bootstrap: bool  # its first full download (not one of the run's exchanges)
    delay_s: float  # until it has them, on the run's clock
    built: bool = False  # none: the island starts from the version 0 it built


class Publisher:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        pool: IslandPool,
        outer: Outer,
        flat: torch.Tensor,
        fragments: Fragments | None,
        lag: int,
    ) -> None:
        """`lag`: how many versions behind the newest the pacing may start work (its `lag`)."""
        self.cfg, self.pool, self.outer, self.flat = cfg, pool, outer, flat
        self.links: Transfers = pool.transfers(outer.numel)  # what the pool's clock charges (real pools: nothing)
        self.refs: dict[int, Any] = {}  # version -> published parameters
        self.published_at: dict[int, float] = {}
        self.digests: dict[int, str | None] = {}  # version -> digest of what was published (hand-offs)
        self.held: dict[int, int] = {}  # island -> version it holds (downloaded)
        self.version0: str | None = None  # digest of version 0 when islands can build it (`islands.build_version0`)
        self.built: set[int] = set()  # islands that hold the version 0 they built
        self.unput: int | None = None  # the version the copy holds, not put yet (put when an island needs it)
        # version -> its change as the pool shared it (once, for every island): one, or a part a slice
        self.shared: dict[int, list[Any]] = {}
        self.lag = lag  # work may start from versions this far back: those are put and kept
        # changes kept: two turns of the fragments and four more (a whole model counts as four)
        turn = fragments.count if fragments is not None else 4
        self.downlink: Downlink | SlicedDownlink | None = (
            outer.downlink(cfg.compression.downlink, cfg.compression.chunk, keep=2 * turn + 4)
            if cfg.tracks_copy
            else None
        )

    def publish(self, version: int, at: float | None = None, *, merged: int = 0, values: int = 0) -> None:
        """Publish `version` once (islands fetch it from there); keep the `lag` before it
        and let older ones go at once (work already out holds its own reference), so the
        object store can reuse their pages. `at`: when its step could begin on the run's
        clock, if earlier than now (streaming: its pseudo-gradients left τ steps before
        their islands' work ended, so the step was due before the results came back); the
        step itself, over `merged` updates of `values` parameters, takes what the pool's
        clock charges for it (`Transfers.stepped`: nothing on a real one, where it took its
        own time before this call)."""
        if self.downlink is not None and not self.lag:
            self.unput = version
        else:
            self._put(version)
        now = self.pool.now()
        begun = now if at is None else min(at, now)
        if version not in self.published_at:
            self.published_at[version] = self.links.stepped(at=begun, merged=merged, values=values)
        for old in [old for old in self.refs if old < version - self.lag]:
            del self.refs[old]
            self.digests.pop(old, None)
        # work starts from a version at most this far back (the lag's t − 2, or a change
        # routed from what the downlink keeps): older publication times are never read again
        horizon = version - (self.downlink.keep if self.downlink is not None else 2)
        for old in [old for old in self.published_at if old < horizon]:
            del self.published_at[old]

    def _put(self, version: int) -> None:
        """Put `version` in the pool with its digest: the copy islands hold (or the outer
        parameters, where islands take the full parameters every version)."""
        params = self.downlink.published() if self.downlink is not None else self.outer.params()
        self.refs[version] = self.pool.publish(version, params)
        self.digests[version] = params_digest(params)
        if self.unput == version:
            self.unput = None

    def exact(self, version: int) -> Any | None:
        """`version` as published, when that is exactly the outer parameters (no tracked
        copy, which differs from them, and one coordinator, whose parameters are one
        object): what an evaluation reads where it already is instead of another copy."""
        if self.downlink is not None or isinstance(self.refs.get(version), list):
            return None
        return self.refs.get(version)

    def stepped(self, version: int, fragment: int | None) -> None:
        """The outer step made `version`: the published copy takes its change (the version
        it held, never put, is never needed again: work starts from the newest)."""
        if self.downlink is not None:
            self.unput = None
            self.shared[version] = self.downlink.advance(version, self.outer, fragment, self.pool)
            for old in [v for v in self.shared if v not in self.downlink.changes]:
                del self.shared[old]

    def restored(self) -> None:
        """The parameters were loaded from a checkpoint: the published copy is them."""
        if self.downlink is not None:
            self.downlink.reset(self.flat)
            self.shared.clear()

    def joined(self, island: int, built_sha256: str | None) -> bool | None:
        """An island that built version 0 itself holds it if it hashes to the coordinator's
        (True); if it differs (False) it downloads it as any island does; None: no check."""
        if self.version0 is None or built_sha256 is None:
            return None
        if built_sha256 != self.version0:
            return False
        self.held[island] = 0
        self.built.add(island)
        return True

    def deliver(self, work: Work) -> Delivery:
        """What `work.island` receives for `work`; it then holds `work.version`."""
        if work.island in self.built:
            if work.version == 0:
                return Delivery(
                    params=None, params_digest=None, changes=(), nbytes=0, bootstrap=False, delay_s=0.0, built=True
                )
            self.built.discard(work.island)  # past version 0: changes from it, or the new version
        held = self.held.get(work.island)
        self.held[work.island] = work.version
        params: Any = None
        changes: list[Any] = []
        if self.downlink is None:  # the full parameters of each new version
            params, bootstrap = self.refs[work.version], held is None
            nbytes = 0 if held == work.version else self.outer.numel * self.flat.element_size()
        elif (routed := self.downlink.route(held, work.version)) is None:
            if self.unput == work.version:
                self._put(work.version)
            params, bootstrap = self.refs[work.version], held is None
            nbytes = self.downlink.full_nbytes()
        else:
            changes, bootstrap = routed, False
            nbytes = sum(c.nbytes for c in changes)
        delay = 0.0
        if nbytes:  # a new global (or its changes) to download over its link
            now = self.pool.now()
            ready = self.published_at.get(work.version, now)
            delay = max(0.0, self.links.download(work.island, nbytes, bootstrap=bootstrap, ready=ready) - now)
        digest = self.digests.get(work.version) if params is not None else None
        return Delivery(
            params=params,
            params_digest=digest,
            changes=tuple(part for c in changes for part in self.shared[c.version]),
            nbytes=nbytes,
            bootstrap=bootstrap,
            delay_s=delay,
        )

    def forget(self, island: int) -> None:
        """A released island holds nothing any more."""
        self.held.pop(island, None)
        self.built.discard(island)
