"""A verified hand-off: the full parameters an island downloads (a joiner's first state, a
replacement's, any full download) come with a SHA-256 of what the coordinator published
and of the work order's place in the run (`position`: version, schedule position, data
cursor, and for a streaming island its fragment and when it sends). The island checks it
before it trains, so a torn or corrupted transfer, or an order that does not belong to
the parameters it came with, is refused instead of trained into the run (torchtitan users
report joiners with the wrong lr or stale state; prime verifies its hand-off by hash).

Cost: one SHA-256 pass over the parameters per published version on the coordinator, and
one per full download on the island (0.56 s per GB each on a 2-core CPU machine), against
the island downloading the whole model anyway. Changes (streaming, compressed downlinks)
carry no digest: their version chain is checked change by change (`workers/wire/sync.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from workers.wire.messages import WorkOrder


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


def position(order: WorkOrder) -> str:
    """What an order asks of the parameters it comes with: whose it is, the version, the lr
    schedule's position, the data cursor, and the fragment state a streaming island needs
    (which fragment it sends, and after how many steps), plus the overlap's eager start."""
    cursor = ",".join(f"{s}:{p}" for s, p in sorted(order.shards.items()))
    return (
        f"i{order.island}|v{order.version}|{order.kind.value}|h{order.steps}|s{order.schedule_step}|{cursor}"
        f"|t{order.turn}|f{order.fragment}|a{order.send_after}|e{int(order.eager)}"
    )


def seal(order: WorkOrder, params_digest: str) -> WorkOrder:
    """The order with the digest of its hand-off: the parameters' and its `position`."""
    joined = f"{params_digest}|{position(order)}"
    return dataclasses.replace(order, handoff_sha256=hashlib.sha256(joined.encode()).hexdigest())


def verify(order: WorkOrder, params: Any) -> None:
    """Raise `HandOffMismatch` unless `params` and the order's position hash to its digest."""
    received = params_sha256(params)
    if received is None or seal(order, received).handoff_sha256 != order.handoff_sha256:
        raise HandOffMismatch(
            f"the parameters of version {order.version} (schedule step {order.schedule_step}, data "
            f"{dict(sorted(order.shards.items()))}, fragment {order.fragment}) do not match the coordinator's "
            "digest: refused before training"
        )
