"""The island-pool seam: how the engine places islands, hands them work and hears back,
without knowing whether they are Ray actors (`runtime/island_pool.py`) or simulated ones
(the `archipelago.orchestrator.bench.simulation` package beside the product: objects in this process, which
tests and benchmarks use to inject faults and run many islands in seconds, or Ray actors on
a virtual clock).

The pool owns the clock too, and what the clock charges (`transfers`): real time under
Ray, where a transfer takes the time it takes and nothing is added; a virtual clock in a
simulation, where compute and priced links advance it and nothing sleeps; so deadlines and
link delays mean the same in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from archipelago.workers.wire.messages import RoundResult, SavedState, WorkOrder
from archipelago.workers.wire.sync import Change

from .links import Transfers


@dataclass(frozen=True, kw_only=True)
class Joined:
    island: int
    node: str
    steps_per_s: float | None = None  # its speed, when known or probed before its first work
    restored: bool | None = None  # placed to continue a saved inner state: whether it could (None: fresh)
    startup: dict[str, float] | None = None  # the island's seconds building its task and model, and probing
    built_sha256: str | None = None  # of the first parameters it built itself (`islands.build_version0`)
    adopted: bool = False  # its process started before this pool asked (`IslandPool.adopt`)


@dataclass(frozen=True, kw_only=True)
class JoinFailed:
    island: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Done:
    ticket: int
    island: int
    result: RoundResult


@dataclass(frozen=True, kw_only=True)
class Failed:
    """The island died or its code raised while doing `ticket` (None: it had no work out
    — a spare or an idle island whose heartbeat found it gone)."""

    ticket: int | None
    island: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Unreachable:
    """The result of `island`'s work `ticket` could not be fetched because the island could
    not be reached (Ray's `ActorUnavailableError`: a partition, a node's link down): the
    work is lost, not the island, which stays and gets new work. Were it dead, its
    heartbeat or its next work says so."""

    ticket: int
    island: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A heartbeat (`elastic.hang_after_steps`): the inner steps `island` has done so far,
    read beside its round."""

    island: int
    steps: int
    work_steps: int | None = None  # of the work it is on (or last finished); None: not known
    ticket: int | None = None  # ... that work's ticket (a count of another work says nothing of this one)
    at: float | None = None  # when the count was taken, on the pool's clock (None: as it is delivered)
    card_bytes: int | None = None  # bytes its node's card had moved then (a transfer is progress); None: unknown


@dataclass(frozen=True, kw_only=True)
class Preempting:
    """A notice: `island` will be taken away in about `notice_s` (its node drained or
    reclaimed); it may still deliver the work it has if that finishes first, or the part of
    it the engine lets it train (`IslandPool.stop`)."""

    island: int
    notice_s: float | None = None


PoolEvent = Joined | JoinFailed | Done | Failed | Unreachable | Progress | Preempting


class IslandPool(Protocol):
    def now(self) -> float: ...
    def sleep_until(self, t: float) -> None: ...
    def transfers(self, numel: int) -> Transfers:
        """What this pool's clock charges for moving a model of `numel` parameters and for
        the coordinator's step (a real clock: nothing, `INSTANT`)."""
        ...

    def request(
        self, island: int, start_step: int, *, state_folder: str | None = None, restore: SavedState | None = None
    ) -> None:
        """Start placing a new island (returns at once; `Joined`/`JoinFailed` follow); it
        writes its inner state to `state_folder` when asked and continues from `restore`."""

    def reattach(self, island: int) -> str | None:
        """After a coordinator restart: the node of a still-live island, or None."""

    def survivors(self) -> list[int]:
        """After a coordinator restart: the islands of this run still alive (or still being
        placed), known to the checkpoint or not."""

    def writes_ending(self, islands: list[int]) -> Callable[[float], object]:
        """A wait, for any thread, of at most its seconds, until the inner-state writes
        `islands` have in progress now have ended (a checkpoint names an island's file only
        once it is on storage: `IslandStates.confirm`). Asked on the engine's thread."""

    def sweep(self, keep: set[int]) -> None:
        """Release, by name, every island of this run not in `keep` (so none holds resources
        unknown to the engine, and none collides with an index the engine hands out)."""

    def cancel(self, island: int) -> None: ...
    def release(self, island: int) -> None: ...
    def demand(self, islands: int) -> None:
        """How many islands the run wants (on an autoscaling cluster: the nodes to have)."""

    def publish(self, version: int, params: Any) -> Any:
        """The global parameters of `version` in the form islands fetch (once per version)."""

    def share(self, change: Change) -> Any:
        """A change of the published copy in the form islands fetch (once, however many take it)."""

    def dispatch(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        """Start `order` from `params` (as `publish` made them) and `changes` (as `share`
        made them), which the island takes as the order's own."""

    def stop(self, island: int, ticket: int, within_s: float | None) -> None:
        """A preemption notice for the work `ticket` on `island`: it takes no step that would
        end more than `within_s` from now (None: none after the one in progress) and sends
        what it has trained, as a result of fewer steps (none: it fails). Returns at once."""

    def refresh(self, order: WorkOrder, params: Any, changes: tuple[Any, ...] = ()) -> None:
        """An idle island (a hot spare) takes `order`'s version — `params` whole or
        `changes` — as it would for work, and trains nothing (returns at once; a spare that
        is gone is found when it is given work)."""

    def poll(self, timeout: float, wake: float | None = None) -> list[PoolEvent]:
        """Events that happened, waiting up to `timeout` seconds for the first one; a
        virtual clock with nothing due before `wake` moves to `wake` and returns none."""

    def hand_over(self, keep: set[int]) -> dict[int, Any]:
        """At the end of a phase (the warm start): the live islands of `keep`, now no longer
        this pool's, for the next phase's pool to `adopt`; the others are released."""

    def adopt(self, islands: dict[int, Any]) -> None:
        """Islands another phase handed over: a `request` for one of their indices renews
        that island in its process (a new island in every respect but its process, its
        imports and its task's caches) instead of placing a new one; `close` releases
        those never requested."""

    def close(self) -> None: ...
