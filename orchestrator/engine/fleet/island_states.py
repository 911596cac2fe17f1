"""The islands' inner optimizer states that checkpoints name: when to ask an island for
its state, which file each island continues from after a resume, and which files no kept
checkpoint needs any more.

Islands write their own state beside the checkpoints (`workers/runtime/inner_state.py`),
each file with its digest beside it: the coordinator never moves it over the islands'
links. It asks for it only in the rounds before a checkpoint (a state written every round
would cost a model-sized write per island per round), and keeps, for each island, the
newest state whose result it judged — that result's data is what the checkpoint's ledger counts as trained, so the
moments and the ledger agree. A checkpoint records each island's file; the files named by
the newest `checkpoint.keep` checkpoints are kept, the rest deleted once superseded.
"""

from __future__ import annotations

import functools
from collections import deque

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.engine.pacing.registry import pacing_of
from archipelago.orchestrator.engine.state.checkpoints import run_folder
from archipelago.orchestrator.engine.state.membership import IslandStats, Membership
from archipelago.orchestrator.engine.state.records import DiskFaults
from archipelago.workers.runtime.storage import DIGEST, Folder, digest_name, is_plain
from archipelago.workers.wire.messages import SavedState, WorkKind

FOLDER = "islands"  # beside the run's checkpoints


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

    def settled(self, stats: IslandStats, saved: SavedState) -> None:
        """An island's result came with its state, and the result was judged."""
        if stats.inner_state is not None:
            self.superseded.add(stats.inner_state)
        stats.inner_state, stats.inner_state_sha256 = saved.name, saved.sha256

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

    def load(self, names: list[str]) -> None:
        self.window.append(set(names))

    def checkpointed(self, named: set[str], disk: DiskFaults) -> None:
        """A checkpoint was saved naming `named` (the members' states when it was captured:
        it is written in the background, and the members may have moved on by the time it
        is on disk): the superseded files no kept checkpoint names are deleted."""
        self.window.append(set(named))
        named = set().union(*self.window)
        for name in sorted(self.superseded - named):
            self._delete(name, disk)
        self.superseded &= named

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
            for each in [name, digest_name(name)] if beside else [name]:
                disk.attempt(f"deleting {each}", functools.partial(folder.delete, each))
