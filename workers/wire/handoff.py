"""A verified hand-off: the full parameters an island downloads (a joiner's first state, a
replacement's, any full download) come with a SHA-256 of what the coordinator published
and of the work order's schedule position, data cursor and version. The island checks it
before it trains, so a torn or corrupted transfer, or an order that does not belong to
the parameters it came with, is refused instead of trained into the run (torchtitan users
report joiners with the wrong lr or stale state; prime verifies its hand-off by hash).

Cost: one SHA-256 pass over the parameters per published version on the coordinator, and
one per full download on the island (0.56 s per GB each on a 2-core CPU machine), against
the island downloading the whole model anyway. Changes (streaming, compressed downlinks)
carry no digest: their version chain is checked change by change (`workers/wire/sync.py`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


class HandOffMismatch(RuntimeError):
    """What an island received is not what the coordinator published for its order."""


def params_sha256(params: Any) -> str | None:
    """SHA-256 of published parameters (one array, or a sliced coordinator's arrays in
    order); None for what cannot be read here (references to remote slices)."""
    parts = params if isinstance(params, list) else [params]
    if not all(isinstance(p, np.ndarray) for p in parts):
        return None
    digest = hashlib.sha256()
    for part in parts:
        digest.update(np.ascontiguousarray(part).data)
    return digest.hexdigest()


def handoff_sha256(params_digest: str, version: int, schedule_step: int | None, shards: dict[int, int]) -> str:
    """The digest a hand-off carries: the parameters' and the order's position in the run."""
    cursor = ",".join(f"{s}:{p}" for s, p in sorted(shards.items()))
    return hashlib.sha256(f"{params_digest}|v{version}|s{schedule_step}|{cursor}".encode()).hexdigest()


def verify(expected: str, params: Any, version: int, schedule_step: int | None, shards: dict[int, int]) -> None:
    """Raise `HandOffMismatch` unless `params` and the order's position hash to `expected`."""
    received = params_sha256(params)
    if received is None or handoff_sha256(received, version, schedule_step, shards) != expected:
        raise HandOffMismatch(
            f"the parameters of version {version} (schedule step {schedule_step}, data {dict(sorted(shards.items()))}) "
            "do not match the coordinator's digest: refused before training"
        )
