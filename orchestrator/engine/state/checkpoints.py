"""Coordinator checkpoints that a restart can trust, on storage others may write to.

Each run checkpoints into its own subfolder, `<checkpoint.path>/<run id>/`, so runs
pointed at one folder (a fixed path on a shared volume, reruns into one fixed `--out`)
never number, prune or load each other's files: a new run starts fresh beside the
others, and each resumes its own.

A checkpoint is tensors and plain values (numbers, strings, lists, dicts) only, so it is
loaded with `torch.load(weights_only=True)`: a file planted on the shared volume cannot
run code in the coordinator. Each save is a new numbered file (`state-000012.pt`) with its
SHA-256 beside it (`state-000012.pt.sha256`), written under a unique temporary name,
fsynced, renamed into place, and the folder fsynced, so a crash at any instant leaves
either the previous set or the new one, never a torn file; two runs pointed at one folder
never share a temporary file. The state is streamed into the file, hashed on the way,
and its digest is written after it: no copy of the whole state is made in memory (at
1 B parameters a `BytesIO` and its `getvalue()` tripled the head's checkpoint memory),
and a file whose digest is missing is never trusted. The newest `keep` are kept. Loading walks from the newest
back and takes the first whose checksum matches and that loads: one corrupt or truncated
file costs the rounds since the one before it, not the run.

A sliced coordinator's checkpoint is written S + 1 ways: each coordinator slice streams
its part of the parameters and of the outer state from its own node into a part beside
the checkpoint (`state-000012.pt.part-3`), and the coordinator's file holds the rest and
each part's SHA-256. So the head never pulls the state in through its card to write it
alone, and the write is split over S nodes. The coordinator's file is the commit: a part
whose checkpoint never got its digest is never read, and is overwritten by the next
checkpoint of that number or pruned with it. Loading joins the parts back (checked against
the digests the checkpoint names), so whoever reads a checkpoint sees one state.

torch is imported where tensors are read or written, not by this module: the command
(`archipelago run`) finds and checks runs here before any actor starts, and importing
torch there would add 0.8 s to its start-up (`bench startup`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from archipelago.workers.runtime.storage import (
    Folder,
    HashingWriter,
    UnsafeName,
    digest_name,
    is_plain,
    yield_cpu,
)

from ..types import RunFailed

if TYPE_CHECKING:
    import torch

Location = str | Path | Folder  # a local folder, or object storage by URL (`workers/runtime/storage.py`)

log = logging.getLogger(__name__)

_NAME = re.compile(r"^state-(\d{6,})\.pt$")


def _folder(location: Location) -> Folder:
    return location if isinstance(location, Folder) else Folder(location)


def run_folder(checkpoint_dir: Location, run_id: str) -> Folder:
    """Where run `run_id` keeps its checkpoints and membership intent."""
    try:
        return _folder(checkpoint_dir) / run_id
    except UnsafeName as err:
        raise ValueError(f"run id {run_id!r} cannot name a folder") from err


def runs_in(checkpoint_dir: Location) -> list[str]:
    """The runs with checkpoints in `checkpoint_dir`, the most recently saved first."""
    folder = _folder(checkpoint_dir)
    held = []
    for name, is_dir in folder.entries():
        if not is_dir or not is_plain(name):  # a stray object's name (a backslash) is no run of ours
            continue
        run = folder / name
        if saved := _saved(run):
            held.append((run.modified(saved[0][1]), name))
    return [name for _, name in sorted(held, reverse=True)]


def one_run(checkpoint_dir: Location) -> Folder:
    """The checkpoints of the one run in `checkpoint_dir` (a folder given as `init_from`
    or a reused warm start); refused when there is none or the choice is not clear."""
    folder = _folder(checkpoint_dir)
    if _saved(folder):  # a run's own folder
        return folder
    runs = runs_in(folder)
    if len(runs) != 1:
        what = "no checkpoint" if not runs else f"the checkpoints of {len(runs)} runs ({', '.join(runs)}): name one"
        raise RunFailed(f"{folder} holds {what}")
    return folder / runs[0]


def _saved(folder: Folder) -> list[tuple[int, str]]:
    """(sequence, file name) of the checkpoints in `folder`, newest first."""
    found = [(int(m.group(1)), name) for name, _ in folder.entries() if (m := _NAME.match(name))]
    return sorted(found, reverse=True)


PARTS = "parts"  # a checkpoint's key listing the parts written beside it (name, SHA-256, bounds)


def part_name(checkpoint: str, k: int) -> str:
    """The name of part `k` written beside checkpoint `checkpoint` (a coordinator slice's)."""
    return f"{checkpoint}.part-{k}"


def next_name(location: Location) -> str:
    """The name the next checkpoint in `location` takes (one write at a time per run)."""
    saved = _saved(_folder(location))
    return f"state-{(saved[0][0] + 1) if saved else 1:06d}.pt"


# the engine's state to checkpoint, given where and under which name it will be written
Capture = Callable[[Location, str], dict[str, Any]]


class Beside(Protocol):
    """Parts of a checkpoint's state being written beside it by other processes: `written`
    waits for them and returns each one's record (name, SHA-256, bounds), which the
    checkpoint's own file then names. Resolved on the writing thread."""

    def written(self) -> list[dict[str, Any]]: ...


def _streamed(folder: Folder, name: str, state: dict[str, Any]) -> str:
    """`state` streamed into `name`, hashed on the way (torch hands each tensor's bytes
    over without a copy: the writer never holds the state twice); its SHA-256."""
    import torch

    with folder.open_write(name) as f:
        hashing = HashingWriter(f)
        torch.save(state, hashing)  # type: ignore[arg-type]  # a write-only stream is all torch.save needs
    return hashing.sha256.hexdigest()


def save_part(location: Location, name: str, state: dict[str, Any]) -> str:
    """Write one part beside a checkpoint (by a coordinator slice, from its node); its
    SHA-256, which the checkpoint records."""
    return _streamed(_folder(location), name, state)


def save_checkpoint(location: Location, state: dict[str, Any], keep: int = 3, name: str | None = None) -> str:
    """Write `state` as the newest checkpoint (as `name`, which `next_name` gave, where parts
    are written beside it); keep the newest `keep`. A `Beside` under `PARTS` is waited for
    first. Returns its name."""
    folder = _folder(location)
    saved = _saved(folder)
    name = name or next_name(folder)
    beside: Beside | None = state.get(PARTS)
    if beside is not None:
        state = {**state, PARTS: beside.written()}
    # the digest last: a file without one (a crash between the two) is never trusted, and
    # loading falls back to the checkpoint before it
    folder.write_digest(name, _streamed(folder, name, state))
    pruned = [old for _, old in [(0, name), *saved][keep:]]
    entries = [entry for entry, _ in folder.entries()] if pruned else []
    for old in pruned:
        folder.delete(old)
        folder.delete(digest_name(old))
        for entry in entries:
            if entry.startswith(f"{old}.part-"):
                folder.delete(entry)
    return name


class BackgroundSave:
    """One checkpoint being written on a thread of its own, so the engine's thread goes on
    taking results, handing out work and hearing commands while the state streams to
    disk or object storage (at 1 B parameters, 8 GB: seconds to minutes). The state's
    tensors are the engine's live ones; its owner keeps them unchanged until `result`
    has returned (`Outputs.fence`). Not a daemon thread: a coordinator that fails while
    a checkpoint is being written finishes writing it before the process exits."""

    def __init__(
        self,
        location: Location,
        state: dict[str, Any],
        keep: int,
        name: str | None = None,
        prepare: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`prepare`: what changes `state` on this thread before it is written (the names of
        the islands' states: `IslandStates.confirm`)."""
        self.seconds = 0.0  # the write's own, once it has ended
        self.state = state
        self._name: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._write, args=(location, keep, name, prepare), name="checkpoint-write", daemon=False
        )
        self._thread.start()

    def _write(
        self, location: Location, keep: int, name: str | None, prepare: Callable[[dict[str, Any]], None] | None
    ) -> None:
        yield_cpu()
        t0 = time.perf_counter()
        try:
            if prepare is not None:
                prepare(self.state)
                t0 = time.perf_counter()  # the write's own seconds, not the wait for the islands'
            self._name = save_checkpoint(location, self.state, keep, name)
        except BaseException as err:  # handed to whoever waits for it, on their thread
            self._error = err
        finally:
            self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> str:
        """Wait for the write to end; its file's name, or what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._name is not None
        return self._name


class CheckpointError(RunFailed):
    """Checkpoints exist but none of them is valid (the run does not silently start over)."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint names a file outside its folder (`storage.plain`): written by whoever
    could write the checkpoint volume, not by a run. The resume is refused outright, not
    continued from the checkpoint before it: the volume is not to be trusted."""


def named_files(state: dict[str, Any]) -> list[str]:
    """Every file name a checkpoint holds: its parts, the islands' inner states it keeps
    and each member's (`IslandStates`, `Membership`)."""
    members = (state.get("membership") or state).get("members") or {}  # (top level before format 2)
    return [
        *(part.get("name") for part in state.get(PARTS) or []),
        *state.get("island_states", []),
        *(m.get("inner_state") for m in members.values() if isinstance(m, dict) and m.get("inner_state") is not None),
    ]


def _checked(name: str, state: dict[str, Any]) -> dict[str, Any]:
    """`state`, refused (`UnsafeCheckpoint`) if any name it holds is not a plain name."""
    if unsafe := [each for each in named_files(state) if not is_plain(each)]:
        raise UnsafeCheckpoint(f"checkpoint {name} names {unsafe[0]!r}, which is not a file in its folder")
    return state


def load_checkpoint(folder: Location, branch: int | None = None) -> dict[str, Any] | None:
    """The newest valid checkpoint in `folder`, None if there is none at all; raises
    `CheckpointError` when there are checkpoints and every one is corrupt. With `branch`
    (`checkpoint.resume_from`): the newest checkpoint saved on that branch, else checkpoint
    `branch` itself, which must be valid (a resume from a chosen one never falls back)."""
    found = newest_valid(folder, branch)
    return found[1] if found is not None else None


def _load_one(folder: Folder, name: str) -> tuple[str, dict[str, Any]]:
    """(SHA-256, state) of one checkpoint; raises on any defect (digest, format, content).
    Read twice as a stream, local file or object alike: hashed in chunks, then loaded, so
    the head holds the state once and never its bytes beside it (an object read whole and
    then deserialized peaked at 3x a 100 MB state; now 1.1x, measured by the tests)."""
    import torch

    expected = folder.digest(name)
    if folder.sha256(name) != expected:
        raise ValueError("checksum mismatch")
    with folder.open_read(name) as f:
        state = torch.load(f, weights_only=True)
    if not isinstance(state, dict) or "run_id" not in state:
        raise ValueError("not a coordinator checkpoint")
    return expected, _joined(folder, _checked(name, state))


def _joined(folder: Folder, state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint with its parts read back into it: the parameters whole again and each
    slice's outer state under `outer`, as one coordinator's checkpoint holds them. A part
    whose digest is not the one the checkpoint recorded makes the checkpoint unusable."""
    parts = state.pop(PARTS, None)
    if not parts:
        return state
    import torch

    loaded = []
    for part in parts:
        if folder.sha256(part["name"]) != part["sha256"]:
            raise ValueError(f"part {part['name']}: checksum mismatch")
        with folder.open_read(part["name"]) as f:
            loaded.append(torch.load(f, weights_only=True))
    state["params"] = torch.cat([p["params"] for p in loaded])
    state["outer"] = {**state["outer"], "slices": [p["outer"] for p in loaded]}
    return state


def newest_valid(location: Location, branch: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """(SHA-256, state) of the newest checkpoint whose checksum matches and that loads; with
    `branch`, see `load_checkpoint`."""
    folder = _folder(location)
    saved = _saved(folder)
    if branch is not None:
        return _on_branch(folder, saved, branch)
    problems = []
    for _, name in saved:
        try:
            return _load_one(folder, name)
        except UnsafeCheckpoint:
            raise
        except Exception as err:  # any defect of one file: fall back to the one before
            problems.append(f"{name}: {type(err).__name__}: {err}")
            log.warning(
                "checkpoint %s/%s is unusable (%s: %s); trying the one before", folder, name, type(err).__name__, err
            )
    if problems:
        raise CheckpointError(f"no valid checkpoint in {folder}: " + "; ".join(problems))
    return None


def _on_branch(folder: Folder, saved: list[tuple[int, str]], branch: int) -> tuple[str, dict[str, Any]]:
    for seq, name in saved:  # newest first: what the run resumed from `branch` saved since
        if seq <= branch:
            break
        try:
            found = _load_one(folder, name)
        except UnsafeCheckpoint:
            raise
        except Exception:  # a defective later file: the branch falls back, as any restart does
            continue
        if found[1].get("branch") == branch:
            return found
    chosen = [name for seq, name in saved if seq == branch]
    if not chosen:
        raise CheckpointError(f"checkpoint.resume_from: {folder} has no checkpoint {branch}")
    try:
        return _load_one(folder, chosen[0])
    except UnsafeCheckpoint:
        raise
    except Exception as err:
        raise CheckpointError(f"checkpoint.resume_from: {folder}/{chosen[0]} is unusable ({err})") from err


INTENT = "membership.json"


def save_intent(folder: Location, intent: dict[str, Any]) -> None:
    """The operator's membership intent (target, islands asked to leave), written at once
    whenever it changes: a checkpoint is taken every few rounds, and an add or a drain made
    between two must survive a coordinator restart too."""
    _folder(folder).write(INTENT, json.dumps(intent).encode())


def load_intent(folder: Location, run_id: str) -> dict[str, Any] | None:
    try:
        intent = json.loads(_folder(folder).read(INTENT))
    except (OSError, ValueError):
        return None
    return intent if isinstance(intent, dict) and intent.get("run_id") == run_id else None


def load_initial_weights(path: Path) -> tuple[str, dict[str, torch.Tensor] | torch.Tensor, str]:
    """The weights a run starts from (`init_from`): a `final.pt` (a model `state_dict`) or a
    checkpoint folder (its newest valid checkpoint's flat parameters). Returns (kind,
    weights, SHA-256 of the file read), loaded `weights_only` like every checkpoint."""
    if path.is_dir():
        found = newest_valid(one_run(path))
        if found is None:
            raise RunFailed(f"init_from: no checkpoint in {path}")
        digest, state = found
        return "checkpoint", state["params"], digest
    import torch

    data = path.read_bytes()
    try:
        weights = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:
        raise RunFailed(f"init_from: {path} is not a model state_dict ({type(err).__name__}: {err})") from err
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise RunFailed(f"init_from: {path} is not a model state_dict (a final.pt)")
    return "final", weights, hashlib.sha256(data).hexdigest()
