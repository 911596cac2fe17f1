"""Pseudo-gradient encoding: what an island puts on the wire, and how the coordinator gets
fp32 back. A value codec from the registry (`workers/wire/codecs/`: none, bf16, int8,
int4, int2, fp4), alone or after chunked top-k (`topk:K+int2`, `workers/wire/sparse.py`);
error feedback; and the check a payload from another process passes before anything
decodes it. A payload is a small dict of numpy arrays, so it crosses Ray's object store
zero-copy; its bytes are what the link carries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from . import sparse
from .codecs import CODECS, codec_of
from .spec import Payload, parse_codec

if TYPE_CHECKING:
    import torch


class ErrorFeedback:
    """What the codec rounded away last time, added to the next vector before it is encoded
    (error feedback, as in 1-bit SGD and EF-SGD): over rounds the coordinator receives the
    sum of the island's pseudo-gradients to within one quantisation step, instead of an
    error that grows with every round. With `decay` β < 1 the residual is β e + Δ
    (SparseLoCo: the buffer then also plays outer momentum's part).

    The residual lives where the values do: a numpy array on the host, a tensor on the
    island's device (its codec runs there), moved once if the values move (a residual
    restored from a saved state arrives as an array); `host()` is it as an array."""

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = decay
        self.residual: np.ndarray | torch.Tensor | None = None

    def compensate(self, values: Values) -> Values:
        if self.residual is None:
            return values
        residual = self.residual = _like(self.residual, values)
        added: Any = values + (residual if self.decay == 1.0 else self.decay * residual)
        return cast(Values, added)

    def sent(self, values: Values, decoded: Values) -> None:
        """`values` (compensated) were encoded and decode to `decoded`."""
        self.residual = cast(Any, values) - decoded

    def host(self) -> np.ndarray | None:
        """A copy of the residual on the host (what an island's saved state holds: it is
        written while later rounds update the residual in place)."""
        r = self.residual
        if r is None:
            return None
        return r.copy() if isinstance(r, np.ndarray) else r.detach().to("cpu", copy=True).numpy()


Values = TypeVar("Values", np.ndarray, "torch.Tensor")


def _like(residual: np.ndarray | torch.Tensor, values: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """`residual` where `values` are: the same kind, the same device (torch is imported only
    when they are tensors: the coordinator's imports of this module stay torch-free)."""
    if isinstance(values, np.ndarray):
        return residual if isinstance(residual, np.ndarray) else residual.detach().cpu().numpy()
    import torch

    if isinstance(residual, np.ndarray):
        residual = torch.from_numpy(np.ascontiguousarray(residual))
    return residual.to(values.device)


def encode(x: np.ndarray, codec: str = "none", chunk: int = 4096) -> Payload:
    """`x` under the codec config names (a value codec, or a chain `topk:K+<codec>`)."""
    chain = parse_codec(codec)
    if chain.topk is None:
        return CODECS[chain.value].encode(x, chunk)
    return _topk_encode(x, chain.topk, chain.value, chunk)


def _topk_encode(x: np.ndarray, fraction: float, value_codec: str, chunk: int) -> Payload:
    """Top-k of every chunk, positions bit-packed, the kept values in `value_codec` with one
    scale per chunk's k values (`v.` keys)."""
    if chunk > 1 << 16:
        raise ValueError(f"top-k chunks hold at most 65,536 values, not {chunk}")
    k = sparse.kept_per_chunk(fraction, chunk)
    idx, values = sparse.select(x, k, chunk)
    inner = CODECS[value_codec].encode(values, k)
    return {
        "topk_idx": sparse.pack_indices(idx, sparse.index_bits(chunk)),
        "topk_shape": np.array([x.size, chunk, k], np.int64),
        **{f"v.{key}": a for key, a in inner.items()},
    }


def _topk_decode(p: Payload) -> np.ndarray:
    n, chunk, k = (int(v) for v in p["topk_shape"])
    chunks = -(-n // chunk)
    idx = sparse.unpack_indices(p["topk_idx"], chunks * k, sparse.index_bits(chunk)).reshape(chunks, k)
    return sparse.scatter(idx, decode({key[2:]: a for key, a in p.items() if key.startswith("v.")}), n, chunk)


def decode(payload: Payload) -> np.ndarray:
    """fp32 values of any payload (the codec is recognised by its keys)."""
    if "topk_idx" in payload:
        return _topk_decode(payload)
    codec = codec_of(payload)
    if codec is None:
        raise PayloadError(f"unknown payload with keys {sorted(payload)}")
    return codec.decode(payload)


class PayloadError(ValueError):
    """A payload that no codec can decode into the values it should hold."""


def check_payload(payload: object, size: int) -> None:
    """Raise `PayloadError` unless `payload` decodes to `size` values: a dict of exactly one
    codec's 1-D arrays with that codec's dtypes and consistent lengths. A result comes from
    another process (or node): what it sends is checked before anything decodes it, so a
    malformed one is refused with a reason instead of raising in the coordinator, and an
    integer array can never pass as a float one (its squared norm would overflow to 0)."""
    if not isinstance(payload, dict):
        raise PayloadError(f"the payload is a {type(payload).__name__}, not a codec's arrays")
    if "topk_idx" in payload:
        _check_topk(payload, size)
        return
    codec = codec_of(payload)
    if codec is None:
        raise PayloadError(f"no codec has the keys {sorted(map(str, payload))}")
    layout = codec.layout
    if set(payload) != set(layout):
        raise PayloadError(f"a {codec.name} payload has the keys {sorted(layout)}, not {sorted(map(str, payload))}")
    for key, dtypes in layout.items():
        a = payload[key]
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.name not in dtypes:
            what = f"{a.dtype.name} of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise PayloadError(f"{codec.name} payload's {key!r} is {what}, not 1-D {'/'.join(dtypes)}")
    n = codec.values(payload)
    if n != size:
        raise PayloadError(f"the {codec.name} payload holds {n} values, not the {size} expected")
    if codec.chunked:
        chunk = int(payload["chunk"][0]) if payload["chunk"].size == 1 else 0
        if chunk < 1 or payload["scale"].size != -(-n // chunk):
            raise PayloadError(f"the {codec.name} payload's scales do not cover its values in chunks of {chunk}")


def _check_topk(payload: Payload, size: int) -> None:
    shape, idx = payload.get("topk_shape"), payload.get("topk_idx")
    if not (isinstance(shape, np.ndarray) and shape.dtype == np.int64 and shape.shape == (3,)):
        raise PayloadError("a top-k payload's 'topk_shape' is not 3 int64 values")
    n, chunk, k = (int(v) for v in shape)
    if n != size or not (1 <= k <= chunk <= 1 << 16):
        raise PayloadError(f"the top-k payload holds {n} values in chunks of {chunk} keeping {k}, not {size} values")
    kept = -(-n // chunk) * k
    if not (
        isinstance(idx, np.ndarray)
        and idx.dtype == np.uint8
        and idx.shape == (-(-kept * sparse.index_bits(chunk) // 8),)
    ):
        raise PayloadError("the top-k payload's positions do not cover its kept values")
    inner = {key[2:]: a for key, a in payload.items() if key.startswith("v.")}
    if set(payload) != {"topk_idx", "topk_shape", *(f"v.{key}" for key in inner)} or "topk_idx" in inner:
        raise PayloadError(f"a top-k payload has keys {sorted(map(str, payload))}")
    check_payload(inner, kept)
    codec = codec_of(inner)
    if codec is not None and codec.chunked and int(inner["chunk"][0]) != k:
        raise PayloadError("the top-k payload's value scales are not one per chunk")
