"""Symmetric integer quantisation with one fp32 scale per chunk: `int8` (≈ 4×), `int4`
(two values a byte, ≈ 8×) and `int2` (four a byte, ≈ 16×: four levels and no zero, for
what top-k kept)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .base import (
    Codec,
    Payload,
    Tensors,
    blocks,
    blocks_t,
    chunk_scales,
    chunk_scales_t,
    chunked_payload,
    chunked_tensors,
    pack_nibbles,
    pack_nibbles_t,
    scaled,
    scaled_t,
    unpack_nibbles,
    unpack_nibbles_t,
)

if TYPE_CHECKING:
    import torch


def _quantise(x: np.ndarray, chunk: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest onto integers in [-levels, levels], the chunk's largest magnitude
    mapping to `levels`: (integers, scales)."""
    rows = blocks(x, chunk)
    scale = chunk_scales(rows, levels)
    q = np.rint(rows / scale[:, None]).astype(np.int8)
    return q.reshape(-1)[: x.size], scale


def _int8_encode(x: np.ndarray, chunk: int) -> Payload:
    q, scale = _quantise(x, chunk, 127)
    return {"int8": q, "scale": scale, "chunk": np.array([chunk], np.int32)}


def _int8_decode(p: Payload) -> np.ndarray:
    return scaled(p["int8"], p["scale"], int(p["chunk"][0]))


def _int4_encode(x: np.ndarray, chunk: int) -> Payload:
    """Integers in [-7, 7] stored offset by 8 as nibbles (a zero fills an odd last byte)."""
    q, scale = _quantise(x, chunk, 7)
    return chunked_payload("int4", pack_nibbles((q + 8).astype(np.uint8), 8), x.size, scale, chunk)


def _int4_decode(p: Payload) -> np.ndarray:
    q = unpack_nibbles(p["int4"], int(p["n"][0])).astype(np.int8) - 8
    return scaled(q, p["scale"], int(p["chunk"][0]))


def _int2_encode(x: np.ndarray, chunk: int) -> Payload:
    """(q − 1.5) × scale for q in 0..3, scale = max |x| / 1.5, four values a byte."""
    n = x.size
    rows = blocks(x, chunk)
    scale = chunk_scales(rows, 1.5)
    q = np.clip(np.floor(rows / scale[:, None] + 2.0), 0, 3).astype(np.uint8).reshape(-1)[:n]
    q = np.concatenate([q, np.zeros((-n) % 4, np.uint8)])
    packed = q[0::4] | (q[1::4] << 2) | (q[2::4] << 4) | (q[3::4] << 6)
    return chunked_payload("int2", packed, n, scale, chunk)


def _int2_decode(p: Payload) -> np.ndarray:
    packed, n = p["int2"], int(p["n"][0])
    q = np.empty(packed.size * 4, dtype=np.float32)
    for j in range(4):
        q[j::4] = (packed >> (2 * j)) & 3
    return scaled(q[:n] - 1.5, p["scale"], int(p["chunk"][0]))


# the same over tensors (torch.round rounds half to even, as np.rint does)


def _quantise_t(x: torch.Tensor, chunk: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    rows = blocks_t(x, chunk)
    scale = chunk_scales_t(rows, levels)
    return torch.round(rows / scale[:, None]).to(torch.int8).view(-1)[: x.numel()], scale


def _int8_encode_t(x: torch.Tensor, chunk: int) -> Tensors:
    import torch

    q, scale = _quantise_t(x, chunk, 127)
    return {"int8": q, "scale": scale, "chunk": torch.tensor([chunk], dtype=torch.int32, device=q.device)}


def _int8_decode_t(p: Tensors) -> torch.Tensor:
    return scaled_t(p["int8"], p["scale"], int(p["chunk"][0]))


def _int4_encode_t(x: torch.Tensor, chunk: int) -> Tensors:
    import torch

    q, scale = _quantise_t(x, chunk, 7)
    return chunked_tensors("int4", pack_nibbles_t((q + 8).to(torch.uint8), 8), x.numel(), scale, chunk)


def _int4_decode_t(p: Tensors) -> torch.Tensor:
    import torch

    q = unpack_nibbles_t(p["int4"], int(p["n"][0])).to(torch.int8) - 8
    return scaled_t(q, p["scale"], int(p["chunk"][0]))


def _int2_encode_t(x: torch.Tensor, chunk: int) -> Tensors:
    import torch

    n = x.numel()
    rows = blocks_t(x, chunk)
    scale = chunk_scales_t(rows, 1.5)
    q = torch.clamp(torch.floor(rows / scale[:, None] + 2.0), 0, 3).to(torch.uint8).view(-1)[:n]
    q = torch.cat([q, q.new_zeros((-n) % 4)])
    return chunked_tensors("int2", q[0::4] | (q[1::4] << 2) | (q[2::4] << 4) | (q[3::4] << 6), n, scale, chunk)


def _int2_decode_t(p: Tensors) -> torch.Tensor:
    import torch

    packed, n = p["int2"], int(p["n"][0])
    q = torch.stack([(packed >> (2 * j)) & 3 for j in range(4)], dim=1).view(-1)[:n].to(torch.float32)
    return scaled_t(q - 1.5, p["scale"], int(p["chunk"][0]))


INT8 = Codec(
    "int8",
    "int8",
    8,
    _int8_encode,
    _int8_decode,
    _int8_encode_t,
    _int8_decode_t,
    ("int8",),
    chunked=True,
    about="≈ 4x fewer bytes",
)
INT4 = Codec(
    "int4",
    "int4",
    4,
    _int4_encode,
    _int4_decode,
    _int4_encode_t,
    _int4_decode_t,
    ("uint8",),
    per_element=2,
    chunked=True,
    about="≈ 8x fewer bytes",
)
INT2 = Codec(
    "int2",
    "int2",
    2,
    _int2_encode,
    _int2_decode,
    _int2_encode_t,
    _int2_decode_t,
    ("uint8",),
    per_element=4,
    chunked=True,
    about="≈ 16x fewer bytes",
)
