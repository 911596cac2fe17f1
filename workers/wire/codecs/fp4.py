"""FP4 (E2M1, as in OCP's microscaling formats and Streaming DiLoCo's 4-bit exchange):
a sign, two exponent bits and one mantissa bit, so magnitudes 0, 0.5, 1, 1.5, 2, 3, 4
and 6, with one fp32 scale per chunk that maps the chunk's largest magnitude to 6.
Against `int4`'s 15 evenly spaced levels it spends its codes near zero, where most of a
pseudo-gradient's values are, at the price of coarse steps near the chunk's maximum.

Rounding is to the nearest code, ties to the even mantissa (the OCP rule): 0.25 → 0,
0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4. Each value is a nibble, sign in
bit 3 (no negative zero is sent), two a byte, low nibble first."""

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

MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# the midpoints between neighbouring magnitudes; where the tie goes up (to an even mantissa)
# the boundary sits one ulp below, so `searchsorted` counts it for a value on it
_UP = {0.75, 1.75, 3.5}
_BOUNDS = np.array(
    [np.nextafter(np.float32(m), np.float32(0)) if m in _UP else m for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)],
    np.float32,
)
_TABLE = np.concatenate([MAGNITUDES, -MAGNITUDES])  # code -> value: bit 3 is the sign


def _fp4_encode(x: np.ndarray, chunk: int) -> Payload:
    rows = blocks(x, chunk)
    scale = chunk_scales(rows, 6.0)
    y = (rows / scale[:, None]).reshape(-1)[: x.size]
    code = np.searchsorted(_BOUNDS, np.abs(y), side="left").astype(np.uint8)
    code |= ((y < 0) & (code > 0)).astype(np.uint8) << 3
    return chunked_payload("fp4", pack_nibbles(code, 0), x.size, scale, chunk)


def _fp4_decode(p: Payload) -> np.ndarray:
    return scaled(_TABLE[unpack_nibbles(p["fp4"], int(p["n"][0]))], p["scale"], int(p["chunk"][0]))


def _fp4_encode_t(x: torch.Tensor, chunk: int) -> Tensors:
    """As `_fp4_encode`, over a tensor (torch.searchsorted with right=False is numpy's side="left")."""
    import torch

    rows = blocks_t(x, chunk)
    scale = chunk_scales_t(rows, 6.0)
    y = (rows / scale[:, None]).view(-1)[: x.numel()]
    code = torch.searchsorted(torch.from_numpy(_BOUNDS).to(y.device), y.abs(), right=False).to(torch.uint8)
    code |= ((y < 0) & (code > 0)).to(torch.uint8) << 3
    return chunked_tensors("fp4", pack_nibbles_t(code, 0), x.numel(), scale, chunk)


def _fp4_decode_t(p: Tensors) -> torch.Tensor:
    import torch

    table = torch.from_numpy(_TABLE).to(p["fp4"].device)
    codes = unpack_nibbles_t(p["fp4"], int(p["n"][0]))
    return scaled_t(table[codes.to(torch.int32)], p["scale"], int(p["chunk"][0]))


FP4 = Codec(
    "fp4",
    "fp4",
    4,
    _fp4_encode,
    _fp4_decode,
    _fp4_encode_t,
    _fp4_decode_t,
    ("uint8",),
    per_element=2,
    chunked=True,
    about="E2M1 floats, ≈ 8x fewer bytes, finer than int4 near zero",
)
