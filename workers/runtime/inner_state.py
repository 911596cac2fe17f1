"""An island's inner state on checkpoint storage: its optimizer's moments (AdamW's
`exp_avg`/`exp_avg_sq` and step, SGD's momentum) and its error-feedback residuals, so
a resumed run's islands continue where they were instead of re-learning their moments
from zero.

The island writes its own state next to the coordinator's checkpoints (a local folder or
object storage): the state is twice the model, and sending it to the coordinator would
cross the slow links DiLoCo exists to spare. The coordinator only keeps the name of each
island's newest state whose result it judged, in its checkpoint.

The write is off the round's critical path (`StateWrites`): the island takes a snapshot
(one host copy of the state), its result leaves at once, and the file streams to storage
on a thread of its own while the next round trains. Written inside the round, it held the
whole fleet: at 100 M parameters on this machine's disk, 4.3 s of a 6.5-s round (a copy,
`np.savez` into memory, the bytes copied out, written, then hashed: five passes and three
copies of the state); at 1 B parameters, 8 GB to object storage. The file is streamed and
hashed in one pass, and its SHA-256 is written beside it last (`….npz.sha256`, as the
coordinator's checkpoints are), so a file whose write did not end is never trusted; an
older checkpoint's record carries the digest itself, and is checked against it.

The file is an `.npz` of flat arrays, one per kind of state (every parameter's tensor of
that kind concatenated in parameter order, as `FlatParams` lays them out), read back with
`allow_pickle=False`: a planted file cannot run code, and a file whose digest differs is
refused before anything of it is used. A state that cannot be used — its write cut short
by the island's end, deleted, altered — costs only that island's moments on a resume.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
import zipfile

import numpy as np
import torch

from ..wire.compress import ErrorFeedback
from ..wire.messages import SavedState
from .storage import Folder, HashingWriter, yield_cpu

log = logging.getLogger(__name__)

SCALAR = "scalar:"  # prefix of per-parameter scalar state (AdamW's `step`)
FEEDBACK = "feedback:"  # prefix of an error-feedback residual (by fragment; "all" for none)


class InnerStateError(RuntimeError):
    """A saved inner state that cannot be used (missing, corrupt, or of another model)."""


def capture(optimizer: torch.optim.Optimizer, feedback: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The optimizer's state as flat arrays: a tensor state of every parameter's shape
    becomes one array over all parameters; a scalar state one value per parameter. An
    optimizer of several parameter groups whose states differ (Muon's momentum beside
    AdamW's moments) is captured group by group (keys `g<i>/<kind>`)."""
    groups = [list(g["params"]) for g in optimizer.param_groups]
    if len(groups) == 1:
        arrays = _capture(optimizer, groups[0])
    else:
        arrays = {f"g{i}/{k}": v for i, params in enumerate(groups) for k, v in _capture(optimizer, params).items()}
    arrays.update({FEEDBACK + name: residual for name, residual in feedback.items()})
    return arrays


def _capture(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, np.ndarray]:
    kinds = sorted({k for p in params for k in optimizer.state.get(p, {})})
    arrays: dict[str, np.ndarray] = {}
    for kind in kinds:
        values = [optimizer.state.get(p, {}).get(kind) for p in params]
        if all(v is None for v in values):  # SGD without momentum keeps a None buffer
            continue
        if any(v is None for v in values):
            raise InnerStateError(f"optimizer state {kind!r} is held for some parameters only")
        if all(v.dim() == 0 for v in values):
            arrays[SCALAR + kind] = np.array([float(v) for v in values], dtype=np.float64)
        else:
            arrays[kind] = _flat_on_host(values)
    return arrays


def _flat_on_host(values: list[torch.Tensor]) -> np.ndarray:
    """The tensors one after another in one new host array, each copied straight into its
    place: no concatenation on the device (a state-sized buffer beside the state), one copy."""
    dtype = functools.reduce(torch.promote_types, (v.dtype for v in values))
    host = torch.empty(sum(v.numel() for v in values), dtype=dtype)
    offset = 0
    for v in values:
        host[offset : offset + v.numel()].copy_(v.detach().reshape(-1))
        offset += v.numel()
    return host.numpy()


def restore(optimizer: torch.optim.Optimizer, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Put `capture`'s arrays back into a fresh optimizer over the same parameters;
    returns the error-feedback residuals. (The learning-rate schedule is not state: a
    resumed island is placed at the run's position in it, as a joining island is.)"""
    groups = [list(g["params"]) for g in optimizer.param_groups]
    for key, values in arrays.items():
        if key.startswith(FEEDBACK):
            continue
        group, slash, kind = key.partition("/")
        if slash and group[1:].isdigit() and int(group[1:]) < len(groups):
            _restore(optimizer, groups[int(group[1:])], kind, values)
        elif not slash and len(groups) == 1:
            _restore(optimizer, groups[0], key, values)
        else:
            raise InnerStateError(f"{key!r} does not fit this optimizer's {len(groups)} parameter groups")
    return {k[len(FEEDBACK) :]: v for k, v in arrays.items() if k.startswith(FEEDBACK)}


def _restore(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], key: str, values: np.ndarray) -> None:
    scalar = key.startswith(SCALAR)
    expected = len(params) if scalar else sum(p.numel() for p in params)
    if values.size != expected:
        raise InnerStateError(f"{key!r} holds {values.size} values; this model needs {expected}")
    offset = 0
    for i, p in enumerate(params):
        state = optimizer.state[p]
        if scalar:
            state[key[len(SCALAR) :]] = torch.tensor(float(values[i]), dtype=torch.float32)
        else:
            n = p.numel()
            state[key] = torch.from_numpy(values[offset : offset + n].copy()).to(p.device).view_as(p)
            offset += n


def new_name(island: int) -> str:
    """A new file's name (never one a checkpoint may already name)."""
    return f"island-{island:05d}-{uuid.uuid4().hex[:12]}.npz"


def save(folder: str, island: int, arrays: dict[str, np.ndarray], name: str | None = None) -> SavedState:
    """Write the arrays as file `name` (a new one by default), streamed and hashed in one
    pass, then its SHA-256 beside it."""
    store, name = Folder(folder), name or new_name(island)
    with store.open_write(name) as out:
        hashing = HashingWriter(out)
        # `np.savez`'s layout (read back by `np.load`), written through the hashing stream,
        # which `np.savez` refuses (it takes a stream only if it can also be read); the
        # stubs want a stream that closes too, which ZipFile never does to one it is given
        zipped = zipfile.ZipFile(hashing, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)  # type: ignore[call-overload]
        with zipped as npz:
            for key, values in arrays.items():
                with npz.open(f"{key}.npy", "w", force_zip64=True) as entry:
                    np.lib.format.write_array(entry, values, allow_pickle=False)
    digest = hashing.sha256.hexdigest()
    store.write_digest(name, digest)
    return SavedState(name=name, sha256=digest)


def load(folder: str, saved: SavedState) -> dict[str, np.ndarray]:
    """The arrays of a saved state, checked against the digest its record carries, else
    the one written beside it (missing: the write never ended). Read twice as a stream,
    hashed in chunks and then loaded array by array, so the host holds the state once: read
    whole into memory and parsed from there, an 800 MB state peaked 1,563 MB above the
    process's start (782 MB now; at 1 B parameters, 8 GB of AdamW moments read twice over).
    Its files are never rewritten, so the two reads see the same bytes."""
    store = Folder(folder)
    try:
        expected = saved.sha256 or store.digest(saved.name)
        if store.sha256(saved.name) != expected:
            raise InnerStateError(f"{folder}/{saved.name}: its SHA-256 is not the one recorded for it")
        with store.open_read(saved.name) as f, np.load(f, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as err:
        raise InnerStateError(f"{folder}/{saved.name}: {err}") from err


def _name(fragment: int | None) -> str:
    return "all" if fragment is None else str(fragment)


def continue_from(
    folder: str,
    saved: SavedState,
    optimizer: torch.optim.Optimizer,
    feedback: dict[int | None, ErrorFeedback],
    island: int,
    decay: float = 1.0,
) -> bool:
    """Put an island's saved state into its fresh optimizer and error-feedback residuals
    (by fragment, each decaying by `decay`). A state that cannot be used (gone, altered, of another model) is logged
    and the island starts with fresh moments, as a joining island does: a resume is never
    refused for it. Returns whether it was restored."""
    try:
        residuals = restore(optimizer, load(folder, saved))
    except InnerStateError as err:
        optimizer.state.clear()
        log.warning("island %d starts with a fresh optimizer: %s", island, err)
        return False
    for name, residual in residuals.items():
        feedback[None if name == "all" else int(name)] = kept = ErrorFeedback(decay)
        kept.residual = residual
    return True


def snapshot(optimizer: torch.optim.Optimizer, feedback: dict[int | None, ErrorFeedback]) -> dict[str, np.ndarray]:
    """The island's whole inner state as host arrays of its own (what a save writes)."""
    return capture(optimizer, {_name(k): r for k, f in feedback.items() if (r := f.host()) is not None})


class StateWrites:
    """An island's inner-state writes, each on a thread of its own, so the result that
    asked for the state leaves at once (see the module's docstring). The thread first takes
    the snapshot (one host copy), which the island's next steps wait for (`taken`: a hot
    path does not change a state being copied), then writes it at a lower CPU priority
    beside them. One write at a time: a new one waits for the one before, so the host holds
    one snapshot at most. Not a daemon thread: an island process that ends while a state
    is being written finishes writing it first; a pool ending its islands waits for `wait`
    (bounded) before it kills them."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._taken = threading.Event()
        self._taken.set()

    def start(
        self, folder: str, island: int, optimizer: torch.optim.Optimizer, feedback: dict[int | None, ErrorFeedback]
    ) -> SavedState:
        """Save the island's state as it stands (after an order's last step: the state its
        result leaves the island in); the file's name. A state that cannot be saved is
        logged, and its file never written (a resume then gives the island fresh moments)."""
        self.wait()
        name, self._taken = new_name(island), threading.Event()
        thread = threading.Thread(
            target=self._save,
            args=(folder, island, optimizer, feedback, name, self._taken),
            name="inner-state-write",
            daemon=False,
        )
        thread.start()
        self._thread = thread  # started: `ended`, on another thread, may join it from now on
        return SavedState(name=name)

    @staticmethod
    def _save(
        folder: str,
        island: int,
        optimizer: torch.optim.Optimizer,
        feedback: dict[int | None, ErrorFeedback],
        name: str,
        taken: threading.Event,
    ) -> None:
        t0 = time.perf_counter()
        try:
            try:
                arrays = snapshot(optimizer, feedback)
            finally:
                taken.set()
            yield_cpu()  # after the snapshot, which the next steps wait for
            save(folder, island, arrays, name)
        except Exception as err:  # of the state or of storage: the run goes on, a resume gives fresh moments
            log.warning("island %d could not save its inner state %s: %s", island, name, err)
            return
        log.debug("island %d wrote its inner state %s in %.2f s", island, name, time.perf_counter() - t0)

    def taken(self) -> None:
        """Until the snapshot being taken (if any) is: the state is the island's again."""
        self._taken.wait()

    def wait(self) -> None:
        """Until the write in progress (if any) has ended. Cleared only once it has: an
        `ended` beside it must see the write until then."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def ended(self, timeout_s: float | None = None) -> None:
        """Until the write in progress when asked (if any) has ended, or `timeout_s`, for a
        caller beside the island's own thread (which may start the next write meanwhile:
        that one is not waited for, and the island's record of its writes is left to it)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
