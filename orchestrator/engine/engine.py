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

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from archipelago.workers.runtime.storage import Folder
from archipelago.workers.tasks.task import Task

from ..algorithms.dylu import SpeedTracker
from .commands import Answer, Command, Inbox
from .fleet.fleet import Fleet
from .outcomes import (
    Halt,
    Judged,
    Lost,
    Outcome,
    Place,
    Promote,
    Release,
    StartDrain,
    StopWork,
    Transition,
)
from .outputs.outputs import Outputs
from .outputs.persistence import RunCore, capture
from .outputs.startup import Startup
from .pool import (
    Done,
    Failed,
    IslandPool,
    Joined,
    JoinFailed,
    PoolEvent,
    Preempting,
    Progress,
    Unreachable,
)
from .requests import OperatorRequests
from .state.checkpoints import Location
from .state.flights import Close, Flight
from .state.lifecycle import Lifecycle
from .state.loop_time import Part
from .state.views import RunStatus
from .step.outer import take_step
from .threads import torch_threads
from .types import Event, RunFailed, RunPhase, SliceLost
from .warm_start import WarmStart
from .work.inflight import POLL_S, InFlight

log = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class EngineParts(RunCore):
    """Everything a round engine works with beyond what its checkpoints hold (`RunCore`),
    built and wired by `build.assemble`, the run's one composition root (the coordinator
    actor and the tests build through it). `inbox`: the run's operator commands (shared
    by its phases); a phase that does not `takes_changes` (the warm start) honours pause
    and stop and leaves settings and membership changes for the next; one that
    `hands_over` (the warm start again) leaves its islands running when it finishes, for
    the next phase's pool to take over."""

    task: Task
    model: torch.nn.Module
    pool: IslandPool
    inbox: Inbox
    speeds: SpeedTracker  # measured inner steps per second, every mode
    startup: Startup
    lifecycle: Lifecycle  # the run's phase (`state/lifecycle.py`), which its outputs show
    outputs: Outputs
    inflight: InFlight
    fleet: Fleet
    requests: OperatorRequests
    checkpoints: Folder  # this run's checkpoint folder (local or object storage)
    resumed: bool  # continued from one of its checkpoints
    init_from: dict[str, str] | None = None  # the weights the model was loaded with (`build.start_from`)
    warm: WarmStart | None = None  # the warm start the model was loaded from; the run continues its data
    takes_changes: bool = True
    hands_over: bool = False


@dataclass(kw_only=True, eq=False, repr=False)
class RoundEngine(EngineParts):
    """The state machine over its parts: it moves the run's phase (`lifecycle`); its own
    state is the records due, what the current step carried out and the summary once it
    has ended."""

    def __post_init__(self) -> None:
        self.events, self.recorder, self.disk = self.outputs.events, self.outputs.recorder, self.outputs.disk
        self.due: list[int] = []  # recorded rounds due, written after the next dispatch
        self.applied: list[Outcome] = []  # what this step carried out (`_apply`)
        self.clock0 = 0.0  # the pool's clock when training began (`_clock`)
        self.summary: dict[str, Any] = {}

    @property
    def phase(self) -> RunPhase:
        return self.lifecycle.now

    # -- the state machine -----------------------------------------------------------------
    def start(self) -> None:
        """Ask for the islands (after a restart: re-attach to the live ones, re-place the rest)."""
        self.fleet.start()

    def submit(self, command: Command, *, key: str | None = None) -> Answer:
        """An operator's command, validated now, applied by the engine at its own pace
        (`key`: its idempotency key, `Inbox.submit`)."""
        return self.inbox.submit(command, key=key)

    def step(self) -> Transition:
        """One transition: the phase before and after it and what was carried out on the
        way (`outcomes.py`); false once the run has ended."""
        before, self.applied = self.phase, []
        running = self._step()
        return Transition(before=before, after=self.phase, outcomes=tuple(self.applied), running=running)

    def _step(self) -> bool:
        if self.lifecycle.ended:
            return False
        self.requests.heard_stop()
        if self.inbox.aborting.is_set():
            self._finish()
            return False
        if self.phase == RunPhase.STARTING:
            self._handle(self.pool.poll(POLL_S))
            self.fleet.expire_joins()
            if not self.members.pending:
                self._begin()
            self.outputs.refresh_islands()
            return True
        self.run.stopping = self.inbox.stopping.is_set()
        self._boundary()
        with self.stats.loop.timed(Part.DISPATCH):
            self._dispatch()
        if not self.outputs.initial_asked:  # off the critical path: the islands train meanwhile
            self._initial_eval()
        self._write_due()
        if not self.flights:  # nothing out, nothing waiting to close
            if self.pacing.done(self.run) or self.run.stopping:
                self._finish()
                return False
            self.fleet.check_progress(self.phase == RunPhase.PAUSED, bool(self.inflight.overdue))
        self.run.now = self.pool.now()
        wake = self.pacing.wake(self.run, self.in_flight)
        with self.stats.loop.timed(Part.WAIT):
            events = self.pool.poll(self.inflight.timeout(wake), wake=wake)
        self._handle(events)
        self._apply(self.inflight.expire())
        if self.pacing.spent(self.run):
            self._apply(self.inflight.stragglers(self.members.schedulable()))
        self.run.now = self.pool.now()
        # paused: results that come back wait for the resume (no outer step while the status says paused)
        while self.phase != RunPhase.PAUSED and (close := self.pacing.next_close(self.run, self.in_flight)) is not None:
            # a record describes the model its step produced: written before another step
            # changes it (two rounds can close at once, e.g. after a round lost all its work)
            self._write_due()
            with self.stats.loop.timed(Part.STEP):
                self._close(close)
        self.outputs.refresh_islands()
        self.fleet.journal()
        return True

    def execute(self) -> dict[str, Any]:
        """Run to the end; returns the summary (also written to `out_dir/summary.json`).
        An error nothing below foresaw ends the run as a `RunFailed` naming it, with the
        last checkpoint as it was — one being written is finished first — (a lost
        coordinator slice still restarts the coordinator)."""
        try:
            self.start()
            while self.step():
                pass
        except (RunFailed, SliceLost):
            self.outputs.finish_writing()
            raise
        except Exception as err:
            self.outputs.finish_writing()
            log.exception("the round engine failed")
            self.lifecycle.to(RunPhase.FAILED)
            raise RunFailed(
                f"the round engine failed at version {self.run.version}: {type(err).__name__}: {err} "
                f"(the last checkpoint in {self.checkpoints} is intact)"
            ) from err
        return self.summary

    # -- phases ------------------------------------------------------------------------------
    def _begin(self) -> None:
        if not self.members.schedulable():
            self.lifecycle.to(RunPhase.FAILED)
            raise self.fleet.no_island_left()
        self.stats.start_training()
        self.clock0 = self.pool.now()
        self.startup.began()
        self.lifecycle.to(RunPhase.TRAINING)
        self.publisher.publish(self.run.version)
        self.outputs.update_snapshot(self.run.version)

    def _finish(self) -> None:
        """End the run: work still out is given back to the ledger (trained again on
        resume); a stopped run is evaluated and checkpointed where it stands."""
        stopped = self.inbox.stopping.is_set()
        if not stopped:  # the budget is spent: every round is complete, those no close covered too
            last = max(self.due, default=self.rounds_done)  # (H lowered mid-run in an async mode)
            self.due.extend(range(last + 1, self.run.rounds + 1))
        self._write_due()  # a step taken is recorded, so the checkpoint's version and rounds agree
        self.inflight.abandon("the run ended before its outer step")
        if stopped:
            if not self.inbox.aborting.is_set():
                self.outputs.evaluate(self.run.version)
            if self.cfg.checkpoint.every_rounds:
                self.outputs.checkpoint(self.run.version, self.rounds_done, self.capture)
            self.events.add(Event.STOPPED, version=self.run.version, rounds_done=self.rounds_done)
        self.lifecycle.to(RunPhase.STOPPED if stopped else RunPhase.FINISHED)
        if self.takes_changes:  # the run's last phase: nothing more can be asked of it
            self.inbox.ended = True
        extra = {
            "clock_seconds": self._clock(),
            "init_from": self.init_from,
            "warm_start": self.warm.record if self.warm is not None else None,
            "startup": self.startup.as_dict(),
        }
        self.summary = self.outputs.summarise(self.run.version, extra, self.ledger)
        self.outputs.update_snapshot(self.run.version)
        self.outputs.refresh_islands()
        self.states.sweep(self.disk)  # nothing is in flight: the states no checkpoint names go
        if not (self.hands_over and self.phase == RunPhase.FINISHED):
            for i in list(self.members.islands):
                if not self.members.islands[i].state.gone:
                    self.pool.release(i)
        for i in list(self.members.pending):
            self.pool.cancel(i)

    # -- operator requests, applied between rounds ------------------------------------------------
    def _boundary(self) -> None:
        if self.pacing.between_rounds(list(self.flights.values())):
            self.lifecycle.to(self.requests.between_rounds(self.phase))
        busy, held = self.inflight.busy(), self.inflight.held()
        self._scale(busy)
        self.members.prune(held)  # long-released islands folded into the totals (none with work to judge)

    def _scale(self, busy: set[int], *, commands: bool = True) -> None:
        """The operator's membership commands (unless not `commands`), then the scaling
        policy's decisions."""
        self._apply(self.fleet.take_requests(commands=commands))
        self._apply(self.fleet.decide(busy))

    # -- work out -------------------------------------------------------------------------------
    def _initial_eval(self) -> None:
        """The evaluation of the version the run starts from, once its first work is out:
        nothing changes the global model before the first outer step, which comes later
        (`Outputs.first_evaluation`: a warm start's final one when it is of this model)."""
        t0 = time.perf_counter()
        self.outputs.first_evaluation(self.warm, self.run.version)
        self.startup.first_eval_s = time.perf_counter() - t0

    def _dispatch(self) -> None:
        if self.phase != RunPhase.TRAINING:
            return
        idle = self.inflight.free(self.members.schedulable())
        if not idle:
            return
        for work in self.pacing.plan(self.run, idle):
            self.inflight.hand_out(self.fleet.first_work(work))

    # -- work back ------------------------------------------------------------------------------
    def _handle(self, events: list[PoolEvent]) -> None:
        for event in events:
            if isinstance(event, Joined):
                self.startup.joined(event.startup)
                built = self.publisher.joined(event.island, event.built_sha256)
                speed = self.fleet.joined(event, starting=self.phase == RunPhase.STARTING, built=built)
                if speed is not None:
                    self.speeds.know(event.island, speed)
            elif isinstance(event, JoinFailed):
                self.fleet.join_failed(event)
            elif isinstance(event, Done):
                self.startup.stepped(event.result.started_at)
                self._apply(self.inflight.arrived(event.ticket, event.island, event.result))
            elif isinstance(event, Preempting):
                self._apply(self.fleet.preempting(event.island, event.notice_s))
            elif isinstance(event, Progress):
                self.inflight.progressed(event)
            elif isinstance(event, Unreachable):
                self.inflight.unreachable(event.ticket, event.island, event.reason)
            elif isinstance(event, Failed):
                if event.ticket is not None:
                    if event.ticket in self.flights and self.flights[event.ticket].result is None:
                        self.inflight.lose(event.ticket, event.reason)
                    self.inflight.overdue.pop(event.ticket, None)
                self._apply([Lost(island=event.island, reason=event.reason)])

    # -- the outer step ------------------------------------------------------------------------------
    def _close(self, close: Close) -> None:
        self.outputs.fence()  # a checkpoint being written reads the state this step changes
        flights = close.flights  # every flight a pacing closes has its result
        results = [f.result for f in flights if f.result is not None]
        # a pacing closes once every result has crossed its (simulated) link, so `due` is
        # past: when the new version could first have left for the islands
        due = max((f.delivered_at for f in flights), default=None)
        contributions = [self.inflight.contribution(r, close.fragment, close.factors) for r in results]
        with torch_threads(self.outputs.step_threads(self.pacing.islands_wait)):
            outcome = take_step(
                self.outer,
                self.admission,
                contributions,
                close.expected,
                self.run.version,
                close.anchor,
                close.fragment,
                close.scale,
            )
        verdicts = outcome.verdicts
        if outcome.gap is not None:
            self.stats.window.gap_penalty = outcome.gap
        if outcome.stepped or close.advances:
            self.startup.outer()
            self.run.version += 1
            self.publisher.stepped(self.run.version, close.fragment)
            self.outer.anchor(self.run.version, keep_from=max(self.run.base, self.run.version - 1))
            with self.stats.loop.timed(Part.PUBLISH):
                self.publisher.publish(
                    self.run.version, due, merged=len(contributions), values=self.inflight.sizes.of(close.fragment)
                )
                self.inflight.refresh(self.members.spares(), self.run.version)
        self.run.closes += 1
        judged = [
            self.inflight.settle(
                flight,
                verdict,
                close.ages.get(flight.work.island, verdict.staleness) if close.ages else verdict.staleness,
            )
            for flight, verdict in zip(flights, verdicts)
        ]
        self.due.extend(self.pacing.closed(self.run, close))
        self._apply(judged)  # once every result of the close is settled (`InFlight.settle`)

    def _apply(self, outcomes: Iterable[Outcome]) -> None:
        """Carry out what the collaborators decided, in order, each outcome's consequences
        before the next outcome (a verdict that quarantines an island releases it, which
        gives up its work, before the next verdict is counted); `step()` reports them."""
        for outcome in outcomes:
            self.applied.append(outcome)
            match outcome:
                case Judged():
                    self._apply(self.fleet.judged(outcome))
                case Lost():
                    self._apply(self.fleet.fail(outcome))
                case Release(island=island, state=state, reason=reason):
                    self.inflight.forget(island, state)
                    self.fleet.released(island, state, reason)
                case Place(island=island):
                    self.fleet.place(island)
                case Promote(island=island):
                    self.fleet.promote(island)
                case StartDrain(island=island):
                    self.fleet.start_drain(island)
                case StopWork(island=island, notice_s=notice_s):
                    self.inflight.stop(island, notice_s)
                case Halt(seconds=seconds, reason=reason):
                    # the failed island's replacement is placed while all stand still
                    self._scale(set(), commands=False)
                    self._halt(seconds, reason)

    def _halt(self, seconds: float, reason: str) -> None:
        """Stop-the-world recovery (a bench's checkpoint-restart baseline, `simulation.restart_s`): every island's work,
        out or arrived and not yet stepped, is given up (its batches go back to the
        ledger), and nothing trains for `seconds` — what a job restarted from its last
        checkpoint loses; the run goes on from its last outer step."""
        self.inflight.abandon(f"the run restarts: {reason}")
        self.pacing.restart(self.run)
        self.events.add(Event.RESTART, version=self.run.version, reason=reason, halt_s=seconds)
        self.pool.sleep_until(self.pool.now() + seconds)
        self._handle(self.pool.poll(0.0))  # replacements that joined while it stood still train at once

    # -- records, evaluation, checkpoints -----------------------------------------------------------
    def _clock(self) -> float:
        """Seconds on the pool's clock since training began here: real time, or simulated
        time on a simulated fleet's virtual clock (`archipelago.orchestrator.bench.simulation`)."""
        return self.pool.now() - self.clock0

    @property
    def rounds_done(self) -> int:
        return self.stats.rounds_done

    def capture(self, location: Location, name: str) -> dict[str, Any]:
        """The checkpoint of this engine's committed state, to be written as `name` in
        `location` (`engine/outputs/persistence.py`)."""
        return capture(self, self.flights, location, name)

    def _write_due(self) -> None:
        with self.stats.loop.timed(Part.RECORD):
            for rnd in self.due:
                self.outputs.record(rnd, self.run.version, self._clock(), self.capture)
            self.outputs.collect(wait=False)  # records whose evaluation came back since
        self.due.clear()

    @property
    def in_flight(self) -> list[Flight]:
        return self.inflight.in_flight()

    @property
    def flights(self) -> dict[int, Flight]:
        """Work out, and results waiting for their outer step (`InFlight`)."""
        return self.inflight.flights

    # -- what the control plane reads ----------------------------------------------------------
    @property
    def snapshot(self) -> RunStatus:
        return self.outputs.snapshot

    @property
    def islands_view(self) -> dict[str, dict[str, Any]]:
        return self.outputs.islands_view

    def status(self) -> RunStatus:
        return self.outputs.status()
