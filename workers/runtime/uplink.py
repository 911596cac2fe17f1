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

import numpy as np
import torch

from archipelago.workers.runtime.island_spec import IslandSpec
from archipelago.workers.wire.codecs import CODECS
from archipelago.workers.wire.codecs.base import Codec, Payload, to_payload
from archipelago.workers.wire.compress import ErrorFeedback, decode, encode
from archipelago.workers.wire.flat import slice_bounds
from archipelago.workers.wire.messages import Sliced, Wire
from archipelago.workers.wire.spec import parse_codec


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
        payloads = _there(x.detach(), CODECS[chain.value], spec.chunk, bounds, kept)
    else:
        payloads = _host(x.detach().cpu().numpy(), spec.codec, spec.chunk, bounds, kept)
    return payloads[0] if spec.coordinator_shards == 1 else Sliced(parts=tuple(payloads))


def _there(
    values: torch.Tensor, codec: Codec, chunk: int, bounds: list[tuple[int, int]], kept: ErrorFeedback | None
) -> list[Payload]:
    """Encoded on the values' device; only the payloads come to the host."""
    if kept is not None:
        values = kept.compensate(values)
    encoded = [codec.encode_tensor(values[lo:hi], chunk) for lo, hi in bounds]
    if kept is not None:
        kept.sent(values, torch.cat([codec.decode_tensor(e) for e in encoded]))
    return [to_payload(e) for e in encoded]


def _host(
    values: np.ndarray, codec: str, chunk: int, bounds: list[tuple[int, int]], kept: ErrorFeedback | None
) -> list[Payload]:
    if kept is not None:
        values = kept.compensate(values)
    payloads = [encode(values[lo:hi], codec, chunk) for lo, hi in bounds]
    if kept is not None:
        kept.sent(values, np.concatenate([decode(p) for p in payloads]))
    return payloads
