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
from orchestrator.engine.checkpoints import (
    load_checkpoint,
    load_intent,
    save_checkpoint,
    save_intent,
)
from orchestrator.engine.controls import RunControls, SettingsUpdate
from orchestrator.engine.downlink import Downlink
from orchestrator.engine.ledger import DataLedger
from orchestrator.engine.membership import IslandStats, Membership
from orchestrator.engine.outer_step import Outer, SlicedOuter, take_step
from orchestrator.engine.pacing import Close, Flight, Pacing, RunState, Work
from orchestrator.engine.policies import Policies
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
    ) -> None:
        """Continues from the checkpoint of `run_id` in `cfg.checkpoint_dir` if there is one.
        `init_from` describes the weights the model was loaded with (`start_from`); `warm`
        is the warm start the model was loaded from, whose data positions the run continues;
        `fragments` are streaming's (the outer step and the published copy work by fragment)."""
        self.cfg, self.task, self.model, self.flat, self.outer = cfg, task, model, flat, outer
        self.pacing: Pacing = policies.pacing
        self.admission: Admission = policies.admission
        self.pool, self.run_id, self.on_record = pool, run_id, on_record
        self.eval_batches = list(task.eval_batches())
        self.members = Membership(cfg.islands.count, cfg.elastic.min_islands, cfg.elastic.max_islands)
        self.run = RunState(cfg.rounds, cfg.inner_steps, self.members)
        self.ledger = DataLedger(cfg.num_shards)
        self.controls = RunControls()
        self.phase = RunPhase.STARTING
        self.flights: dict[int, Flight] = {}
        self.overdue: dict[int, tuple[int, float]] = {}  # ticket -> (island, deadline), abandoned past it
        self.speeds = policies.speeds  # measured inner steps per second, every mode
        self._tickets = itertools.count()
        self.refs: dict[int, Any] = {}  # version -> published parameters
        self._demanded: int | None = None
        self.published_at: dict[int, float] = {}
        self.held: dict[int, int] = {}  # island -> version it holds (downloaded)
        self.due: list[int] = []  # recorded rounds due, written after the next dispatch
        self.stats = RunStats()
        self.init_from = init_from
        self.warm = warm
        self._intent: dict[str, Any] | None = None  # last membership intent written (`_journal`)
        self._journalled_at = -1  # events.count when the intent was last looked at
        self.islands_view: dict[str, dict[str, Any]] = {}  # what /v1/islands serves (`_refresh_islands`)
        self._islands_seen: tuple[int, int] | None = None
        self.waiting_since: float | None = None  # since when no island could train
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

    # -- the state machine -----------------------------------------------------------------
    def start(self) -> None:
        """Ask for the islands (after a restart: re-attach to the live ones, re-place the rest)."""
        if self.resumed:
            self._reattach()
        else:
            # a coordinator Ray restarted before its first checkpoint starts afresh: the islands
            # its predecessor placed are released by name, or their names would collide
            self.pool.sweep(set())
            for i in range(self.cfg.islands.count):
                self._request(i)
        self._demand()

    def _reattach(self) -> None:
        """After a restart, membership as it was, not as the checkpoint saw it: the target
        and the islands asked to leave come from the intent journal (written at each
        change), islands that joined after the checkpoint are adopted, a draining island
        goes on draining, a drained one stays drained, and whatever else of this run is
        left in the pool is released by name before any index is handed out again."""
        intent = load_intent(Path(self.cfg.checkpoint_dir), self.run_id) or {}
        leaving = set(intent.get("leaving", []))
        if "target" in intent:
            self.members.target = self.members.requested = int(intent["target"])
        known = set(self.members.islands)
        for i in self.pool.survivors():
            if i not in known and i not in leaving and (node := self.pool.reattach(i)) is not None:
                self.members.add(i, node, joined_version=self.run.version)
                self.events.add(Event.REATTACH, i, node=node, joined_after_checkpoint=True)
        replace = []
        for i in sorted(known):
            stats = self.members.islands[i]
            if stats.state.gone:
                continue
            node = self.pool.reattach(i)
            if node is not None:
                if i in leaving and stats.state in (IslandState.TRAINING, IslandState.LATE):
                    stats.state = IslandState.DRAINING  # released between rounds, as asked
                elif stats.state == IslandState.LATE:
                    stats.state = IslandState.TRAINING
                self.events.add(Event.REATTACH, i, node=node)
            elif stats.state == IslandState.DRAINING or i in leaving:
                stats.state = IslandState.DRAINED  # it was leaving anyway
            else:
                stats.state = IslandState.STARTING
                replace.append(i)
        self.pool.sweep({i for i, s in self.members.islands.items() if s.state.alive})
        for i in replace:
            self._request(i)
        self._journal()

    def _journal(self) -> None:
        """Write the membership intent when it changed (see `_reattach`); every membership
        change logs an event, so nothing is looked at in steps without one."""
        if not self.cfg.checkpoint.every_rounds or self.events.count == self._journalled_at:
            return
        self._journalled_at = self.events.count
        leaving = sorted(
            i for i, s in self.members.islands.items() if s.state in (IslandState.DRAINING, IslandState.DRAINED)
        )
        intent = {"run_id": self.run_id, "target": self.members.target, "leaving": leaving}
        if intent != self._intent and self.disk.attempt(
            "the membership intent", lambda: save_intent(Path(self.cfg.checkpoint_dir), intent)
        ):
            self._intent = intent

    def step(self) -> bool:
        """One transition; False once the run has ended."""
        if self.phase in (RunPhase.FINISHED, RunPhase.STOPPED, RunPhase.FAILED):
            return False
        if self.controls.aborting.is_set():
            self._finish()
            return False
        if self.phase == RunPhase.STARTING:
            self._handle(self.pool.poll(POLL_S))
            self._expire_joins()
            if not self.members.pending:
                self._begin()
            self._refresh_islands()
            return True
        self.run.stopping = self.controls.stopping.is_set()
        self._boundary()
        self._dispatch()
        self._write_due()
        if not self.flights:  # nothing out, nothing waiting to close
            if self.pacing.done(self.run) or self.run.stopping:
                self._finish()
                return False
            self._check_progress()
        self._handle(self.pool.poll(self._timeout()))
        self._expire()
        while (close := self.pacing.next_close(self.run, self._in_flight())) is not None:
            # a record describes the model its step produced: written before another step
            # changes it (two rounds can close at once, e.g. after a round lost all its work)
            self._write_due()
            self._close(close)
        self._refresh_islands()
        self._journal()
        return True

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
            raise self._no_island_left()
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
        stopped = self.controls.stopping.is_set()
        if stopped:
            if not self.controls.aborting.is_set():
                self.stats.last_eval = self.evaluate()
            if self.cfg.checkpoint.every_rounds:
                self._checkpoint()
            self.events.add(Event.STOPPED, version=self.run.version, rounds_done=self.rounds_done)
        self.phase = RunPhase.STOPPED if stopped else RunPhase.FINISHED
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
            update = self.controls.take()
            if update is not None:
                self._apply_settings(update)
            paused = self.controls.paused.is_set() and not self.controls.stopping.is_set()
            if paused and self.phase == RunPhase.TRAINING:
                self.phase = RunPhase.PAUSED
                self.events.add(Event.PAUSED, version=self.run.version)
            elif not paused and self.phase == RunPhase.PAUSED:
                self.phase = RunPhase.TRAINING
                self.events.add(Event.RESUMED, version=self.run.version)
            self.snapshot["state"] = self.phase.value
        self._membership()

    def _apply_settings(self, update: SettingsUpdate) -> None:
        if update.inner_steps is not None:
            self.cfg.inner_steps = self.run.inner_steps = update.inner_steps
        if update.outer_lr is not None:
            self.outer.set_lr(update.outer_lr)
        self.events.add(Event.SETTINGS, version=self.run.version, **update.model_dump(exclude_none=True))

    def _membership(self) -> None:
        """Apply target and drain requests; keep the live islands at the target."""
        m = self.members
        for kind, value in m.take_requests():
            if kind == "target":
                m.target = value
                self.events.add(Event.TARGET, None, target=value)
            elif kind == "drain" and self._start_drain(value):
                m.target = max(0, m.target - 1)  # a drained island is not replaced
        m.settle()
        self._demand()
        self._expire_joins()
        surplus = len(m.live()) + len(m.pending) - m.target
        for i in sorted(m.live(), reverse=True)[: max(0, surplus)]:
            self._start_drain(i)
        for _ in range(max(0, -surplus)):
            self._request(m.next_index())
        busy = {f.work.island for f in self._in_flight()}
        for i, s in list(m.islands.items()):
            if s.state == IslandState.DRAINING and (i not in busy or self.cfg.elastic.drain == "abandon"):
                self._release(i, IslandState.DRAINED)

    def _demand(self) -> None:
        """Tell the pool (on KubeRay: the autoscaler) how many islands the run wants."""
        if self._demanded != self.members.target:
            self._demanded = self.members.target
            self.pool.demand(self.members.target)
            self.events.add(Event.RESOURCES_REQUESTED, None, bundles=self.members.target)

    def _expire_joins(self) -> None:
        now = self.pool.now()
        for i, since in list(self.members.pending.items()):
            if now - since > self.cfg.elastic.placement_timeout_s:
                del self.members.pending[i]
                self.pool.cancel(i)
                self.events.add(Event.JOIN_FAILED, i, reason="no resources within elastic.placement_timeout_s")

    def _request(self, index: int) -> None:
        start = self.cfg.warm_steps + self.run.completed_steps // max(1, len(self.members.live()))
        self.members.pending[index] = self.pool.now()
        self.pool.request(index, start)
        self.events.add(Event.REQUESTED, index)

    def _start_drain(self, island: int) -> bool:
        """Start draining (or cancel a join); False if the island is already gone."""
        if self.members.pending.pop(island, None) is not None:
            self.pool.cancel(island)
            self.events.add(Event.JOIN_CANCELLED, island)
            return True
        stats = self.members.islands.get(island)
        if stats is None or stats.state not in (IslandState.TRAINING, IslandState.LATE):
            return False
        self.members.mark(island, IslandState.DRAINING)
        self.events.add(Event.DRAIN, island, policy=self.cfg.elastic.drain)
        return True

    def _release(self, island: int, state: IslandState, reason: str | None = None) -> None:
        """Release an island for good; its work still out is lost (and retrained by the next
        owner of its shards), its results already in still count."""
        for flight in [f for f in self._in_flight() if f.work.island == island]:
            self._lose(flight.ticket, f"island {state.value}")
        self.members.mark(island, state, reason)
        self.held.pop(island, None)
        for t in [t for t, (i, _) in self.overdue.items() if i == island]:
            del self.overdue[t]
        self.pool.release(island)
        self.events.add(Event.RELEASED, island, state=state.value)

    def _fail(self, island: int, reason: str, state: IslandState = IslandState.DEAD) -> None:
        """Release an island that died, raised, or is quarantined; the target replaces it
        unless `elastic.replace_dead` is off."""
        stats = self.members.islands.get(island)
        if stats is None or stats.state.gone:
            return
        if stats.state == IslandState.DRAINING:
            self._release(island, IslandState.DRAINED)
            return
        if not self.cfg.elastic.replace_dead:
            self.members.target = max(0, self.members.target - 1)
        self.events.add(Event.CRASH if state == IslandState.DEAD else Event.QUARANTINED, island, reason=reason)
        self._release(island, state, reason)

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
            work.island,
            ticket,
            work.version,
            work.kind,
            work.steps,
            reservation.starts,
            reservation.turn,
            delay,
            work.schedule_step,
            work.fragment,
            tuple(changes),
            work.eager,
            work.send_after,
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
                self._joined(event)
            elif isinstance(event, JoinFailed):
                self.members.pending.pop(event.island, None)
                self.events.add(Event.JOIN_FAILED, event.island, reason=event.reason)
            elif isinstance(event, Done):
                self._arrived(event.ticket, event.island, event.result)
            elif isinstance(event, Failed):
                if event.ticket in self.flights and self.flights[event.ticket].result is None:
                    self._lose(event.ticket, event.reason)
                self.overdue.pop(event.ticket, None)
                self._fail(event.island, event.reason)

    def _joined(self, event: Joined) -> None:
        if event.island not in self.members.pending:
            self.pool.release(event.island)  # cancelled meanwhile
            return
        known = self.members.islands.get(event.island)
        if known is not None:  # re-placed after a coordinator restart: keeps its statistics
            self.members.pending.pop(event.island, None)
            known.state, known.node = IslandState.TRAINING, event.node
            self.events.add(Event.JOIN, event.island, node=event.node, version=self.run.version)
            return
        joined = self.run.version if self.phase != RunPhase.STARTING else 0
        self.members.add(event.island, event.node, joined_version=joined)
        if event.steps_per_s is not None:
            self.speeds.know(event.island, event.steps_per_s)
        self.events.add(Event.JOIN, event.island, node=event.node, version=self.run.version)

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
                self._fail(i, f"hung: no result {grace:g}s past its deadline (elastic.late_grace_s)")

    def _check_progress(self) -> None:
        """Nothing in flight and nothing to close: someone must be able to train soon — an
        island being placed, or a late one whose result may still come. The longest that
        can take is a late island's grace, then its replacement's placement; a run that has
        had no island able to train for that long (replacements keep failing to place) or
        has nothing coming at all has failed."""
        if self.phase == RunPhase.PAUSED or self.members.schedulable():
            self.waiting_since = None
            return
        now = self.pool.now()
        self.waiting_since = now if self.waiting_since is None else self.waiting_since
        patience = self.cfg.elastic.late_grace_s + self.cfg.elastic.placement_timeout_s
        if not (self.members.pending or self.overdue) or now - self.waiting_since > patience:
            raise self._no_island_left()

    def _no_island_left(self) -> RunFailed:
        self.phase = RunPhase.FAILED
        return RunFailed(
            "no island can train: "
            + (
                "; ".join(f"island {i}: {s.state.value} ({s.error})" for i, s in self.members.islands.items())
                or "none joined"
            )
        )

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
            Contribution(r.island, r.version, r.payload, self._weight(r), r.steps, close.fragment) for r in results
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
            self._fail(
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
        self.members.target = self.members.requested = state["target"]
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
            "paused": self.controls.paused.is_set(),
            "stopping": self.controls.stopping.is_set(),
            "disk_errors": self.disk.count,
            "last_disk_error": self.disk.last,
        }

    def set_target(self, n: int) -> int:
        return self.members.set_target(n)

    def add_islands(self, n: int) -> int:
        return self.members.add_islands(n)

    def stop(self, now: bool = False) -> None:
        """Finish the round in flight, checkpoint, write the outputs, end the run. With
        `now` the work in flight is abandoned instead (its data is trained again on
        resume): what `ray job stop` needs, as Ray kills the job a few seconds later."""
        self.controls.stop(now)
        self.events.add(Event.STOP_REQUESTED, version=self.run.version, now=now)
