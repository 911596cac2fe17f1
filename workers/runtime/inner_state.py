"""An island's inner state on checkpoint storage: its optimizer's moments (AdamW's
`exp_avg`/`exp_avg_sq` and step, SGD's momentum) and its error-feedback residuals, so
a resumed run's islands continue where they were instead of re-learning their moments
from zero.

The island writes its own state next to the coordinator's checkpoints (a local folder or
object storage): the state is twice the model, and sending it to the coordinator would
cross the slow links DiLoCo exists to spare. The coordinator only keeps the name and
SHA-256 of each island's newest state whose result it judged, in its checkpoint.

The file is an `.npz` of flat arrays, one per kind of state (every parameter's tensor of
that kind concatenated in parameter order, as `FlatParams` lays them out), read back with
`allow_pickle=False`: a planted file cannot run code, and a file whose digest differs is
refused before anything of it is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
import uuid

import numpy as np
import torch

from archipelago.workers.runtime.storage import Folder
from archipelago.workers.wire.compress import ErrorFeedback
from archipelago.workers.wire.messages import SavedState

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
            arrays[kind] = torch.cat([v.detach().reshape(-1) for v in values]).cpu().numpy()
    return arrays


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


def save(folder: str, island: int, arrays: dict[str, np.ndarray]) -> SavedState:
    """Write the arrays as a new file (never overwriting one a checkpoint may name)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types `allow_pickle` among the names
    data = buffer.getvalue()
    name = f"island-{island:05d}-{uuid.uuid4().hex[:12]}.npz"
    Folder(folder).write(name, data)
    return SavedState(name=name, sha256=hashlib.sha256(data).hexdigest())


def load(folder: str, saved: SavedState) -> dict[str, np.ndarray]:
    try:
        data = Folder(folder).read(saved.name)
    except OSError as err:
        raise InnerStateError(f"{folder}/{saved.name}: {err}") from err
    if hashlib.sha256(data).hexdigest() != saved.sha256:
        raise InnerStateError(f"{folder}/{saved.name}: its SHA-256 is not the one its checkpoint recorded")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (ValueError, OSError) as err:
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


def write(
    folder: str, island: int, optimizer: torch.optim.Optimizer, feedback: dict[int | None, ErrorFeedback]
) -> SavedState | None:
    """Save the island's state as it stands (after an order's last step: the state its
    result leaves the island in); a write that fails is logged and None returned (the
    state saved before stands)."""
    residuals = {_name(k): r for k, f in feedback.items() if (r := f.host()) is not None}
    try:
        return save(folder, island, capture(optimizer, residuals))
    except (OSError, InnerStateError) as err:
        log.warning("island %d could not save its inner state: %s", island, err)
        return None
