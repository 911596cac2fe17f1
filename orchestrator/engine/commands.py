"""The one way an operator's request reaches a run: a typed, frozen command per action,
validated on the caller's thread (the control plane's, a signal handler's, a test's) by
`Inbox.submit`, and answered there with an `Ack` or a `Refused` carrying a `Refusal`
reason. The engine takes what was accepted at its own pace: a stop at its next step,
pause, settings and membership changes at a round boundary, so a change never tears a
round in half.

The inbox belongs to the run, not to a phase: a run with a warm start hands the same
inbox to both phases, so a pause, a stop, a target or a settings change made during the
warm start is honoured by the main phase (settings and membership changes wait for it).

A command may come with an idempotency key (the control plane's `Idempotency-Key`): a
client that got no answer (a timeout, a coordinator restarting) cannot know whether its
command was applied, and retrying `AddIslands` blindly raised the target twice. The inbox
answers a key it has accepted with the first answer and applies nothing; the keys of
membership changes are journalled with them (`keyed`), so a restarted coordinator knows
them too (`remember`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .state.membership import JOINING, Membership
from .types import IslandState

log = logging.getLogger(__name__)


class SettingsUpdate(BaseModel):
    """Settings that may change mid-run (validated like the config file); the control
    plane's request body is this model too. Strict: `true`, `"2"` and `2.0` are not an H."""

    model_config = ConfigDict(extra="forbid", strict=True)
    inner_steps: int | None = Field(None, ge=1, le=100_000, description="H from the next round on", examples=[100])
    outer_lr: float | None = Field(None, gt=0, le=100, description="outer learning rate from the next step on")
    quorum: int | None = Field(None, ge=1, description="async quorum rule: results that open a step", examples=[3])
    grace_cap: float | None = Field(None, ge=0, le=100, description="async quorum rule: window cap, x a round")
    grace_k: float | None = Field(None, ge=0, le=100, description="async quorum rule: window = median + k x MAD")
    age_power: float | None = Field(None, ge=0, le=100, description="async quorum rule: weight x (1 + age)^-power")
    hang_after_steps: float | None = Field(
        None, gt=0, le=1_000_000, description="heartbeats: hung after this many step times without progress"
    )


@dataclass(frozen=True, kw_only=True)
class SetTarget:
    islands: int


@dataclass(frozen=True, kw_only=True)
class AddIslands:
    count: int = 1


@dataclass(frozen=True, kw_only=True)
class Drain:
    island: int


@dataclass(frozen=True, kw_only=True)
class Preempt:
    """`island` is about to be taken away (its node drained or reclaimed; a scheduler that
    knows first): it is given no new work and its replacement is placed now, while it
    finishes what it has, or the part of it that ends within `notice_s` (None: unknown, it
    stops after the step in progress; `elastic.partial_on_notice`) — the target stays."""

    island: int
    notice_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Pause:
    pass


@dataclass(frozen=True, kw_only=True)
class Resume:
    pass


@dataclass(frozen=True, kw_only=True)
class Stop:
    now: bool = False  # abandon the work in flight (a job being stopped) instead of finishing the round


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    settings: SettingsUpdate


Command = SetTarget | AddIslands | Drain | Preempt | Pause | Resume | Stop | UpdateSettings


class Refusal(str, Enum):
    """Why a command was refused (the control plane answers 4xx from this, never from an
    exception class)."""

    OUT_OF_BOUNDS = "out_of_bounds"  # a target outside [elastic.min_islands, elastic.max_islands]
    UNKNOWN_ISLAND = "unknown_island"
    NOT_NOW = "not_now"  # the run or the island is in a state that cannot take it
    INVALID = "invalid"  # settings the mode cannot take, or nothing to change


@dataclass(frozen=True, kw_only=True)
class Ack:
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refused:
    reason: Refusal
    message: str


Answer = Ack | Refused

KEPT_KEYS = 1024  # idempotency keys answered from memory: the newest, across every command
JOURNALLED_KEYS = 64  # ... of membership changes, written with the membership intent
MAX_KEY_LENGTH = 255


def signature(command: Command) -> dict[str, Any]:
    """What a command asks, as plain values: a key sent again with another command is an error."""
    fields = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
    if isinstance(command, UpdateSettings):
        fields = {"settings": command.settings.model_dump(exclude_none=True)}
    return {"command": type(command).__name__, **fields}


def _switch(event: threading.Event, on: bool) -> None:
    if on:
        event.set()
    else:
        event.clear()


class Inbox:
    """Accepted commands, waiting for the engine. Thread-safe: `submit` runs on any thread,
    `take_*` on the engine's. `requested` is the island target once every queued change is
    applied: commands read and move it under the lock, so two adds make +2, a target then
    an add compose, and a drain below `min_islands` is refused when asked.

    An accepted change of membership is durable before it is acknowledged: `journal` (set
    by the phase that takes membership changes; the fleet's membership intent) is written
    under `lock` with the change queued, so a coordinator that dies before its engine takes
    the command restarts with it. The engine writes the intent under the same lock, so the
    two writers never put an older view over a newer one."""

    def __init__(
        self, *, target: int, min_islands: int, max_islands: int, check: Callable[[SettingsUpdate, int], None]
    ) -> None:
        self.lock = threading.RLock()  # reentrant: `journal` reads the queue under it
        self.min_islands, self.max_islands, self._check = min_islands, max_islands, check
        self.requested = target
        self.paused = threading.Event()
        self.stopping = threading.Event()
        self.aborting = threading.Event()  # stop now
        self.ended = False  # the whole run has ended: nothing more is taken
        self.members: Membership | None = None  # the phase that takes membership changes (None: warm start)
        self._settings: SettingsUpdate | None = None
        self.accepted: dict[str, Any] = {}  # every settings change accepted this run, merged (journalled)
        self._membership: list[SetTarget | Drain | Preempt] = []
        self.journal: Callable[[], bool] | None = None  # writes the membership intent; False if it could not
        # idempotency key -> (the command's signature, its acknowledgement, journalled with membership)
        self._keys: OrderedDict[str, tuple[dict[str, Any], Ack, bool]] = OrderedDict()
        self._key: tuple[str, dict[str, Any]] | None = None  # the key of the command being taken, if any

    def submit(self, command: Command, *, key: str | None = None) -> Answer:
        """Validate and take `command`. With `key`: a key already accepted returns its first
        answer and changes nothing (one sent with another command is refused); refusals are
        not kept (nothing changed: the same key may try again)."""
        with self.lock:
            if key is None:
                return self._take(command)
            if not 0 < len(key) <= MAX_KEY_LENGTH:
                return Refused(
                    reason=Refusal.INVALID, message=f"an idempotency key has 1 to {MAX_KEY_LENGTH} characters"
                )
            sig = signature(command)
            seen = self._keys.get(key)
            if seen is not None:
                if seen[0] != sig:
                    return Refused(
                        reason=Refusal.INVALID, message=f"idempotency key {key!r} was sent with another command"
                    )
                return seen[1]
            self._key = (key, sig)  # a membership change journals it with itself (`_queue`)
            try:
                answer = self._take(command)
            finally:
                self._key = None
            if isinstance(answer, Ack) and key not in self._keys:
                self._keep(key, sig, answer, journalled=False)
            return answer

    def _keep(self, key: str, sig: dict[str, Any], ack: Ack, *, journalled: bool) -> None:
        self._keys[key] = (sig, ack, journalled)
        while len(self._keys) > KEPT_KEYS:
            self._keys.popitem(last=False)

    def keyed(self) -> list[list[Any]]:
        """The newest keys of membership changes, as [key, signature, detail]: what the
        membership intent journals (called under `lock`)."""
        kept = [[k, sig, ack.detail] for k, (sig, ack, journalled) in self._keys.items() if journalled]
        return kept[-JOURNALLED_KEYS:]

    def remember(self, keyed: Any) -> None:
        """Keys journalled by the coordinator before a restart (`keyed`). From a file on a
        writable volume: what is not a well-formed entry is skipped."""
        with self.lock:
            for entry in keyed if isinstance(keyed, list) else []:
                if (
                    isinstance(entry, list)
                    and len(entry) == 3
                    and isinstance(entry[0], str)
                    and 0 < len(entry[0]) <= MAX_KEY_LENGTH
                    and isinstance(entry[1], dict)
                    and isinstance(entry[2], dict)
                ):
                    self._keep(entry[0], entry[1], Ack(detail=entry[2]), journalled=True)

    def _take(self, command: Command) -> Answer:
        if self.ended:
            return Refused(reason=Refusal.NOT_NOW, message="the run has ended")
        match command:
            case SetTarget(islands=n):
                return self._target(n)
            case AddIslands(count=k):
                if k < 1:
                    return Refused(reason=Refusal.OUT_OF_BOUNDS, message=f"count {k} must be at least 1")
                return self._target(self.requested + k)
            case Drain(island=i):
                return self._drain(i)
            case Preempt(island=i, notice_s=notice_s):
                return self._preempt(i, notice_s)
            case Pause():
                return self._pause(True)
            case Resume():
                return self._pause(False)
            case Stop(now=now):
                if now:
                    self.aborting.set()
                self.stopping.set()
                return Ack(detail={"action": "stop", "now": now})
            case UpdateSettings(settings=update):
                return self._update(update)
        raise TypeError(f"not a command: {command!r}")

    def _target(self, n: int) -> Answer:
        if not self.min_islands <= n <= self.max_islands:
            return Refused(
                reason=Refusal.OUT_OF_BOUNDS,
                message=f"target {n} is outside [elastic.min_islands, elastic.max_islands] = "
                f"[{self.min_islands}, {self.max_islands}]",
            )
        return self._queue(SetTarget(islands=n), n, {"target": n})

    def _leaving(self, island: int, what: str, *also: IslandState) -> Refused | None:
        """Why `island` cannot be asked to leave now (training, late, joining or one of
        `also`), or None."""
        if self.members is None:
            return Refused(reason=Refusal.NOT_NOW, message=f"the run is in its warm start: {what} islands after it")
        standing = self.members.standing(island)
        if standing is None:
            return Refused(reason=Refusal.UNKNOWN_ISLAND, message=f"no island {island}")
        if standing not in (JOINING, IslandState.TRAINING.value, IslandState.LATE.value, *(s.value for s in also)):
            return Refused(reason=Refusal.NOT_NOW, message=f"island {island} is {standing}, not training")
        return None

    def _preempt(self, island: int, notice_s: float | None) -> Answer:
        """`island` is leaving and is replaced (the target stays); a hot spare too."""
        refused = self._leaving(island, "preempt", IslandState.SPARE)
        if refused is not None:
            return refused
        if notice_s is not None and not (math.isfinite(notice_s) and notice_s >= 0):
            return Refused(reason=Refusal.INVALID, message=f"notice_s {notice_s} is not a time from now")
        return self._queue(Preempt(island=island, notice_s=notice_s), self.requested, {"preempting": island})

    def _drain(self, island: int) -> Answer:
        """Ask `island` to leave (not replaced: the target drops by one); one still joining
        is cancelled instead."""
        refused = self._leaving(island, "drain")
        if refused is not None:
            return refused
        if Drain(island=island) in self._membership:
            return Refused(reason=Refusal.NOT_NOW, message=f"island {island} is already asked to leave")
        if self.requested - 1 < self.min_islands:
            return Refused(
                reason=Refusal.OUT_OF_BOUNDS,
                message=f"draining island {island} would leave {self.requested - 1} islands, "
                f"below elastic.min_islands = {self.min_islands}",
            )
        return self._queue(Drain(island=island), self.requested - 1, {"draining": island})

    def _queue(self, command: SetTarget | Drain | Preempt, requested: int, detail: dict[str, Any]) -> Answer:
        """Queue a change of membership, made durable first (`journal`), with its idempotency
        key: one that could not be written is not accepted — nothing changed, the caller retries."""
        before = self.requested
        self.requested = requested
        self._membership.append(command)
        ack, key = Ack(detail=detail), self._key
        if key is not None:
            self._keep(key[0], key[1], ack, journalled=True)
        if not self._journalled():
            self._membership.pop()
            self.requested = before
            if key is not None:
                del self._keys[key[0]]
            return self._unwritten()
        return ack

    def _pause(self, paused: bool) -> Answer:
        """Pause or resume, journalled like a change of membership: a coordinator restarted
        after the answer is paused as the operator left it."""
        was = self.paused.is_set()
        _switch(self.paused, paused)
        if not self._journalled():
            _switch(self.paused, was)
            return self._unwritten()
        return Ack(detail={"action": "pause" if paused else "resume"})

    def _journalled(self) -> bool:
        return self.journal is None or self.journal()

    @staticmethod
    def _unwritten() -> Refused:
        return Refused(
            reason=Refusal.NOT_NOW,
            message="the change could not be written to the membership intent (the coordinator is restarting, "
            "or the run's disk errors say why); nothing was changed: retry",
        )

    def durable(self) -> dict[str, Any]:
        """What the membership intent journals besides the membership (called under `lock`):
        the settings accepted, merged, and whether the run is paused, so that a coordinator
        restarted from an older checkpoint takes them again (`restore_accepted`)."""
        return {"settings": dict(self.accepted), "paused": self.paused.is_set()}

    def restore_accepted(self, intent: dict[str, Any]) -> None:
        """After a restart: the settings and the pause the journal holds, taken again (the
        settings validated as if sent now; what does not validate is logged and dropped,
        like a file planted on the volume)."""
        if intent.get("paused") is True:  # first: the settings' journal below writes the pause with them
            self.paused.set()
        settings = intent.get("settings")
        if isinstance(settings, dict) and settings:
            try:
                update = SettingsUpdate.model_validate(settings)
            except ValueError as err:
                log.warning("membership intent: its settings %s are not valid (%s); not taken", settings, err)
            else:
                answer = self.submit(UpdateSettings(settings=update))
                if isinstance(answer, Refused):
                    log.warning("membership intent: its settings %s were refused: %s", settings, answer.message)

    def _update(self, update: SettingsUpdate) -> Answer:
        changes = update.model_dump(exclude_none=True)
        if not changes:
            fields = ", ".join(SettingsUpdate.model_fields)
            return Refused(reason=Refusal.INVALID, message=f"nothing to change: give one or more of {fields}")
        try:
            self._check(update, self.requested)
        except ValueError as err:
            return Refused(reason=Refusal.INVALID, message=str(err))
        merged = self._settings.model_dump(exclude_none=True) if self._settings else {}
        before, accepted = self._settings, dict(self.accepted)
        self._settings = SettingsUpdate(**{**merged, **changes})
        self.accepted.update(changes)
        if not self._journalled():
            self._settings, self.accepted = before, accepted
            return self._unwritten()
        return Ack(detail=changes)

    # -- the engine's side ------------------------------------------------------------------
    def take_settings(self) -> SettingsUpdate | None:
        with self.lock:
            update, self._settings = self._settings, None
        return update

    def take_membership(self) -> list[SetTarget | Drain | Preempt]:
        with self.lock:
            taken, self._membership = self._membership, []
        return taken

    def queued(self) -> tuple[int | None, set[int]]:
        """What accepted changes the engine has not taken yet add to the membership: the
        target they make (None: no change of target queued) and the islands they ask to
        leave (drained, or preempted: a restart finds those leaving as it finds a drain)."""
        with self.lock:
            changes = [c for c in self._membership if isinstance(c, SetTarget | Drain)]
            leaving = {c.island for c in self._membership if isinstance(c, Drain | Preempt)}
            return (self.requested if changes else None), leaving

    def settle(self, target: int) -> None:
        """After the engine applied the changes: with none queued, `requested` is the target
        (the engine's own changes, e.g. a failed island not replaced, are in it)."""
        with self.lock:
            if not self._membership:
                self.requested = target
