"""A model's memory as a plan reads it: what `measure.py` finds (importing torch) and
what the planner and the run's preflight read (not importing it: the command starts Ray
and its actors without torch, `bench startup`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelMemory:
    """Peaks in bytes, each of one process's tensors (no interpreter, no Ray)."""

    params: int  # parameters (numel)
    process: int  # the measuring process's resident bytes before it measured: interpreter, torch, the task
    runtime: int  # what torch's first real backward and optimizer step add (autograd engine, thread pools)
    outer_runtime: int  # what the coordinator's first outer step adds (the compiled kernels)
    data: int  # what reading the first training batch adds to a process (a local corpus loaded; 0: streamed)
    train_rows: int  # rows of a micro-batch
    train_peak: int  # an island worker's inner step: params, grads, optimizer state, activations
    train_parts: dict[str, int]  # its parts at the peak: parameters, gradients, optimizer state, activations
    eval_rows: int  # rows one evaluation forward takes
    eval_peak: int  # an evaluation forward: params and activations (no autograd)
    eval_set: int  # the evaluation's batches, held by whoever evaluates
    measure_s: float  # how long the measurement took
    cached: bool = False  # read from the cache of an earlier measurement of the same shapes (`plan/preflight.py`)


def uplink_bytes_per_value(cfg: RunConfig) -> float:
    """Bytes a pseudo-gradient takes per parameter under `compression.codec`."""
    return codec_bytes_per_value(cfg.compression.codec, cfg.compression.chunk)


def downlink_bytes_per_value(cfg: RunConfig) -> float:
    """Bytes an island receives per parameter a round: the parameters in fp32, or their
    change under `compression.downlink`."""
    return codec_bytes_per_value(cfg.compression.downlink, cfg.compression.chunk)


@functools.cache
def codec_bytes_per_value(codec: str, chunk: int) -> float:
    """Bytes per value under `codec`: 4 (fp32) for none, else a sample of 64 chunks encoded
    by the islands' own codec (bytes are linear in the size), once per codec and chunk (a
    plan prices several candidates, each both ways)."""
    if codec == "none":
        return 4.0
    import numpy as np

    from archipelago.workers.wire.compress import encode
    from archipelago.workers.wire.spec import payload_nbytes

    n = 64 * chunk
    sample = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    return payload_nbytes(encode(sample, codec, chunk)) / n
