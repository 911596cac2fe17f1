"""The work in flight: handing it out (its batches reserved in the data ledger, its
parameters or their changes delivered over its link), taking its result back (screened,
checked against what it was given, timed on the coordinator's clock), and giving it up
— lost, refused or past its deadline — with its batches returned to the ledger, so each
batch is trained exactly once whatever happens to the island that read it."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator

from archipelago.workers.wire.handoff import seal
from archipelago.workers.wire.messages import RoundResult, WorkKind, WorkOrder

from ...algorithms.dylu import SpeedTracker
from ...config import RunConfig
from ..fleet.island_states import IslandStates, save_due
from ..outcomes import Judged, Lost, Outcome, StopWork
from ..pacing.base import Pacing
from ..pool import IslandPool, Progress
from ..state.flights import Flight, RunState, Work
from ..state.ledger import DataLedger
from ..state.membership import Membership
from ..state.records import EventLog
from ..state.stats import RunStats
from ..step.screen import Sizes, screen
from ..types import Contribution, Decision, Event, IslandState, Merge, Reason, Verdict
from .publisher import Publisher
from .stragglers import HangRule, TailStop

POLL_S = 0.2  # the longest the engine waits on the pool: a stop-now is seen within it


class InFlight:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        pool: IslandPool,
        ledger: DataLedger,
        pacing: Pacing,
        run: RunState,
        members: Membership,
        stats: RunStats,
        publisher: Publisher,
        states: IslandStates,
        speeds: SpeedTracker,
        events: EventLog,
        sizes: Sizes,
        hangs: HangRule,
        tail_stop: TailStop | None,
    ) -> None:
        """The run's parts it reads and changes: its ledger, pacing, membership and state, the
        islands' inner states a checkpoint names; the rules that find hung islands and
        stragglers (`stragglers.py`, built by the composition root). What needs the fleet (a refused result's
        verdict, a hung island) is returned as outcomes (`outcomes.py`)."""
        self.cfg, self.pool, self.ledger, self.pacing, self.run = cfg, pool, ledger, pacing, run
        self.members, self.stats, self.speeds, self.publisher = members, stats, speeds, publisher
        self.events, self.sizes, self.states = events, sizes, states
        self.hangs, self.tail_stop = hangs, tail_stop
        self.flights: dict[int, Flight] = {}  # handed out; arrived results wait here until their step closes
        self.overdue: dict[int, tuple[int, float]] = {}  # ticket -> (island, deadline), abandoned past it
        self.reported: dict[int, int] = {}  # heartbeats: each island's inner steps in all, as last reported
        self.cards: dict[int, tuple[float, int]] = {}  # heartbeats: each island's card bytes, (when, bytes)
        self.uplink: dict[int, int] = {}  # each island's last result's bytes (what a stopped work will send)
        self.trip_s: dict[int, float] = {}  # each island's last work's time off its steps (download, upload, waits)
        self.behind: set[int] = set()  # islands stopped as stragglers at the budget's end: they train no more of it
        self.tickets = itertools.count()

    def in_flight(self) -> list[Flight]:
        """Work handed out whose result has not come back."""
        return [f for f in self.flights.values() if f.result is None]

    def busy(self) -> set[int]:
        return {f.work.island for f in self.in_flight()}

    def free(self, schedulable: list[int]) -> list[int]:
        """The `schedulable` islands training nothing that may be given work: not those
        stopped as stragglers at the budget's end (`behind`) while another island can train
        — once none can (the islands meant to train their rest died, none could be placed),
        they train it, or the run would wait for good on islands the fleet counts as able to
        train. One whose result waits for its step is free: the pacing hands it work once
        that step is taken."""
        out = self.busy()
        if any(i not in self.behind for i in schedulable):
            out |= self.behind
        return [i for i in schedulable if i not in out]

    def held(self) -> set[int]:
        """Islands with work out, arrived and waiting for its step, or overdue."""
        return {f.work.island for f in self.flights.values()} | {i for i, _ in self.overdue.values()}

    def refresh(self, spares: list[int], version: int) -> None:
        """Hot spares kept current where islands follow a published copy through changes
        (a compressed or streaming downlink): each takes the changes to `version` (the whole
        copy the first time), counted in its bytes, so a promoted spare's first work
        downloads only what came since. Where every work downloads its version whole, a
        spare refreshed would download each version for nothing: it is not."""
        if not self.cfg.tracks_copy:
            return
        for island in spares:
            delivery = self.publisher.deliver(Work(island=island, round=0, version=version, steps=0))
            if delivery.built:
                continue
            self.stats.download(self.members.islands[island], delivery.nbytes, delivery.bootstrap)
            order = WorkOrder(island=island, ticket=-1, version=version, kind=WorkKind.TRAIN, steps=0, shards={})
            if delivery.params_digest is not None:
                order = seal(order, delivery.params_digest)
            self.pool.refresh(order, delivery.params, delivery.changes)

    def hand_out(self, work: Work) -> None:
        ticket = next(self.tickets)
        reservation = self.ledger.reserve(ticket, work.island, self.members.schedulable(), work.steps)
        if reservation is None:
            self.pacing.cancel(work)  # no free shard: it idles
            return
        stats = self.members.islands[work.island]
        delivery = self.publisher.deliver(work)
        if delivery.nbytes:
            self.stats.download(stats, delivery.nbytes, delivery.bootstrap)
        order = WorkOrder(
            island=work.island,
            ticket=ticket,
            version=work.version,
            kind=work.kind,
            steps=work.steps,
            shards=reservation.starts,
            streams=self.ledger.resume_points(reservation.starts),
            turn=reservation.turn,
            schedule_step=work.schedule_step,
            fragment=work.fragment,
            eager=work.eager,
            send_after=work.send_after,
            built=delivery.built,
            save_state=self.states.folder is not None
            and save_due(self.cfg, work.kind, self.stats.rounds_done, len(self.members.schedulable())),
        )
        if delivery.params_digest is not None:
            order = seal(order, delivery.params_digest)
        stats.inner_steps, stats.merge, stats.last_progress = work.steps, Merge.TRAINING, time.time()
        allowed = self.cfg.deadline_s(work.steps, self.speeds.speeds.get(work.island))
        deadline = self.pool.now() + delivery.delay_s + allowed
        received = 0 if delivery.bootstrap else delivery.nbytes
        self.flights[ticket] = Flight(
            ticket,
            work,
            deadline,
            sent_at=self.pool.now(),
            received=received,
            progress_at=self.pool.now() + delivery.delay_s,
        )
        self.pool.dispatch(order, delivery.params, delivery.changes)

    def timeout(self, wake: float | None = None) -> float:
        """How long the engine may wait on the pool: until the first deadline, or the
        pacing's `wake` (a step due on time), never more than `POLL_S`."""
        due = [f.deadline for f in self.in_flight()] + ([wake] if wake is not None else [])
        if not due:
            return POLL_S
        return max(0.0, min(POLL_S, min(due) - self.pool.now()))

    def arrived(self, ticket: int, island: int, result: RoundResult) -> list[Outcome]:
        """Take a result back; a refused one's verdict, for the fleet."""
        stats = self.members.islands.get(island)
        if stats is not None:  # whatever becomes of the result, the island is not hung
            stats.last_progress = time.time()
        flight = self.flights.get(ticket)
        if flight is None or flight.result is not None:  # an overdue result: discarded, the island trains again
            if self.overdue.pop(ticket, None) is not None and self.members.islands[island].state == IslandState.LATE:
                self.members.mark(island, IslandState.TRAINING)
            return []
        malformed = screen(result, flight.work, self.sizes)
        if malformed is not None:
            return [self.refuse(ticket, island, malformed, Reason.MALFORMED)]
        partial = result.steps < flight.work.steps  # (screened: an int of at least 1)
        if partial:
            short = self._partial(flight, result.steps)
            if short is not None:
                return [self.refuse(ticket, island, short, Reason.SHARDS)]
        problem = self.ledger.check(ticket, result.positions, result.shard_tokens, result.stream_states)
        if problem is None and result.weight != sum(result.shard_tokens.values()):
            problem = (
                f"weight {result.weight} is not the {sum(result.shard_tokens.values())} tokens it reports per shard"
            )
        if problem is not None:
            return [self.refuse(ticket, island, problem, Reason.SHARDS)]
        if partial:  # checked: the untaken steps go back to the pacing's budget (a refused one's all go, as lost)
            self.pacing.shortened(flight, result.steps)
        self.speeds.observe(island, result.steps, result.compute_s)
        self.uplink[island] = result.nbytes
        self.stats.exchange(flight.received + result.nbytes)
        flight.result = result
        # Arrival is on the coordinator's clock: an island's own clock (a node running fast,
        # or a value of 1e18) is never slept on; it may only place its finish earlier.
        now = self.pool.now()
        finished = min(result.finished_at, now) if math.isfinite(result.finished_at) else now
        # a pseudo-gradient taken τ steps before the end (streaming) was on its link meanwhile
        sent_at = finished - min(result.tail_s, result.compute_s)
        flight.delivered_at = sent_at + self.publisher.links.upload_s(
            island, result.nbytes, islands=self.members.schedulable(), sent=sent_at, compute_s=result.compute_s
        )
        flight.received_at = now
        self.trip_s[island] = max(0.0, now - flight.sent_at - result.compute_s)
        self.run.completed_steps += result.steps
        self.members.islands[island].merge = Merge.WAITING
        self.pacing.arrived(flight)
        return []

    def stop(self, island: int, notice_s: float | None) -> None:
        """A preemption notice: `island`'s work out takes no step that would not end in time
        for its result to cross its link before the node is taken (`notice_s` less the
        upload; unknown: no step after the one in progress) and sends what it has, a
        partial pseudo-gradient weighted by the tokens it trained (`_partial`). An island of
        several workers is not asked (its ranks would have to agree on the step): its work
        finishes, or is lost with the node."""
        if self.cfg.islands.workers > 1:
            return
        for flight in self.in_flight():
            if flight.work.island == island and flight.work.kind == WorkKind.TRAIN:
                flight.stopping = True
                within = None
                if notice_s is not None:
                    nbytes = self.uplink.get(island, 4 * self.sizes.of(flight.work.fragment))
                    now = self.pool.now()
                    upload = self.publisher.links.upload_s(
                        island, nbytes, islands=[island], sent=now, compute_s=0.0, book=False
                    )
                    within = max(0.0, notice_s - upload)
                self.pool.stop(island, flight.ticket, within)

    def stragglers(self, schedulable: list[int]) -> list[StopWork]:
        """The budget's end (every step handed out): the works the tail stop decides to stop
        (`stragglers.TailStop`), so that the idle islands, at their measured speeds and
        after a trip as long as their last (`trip_s`), train the rest of them. Its own result
        goes up its link either way. A stopped island gets no more of the budget (`behind`):
        its speed, smoothed, would still claim a share. Without heartbeats a work's pace is
        not known, and nothing is stopped; nor is an island of several workers (its ranks
        would have to agree on the step: `stop`)."""
        if self.tail_stop is None or self.cfg.islands.workers > 1:
            return []
        idle = self.free(schedulable)
        trips = sorted(self.trip_s.get(i, 0.0) for i in idle)
        rate = sum(self.speeds.speeds.get(i, 0.0) for i in idle)
        decided = self.tail_stop.decide(
            self.in_flight(), rate, trips[len(trips) // 2] if trips else 0.0, self.pool.now()
        )
        for d in decided:
            self.behind.add(d.flight.work.island)
            self.events.add(
                Event.STRAGGLER,
                d.flight.work.island,
                ticket=d.flight.ticket,
                steps_left=d.left,
                keep_s=round(d.keep_s, 2),
                instead_s=round(d.instead_s, 2),
            )
        return [StopWork(island=d.flight.work.island) for d in decided]

    def _partial(self, flight: Flight, steps: int) -> str | None:
        """A result of fewer steps than its work: the prefix a notice stopped (`stop`). Its
        reservation shrinks to the batches it trained and the rest go back to the ledger,
        for the shard's next owner (before its report is checked against what it was
        given); None, or why it is refused (no notice asked for it)."""
        if not flight.stopping:
            return f"it trained {steps} of its {flight.work.steps} steps, and no notice stopped it"
        back = self.ledger.shorten(flight.ticket, steps)
        if back is None:
            return f"its {steps} steps cannot be kept apart from the batches after them"
        spans = {s: list(span) for s, span in back.items()}
        self.events.add(
            Event.PARTIAL, flight.work.island, ticket=flight.ticket, steps=steps, of=flight.work.steps, spans=spans
        )
        return None

    def progressed(self, event: Progress) -> None:
        """A heartbeat: `island` has done `steps` inner steps in all, `work_steps` of the work
        `ticket` it is on (whether that work is between steps: `Flight.stepping`; a count of
        another work, read before this one began, says nothing of it), counted at `at` (the
        pool's clock; None: now). Its work out has
        progressed if the count moved past what it reported before (`steps_seen`, or its
        last report during earlier work, or 0), or, while it is not stepping, if its card
        moved bytes as a transfer does (`HangRule.moving`); only then is it the island's news
        (`last_progress`): a hung island answering with a count that no longer moves is
        silent to the dashboard's stuck rule too."""
        island, steps = event.island, event.steps
        before = self.reported.get(island, 0)  # a first report: any step at all is progress
        at = self.pool.now() if event.at is None else event.at
        self.reported[island] = steps
        moving = self.hangs.moving(self.cards.get(island), at, event.card_bytes)
        if event.card_bytes is not None:
            self.cards[island] = (at, event.card_bytes)
        for flight in self.in_flight():
            if flight.work.island == island:
                seen = flight.steps_seen if flight.steps_seen is not None else before
                # between steps (its download, its upload) bytes moving on its card are progress
                if steps > seen or (moving and not flight.stepping):
                    flight.progress_at = max(flight.progress_at, at)
                    if (stats := self.members.islands.get(island)) is not None:
                        stats.last_progress = time.time()
                flight.steps_seen, flight.heard_at = steps, max(flight.heard_at, at)
                flight.work_steps = event.work_steps if event.ticket == flight.ticket else None
                if flight.work_steps and flight.first_step is None:  # its pace is counted from here
                    flight.first_step = (at, flight.work_steps)

    def refuse(self, ticket: int, island: int, problem: str, reason: Reason) -> Judged:
        """A result that cannot be decoded, or whose report of what it read and trained does
        not match its work order: refused before the outer step sees it (its batches go back
        to the ledger) and counted towards quarantine like any faulty update."""
        verdict = Verdict(Decision.REJECT, reason, problem)
        self.lose(ticket, f"rejected ({verdict.why})")
        self.members.islands[island].rejections += 1
        return Judged(island=island, verdict=verdict)

    def unreachable(self, ticket: int, island: int, reason: str) -> None:
        """Ray could not reach `island` for the result of `ticket`: that work is lost (its
        batches back to the ledger), the island is not. Past its deadline it was waiting as
        late, for a result that will not come now: it trains again."""
        flight = self.flights.get(ticket)
        if flight is not None and flight.result is None:
            self.lose(ticket, reason)
        if self.overdue.pop(ticket, None) is not None and self.members.islands[island].state == IslandState.LATE:
            self.members.mark(island, IslandState.TRAINING)

    def lose(self, ticket: int, reason: str) -> None:
        flight = self.flights.pop(ticket)
        reservation = self.ledger.rollback(ticket)
        self.pacing.lost(flight)
        spans = {s: list(span) for s, span in reservation.spans.items()} if reservation else {}
        self.events.add(Event.LOST, flight.work.island, reason=reason, ticket=ticket, spans=spans)

    def abandon(self, reason: str) -> None:
        """Give up every piece of work, out or arrived and not yet stepped (its batches go
        back to the ledger; an arrived result's steps no longer count as completed)."""
        for ticket in sorted(self.flights, reverse=True):  # an island's later reservation first
            result = self.flights[ticket].result
            if result is not None:
                self.run.completed_steps -= result.steps
            self.lose(ticket, reason)

    def expire(self) -> Iterator[Lost]:
        """Work past its deadline is given up (its round closes without it; its batches go
        back to the ledger) and its island is late: it gets work again once the overdue
        result arrives. One whose result has not come `elastic.late_grace_s` later is hung:
        it is released, and replaced like a dead island, so it never holds its resources
        (or the run) for good. Hung islands are yielded one at a time, each applied before
        the next is looked at: a release, or a halt in which results come in, can settle
        another island's overdue work."""
        now = self.pool.now()
        for flight in self.in_flight():
            ticket = flight.ticket
            if flight.deadline <= now:
                i = flight.work.island
                self.lose(ticket, "past the round deadline")
                self.overdue[ticket] = (i, flight.deadline)
                if self.members.islands[i].state == IslandState.TRAINING:
                    self.members.mark(i, IslandState.LATE)
                self.members.islands[i].late_results += 1
                self.events.add(Event.LATE, i, deadline_s=flight.deadline - flight.sent_at)
        for ticket, (i, deadline) in list(self.overdue.items()):
            if ticket in self.overdue and (why := self.hangs.overdue(now, deadline)) is not None:
                yield Lost(island=i, reason=why)
        for flight in self.in_flight():  # heartbeats: a stall, long before any deadline
            if flight.ticket not in self.flights:
                continue
            speed = self.speeds.speeds.get(flight.work.island)
            if (why := self.hangs.stalled(flight, now, speed, self.run.hang_after_steps)) is not None:
                yield Lost(island=flight.work.island, reason=why)

    def forget(self, island: int, state: IslandState) -> None:
        """An island is released for good (the fleet's call): its work still out is lost
        (retrained by the next owner of its shards); its results already in still count."""
        for flight in [f for f in self.in_flight() if f.work.island == island]:
            self.lose(flight.ticket, f"island {state.value}")
        self.publisher.forget(island)
        for t in [t for t, (i, _) in self.overdue.items() if i == island]:
            del self.overdue[t]
        self.reported.pop(island, None)
        self.cards.pop(island, None)

    def contribution(self, r: RoundResult, fragment: int | None, factors: dict[int, float] | None) -> Contribution:
        """What an arrived result gives its outer step: its tokens, times its pacing's
        factor (age-aware merging); a newcomer's first update counts `elastic.join_weight`
        (no loss spike on a join)."""
        stats = self.members.islands[r.island]
        weight = float(r.weight) * (factors.get(r.island, 1.0) if factors else 1.0)
        if stats.joined_version > 0 and stats.submissions == 0:
            weight *= self.cfg.elastic.join_weight
        return Contribution(
            island=r.island, version=r.version, delta=r.payload, weight=weight, steps=r.steps, fragment=fragment
        )

    def settle(self, flight: Flight, verdict: Verdict, staleness: int) -> Judged:
        """A result its outer step has judged: committed to the ledger (trained), or given
        back if it was refused and its batches can still be retrained; counted either way.
        Returns the verdict for the fleet, which must hear it only once every result of the
        close is settled: a verdict can quarantine an island, and under
        the checkpoint-restart baseline (`simulation.restart_s`) a failure gives up every piece of work not yet
        stepped. Heard mid-close, it gave up results the step had already applied (their
        batches trained twice) and the close then settled a flight that no longer existed."""
        r = flight.result
        assert r is not None
        refused = not verdict.admitted and verdict.decision != Decision.DROP
        returned = refused and self.ledger.newest(flight.ticket)
        if returned:
            self.give_back(flight, verdict)
        else:
            del self.flights[flight.ticket]
            self.ledger.commit(flight.ticket, r.shard_tokens, r.stream_states)
        stats = self.members.islands[r.island]
        if r.saved_state is not None:  # the island trained it, taken or not: its moments moved
            self.states.settled(stats, r.saved_state)
        self.stats.account(stats, r, verdict, staleness, trained=not returned)
        stats.steps_per_s = self.speeds.speeds.get(r.island, 0.0)
        if verdict.admitted:
            stats.merge = Merge.LATE if staleness > 0 else Merge.MERGED
        return Judged(island=r.island, verdict=verdict, version=r.version)

    def give_back(self, flight: Flight, verdict: Verdict) -> None:
        """A rejected update never touched the model, so its batches go back to the ledger
        and are trained again (by the shard's owner), as lost work is. Only possible while
        no later work holds the same shards (under CO2's one-round lag the island is
        already training the next batches: there the rejected batches stay consumed)."""
        assert flight.result is not None
        self.run.completed_steps -= flight.result.steps
        self.lose(flight.ticket, f"rejected ({verdict.why})")
