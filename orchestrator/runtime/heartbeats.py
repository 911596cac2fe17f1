"""Islands' heartbeats on Ray, asked and heard on a thread of the coordinator's own, so that
liveness never depends on the engine's thread.

The engine's thread blocks for long stretches on purpose: an evaluation on the coordinator,
a checkpoint written, the wait for evaluations before it. Asked only from the engine's
`poll`, heartbeats stopped with it, and once it was free every island's last count was
older than the silence rule allows: a 70-s checkpoint declared every working island hung
and replaced it. Here a thread asks every `elastic.progress_every_s` each placed island —
working or a hot spare — for its step count (answered in the island's `control` group,
beside its round) and queues what it hears; the engine's thread reads the queue when it
polls, the counts stamped with when they were asked.

Silence is counted on a `ListeningClock`: monotonic (a wall-clock step moves nothing), and
stopped while this thread could not run — the coordinator's process suspended, its node
starved — so no island is ever found silent across a span in which the coordinator itself
was not listening. A truly stopped island (SIGSTOP, a frozen node) answers nothing while
the thread goes on asking, and its silence grows as before.

A probe that finds an island's actor gone is queued too: for an island without work out (a
spare, an idle island) it is the only way its death is found before it is given work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from ..engine.pool import Progress

log = logging.getLogger(__name__)


class ListeningClock:
    """Monotonic seconds that stand still while the listening thread could not run: each
    `tick` of the thread later than `allow_s` after the one before adds the excess to the
    time not heard (`deaf_s`), and a tick overdue right now already counts (the engine may
    read the clock before the thread, back from the same stall, has ticked)."""

    def __init__(self, allow_s: float, source: Callable[[], float] = time.monotonic) -> None:
        self.allow_s, self.source = allow_s, source
        self.deaf_s = 0.0
        self._tick = source()
        self._lock = threading.Lock()

    def tick(self) -> float:
        """The listening thread runs: returns the seconds just found not heard (0 if none)."""
        with self._lock:
            t = self.source()
            late = max(0.0, t - self._tick - self.allow_s)
            self.deaf_s += late
            self._tick = t
        return late

    def now(self) -> float:
        with self._lock:
            t = self.source()
            return t - self.deaf_s - max(0.0, t - self._tick - self.allow_s)


@dataclass(frozen=True, kw_only=True)
class Gone:
    """A probe found `island`'s actor dead."""

    island: int
    reason: str


class Heartbeats:
    """The listening thread: `watch` an island once it is placed, `forget` it when it is
    released, `take` what was heard since the last call (`Progress` and `Gone`, in order)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        # a tick is due every `every_s`; one later than a second (or a period) more than that
        # was not the thread's own work (a few remote calls) but the process not running
        self.clock = ListeningClock(every_s + max(1.0, every_s))
        self._watched: dict[int, Any] = {}  # island -> its actor
        self._probes: dict[Any, tuple[int, Any, float]] = {}  # ref -> (island, actor asked, asked at)
        self._heard: list[Progress | Gone] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="archipelago-heartbeats")
        self._thread.start()

    def watch(self, island: int, actor: Any) -> None:
        with self._lock:
            self._watched[island] = actor

    def forget(self, island: int) -> None:
        with self._lock:
            self._watched.pop(island, None)

    def take(self) -> list[Progress | Gone]:
        with self._lock:
            heard, self._heard = self._heard, []
        return heard

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            late = self.clock.tick()
            if late:
                log.warning(
                    "the coordinator did not listen to its islands for %.1f s: that time is no island's silence", late
                )
            try:
                self._hear()
                self._ask()
            except Exception:  # the thread must outlive any one round of calls (Ray shutting down, say)
                log.exception("heartbeats: a round of probes failed; asking again in %.1f s", self.every_s)

    def _hear(self) -> None:
        if not self._probes:
            return
        ready, _ = ray.wait(list(self._probes), num_returns=len(self._probes), timeout=0)
        heard: list[Progress | Gone] = []
        for ref in ready:
            island, _, asked_at = self._probes.pop(ref)
            try:
                info = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                continue  # not reached (a partition): silence, which the hang rule judges, not a death
            except ray.exceptions.RayActorError as err:
                heard.append(Gone(island=island, reason=f"actor died: {type(err).__name__} (found by its heartbeat)"))
                continue
            except ray.exceptions.RayError:
                continue
            work, ticket, card = info.get("work_steps_done"), info.get("work_ticket"), info.get("card_bytes")
            heard.append(
                Progress(
                    island=island,
                    steps=int(info["inner_steps_done"]),
                    work_steps=None if work is None else int(work),
                    ticket=None if ticket is None else int(ticket),
                    at=asked_at,  # its count is no older than the question
                    card_bytes=None if card is None else int(card),
                )
            )
        with self._lock:  # what was heard of an island since forgotten (released) is not its news
            self._heard += [h for h in heard if h.island in self._watched]

    def _ask(self) -> None:
        with self._lock:
            watched = dict(self._watched)
        asked = {(island, id(actor)) for island, actor, _ in self._probes.values()}
        for island, actor in watched.items():
            if (island, id(actor)) not in asked:  # one question at a time: a frozen island's stays open
                self._probes[actor.identity.remote()] = (island, actor, self.clock.now())
        for ref, (island, actor, _) in list(self._probes.items()):
            if watched.get(island) is not actor:  # released, or renewed in another actor
                del self._probes[ref]
