"""Pseudo-gradient codecs: what an island puts on the wire, and how the coordinator gets
fp32 back. `none` (as is: fp32), `bf16` (2×), `int8` with one fp32 scale per chunk (≈ 4×),
`int4` with one fp32 scale per chunk, two values per byte (≈ 8×), `int2`, four values per
byte (≈ 16×); and any of them after chunked top-k (`topk:K+int2`, `workers/wire/sparse.py`).

A payload is a small dict of numpy arrays, so it crosses Ray's object store zero-copy;
`nbytes` is what the link carries. New value codecs register in `CODECS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from workers.wire import sparse
from workers.wire.spec import Payload, parse_codec


def _none_encode(x: np.ndarray, chunk: int) -> Payload:
    return {"raw": np.ascontiguousarray(x)}  # keeps the model's dtype (float64 in exactness tests)


def _none_decode(p: Payload) -> np.ndarray:
    return p["raw"]


def _bf16_encode(x: np.ndarray, chunk: int) -> Payload:
    bf = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return {"bf16": bf.view(torch.int16).numpy()}


def _bf16_decode(p: Payload) -> np.ndarray:
    return torch.from_numpy(np.array(p["bf16"])).view(torch.bfloat16).float().numpy()


def _blocks(x: np.ndarray, chunk: int) -> np.ndarray:
    """`x` as fp32 rows of `chunk` values, the last one zero-padded."""
    pad = (-x.size) % chunk
    flat = x.astype(np.float32, copy=False)
    return (np.concatenate([flat, np.zeros(pad, np.float32)]) if pad else flat).reshape(-1, chunk)


def _quantise(x: np.ndarray, chunk: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest onto integers in [-levels, levels], one fp32 scale per
    chunk (the chunk's largest magnitude maps to `levels`): (integers, scales)."""
    n = x.size
    blocks = _blocks(x, chunk)
    scale = np.abs(blocks).max(axis=1) / levels
    scale[scale == 0] = 1.0
    q = np.rint(blocks / scale[:, None]).astype(np.int8)
    return q.reshape(-1)[:n], scale.astype(np.float32)


def _dequantise(q: np.ndarray, scale: np.ndarray, chunk: int) -> np.ndarray:
    n = q.size
    out = np.zeros(scale.size * chunk, dtype=np.float32)
    out[:n] = q
    return (out.reshape(-1, chunk) * scale[:, None]).reshape(-1)[:n]


def _int8_encode(x: np.ndarray, chunk: int) -> Payload:
    q, scale = _quantise(x, chunk, 127)
    return {"int8": q, "scale": scale, "chunk": np.array([chunk], np.int32)}


def _int8_decode(p: Payload) -> np.ndarray:
    return _dequantise(p["int8"], p["scale"], int(p["chunk"][0]))


def _int4_encode(x: np.ndarray, chunk: int) -> Payload:
    """Integers in [-7, 7] stored offset by 8 as nibbles, two per byte (low nibble first)."""
    q, scale = _quantise(x, chunk, 7)
    u = (q + 8).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(8))  # a zero in the unused last nibble
    packed = u[0::2] | (u[1::2] << 4)
    return {"int4": packed, "n": np.array([x.size], np.int64), "scale": scale, "chunk": np.array([chunk], np.int32)}


def _int4_decode(p: Payload) -> np.ndarray:
    packed, n = p["int4"], int(p["n"][0])
    q = np.empty(packed.size * 2, dtype=np.int8)
    q[0::2] = (packed & 0x0F).astype(np.int8) - 8
    q[1::2] = (packed >> 4).astype(np.int8) - 8
    return _dequantise(q[:n], p["scale"], int(p["chunk"][0]))


def _int2_encode(x: np.ndarray, chunk: int) -> Payload:
    """Four levels per chunk, (q − 1.5) × scale for q in 0..3 with scale = max |x| / 1.5 (no
    zero level: what is sent is mostly what top-k kept), four values per byte."""
    n = x.size
    blocks = _blocks(x, chunk)
    scale = np.abs(blocks).max(axis=1) / 1.5
    scale[scale == 0] = 1.0
    q = np.clip(np.floor(blocks / scale[:, None] + 2.0), 0, 3).astype(np.uint8).reshape(-1)[:n]
    q = np.concatenate([q, np.zeros((-n) % 4, np.uint8)])
    packed = q[0::4] | (q[1::4] << 2) | (q[2::4] << 4) | (q[3::4] << 6)
    return {
        "int2": packed,
        "n": np.array([n], np.int64),
        "scale": scale.astype(np.float32),
        "chunk": np.array([chunk], np.int32),
    }


def _int2_decode(p: Payload) -> np.ndarray:
    packed, n = p["int2"], int(p["n"][0])
    q = np.empty(packed.size * 4, dtype=np.float32)
    for j in range(4):
        q[j::4] = (packed >> (2 * j)) & 3
    return _dequantise(q[:n] - 1.5, p["scale"], int(p["chunk"][0]))


@dataclass(frozen=True)
class Codec:
    encode: Callable[[np.ndarray, int], Payload]
    decode: Callable[[Payload], np.ndarray]


CODECS: dict[str, Codec] = {
    "none": Codec(_none_encode, _none_decode),
    "bf16": Codec(_bf16_encode, _bf16_decode),
    "int8": Codec(_int8_encode, _int8_decode),
    "int4": Codec(_int4_encode, _int4_decode),
    "int2": Codec(_int2_encode, _int2_decode),
}


class ErrorFeedback:
    """What the codec rounded away last time, added to the next vector before it is encoded
    (error feedback, as in 1-bit SGD and EF-SGD): over rounds the coordinator receives the
    sum of the island's pseudo-gradients to within one quantisation step, instead of an
    error that grows with every round. With `decay` β < 1 the residual is β e + Δ
    (SparseLoCo: the buffer then also plays outer momentum's part)."""

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = decay
        self.residual: np.ndarray | None = None

    def compensate(self, values: np.ndarray) -> np.ndarray:
        if self.residual is None:
            return values
        return values + (self.residual if self.decay == 1.0 else self.decay * self.residual)

    def sent(self, values: np.ndarray, decoded: np.ndarray) -> None:
        """`values` (compensated) were encoded and decode to `decoded`."""
        self.residual = values - decoded


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


_KEYS = (("none", "raw"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4"), ("int2", "int2"))


def decode(payload: Payload) -> np.ndarray:
    """fp32 values of any payload (the codec is recognised by its keys)."""
    if "topk_idx" in payload:
        return _topk_decode(payload)
    for name, key in _KEYS:
        if key in payload:
            return CODECS[name].decode(payload)
    raise PayloadError(f"unknown payload with keys {sorted(payload)}")


class PayloadError(ValueError):
    """A payload that no codec can decode into the values it should hold."""


# each codec's arrays: key -> the dtypes it may have
_LAYOUT: dict[str, dict[str, tuple[str, ...]]] = {
    "none": {"raw": ("float16", "float32", "float64")},
    "bf16": {"bf16": ("int16",)},
    "int8": {"int8": ("int8",), "scale": ("float32",), "chunk": ("int32",)},
    "int4": {"int4": ("uint8",), "n": ("int64",), "scale": ("float32",), "chunk": ("int32",)},
    "int2": {"int2": ("uint8",), "n": ("int64",), "scale": ("float32",), "chunk": ("int32",)},
}


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
    codec = next((name for name, key in _KEYS if key in payload), None)
    if codec is None:
        raise PayloadError(f"no codec has the keys {sorted(map(str, payload))}")
    layout = _LAYOUT[codec]
    if set(payload) != set(layout):
        raise PayloadError(f"a {codec} payload has the keys {sorted(layout)}, not {sorted(map(str, payload))}")
    for key, dtypes in layout.items():
        a = payload[key]
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.name not in dtypes:
            what = f"{a.dtype.name} of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise PayloadError(f"{codec} payload's {key!r} is {what}, not 1-D {'/'.join(dtypes)}")
    n = _values(codec, payload)
    if n != size:
        raise PayloadError(f"the {codec} payload holds {n} values, not the {size} expected")
    if codec in ("int8", "int4", "int2"):
        chunk = int(payload["chunk"][0]) if payload["chunk"].size == 1 else 0
        if chunk < 1 or payload["scale"].size != -(-n // chunk):
            raise PayloadError(f"the {codec} payload's scales do not cover its values in chunks of {chunk}")


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
    if any(key in inner for key in ("int8", "int4", "int2")) and int(inner["chunk"][0]) != k:
        raise PayloadError("the top-k payload's value scales are not one per chunk")


def _values(codec: str, payload: Payload) -> int:
    per_byte = {"int4": 2, "int2": 4}.get(codec)
    if per_byte:
        n = int(payload["n"][0]) if payload["n"].size == 1 else -1
        return n if n >= 0 and -(-n // per_byte) == payload[codec].size else -1
    return int(payload[dict(_KEYS)[codec]].size)
