"""What leaves an island: its update (a pseudo-gradient, or a gradient for ddp work)
encoded with the run's codec, after the island's error feedback for that fragment when
the codec loses information; with S coordinator slices, S payloads of aligned slices,
each of which encodes exactly as its part of the whole vector would."""

from __future__ import annotations

import numpy as np
import torch

from archipelago.workers.runtime.island_spec import IslandSpec
from archipelago.workers.wire.compress import ErrorFeedback, decode, encode
from archipelago.workers.wire.flat import slice_bounds
from archipelago.workers.wire.messages import Sliced, Wire


def encode_update(
    x: torch.Tensor, spec: IslandSpec, feedback: dict[int | None, ErrorFeedback], fragment: int | None = None
) -> Wire:
    """`x` as the codec's payload; `feedback` holds each fragment's residual (None: the
    whole vector), created on first use and updated with what the payload lost."""
    values = x.cpu().numpy()
    kept = None
    if spec.error_feedback and spec.codec != "none":
        kept = feedback.setdefault(fragment, ErrorFeedback(spec.feedback_decay))
        values = kept.compensate(values)
    if spec.coordinator_shards == 1:
        payloads = [encode(values, spec.codec, spec.chunk)]
    else:
        payloads = [
            encode(values[lo:hi], spec.codec, spec.chunk)
            for lo, hi in slice_bounds(values.size, spec.coordinator_shards, spec.chunk)
        ]
    if kept is not None:
        kept.sent(values, np.concatenate([decode(p) for p in payloads]))
    return payloads[0] if spec.coordinator_shards == 1 else Sliced(parts=tuple(payloads))
