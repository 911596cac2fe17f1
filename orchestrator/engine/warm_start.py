"""The warm start: training shared by every island before they fork (`warm_start` in the
config). It is a run of its own — data-parallel over the run's islands, Local SGD over them
(an average every few steps: the bytes of data-parallel divided by that H), or one island
alone — under `out_dir/warm_start`, with its own checkpoints, so a coordinator restarted
during it resumes it and one restarted after it does not train it again. When it ends,
`warm_start.json` there says so; the main run then starts from its weights, continues
its data positions (no batch is trained twice) and its learning-rate schedule (its
inner warmup is over before the first outer step). A finished warm start can be reused
by other runs (`warm_start.path`), which is how a benchmark compares methods from one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from archipelago.workers.runtime.storage import durable_write
from archipelago.workers.wire.handoff import params_digest, params_sha256

from ..config import RunConfig, WarmStartMode
from ..mode_settings import Mode
from .state.checkpoints import newest_valid, run_folder
from .types import RunFailed

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MARKER = "warm_start.json"


def warm_dir(cfg: RunConfig) -> Path:
    """Where the run's warm start is (or is trained)."""
    return Path(cfg.warm_start.path) if cfg.warm_start.path else Path(cfg.out_dir) / "warm_start"


def version0_file(cfg: RunConfig) -> Path | None:
    """Where the run's first parameters are for islands to load instead of downloading
    them (`islands.build_version0`): the finished warm start's, written beside it by the
    coordinator that forks from it (None: islands build them from the seed)."""
    if not cfg.islands.build_version0 or not cfg.warm_steps:
        return None
    return warm_dir(cfg) / "version0.npy"


def version0_digest(cfg: RunConfig, params: np.ndarray) -> str | None:
    """With `islands.build_version0`: the SHA-256 islands' first parameters must match, the
    warm start's written where they load it (once, by rename: never read half-written)."""
    if not cfg.islands.build_version0:
        return None
    path = version0_file(cfg)
    if path is not None and not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, params)
        os.replace(tmp, path)
    return params_sha256(params)


def warm_run_id(run_id: str) -> str:
    return f"{run_id}-warm"


def warm_config(cfg: RunConfig) -> RunConfig:
    """The warm phase of `cfg`: `warm_steps` inner steps in rounds of `inner_steps` (of
    `warm_start.inner_steps` in mode average; one round when they do not divide), on the
    main run's data shards and seed, following the main run's learning-rate schedule from
    its start, checkpointed at least at its end. An average steps on the run's coordinator
    slices (a mean over parts is the whole mean, bit for bit: at 1 B parameters on 16
    islands its 64 GB each way an average then pass through no one card); data-parallel
    gradients on one coordinator, as mode ddp's."""
    steps, mode = cfg.warm_steps, cfg.warm_start.mode
    h = cfg.warm_start.inner_steps if mode == WarmStartMode.AVERAGE else cfg.inner_steps
    h = h if steps % h == 0 else steps
    out = warm_dir(cfg)
    data = cfg.model_dump(mode="json")
    data.update(rounds=steps // h, inner_steps=h, out_dir=str(out), data_shards=cfg.num_shards)
    data["warm_start"] = {"steps": 0, "mode": mode.value, "path": None}
    data["inner"]["schedule_steps"] = cfg.schedule_steps
    data["checkpoint"].update(every_rounds=max(1, cfg.checkpoint.every_rounds), path=str(out / "checkpoint"))
    data["outer"]["merge"] = "mean"  # the shared start is the plain average
    data["compression"]["downlink"] = "none"  # the shared start is trained exactly
    if mode == WarmStartMode.DDP:
        data["mode"] = Mode.DDP.value
        data["coordinator"]["shards"] = 1  # gradients step on one coordinator, as mode ddp's do
        return RunConfig.model_validate(data)
    # outer SGD lr 1 without momentum applies the mean Δ whole: the islands' average (one
    # island: its own training), with nothing of DiLoCo's outer rule yet
    data["mode"] = Mode.DILOCO.value
    data["outer"].update(optimizer="sgd", lr=1.0, momentum=0.0)
    if mode == WarmStartMode.SINGLE:
        data["islands"]["count"] = 1
        data["elastic"]["min_islands"] = 1
    return RunConfig.model_validate(data)


def pending(cfg: RunConfig, run_id: str) -> bool:
    """Whether `cfg` has a warm start still to train (none given to reuse, none finished
    by this run before a restart)."""
    if not cfg.warm_steps or cfg.warm_start.path is not None:
        return False
    record = finished_record(warm_dir(cfg))
    return record is None or record.get("run_id") != warm_run_id(run_id)


def first_phase(cfg: RunConfig, run_id: str) -> tuple[RunConfig, str] | None:
    """The warm phase's config and run id when run `run_id` has its warm start still to
    train (what runs first, and so what its first islands are built for), else None."""
    return (warm_config(cfg), warm_run_id(run_id)) if pending(cfg, run_id) else None


def finished_record(folder: Path) -> dict[str, Any] | None:
    """The record a finished warm start left in `folder`, or None if there is none."""
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def mark_finished(cfg: RunConfig, run_id: str, summary: dict[str, Any]) -> None:
    """Record that the warm phase of `cfg` (the main run's config) ended, and what it was."""
    record = {
        "run_id": warm_run_id(run_id),
        "steps": cfg.warm_steps,
        "mode": cfg.warm_start.mode.value,
        "seed": cfg.seed,
        "data_shards": cfg.num_shards,
        "task": cfg.task.model_dump(mode="json"),
        "islands": 1 if cfg.warm_start.mode == WarmStartMode.SINGLE else cfg.islands.count,
        **{
            k: summary[k]
            for k in ("tokens", "initial_eval_loss", "final_eval_loss", "train_seconds", "bytes_communicated")
        },
        "final_params_digest": summary.get("final_params_digest"),  # the model `final_eval_loss` is of
    }
    durable_write(warm_dir(cfg) / MARKER, json.dumps(record, indent=2).encode())


@dataclass(frozen=True)
class WarmStart:
    """What the main run takes from a finished warm start."""

    params: torch.Tensor  # flat parameters at the fork
    ledger: dict[str, Any]  # the data ledger at the fork (positions continue from it)
    record: dict[str, Any]  # what summary.json reports of it

    def evaluated(self, params: Any) -> float | None:
        """The warm start's final eval loss if `params` are the model it was taken of
        (their XXH3 digest is the one it recorded), else None: loaded from an earlier
        checkpoint than its last, or recorded before the digest was."""
        digest = self.record.get("final_params_digest")
        loss = self.record.get("final_eval_loss")
        if digest is None or loss is None or params_digest(params) != digest:
            return None
        return float(loss)


def check_warm_start(cfg: RunConfig) -> dict[str, Any]:
    """The record of the finished warm start of `cfg`, checked to fit it (same steps,
    seed, task and data shards: a mismatch would retrain or skip data). The driver checks
    before anything starts, so a misfit is refused at once, not by the coordinator."""
    folder = warm_dir(cfg)
    record = finished_record(folder)
    if record is None:
        raise RunFailed(f"warm_start: no finished warm start in {folder} ({MARKER} missing)")
    expected = {
        "steps": cfg.warm_steps,
        "seed": cfg.seed,
        "data_shards": cfg.num_shards,
        "task": cfg.task.model_dump(mode="json"),
    }
    for key, want in expected.items():
        if record.get(key) != want:
            field = "warm_start.steps" if key == "steps" else key
            raise RunFailed(
                f"warm_start: the warm start in {folder} has {key} = {record.get(key)!r}, this run {want!r} "
                f"(set {field} to match, or train a new one)"
            )
    return record


def load_warm_start(cfg: RunConfig, numel: int) -> WarmStart:
    """The finished warm start of `cfg`: its record (`check_warm_start`), weights (of this
    model's size) and data ledger."""
    record = check_warm_start(cfg)
    folder = warm_dir(cfg)
    checkpoints = run_folder(folder / "checkpoint", record["run_id"])
    found = newest_valid(checkpoints)
    if found is None:
        raise RunFailed(f"warm_start: no checkpoint in {checkpoints}")
    digest, state = found
    params = state["params"]
    if params.numel() != numel:
        raise RunFailed(f"warm_start: {folder} holds {params.numel()} parameters, this task's model {numel}")
    return WarmStart(params, state["ledger"], {**record, "path": str(folder.resolve()), "sha256": digest})
