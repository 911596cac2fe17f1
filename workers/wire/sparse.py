"""Chunked top-k (SparseLoCo's sparsifier): in every chunk of C values keep the k largest
magnitudes; their positions inside the chunk are packed at ceil(log2 C) bits each (9 bits
for C = 512, not the 16 or 32 of an index array). Pure numpy; `wire/compress.py` composes
it with a value codec into a `topk:K+<codec>` chain."""

from __future__ import annotations

import math

import numpy as np


def kept_per_chunk(fraction: float, chunk: int) -> int:
    return max(1, min(chunk, math.ceil(fraction * chunk)))


def index_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def select(x: np.ndarray, k: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions inside each chunk, ascending, shape (chunks, k); their values): the k
    largest magnitudes of each chunk of `chunk` values (the last chunk zero-padded)."""
    pad = (-x.size) % chunk
    blocks = np.concatenate([x.astype(np.float32, copy=False), np.zeros(pad, np.float32)]).reshape(-1, chunk)
    if k == chunk:
        idx = np.broadcast_to(np.arange(chunk), blocks.shape).copy()
    else:
        idx = np.sort(np.argpartition(-np.abs(blocks), k - 1, axis=1)[:, :k], axis=1)
    return idx, np.take_along_axis(blocks, idx, axis=1).reshape(-1)


def scatter(idx: np.ndarray, values: np.ndarray, n: int, chunk: int) -> np.ndarray:
    """The dense vector of `n` values with `values` at their chunks' positions `idx`, zeros elsewhere."""
    out = np.zeros((idx.shape[0], chunk), dtype=np.float32)
    np.put_along_axis(out, idx, values.reshape(idx.shape).astype(np.float32, copy=False), axis=1)
    return out.reshape(-1)[:n]


def pack_indices(idx: np.ndarray, bits: int) -> np.ndarray:
    """Positions as a little-endian bit stream, `bits` per position."""
    flat = idx.reshape(-1).astype(np.uint32)
    planes = ((flat[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_indices(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    planes = np.unpackbits(packed, count=count * bits, bitorder="little").reshape(count, bits)
    return (planes.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=1)
