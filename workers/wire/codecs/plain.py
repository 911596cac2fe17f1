"""Unquantised values: `none` (the model's own floats: fp32, or fp64 in exactness tests)
and `bf16` (fp32 rounded to bfloat16 by torch, 2× fewer bytes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .base import Codec, Payload, Tensors

if TYPE_CHECKING:
    import torch


def _none_encode(x: np.ndarray, chunk: int) -> Payload:
    return {"raw": np.ascontiguousarray(x)}


def _none_decode(p: Payload) -> np.ndarray:
    return p["raw"]


def _bf16_encode(x: np.ndarray, chunk: int) -> Payload:
    import torch  # here: the registry is read by the run config, which imports no torch

    bf = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return {"bf16": bf.view(torch.int16).numpy()}


def _bf16_decode(p: Payload) -> np.ndarray:
    import torch

    return torch.from_numpy(np.array(p["bf16"])).view(torch.bfloat16).float().numpy()


def _none_encode_t(x: torch.Tensor, chunk: int) -> Tensors:
    return {"raw": x.contiguous()}


def _none_decode_t(p: Tensors) -> torch.Tensor:
    return p["raw"]


def _bf16_encode_t(x: torch.Tensor, chunk: int) -> Tensors:
    import torch

    return {"bf16": x.to(torch.float32).to(torch.bfloat16).view(torch.int16)}


def _bf16_decode_t(p: Tensors) -> torch.Tensor:
    import torch

    return p["bf16"].view(torch.bfloat16).float()


NONE = Codec(
    "none",
    "raw",
    32,
    _none_encode,
    _none_decode,
    _none_encode_t,
    _none_decode_t,
    ("float16", "float32", "float64"),
    about="fp32 as trained",
)
BF16 = Codec(
    "bf16",
    "bf16",
    16,
    _bf16_encode,
    _bf16_decode,
    _bf16_encode_t,
    _bf16_decode_t,
    ("int16",),
    about="bfloat16, 2x fewer bytes",
)
