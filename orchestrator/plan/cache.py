"""The plan's measurement of a model, cached on disk per shape.

The measurement (`measure.py`) depends only on the task, the inner loop's memory-shaping
settings and torch's and archipelago's versions, so it is cached under that key: the first plan
or run of a config pays seconds (torch imported, fake tensors, a fresh interpreter's
baseline), every later one with the same shapes reads a file and imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

from ..config import RunConfig
from .memory import ModelMemory

log = logging.getLogger(__name__)

FORMAT = 5  # the measurement's fields and what it holds; a cached one of another format is measured again


def _cache_dir() -> Path:
    from archipelago.workers.data.corpus import default_cache_dir

    return default_cache_dir() / "plans"


# what the measurement depends on: the model and its batch (the task), the inner loop's
# memory-shaping settings, the island's workers and the corpus's shards. Learning rates,
# schedules, the seed and the codecs change no tensor the measurement takes (the planner
# prices a codec's bytes and buffers itself): a run that tunes them plans from
# the cache instead of paying the measurement again.
# (`momentum`: SGD keeps a buffer only with it.)
_INNER_SHAPES = ("optimizer", "momentum", "precision", "micro_batches", "compile")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _key(cfg: RunConfig) -> str:
    shape = {
        "format": FORMAT,
        "torch": _version("torch"),
        "archipelago": _version("archipelago"),  # an upgrade may change what a step holds
        "task": cfg.task.model_dump(mode="json"),
        "inner": {k: getattr(cfg.inner, k) for k in _INNER_SHAPES},
        "clipped": cfg.inner.grad_clip is not None,
        "workers": cfg.islands.workers,
        "shards": cfg.num_shards,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:24]


def model_memory(cfg: RunConfig) -> ModelMemory:
    """The model's measurement for `cfg`, from the cache or measured (and cached)."""
    path = _cache_dir() / f"{_key(cfg)}.json"
    try:
        return dataclasses.replace(ModelMemory(**json.loads(path.read_text())), cached=True)
    except (OSError, ValueError, TypeError):
        pass
    from archipelago.workers.tasks.task import load_task

    from .measure import measure

    found = measure(cfg, load_task(cfg.task.factory, cfg.task.kwargs))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(found)))
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: measured again next time
        log.debug("plan cache not written: %s", err)
    return found
