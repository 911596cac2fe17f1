"""The fleet: every island's life from request to release — placing, joining, draining,
releasing, replacing and, after a coordinator restart, re-attaching — so the round engine
only hands out work and takes it back.

What to do is decided by two small policies that return decisions and touch nothing:
`ScalingPolicy` (keep the live islands at the target and the hot spares behind them:
which spare to promote, which to place, which to drain, which drained ones to release)
and `FailurePolicy` (an island that died, hung or is quarantined: release it, and
replace it or lower the target). `Fleet` carries the
decisions out through the island pool and logs each as an event; what needs more than
the fleet (a release gives up the island's work in flight, a restart halts everyone)
it returns as outcomes (`outcomes.py`) for the engine to apply.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, replace

from ...config import RunConfig
from ..commands import Drain, Inbox, Preempt, SetTarget
from ..outcomes import (
    FleetDecision,
    Halt,
    Judged,
    Lost,
    Outcome,
    Place,
    Promote,
    Release,
    StartDrain,
    StopWork,
)
from ..pool import IslandPool, Joined, JoinFailed
from ..state.checkpoints import load_intent, run_folder, save_intent
from ..state.flights import RunState, Work
from ..state.membership import Membership
from ..state.records import DiskFaults, EventLog
from ..step.admission import Admission
from ..types import Decision, Event, IslandState, RunFailed
from .island_states import IslandStates

log = logging.getLogger(__name__)


class ScalingPolicy:
    """Live islands (training or late) meet the target, with `spares` hot spares behind
    them: a place short in the target goes to a spare at once (lowest index first), and
    the islands being placed make up what is still short, spares included (a placement
    joins as whatever is short when it arrives: `Fleet.joined`). A surplus releases
    spares first, then drains the highest live indices; a draining island is released
    once its round is in (at once with `elastic.drain: abandon`)."""

    def __init__(self, abandon: bool, spares: int) -> None:
        self.abandon, self.spares = abandon, spares

    def decide(self, members: Membership, busy: set[int]) -> list[FleetDecision]:
        live, spares = members.live(), sorted(members.spares())
        promoted = spares[: max(0, members.target - len(live))]
        standing = spares[len(promoted) :]
        live_short = max(0, members.target - len(live) - len(promoted))
        spares_short = max(0, self.spares - len(standing))
        # placements beyond what is short will train: a live island makes room for each
        surplus = len(live) + len(promoted) + max(0, len(members.pending) - spares_short) - members.target
        decisions: list[FleetDecision] = [Promote(island=i) for i in promoted]
        dropped = sorted(standing, reverse=True)[: max(0, len(standing) - self.spares)]
        decisions += [Release(island=i, state=IslandState.DRAINED) for i in dropped]
        decisions += [StartDrain(island=i) for i in sorted(live, reverse=True)[: max(0, surplus)]]
        first = members.next_index()
        placed = max(0, live_short + spares_short - len(members.pending))
        decisions += [Place(island=first + k) for k in range(placed)]
        leaving = {d.island for d in decisions if isinstance(d, StartDrain)}
        decisions += [
            Release(island=i, state=IslandState.DRAINED)
            for i, s in members.islands.items()
            if (s.state == IslandState.DRAINING or i in leaving) and (i not in busy or self.abandon)
        ]
        return decisions


@dataclass(frozen=True, kw_only=True)
class Retire:
    """Release a failed island; `replace`: the target stays (a new island takes its place)."""

    state: IslandState
    replace: bool
    halt_s: float | None = None  # then every island's work is given up and the fleet stands still this long


class FailurePolicy:
    def __init__(self, replace_dead: bool, restart_s: float | None) -> None:
        """`restart_s`: every failure halts the whole fleet this long (None: never)."""
        self.replace_dead, self.restart_s = replace_dead, restart_s

    def decide(self, state_now: IslandState, failure: IslandState) -> Retire | None:
        """None for an island already gone; one that was draining just leaves as drained; a
        spare held no work and no place in the target (another is placed behind it)."""
        if state_now.gone:
            return None
        if state_now == IslandState.DRAINING:
            return Retire(state=IslandState.DRAINED, replace=False)
        if state_now == IslandState.SPARE:
            return Retire(state=failure, replace=True)
        return Retire(state=failure, replace=self.replace_dead, halt_s=self.restart_s)


class Fleet:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        run_id: str,
        pool: IslandPool,
        members: Membership,
        run: RunState,
        states: IslandStates,
        admission: Admission,
        events: EventLog,
        disk: DiskFaults,
        inbox: Inbox | None,
        scaling: ScalingPolicy,
        failures: FailurePolicy,
        resumed: bool,
    ) -> None:
        """The run's parts it reads and changes: its membership and state, where islands keep
        their inner state and what an island placed again continues from (`states`);
        admission, which counts each island's bad updates in a row (towards quarantine).
        `inbox`: the operator's commands, when this phase takes membership changes (a warm
        start does not). `scaling` and `failures`: the policies whose decisions it carries
        out, built by the composition root (`build.assemble`) from the config. `resumed`: the
        run continues from a checkpoint (`start` re-attaches)."""
        self.cfg, self.run_id, self.pool, self.members, self.run = cfg, run_id, pool, members, run
        self.states, self.admission = states, admission
        self.events, self.disk, self.inbox = events, disk, inbox
        self.spares = cfg.elastic.spares
        self.scaling, self.failures = scaling, failures
        self._demanded: int | None = None
        self._intent: dict | None = None  # last membership intent written (`journal`)
        # the intent on storage is the truth until `start` has read it: a command journalled by
        # a restarted coordinator before `_reattach` wrote the checkpoint's older membership over it
        # (a drain accepted after that checkpoint was lost, and the drained island placed again)
        self.resumed, self._intent_read = resumed, not resumed
        self._journalled_at = -1  # events.count when the intent was last looked at
        self._config_sha = hashlib.sha256(self.cfg.model_dump_json().encode()).hexdigest()
        self.waiting_since: float | None = None  # since when no island could train
        self._seek: dict[int, int] = {}  # promoted spares -> where their first work puts the lr schedule

    # -- start and restart -----------------------------------------------------------------
    def start(self) -> None:
        """Ask for the islands (after a restart: re-attach to the live ones, re-place the rest)."""
        if self.resumed:
            self._reattach()
        else:
            # a coordinator Ray restarted before its first checkpoint starts afresh: the islands
            # its predecessor placed are released by name, or their names would collide
            self.pool.sweep(set())
            for i in range(self.members.target + self.spares):
                self.place(i)
        self.demand()

    def _reattach(self) -> None:
        """After a restart, membership as it was, not as the checkpoint saw it: the target
        and the islands asked to leave come from the intent journal (written at each
        change), islands that joined after the checkpoint are adopted, a draining island
        goes on draining, a drained one stays drained, and whatever else of this run is
        left in the pool is released by name before any index is handed out again."""
        intent = load_intent(run_folder(self.cfg.checkpoint_dir, self.run_id), self.run_id) or {}
        # the journal lives on a writable volume: its values are held to what the config allows
        # (a planted target of 1,000,000 asked for a million placement groups)
        leaving = {i for i in intent.get("leaving", []) if isinstance(i, int) and not isinstance(i, bool)}
        target = intent.get("target")
        if isinstance(target, int) and not isinstance(target, bool):
            elastic = self.cfg.elastic
            self.members.target = min(max(target, elastic.min_islands), elastic.max_islands)
            if self.members.target != target:
                log.warning(
                    "membership intent: target %d is outside elastic.min/max_islands; using %d",
                    target,
                    self.members.target,
                )
        if self.inbox is not None:
            self.inbox.settle(self.members.target)  # commands count from the journalled target, not the checkpoint's
            self.inbox.remember(intent.get("keys", []))  # a client retrying a command whose answer the restart lost
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
            self.place(i)
        # the membership is the intent's now: commands may journal over it, once the settings and
        # the pause accepted since the checkpoint are taken again (a resume with another config:
        # the config's win) and journalled — under the inbox's lock, so that a command a client
        # retries meanwhile comes after them, never under them
        with self.inbox.lock if self.inbox is not None else contextlib.nullcontext():
            self._intent_read = True
            if self.inbox is not None and intent.get("config_sha256") == self._config_sha:
                self.inbox.restore_accepted(intent)
            self.journal()

    def journal(self) -> bool:
        """Write the membership intent when it changed (see `_reattach`); every membership
        change logs an event or is a command the inbox just accepted, so nothing is looked
        at in steps without one. The intent is the members' target and leaving islands with
        the inbox's accepted changes not yet taken on top, and the idempotency keys of the
        newest membership changes (`Inbox.keyed`), written under the inbox's lock
        (`Inbox.journal` calls this from the caller's thread). False if it could not be
        written, or not yet: a resumed run's `start` has not read the intent."""
        if not self.cfg.checkpoint.every_rounds:
            return True
        if not self._intent_read:
            return False
        with self.inbox.lock if self.inbox is not None else contextlib.nullcontext():
            queued_target, queued_leaving = self.inbox.queued() if self.inbox is not None else (None, set())
            durable = self.inbox.durable() if self.inbox is not None else {}
            if (
                self.events.count == self._journalled_at
                and not queued_leaving
                and queued_target is None
                and all(self._intent is not None and self._intent.get(k) == v for k, v in durable.items())
            ):
                return True
            self._journalled_at = self.events.count
            islands = list(self.members.islands.items())  # one read (the caller's thread may be another)
            leaving = {i for i, s in islands if s.state in (IslandState.DRAINING, IslandState.DRAINED)}
            target = self.members.target if queued_target is None else queued_target
            intent = {
                "run_id": self.run_id,
                "target": target,
                "leaving": sorted(leaving | queued_leaving),
                "keys": self.inbox.keyed() if self.inbox is not None else [],
                **durable,
                "config_sha256": self._config_sha,
            }
            if intent == self._intent:
                return True
            folder = run_folder(self.cfg.checkpoint_dir, self.run_id)
            if not self.disk.attempt("the membership intent", lambda: save_intent(folder, intent)):
                return False
            self._intent = intent
            return True

    # -- between rounds ----------------------------------------------------------------------
    def take_requests(self, *, commands: bool = True) -> list[Outcome]:
        """Apply the operator's accepted target and drain commands (from the inbox, when this
        phase takes them and `commands`); tell the pool what the run wants; give up joins
        past their time.
        Returns what a preemption notice asks of the engine (`preempting`); the scaling
        policy's decisions follow (`decide`, applied by the engine)."""
        m = self.members
        out: list[Outcome] = []
        inbox = self.inbox if commands else None
        for command in inbox.take_membership() if inbox is not None else []:
            if isinstance(command, SetTarget):
                m.target = command.islands
                self.events.add(Event.TARGET, None, target=command.islands)
            elif isinstance(command, Drain):
                # accepted (and journalled) as one island fewer: a drained island is not
                # replaced, nor is one that failed between the command and now
                self.start_drain(command.island)
                m.target = max(0, m.target - 1)
            elif isinstance(command, Preempt):
                out += self.preempting(command.island, command.notice_s)
        if inbox is not None:
            inbox.settle(m.target)
        self.demand()
        self.expire_joins()
        return out

    def decide(self, busy: set[int]) -> list[FleetDecision]:
        """The scaling policy's decisions for the membership as it stands (`busy`: islands
        with work out), for the engine to apply."""
        return self.scaling.decide(self.members, busy)

    def demand(self) -> None:
        """Tell the pool (on KubeRay: the autoscaler) how many islands the run wants, spares
        included."""
        wanted = self.members.target + self.spares
        if self._demanded != wanted:
            self._demanded = wanted
            self.pool.demand(wanted)
            self.events.add(Event.RESOURCES_REQUESTED, None, bundles=wanted)

    def expire_joins(self) -> None:
        now = self.pool.now()
        for i, since in list(self.members.pending.items()):
            if now - since > self.cfg.elastic.placement_timeout_s:
                del self.members.pending[i]
                self.pool.cancel(i)
                self.events.add(Event.JOIN_FAILED, i, reason="no resources within elastic.placement_timeout_s")

    def schedule_step(self) -> int:
        """Where the run's inner lr schedule stands: where an island starting now begins it."""
        return self.cfg.warm_steps + self.run.completed_steps // max(1, len(self.members.live()))

    def place(self, index: int) -> None:
        self.members.pending[index] = self.pool.now()
        restore = self.states.restore_for(self.members.islands.get(index))
        self.pool.request(index, self.schedule_step(), state_folder=self.states.folder, restore=restore)
        self.events.add(Event.REQUESTED, index)

    def promote(self, island: int) -> None:
        """A hot spare takes a place in the target: it trains from its next work, which puts
        its lr schedule where the run's stands (it was built when it was placed) and weighs
        its first contribution as a newcomer's."""
        stats = self.members.islands[island]
        self.members.mark(island, IslandState.TRAINING)
        stats.joined_version, stats.last_progress = self.run.version, time.time()
        self._seek[island] = self.schedule_step()
        self.events.add(Event.PROMOTED, island, version=self.run.version)

    def first_work(self, work: Work) -> Work:
        """`work` as a just-promoted spare must have it: at the run's place in the lr
        schedule (pacings that set it every time already do)."""
        step = self._seek.pop(work.island, None)
        return replace(work, schedule_step=step) if step is not None and work.schedule_step is None else work

    def start_drain(self, island: int, *, spare: bool = False) -> bool:
        """Start draining (or cancel a join); False if the island is already gone (or a hot
        spare, unless `spare`: one being preempted leaves, and another is placed behind it)."""
        if self.members.pending.pop(island, None) is not None:
            self.pool.cancel(island)
            self.events.add(Event.JOIN_CANCELLED, island)
            return True
        stats = self.members.islands.get(island)
        leaves = (IslandState.TRAINING, IslandState.LATE, *((IslandState.SPARE,) if spare else ()))
        if stats is None or stats.state not in leaves:
            return False
        self.members.mark(island, IslandState.DRAINING)
        self.events.add(Event.DRAIN, island, policy=self.cfg.elastic.drain)
        return True

    def preempting(self, island: int, notice_s: float | None = None) -> list[Outcome]:
        """`island` will be taken away (`notice_s` from now, when known): it drains — no new
        work, released once what it has is in, or lost if it is gone first — and, the target
        unchanged, the scaling policy places its replacement now rather than after it is
        gone. Its work out stops in time and sends what it has (`StopWork`), unless
        `elastic.partial_on_notice` is off."""
        if not self.start_drain(island, spare=True):
            return []
        self.events.add(Event.PREEMPTING, island, notice_s=notice_s)
        return [StopWork(island=island, notice_s=notice_s)] if self.cfg.elastic.partial_on_notice else []

    def released(self, island: int, state: IslandState, reason: str | None = None) -> None:
        """An island released for good (`Release`: the engine gave up its work first)."""
        self._seek.pop(island, None)
        self.members.mark(island, state, reason)
        self.pool.release(island)
        self.events.add(Event.RELEASED, island, state=state.value)

    def fail(self, lost: Lost) -> list[Outcome]:
        """An island died, raised, hung or is quarantined: as the failure policy decides —
        its release, and under a restart policy the halt in which its replacement is placed."""
        island = lost.island
        stats = self.members.islands.get(island)
        retire = self.failures.decide(stats.state, lost.state) if stats is not None else None
        if retire is None:
            return []
        if retire.state == IslandState.DRAINED:
            return [Release(island=island, state=IslandState.DRAINED)]
        if not retire.replace:
            self.members.target = max(0, self.members.target - 1)
        crash = Event.CRASH if lost.state == IslandState.DEAD else Event.QUARANTINED
        self.events.add(crash, island, reason=lost.reason)
        out: list[Outcome] = [Release(island=island, state=retire.state, reason=lost.reason)]
        if retire.halt_s is not None:
            out.append(Halt(seconds=retire.halt_s, reason=f"island {island} failed ({lost.reason})"))
        return out

    def judged(self, judged: Judged) -> list[Outcome]:
        """A verdict on an island's result: a rejection is logged; an island is quarantined
        at its `quarantine_after`-th bad update in a row."""
        island, verdict = judged.island, judged.verdict
        if not verdict.admitted and verdict.decision != Decision.DROP:
            detail = {} if judged.version is None else {"version": judged.version}
            self.events.add(Event.REJECTION, island, reason=verdict.why, **detail)
        if self.admission.record(island, verdict):
            reason = f"quarantined after {self.admission.quarantine_after} bad updates in a row"
            return [Lost(island=island, reason=reason, state=IslandState.QUARANTINED)]
        return []

    # -- the pool's news ---------------------------------------------------------------------
    def joined(self, event: Joined, starting: bool, built: bool | None = None) -> float | None:
        """Take in a placed island; returns its known speed (steps/s) for the pacing, if any.
        `built`: whether the version 0 it built matched the coordinator's (None: not asked)."""
        version0 = {} if built is None else {"version0": "built" if built else "built differently: downloads it"}
        if built is False:
            log.warning("island %d built version 0 differently from the coordinator: it downloads it", event.island)
        if event.island not in self.members.pending:
            self.pool.release(event.island)  # cancelled meanwhile
            return None
        known = self.members.islands.get(event.island)
        role = self._role()
        if known is not None:  # re-placed after a coordinator restart: keeps its statistics
            self.members.pending.pop(event.island, None)
            known.state, known.node, known.last_progress = role, event.node, time.time()
            restored = {} if event.restored is None else {"inner_state": "restored" if event.restored else "lost"}
            self.events.add(Event.JOIN, event.island, node=event.node, version=self.run.version, **restored)
            return None
        self.members.add(event.island, event.node, joined_version=0 if starting else self.run.version, state=role)
        adopted = {"adopted": True} if event.adopted else {}
        spare = {"spare": True} if role == IslandState.SPARE else {}
        self.events.add(
            Event.JOIN, event.island, node=event.node, version=self.run.version, **version0, **adopted, **spare
        )
        return event.steps_per_s

    def _role(self) -> IslandState:
        """What an island joining now becomes: a place in the target while one is short,
        else a hot spare while those are short (a surplus one trains, and the scaling
        policy drains the surplus)."""
        members = self.members
        if len(members.live()) >= members.target and len(members.spares()) < self.spares:
            return IslandState.SPARE
        return IslandState.TRAINING

    def join_failed(self, event: JoinFailed) -> None:
        self.members.pending.pop(event.island, None)
        self.events.add(Event.JOIN_FAILED, event.island, reason=event.reason)

    def check_progress(self, paused: bool, overdue: bool) -> None:
        """Nothing in flight and nothing to close: someone must be able to train soon — an
        island being placed, or a late one (`overdue`) whose result may still come. The
        longest that can take is a late island's grace, then its replacement's placement;
        a run that has had no island able to train for that long (replacements keep failing
        to place) or has nothing coming at all has failed."""
        if paused or self.members.schedulable():
            self.waiting_since = None
            return
        now = self.pool.now()
        self.waiting_since = now if self.waiting_since is None else self.waiting_since
        patience = self.cfg.elastic.late_grace_s + self.cfg.elastic.placement_timeout_s
        if not (self.members.pending or overdue) or now - self.waiting_since > patience:
            raise self.no_island_left()

    def no_island_left(self) -> RunFailed:
        return RunFailed(
            "no island can train: "
            + (
                "; ".join(f"island {i}: {s.state.value} ({s.error})" for i, s in self.members.islands.items())
                or "none joined"
            )
        )
