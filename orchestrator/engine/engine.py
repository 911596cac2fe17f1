"""The round engine: one explicit state machine that runs a training run in every mode.

`step()` makes one transition: apply what the operator asked (between rounds), hand
idle islands the work the pacing plans (reserving their batches in the data ledger),
write the records that are due, wait briefly for the island pool, take in what happened
(results, deaths, joins), give up on work past its deadline, and close every outer step
the pacing says is ready (admission → token-weighted mean → outer rule). `run()` is
`start()` then `step()` until the run ends. The engine has no Ray in it: the pool,
the outer step (whole or sliced) and the policies are handed in, so the same engine is
driven by the Ray coordinator and, in tests, by an in-process pool with injected faults.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orchestrator.config import RunConfig
from orchestrator.engine.admission import Admission, Verdict
from orchestrator.engine.checkpoints import load_checkpoint, save_checkpoint
from orchestrator.engine.commands import Answer, Command, Inbox, SettingsUpdate
from orchestrator.engine.downlink import Downlink
from orchestrator.engine.fleet import Fleet
from orchestrator.engine.ledger import DataLedger
from orchestrator.engine.membership import IslandStats, Membership
from orchestrator.engine.outer_step import Outer, SlicedOuter, take_step
from orchestrator.engine.pacing import Close, Flight, Pacing, RunState, Work
from orchestrator.engine.policies import Policies, run_inbox
from orchestrator.engine.pool import Done, Failed, IslandPool, Joined, JoinFailed, PoolEvent
from orchestrator.engine.records import DiskFaults, EventLog, Recorder
from orchestrator.engine.screen import Sizes, screen
from orchestrator.engine.stats import RunStats
from orchestrator.engine.types import (
    Contribution,
    Decision,
    Event,
    IslandState,
    Reason,
    RunFailed,
    RunPhase,
    SliceLost,
)
from orchestrator.engine.warm_start import WarmStart
from workers.flat import FlatParams
from workers.fragments import Fragments
from workers.messages import RoundResult, WorkOrder
from workers.sync import Change
from workers.task import ExportableTask, Task, export_pretrained

log = logging.getLogger(__name__)
POLL_S = 0.2  # the longest the engine waits on the pool: a stop-now is seen within it


class RoundEngine:
    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        model: torch.nn.Module,
        flat: FlatParams,
        outer: Outer,
        policies: Policies,
        pool: IslandPool,
        run_id: str = "local",
        on_record: Callable[[dict[str, Any], dict[str, dict[str, Any]]], None] | None = None,
        init_from: dict[str, str] | None = None,
        warm: WarmStart | None = None,
        fragments: Fragments | None = None,
        inbox: Inbox | None = None,
        takes_changes: bool = True,
    ) -> None:
        """Continues from the checkpoint of `run_id` in `cfg.checkpoint_dir` if there is one.
        `init_from` describes the weights the model was loaded with (`start_from`); `warm`
        is the warm start the model was loaded from, whose data positions the run continues;
        `fragments` are streaming's (the outer step and the published copy work by fragment).
        `inbox`: the run's operator commands (shared by its phases); a phase that does not
        `takes_changes` (the warm start) honours pause and stop and leaves settings and
        membership changes for the next."""
        self.cfg, self.task, self.model, self.flat, self.outer = cfg, task, model, flat, outer
        self.pacing: Pacing = policies.pacing
        self.admission: Admission = policies.admission
        self.pool, self.run_id, self.on_record = pool, run_id, on_record
        self.eval_batches = list(task.eval_batches())
        self.members = Membership(cfg.islands.count)
        self.run = RunState(cfg.rounds, cfg.inner_steps, self.members)
        self.ledger = DataLedger(cfg.num_shards)
        self.inbox = inbox or run_inbox(cfg)
        self.takes_changes = takes_changes
        self.phase = RunPhase.STARTING
        self.flights: dict[int, Flight] = {}
        self.overdue: dict[int, tuple[int, float]] = {}  # ticket -> (island, deadline), abandoned past it
        self.speeds = policies.speeds  # measured inner steps per second, every mode
        self._tickets = itertools.count()
        self.refs: dict[int, Any] = {}  # version -> published parameters
        self.published_at: dict[int, float] = {}
        self.held: dict[int, int] = {}  # island -> version it holds (downloaded)
        self.due: list[int] = []  # recorded rounds due, written after the next dispatch
        self.stats = RunStats()
        self.init_from = init_from
        self.warm = warm
        self.islands_view: dict[str, dict[str, Any]] = {}  # what /v1/islands serves (`_refresh_islands`)
        self._islands_seen: tuple[int, int] | None = None
        self.clock0 = 0.0  # the pool's clock when training began (`_clock`)
        self.summary: dict[str, Any] = {}
        slices = tuple(outer.bounds) if isinstance(outer, SlicedOuter) else None
        self.sizes = Sizes(outer.numel, fragments, slices)
        self.downlink = (
            Downlink(
                flat.data,
                cfg.compression.downlink,
                cfg.compression.chunk,
                fragments,
                keep=2 * cfg.streaming.fragments + 4,
            )
            if cfg.tracks_copy
            else None
        )
        state = load_checkpoint(Path(cfg.checkpoint_dir)) if cfg.checkpoint.every_rounds else None
        self.resumed = state is not None and state["run_id"] == run_id
        if self.resumed:
            assert state is not None
            self._restore(state)
        elif warm is not None:  # the data the warm start trained is not trained again
            self.ledger.load({**warm.ledger, "tokens": [0] * cfg.num_shards})
        self.disk = DiskFaults()
        self.checkpoint_owed = False  # a checkpoint that could not be written: retried at the next record
        keep = self.rounds_done if self.resumed else None
        self.recorder = Recorder(cfg.out_dir, cfg, keep_records=keep, faults=self.disk)
        self.events = EventLog(self.recorder.out / "events.jsonl", append=self.resumed, faults=self.disk)
        self.snapshot: dict[str, Any] = {
            "state": RunPhase.STARTING.value,
            "round": self.rounds_done,
            "rounds": cfg.rounds,
        }
        if self.resumed:
            self.events.add(Event.RESTART, version=self.run.version, rounds_done=self.rounds_done)
        self.fleet = Fleet(
            cfg=cfg,
            run_id=run_id,
            pool=pool,
            members=self.members,
            run=self.run,
            events=self.events,
            disk=self.disk,
            forget=self._forget,
        )
        self.stop_seen = False
        if takes_changes:
            self.inbox.members = self.members
            self.inbox.settle(self.members.target)

    # -- the state machine -----------------------------------------------------------------
    def start(self) -> None:
        """Ask for the islands (after a restart: re-attach to the live ones, re-place the rest)."""
        self.fleet.start(self.resumed)

    def submit(self, command: Command) -> Answer:
        """An operator's command, validated now, applied by the engine at its own pace."""
        return self.inbox.submit(command)

    def step(self) -> bool:
        """One transition; False once the run has ended."""
        if self.phase in (RunPhase.FINISHED, RunPhase.STOPPED, RunPhase.FAILED):
            return False
        self._heard_stop()
        if self.inbox.aborting.is_set():
            self._finish()
            return False
        if self.phase == RunPhase.STARTING:
            self._handle(self.pool.poll(POLL_S))
            self.fleet.expire_joins()
            if not self.members.pending:
                self._begin()
            self._refresh_islands()
            return True
        self.run.stopping = self.inbox.stopping.is_set()
        self._boundary()
        self._dispatch()
        self._write_due()
        if not self.flights:  # nothing out, nothing waiting to close
            if self.pacing.done(self.run) or self.run.stopping:
                self._finish()
                return False
            self.fleet.check_progress(self.phase == RunPhase.PAUSED, bool(self.overdue))
        self._handle(self.pool.poll(self._timeout()))
        self._expire()
        while (close := self.pacing.next_close(self.run, self._in_flight())) is not None:
            # a record describes the model its step produced: written before another step
            # changes it (two rounds can close at once, e.g. after a round lost all its work)
            self._write_due()
            self._close(close)
        self._refresh_islands()
        self.fleet.journal()
        return True

    def _heard_stop(self) -> None:
        """Log a stop the inbox accepted, once (its `now` says whether work is abandoned)."""
        if self.inbox.stopping.is_set() and not self.stop_seen:
            self.stop_seen = True
            self.events.add(Event.STOP_REQUESTED, version=self.run.version, now=self.inbox.aborting.is_set())

    def _in_flight(self) -> list[Flight]:
        """Work handed out whose result has not come back (arrived results wait in
        `flights` too, until their outer step closes)."""
        return [f for f in self.flights.values() if f.result is None]

    def execute(self) -> dict[str, Any]:
        """Run to the end; returns the summary (also written to `out_dir/summary.json`).
        An error nothing below foresaw ends the run as a `RunFailed` naming it, with the
        last checkpoint as it was (a lost coordinator slice still restarts the coordinator)."""
        try:
            self.start()
            while self.step():
                pass
        except (RunFailed, SliceLost):
            raise
        except Exception as err:
            log.exception("the round engine failed")
            self.phase = RunPhase.FAILED
            self.snapshot["state"] = self.phase.value
            raise RunFailed(
                f"the round engine failed at version {self.run.version}: {type(err).__name__}: {err} "
                f"(the last checkpoint in {self.cfg.checkpoint_dir} is intact)"
            ) from err
        return self.summary

    # -- phases ------------------------------------------------------------------------------
    def _begin(self) -> None:
        if not self.members.schedulable():
            self.phase = RunPhase.FAILED
            raise self.fleet.no_island_left()
        self.stats.start_training()
        self.clock0 = self.pool.now()
        if not self.resumed:
            self.stats.initial_eval = self.stats.last_eval = self.evaluate()
        self.phase = RunPhase.TRAINING
        self._publish()
        self._update_snapshot()

    def _finish(self) -> None:
        """End the run: work still out is given back to the ledger (trained again on
        resume); a stopped run is evaluated and checkpointed where it stands."""
        self._write_due()  # a step taken is recorded, so the checkpoint's version and rounds agree
        for ticket in sorted(self.flights, reverse=True):  # an island's later reservation first
            self._lose(ticket, "the run ended before its outer step")
        stopped = self.inbox.stopping.is_set()
        if stopped:
            if not self.inbox.aborting.is_set():
                self.stats.last_eval = self.evaluate()
            if self.cfg.checkpoint.every_rounds:
                self._checkpoint()
            self.events.add(Event.STOPPED, version=self.run.version, rounds_done=self.rounds_done)
        self.phase = RunPhase.STOPPED if stopped else RunPhase.FINISHED
        if self.takes_changes:  # the run's last phase: nothing more can be asked of it
            self.inbox.ended = True
        self.outer.copy_to(self.flat.data)
        self.summary = self.stats.summary(
            self.phase, self.cfg, self.run.version, self.members, self.ledger, self.outer.numel, self.recorder.out
        )
        self.summary["clock_seconds"] = self._clock()
        self.summary["init_from"] = self.init_from
        self.summary["warm_start"] = self.warm.record if self.warm is not None else None
        if isinstance(self.task, ExportableTask):  # the model back in its ecosystem's format, too
            export = self.recorder.out / "export"
            if self.disk.attempt("the export", lambda: export_pretrained(self.task, self.model.state_dict(), export)):
                self.summary["export"] = str(export)
        self.recorder.finish(self.summary, self.model)
        self._update_snapshot()
        self._refresh_islands()
        for i in list(self.members.islands):
            if not self.members.islands[i].state.gone:
                self.pool.release(i)
        for i in list(self.members.pending):
            self.pool.cancel(i)

    # -- operator requests, applied between rounds ------------------------------------------------
    def _boundary(self) -> None:
        if self.pacing.between_rounds(list(self.flights.values())):
            update = self.inbox.take_settings() if self.takes_changes else None
            if update is not None:
                self._apply_settings(update)
            paused = self.inbox.paused.is_set() and not self.inbox.stopping.is_set()
            if paused and self.phase == RunPhase.TRAINING:
                self.phase = RunPhase.PAUSED
                self.events.add(Event.PAUSED, version=self.run.version)
            elif not paused and self.phase == RunPhase.PAUSED:
                self.phase = RunPhase.TRAINING
                self.events.add(Event.RESUMED, version=self.run.version)
            self.snapshot["state"] = self.phase.value
        self.fleet.apply(self.inbox if self.takes_changes else None, {f.work.island for f in self._in_flight()})

    def _apply_settings(self, update: SettingsUpdate) -> None:
        if update.inner_steps is not None:
            self.cfg.inner_steps = self.run.inner_steps = update.inner_steps
        if update.outer_lr is not None:
            self.outer.set_lr(update.outer_lr)
        self.events.add(Event.SETTINGS, version=self.run.version, **update.model_dump(exclude_none=True))

    # -- work out -------------------------------------------------------------------------------
    def _publish(self, at: float | None = None) -> None:
        """Publish the new version once (islands fetch it from there); keep the one before,
        which a round under a one-round lag starts from. `at`: when it was ready on the
        run's clock, if earlier than now (streaming: its pseudo-gradients left τ steps
        before their islands' work ended, so the step was due before the results came back)."""
        v = self.run.version
        params = self.downlink.copy.numpy() if self.downlink is not None else self.outer.params()
        self.refs[v] = self.pool.publish(v, params)
        now = self.pool.now()
        self.published_at.setdefault(v, now if at is None else min(at, now))
        for old in [old for old in self.refs if old < v - 1]:
            del self.refs[old]

    def _dispatch(self) -> None:
        if self.phase != RunPhase.TRAINING:
            return
        busy = {f.work.island for f in self._in_flight()}
        idle = [i for i in self.members.schedulable() if i not in busy]
        if not idle:
            return
        for work in self.pacing.plan(self.run, idle):
            self._hand_out(work)

    def _hand_out(self, work: Work) -> None:
        ticket = next(self._tickets)
        reservation = self.ledger.reserve(ticket, work.island, self.members.schedulable(), work.steps)
        if reservation is None:
            self.pacing.cancel(work)  # no free shard: it idles
            return
        stats = self.members.islands[work.island]
        now = self.pool.now()
        params, changes, nbytes, bootstrap = self._downlink(work)
        delay = 0.0
        if nbytes:  # a new global (or its changes) to download over its link
            self.stats.download(stats, nbytes, bootstrap)
            delay = max(
                0.0, self.published_at.get(work.version, now) + self.cfg.island_link(work.island).seconds(nbytes) - now
            )
        self.held[work.island] = work.version
        order = WorkOrder(
            island=work.island,
            ticket=ticket,
            version=work.version,
            kind=work.kind,
            steps=work.steps,
            shards=reservation.starts,
            turn=reservation.turn,
            start_delay_s=delay,
            schedule_step=work.schedule_step,
            fragment=work.fragment,
            changes=tuple(changes),
            eager=work.eager,
            send_after=work.send_after,
        )
        stats.inner_steps = work.steps
        deadline = now + delay + self.cfg.deadline_s(work.steps)
        self.flights[ticket] = Flight(ticket, work, deadline, received=0 if bootstrap else nbytes)
        self.pool.dispatch(order, params)

    def _downlink(self, work: Work) -> tuple[Any, list[Change], int, bool]:
        """What island `work.island` receives for its work: (full parameters or None, the
        changes since the version it holds, bytes on its link, whether it is a first
        download, which is not one of the run's exchanges)."""
        held = self.held.get(work.island)
        if self.downlink is None:  # the full parameters of each new version
            nbytes = 0 if held == work.version else self.outer.numel * self.flat.data.element_size()
            return self.refs[work.version], [], nbytes, held is None
        changes = self.downlink.route(held, work.version)
        if changes is None:
            return self.refs[work.version], [], self.downlink.full_nbytes(), held is None
        return None, changes, sum(c.nbytes for c in changes), False

    # -- work back ------------------------------------------------------------------------------
    def _timeout(self) -> float:
        flying = self._in_flight()
        if not flying:
            return POLL_S
        return max(0.0, min(POLL_S, min(f.deadline for f in flying) - self.pool.now()))

    def _handle(self, events: list[PoolEvent]) -> None:
        for event in events:
            if isinstance(event, Joined):
                speed = self.fleet.joined(event, starting=self.phase == RunPhase.STARTING)
                if speed is not None:
                    self.speeds.know(event.island, speed)
            elif isinstance(event, JoinFailed):
                self.fleet.join_failed(event)
            elif isinstance(event, Done):
                self._arrived(event.ticket, event.island, event.result)
            elif isinstance(event, Failed):
                if event.ticket in self.flights and self.flights[event.ticket].result is None:
                    self._lose(event.ticket, event.reason)
                self.overdue.pop(event.ticket, None)
                self.fleet.fail(event.island, event.reason)

    def _arrived(self, ticket: int, island: int, result: RoundResult) -> None:
        flight = self.flights.get(ticket)
        if flight is None or flight.result is not None:  # an overdue result: discarded, the island trains again
            if self.overdue.pop(ticket, None) is not None and self.members.islands[island].state == IslandState.LATE:
                self.members.mark(island, IslandState.TRAINING)
            return
        malformed = screen(result, flight.work, self.sizes)
        if malformed is not None:
            self._refuse(ticket, island, malformed, Reason.MALFORMED)
            return
        problem = self.ledger.check(ticket, result.positions, result.shard_tokens)
        if problem is None and result.weight != sum(result.shard_tokens.values()):
            problem = (
                f"weight {result.weight} is not the {sum(result.shard_tokens.values())} tokens it reports per shard"
            )
        if problem is not None:
            self._refuse(ticket, island, problem, Reason.SHARDS)
            return
        self.speeds.observe(island, result.steps, result.compute_s)
        self.stats.exchange(flight.received + result.nbytes)
        flight.result = result
        # Arrival is on the coordinator's clock: an island's own clock (a node running fast,
        # or a value of 1e18) is never slept on; it may only place its finish earlier.
        now = self.pool.now()
        finished = min(result.finished_at, now) if math.isfinite(result.finished_at) else now
        # a pseudo-gradient taken τ steps before the end (streaming) was on its link meanwhile
        sent_at = finished - min(result.tail_s, result.compute_s)
        flight.delivered_at = sent_at + self.cfg.island_link(island).seconds(result.nbytes)
        self.run.completed_steps += result.steps
        self.pacing.arrived(flight)

    def _refuse(self, ticket: int, island: int, problem: str, reason: Reason) -> None:
        """A result that cannot be decoded, or whose report of what it read and trained does
        not match its work order: refused before the outer step sees it (its batches go back
        to the ledger) and counted towards quarantine like any faulty update."""
        verdict = Verdict(Decision.REJECT, reason, problem)
        self._lose(ticket, f"rejected ({verdict.why})")
        self.members.islands[island].rejections += 1
        self._judged(island, verdict)

    def _lose(self, ticket: int, reason: str) -> None:
        flight = self.flights.pop(ticket)
        reservation = self.ledger.rollback(ticket)
        self.pacing.lost(flight)
        spans = {s: list(span) for s, span in reservation.spans.items()} if reservation else {}
        self.events.add(Event.LOST, flight.work.island, reason=reason, ticket=ticket, spans=spans)

    def _expire(self) -> None:
        """Work past its deadline is given up (its round closes without it; its batches go
        back to the ledger) and its island is late: it gets work again once the overdue
        result arrives. One whose result has not come `elastic.late_grace_s` later is hung:
        it is released, and replaced like a dead island, so it never holds its resources
        (or the run) for good."""
        now = self.pool.now()
        for flight in self._in_flight():
            ticket = flight.ticket
            if flight.deadline <= now:
                i = flight.work.island
                self._lose(ticket, "past the round deadline")
                self.overdue[ticket] = (i, flight.deadline)
                if self.members.islands[i].state == IslandState.TRAINING:
                    self.members.mark(i, IslandState.LATE)
                self.members.islands[i].late_results += 1
                self.events.add(Event.LATE, i, deadline_s=self.cfg.deadline_s(flight.work.steps))
        grace = self.cfg.elastic.late_grace_s
        for ticket, (i, deadline) in list(self.overdue.items()):
            if ticket in self.overdue and now - deadline > grace:
                self.fleet.fail(i, f"hung: no result {grace:g}s past its deadline (elastic.late_grace_s)")

    def _forget(self, island: int, state: IslandState) -> None:
        """An island is released for good (the fleet's call): its work still out is lost
        (retrained by the next owner of its shards); its results already in still count."""
        for flight in [f for f in self._in_flight() if f.work.island == island]:
            self._lose(flight.ticket, f"island {state.value}")
        self.held.pop(island, None)
        for t in [t for t, (i, _) in self.overdue.items() if i == island]:
            del self.overdue[t]

    # -- the outer step ------------------------------------------------------------------------------
    def _weight(self, r: RoundResult) -> float:
        """A newcomer's first update counts `elastic.join_weight` (no loss spike on a join)."""
        stats = self.members.islands[r.island]
        weight = float(r.weight)
        if stats.joined_version > 0 and stats.submissions == 0:
            weight *= self.cfg.elastic.join_weight
        return weight

    def _close(self, close: Close) -> None:
        flights = close.flights  # every flight a pacing closes has its result
        results = [f.result for f in flights if f.result is not None]
        due = max((f.delivered_at for f in flights), default=None)
        if due is not None:  # the step happens once every result has crossed its (simulated) link
            self.pool.sleep_until(due)
        contributions = [
            Contribution(
                island=r.island,
                version=r.version,
                delta=r.payload,
                weight=self._weight(r),
                steps=r.steps,
                fragment=close.fragment,
            )
            for r in results
        ]
        outcome = take_step(
            self.outer, self.admission, contributions, close.expected, self.run.version, close.anchor, close.fragment
        )
        verdicts = outcome.verdicts
        if outcome.gap is not None:
            self.stats.window.extra["gap_penalty"] = outcome.gap
        if outcome.stepped or close.advances:
            self.run.version += 1
            if self.downlink is not None:
                self.downlink.step(self.run.version, self.flat.data, close.fragment)
            self.outer.anchor(self.run.version, keep_from=max(self.run.base, self.run.version - 1))
            self._publish(due)
        self.run.closes += 1
        for flight, r, verdict in zip(flights, results, verdicts):
            staleness = close.staleness if close.staleness is not None else verdict.staleness
            refused = not verdict.admitted and verdict.decision != Decision.DROP
            returned = refused and self.ledger.newest(flight.ticket)
            if returned:
                self._return(flight, verdict)
            else:
                del self.flights[flight.ticket]
                self.ledger.commit(flight.ticket, r.shard_tokens)
            self._account(r, verdict, staleness, trained=not returned)
        due = self.pacing.closed(self.run, close)
        if due is not None:
            self.due.append(due)

    def _return(self, flight: Flight, verdict: Verdict) -> None:
        """A rejected update never touched the model, so its batches go back to the ledger
        and are trained again (by the shard's owner), as lost work is. Only possible while
        no later work holds the same shards (under CO2's one-round lag the island is
        already training the next batches: there the rejected batches stay consumed)."""
        assert flight.result is not None
        self.run.completed_steps -= flight.result.steps
        self._lose(flight.ticket, f"rejected ({verdict.why})")

    def _account(self, r: RoundResult, verdict: Verdict, staleness: int, trained: bool) -> None:
        stats = self.members.islands[r.island]
        self.stats.account(stats, r, verdict, staleness, trained)
        stats.steps_per_s = self.speeds.speeds.get(r.island, 0.0)
        self._judged(r.island, verdict, version=r.version)

    def _judged(self, island: int, verdict: Verdict, **detail: Any) -> None:
        """Log a rejection; quarantine an island at its `quarantine_after`-th fault in a row."""
        if not verdict.admitted and verdict.decision != Decision.DROP:
            self.events.add(Event.REJECTION, island, reason=verdict.why, **detail)
        if self.admission.record(island, verdict):
            self.fleet.fail(
                island,
                f"quarantined after {self.admission.quarantine_after} bad updates in a row",
                IslandState.QUARANTINED,
            )

    # -- records, evaluation, checkpoints -----------------------------------------------------------
    def evaluate(self) -> float:
        self.outer.copy_to(self.flat.data)
        self.model.eval()
        with torch.no_grad():
            losses = [float(self.task.loss(self.model, b)) for b in self.eval_batches]
        return sum(losses) / len(losses)

    def _write_due(self) -> None:
        for rnd in self.due:
            self._record(rnd)
        self.due.clear()

    def _record(self, rnd: int) -> None:
        """Evaluate if due, append one record to metrics.jsonl, checkpoint if due."""
        cfg = self.cfg
        eval_loss = self.evaluate() if rnd % cfg.eval_every == 0 or rnd == cfg.rounds else None
        entry = self.stats.record(rnd, cfg, self.run.version, eval_loss, self.outer.lr(), self.members)
        entry["clock_seconds"] = self._clock()
        self.recorder.record(entry)
        every = cfg.checkpoint.every_rounds
        if every and (rnd % every == 0 or rnd == cfg.rounds or self.checkpoint_owed):
            self._checkpoint(rnd)
        self._update_snapshot()
        if self.on_record is not None:
            self.on_record(self.status(), self.members.summary())

    def _clock(self) -> float:
        """Seconds on the pool's clock since training began here: real time, or simulated
        time under a virtual clock (`islands.virtual_step_s`, and the in-process pool)."""
        return self.pool.now() - self.clock0

    @property
    def rounds_done(self) -> int:
        return self.stats.rounds_done

    def capture(self) -> dict[str, Any]:
        """Everything a restarted coordinator needs: committed work only (work in flight and
        results waiting for their round are redone), so nothing is lost or counted twice."""
        self.outer.copy_to(self.flat.data)
        return {
            "run_id": self.run_id,
            "config": self.cfg.model_dump(mode="json"),
            "params": self.flat.data.detach().clone(),
            "version": self.run.version,
            "outer": self.outer.state_dict(),
            "admission": self.admission.state_dict(),
            "members": {
                i: {**dataclasses.asdict(s), "state": s.state.value, "recent": list(s.recent)}
                for i, s in self.members.islands.items()
            },
            "ledger": self.ledger.state(),
            "completed_steps": self.run.completed_steps - self._uncommitted_steps(),
            "counters": self.stats.state(),
            "target": self.members.target,
        }

    def _uncommitted_steps(self) -> int:
        return sum(f.result.steps for f in self.flights.values() if f.result is not None)

    def save(self) -> None:
        save_checkpoint(Path(self.cfg.checkpoint_dir), self.capture(), self.cfg.checkpoint.keep)

    def _checkpoint(self, rnd: int | None = None) -> None:
        """Save, or owe the checkpoint to the next record if the disk refused it (the run goes
        on from memory; the checkpoints before it stay intact)."""
        self.checkpoint_owed = not self.disk.attempt("a checkpoint", self.save)
        if not self.checkpoint_owed:
            self.events.add(
                Event.CHECKPOINT, version=self.run.version, round=rnd if rnd is not None else self.rounds_done
            )

    def _restore(self, state: dict[str, Any]) -> None:
        saved = state["config"]
        for key in ("mode", "data_shards"):
            if saved.get(key) != self.cfg.model_dump(mode="json").get(key):
                raise RunFailed(
                    f"the checkpoint in {self.cfg.checkpoint_dir} is of a run with {key} = {saved.get(key)!r}, "
                    f"this run has {getattr(self.cfg, key)!r}: resume with the same config or another path"
                )
        self.flat.load(state["params"])
        if self.downlink is not None:
            self.downlink.reset(self.flat.data)
        self.run.version = self.run.base = self.run.closes = state["version"]
        self.outer.load_state_dict(state["outer"], state["version"])
        self.admission.load_state_dict(state["admission"])
        for i, saved in state["members"].items():
            fields = dict(saved)
            recent = fields.pop("recent", [])
            stats = IslandStats(**{**fields, "state": IslandState(fields["state"])})
            stats.recent.extend(recent)
            self.members.islands[int(i)] = stats
        self.ledger.load(state["ledger"])
        self.run.completed_steps = state["completed_steps"]
        self.stats.load(state["counters"])
        self.members.target = state["target"]
        self.pacing.resume(self.run)

    # -- what the control plane reads ----------------------------------------------------------------
    def _update_snapshot(self) -> None:
        history = self.recorder.history
        self.snapshot = self.stats.snapshot(
            self.phase, self.cfg, self.run.version, self.members, history[-1]["round_seconds"] if history else None
        )

    def _refresh_islands(self) -> None:
        """Rebuild the control plane's view of the islands, on this thread, when something
        happened (an event or a record): the API's threads read the finished dict and never
        iterate what the engine mutates."""
        seen = (self.events.count, self.rounds_done)
        if seen == self._islands_seen:
            return
        self._islands_seen = seen
        view = self.members.summary()
        for i in sorted(self.members.pending):  # requested, waiting for resources or starting up
            view[str(i)] = IslandStats(index=i).as_dict()
        self.islands_view = view

    def status(self) -> dict[str, Any]:
        return {
            **self.snapshot,
            "mode": self.cfg.mode.value,
            "run_id": self.run_id,
            "target_islands": self.members.target,
            "pending_islands": sorted(self.members.pending),
            "inner_steps": self.cfg.inner_steps,
            "outer_lr": self.outer.lr(),
            "paused": self.inbox.paused.is_set(),
            "stopping": self.inbox.stopping.is_set(),
            "disk_errors": self.disk.count,
            "last_disk_error": self.disk.last,
        }
