"""What leaves an island: its update (a pseudo-gradient, or a gradient for ddp work)
encoded with the run's codec, after the island's error feedback for that fragment when
the codec loses information; with S coordinator slices, S payloads of aligned slices,
each of which encodes exactly as its part of the whole vector would.

Where the update is, the codec runs: on a GPU island a value codec encodes the tensor
there (its torch form) and the residual stays on the device, so only the encoded payload
crosses to the host (`none`: the values themselves); on the CPU, and for a top-k chain
(numpy's selection), the host form does. Both are bit for bit the same
(tests/test_codec_vectors.py, tests/test_uplink.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..wire.codecs import CODECS
from ..wire.codecs.base import to_payload
from ..wire.compress import ErrorFeedback, decode, encode
from ..wire.flat import slice_bounds
from ..wire.messages import Sliced, Wire
from ..wire.spec import parse_codec
from .island_spec import IslandSpec


def encode_update(
    x: torch.Tensor,
    spec: IslandSpec,
    feedback: dict[int | None, ErrorFeedback],
    fragment: int | None = None,
    on_device: bool | None = None,
) -> Wire:
    """`x` as the codec's payload; `feedback` holds each fragment's residual (None: the
    whole vector), created on first use and updated with what the payload lost.
    `on_device`: encode with the tensor codec where `x` is (default: when `x` is not on
    the CPU and the codec is a value codec)."""
    chain = parse_codec(spec.codec)
    if on_device is None:
        on_device = x.device.type != "cpu"
    kept = None
    if spec.error_feedback and spec.codec != "none":
        kept = feedback.setdefault(fragment, ErrorFeedback(spec.feedback_decay))
    n = x.numel()
    bounds = [(0, n)] if spec.coordinator_shards == 1 else slice_bounds(n, spec.coordinator_shards, spec.chunk)
    if on_device and chain.topk is None:
        codec = CODECS[chain.value]
        payloads = _encoded(x.detach(), bounds, kept, lambda v: codec.encode_tensor(v, spec.chunk), codec.decode_tensor)
        payloads = [to_payload(p) for p in payloads]
    else:
        payloads = _encoded(x.detach().cpu().numpy(), bounds, kept, lambda v: encode(v, spec.codec, spec.chunk), decode)
    return payloads[0] if spec.coordinator_shards == 1 else Sliced(parts=tuple(payloads))


def _encoded(
    values: Any,
    bounds: list[tuple[int, int]],
    kept: ErrorFeedback | None,
    encode_one: Callable[[Any], Any],
    decode_one: Callable[[Any], Any],
) -> list[Any]:
    """`values` (an array on the host, a tensor on its device) encoded slice by slice after
    the error feedback, which then keeps what the payloads lost, where the values are."""
    if kept is not None:
        values = kept.compensate(values)
    encoded = [encode_one(values[lo:hi]) for lo, hi in bounds]
    if kept is not None:
        decoded = [decode_one(e) for e in encoded]
        kept.sent(values, torch.cat(decoded) if isinstance(values, torch.Tensor) else np.concatenate(decoded))
    return encoded
