"""The islands' inner optimizer states that checkpoints name: when to ask an island for
its state, which file each island continues from after a resume, and which files no kept
checkpoint needs any more.

Islands write their own state beside the checkpoints (`workers/runtime/inner_state.py`),
each file with its digest beside it: the coordinator never moves it over the islands'
links. It asks for it only in the rounds before a checkpoint (a state written every round
would cost a model-sized write per island per round), and keeps, for each island, the
newest state whose result it judged — that result's data is what the checkpoint's ledger counts as trained, so the
moments and the ledger agree. A checkpoint records each island's file, only once it is on
storage (`confirm`); the files named by the newest `checkpoint.keep` checkpoints are kept,
the rest deleted once superseded.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from archipelago.workers.runtime.storage import DIGEST, Folder, digest_name, is_plain, is_storage_error
from archipelago.workers.wire.messages import SavedState, WorkKind

from ...config import RunConfig
from ..pacing.registry import pacing_of
from ..state.checkpoints import run_folder
from ..state.membership import IslandStats, Membership
from ..state.records import DiskFaults

FOLDER = "islands"  # beside the run's checkpoints
Confirm = Callable[[dict[str, Any]], None]  # run on a checkpoint's thread before it is written

log = logging.getLogger(__name__)


def _members(state: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """A checkpoint state's members, as `Membership.state_dict` wrote them."""
    return (state.get("membership") or {}).get("members") or {}


def _stored(folder: Folder, name: str) -> tuple[bool, str | None]:
    """Whether state `name` is on storage (its digest is written last), and its digest.
    Where storage could not be asked, it is taken as there, digest unknown (the name kept,
    as before: the checkpoint's own write meets the same fault and counts it)."""
    try:
        return True, folder.digest(name)
    except FileNotFoundError:
        return False, None
    except Exception as err:
        if not is_storage_error(err):
            raise
        return True, None


def state_folder(cfg: RunConfig, run_id: str) -> str | None:
    """Where the run's islands write their inner state; None when none is kept
    (`RunConfig.keeps_island_state`)."""
    return str(run_folder(cfg.checkpoint_dir, run_id) / FOLDER) if cfg.keeps_island_state else None


def save_due(cfg: RunConfig, kind: WorkKind, rounds_done: int, schedulable: int) -> bool:
    """Whether work handed out now should come back with its island's inner state: its
    result may be the last one a checkpoint sees from that island."""
    every = cfg.checkpoint.every_rounds
    if kind != WorkKind.TRAIN or not every:
        return False
    due = min((rounds_done // every + 1) * every, cfg.rounds)
    return due - rounds_done <= pacing_of(cfg).rounds_ahead(schedulable)


class IslandStates:
    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        self.folder = state_folder(cfg, run_id)
        self.window: deque[set[str]] = deque(maxlen=cfg.checkpoint.keep)  # names each kept checkpoint holds
        self.superseded: set[str] = set()  # names judged and replaced since: deleted once no checkpoint names them
        # a state -> the one its island had before: `confirm`'s fallbacks, a chain back to the
        # newest state still on storage (pruned as files are deleted)
        self.before: dict[str, SavedState] = {}

    def settled(self, stats: IslandStats, saved: SavedState) -> None:
        """An island's result came with its state, and the result was judged."""
        if stats.inner_state is not None:
            self.superseded.add(stats.inner_state)
            self.before[saved.name] = SavedState(name=stats.inner_state, sha256=stats.inner_state_sha256)
        stats.inner_state, stats.inner_state_sha256 = saved.name, saved.sha256

    def confirmation(self, members: Membership, ending: Callable[[float], object], wait_s: float) -> Confirm:
        """What a checkpoint captured now runs on its own thread before it is written
        (`confirm`), with what it needs taken here, on the engine's thread: each named
        state's chain of predecessors, and `ending`, the pool's wait for the writes in
        progress."""
        chains: dict[str, list[SavedState]] = {}
        for name in self.named(members):
            chain: list[SavedState] = []
            at = name
            while (previous := self.before.get(at)) is not None and len(chain) < len(self.before):
                chain.append(previous)
                at = previous.name
            chains[name] = chain
        return functools.partial(self.confirm, ending=ending, wait_s=wait_s, chains=chains)

    def confirm(
        self,
        state: dict[str, Any],
        *,
        ending: Callable[[float], object],
        wait_s: float,
        chains: dict[str, list[SavedState]],
    ) -> None:
        """Name in checkpoint `state` only island states that are on storage. An island
        streams its state beside the rounds that follow its result, so the checkpoint that
        names it is captured while it is being written; written as it was, the checkpoint
        named a file a kill of the island then left unwritten, and a resume gave the island
        fresh moments. The writes in progress are waited for (at most `wait_s`: the run's
        silence floor, so a stopped island cannot hold the checkpoint, and with it the
        run's next outer step, for longer); a state whose digest is then not beside it —
        the island died writing, its storage refused it, or it is still writing — is
        replaced by the newest of the island's states before it that is on storage (its
        moments a checkpoint or more older), or by none. The digest read goes into the
        record: the resume checks the file against it. A fault here keeps the name (as
        before): the checkpoint is never lost for it."""
        members = _members(state)
        if self.folder is None or not any(m.get("inner_state") for m in members.values()):
            return
        t0 = time.monotonic()
        try:
            ending(wait_s)
        except Exception:
            log.exception("the islands' state writes could not be waited for")
        if (waited := time.monotonic() - t0) >= wait_s:
            log.warning("the islands' state writes had not all ended after %.0f s: the checkpoint goes on", waited)
        folder = Folder(self.folder)
        for island, member in members.items():
            name = member.get("inner_state")
            if name is None:
                continue
            try:
                self._confirm_one(folder, state, island, member, [SavedState(name=name), *chains.get(name, [])])
            except Exception:
                log.exception("island %s's inner state %s could not be checked: the checkpoint names it", island, name)

    @staticmethod
    def _confirm_one(
        folder: Folder, state: dict[str, Any], island: Any, member: dict[str, Any], candidates: list[SavedState]
    ) -> None:
        for at, candidate in enumerate(candidates):
            stored, digest = _stored(folder, candidate.name)
            if not stored:
                continue
            member["inner_state"] = candidate.name
            member["inner_state_sha256"] = digest or candidate.sha256 or member.get("inner_state_sha256")
            if at:
                state["island_states"] = sorted({*state.get("island_states", []), candidate.name})
                log.warning(
                    "island %s's inner state %s is not on storage: the checkpoint names its state before it, %s",
                    island,
                    candidates[0].name,
                    candidate.name,
                )
            return
        member["inner_state"] = member["inner_state_sha256"] = None
        log.warning(
            "island %s's inner state %s is not on storage: the checkpoint names none", island, candidates[0].name
        )

    def restore_for(self, stats: IslandStats | None) -> SavedState | None:
        """The state an island placed again under its old index continues from."""
        if self.folder is None or stats is None or stats.inner_state is None:
            return None
        return SavedState(name=stats.inner_state, sha256=stats.inner_state_sha256)

    def kept(self, members: Membership) -> list[str]:
        """Every name the kept checkpoints will hold once one more is saved now: the newest
        `keep - 1` saved and the live members' (saved in the checkpoint: a resumed run must
        not delete what the checkpoints before its own still name)."""
        older = list(self.window)[1:] if len(self.window) == self.window.maxlen else list(self.window)
        return sorted(set().union(*older, self.named(members)))

    @staticmethod
    def named(members: Membership) -> set[str]:
        """The states the live members continue from: what a checkpoint taken now names."""
        return {s.inner_state for s in members.islands.values() if s.inner_state is not None}

    @staticmethod
    def named_in(state: dict[str, Any]) -> set[str]:
        """The states checkpoint `state` names for its members (as `confirm` left them)."""
        return {m["inner_state"] for m in _members(state).values() if m.get("inner_state") is not None}

    def load(self, names: list[str]) -> None:
        self.window.append(set(names))

    def checkpointed(self, named: set[str], disk: DiskFaults) -> None:
        """A checkpoint was saved naming `named` (the members' states when it was captured:
        it is written in the background, and the members may have moved on by the time it
        is on disk): the superseded files no kept checkpoint names are deleted."""
        self.window.append(set(named))
        named = set().union(*self.window)
        gone = self.superseded - named
        for name in sorted(gone):
            self._delete(name, disk)
        self.superseded &= named
        self.before = {k: v for k, v in self.before.items() if k not in gone and v.name not in gone}

    def sweep(self, disk: DiskFaults) -> None:
        """The run ended: nothing is in flight, so every file no kept checkpoint names goes
        (states written for work that was then lost, or by a coordinator before a restart)."""
        if self.folder is None:
            return
        folder = Folder(self.folder)
        named = set().union(*self.window)
        entries: list[tuple[str, bool]] = []
        disk.attempt("a listing of the islands' states", lambda: entries.extend(folder.entries()))
        for name, is_dir in entries:
            state = name.removesuffix(DIGEST)
            if not is_dir and state.endswith(".npz") and state not in named and is_plain(name):
                self._delete(name, disk, beside=False)
        self.superseded.clear()

    def _delete(self, name: str, disk: DiskFaults, *, beside: bool = True) -> None:
        """Delete state file `name` and (`beside`) the digest written beside it."""
        if self.folder is not None:
            folder = Folder(self.folder)
            # the digest first: a digest left by a failed delete would vouch for a file gone
            for each in [digest_name(name), name] if beside else [name]:
                disk.attempt(f"deleting {each}", functools.partial(folder.delete, each))
