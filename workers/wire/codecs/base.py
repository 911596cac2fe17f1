"""What a value codec is: one row of the registry (`codecs/__init__.py`) that names it,
says how its payload looks on the wire, and encodes and decodes it. Everything that
handles payloads — the decoder, the payload check, the top-k chain, the config's names —
reads the row, so a new codec is its module and its row, nothing else.

Each codec is written twice, for where its values are: over numpy arrays (`encode`,
`decode`: the wire form, the coordinator's decode and downlink, an island on the CPU) and
over torch tensors (`encode_tensor`, `decode_tensor`: an island on a GPU computes its
pseudo-gradient, compresses it and keeps its error feedback on the device, and only the
encoded payload leaves it). The two are bit for bit the same, checked against one set of
digests (tests/data/codec_digests.json). On the host numpy stays: torch's decode was 1.6–3.5×
slower there, on the coordinator's hot path. Torch is imported when a tensor codec runs,
not here: the run config lists the names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

Payload = dict[str, np.ndarray]  # what a codec puts on the wire: crosses Ray's object store zero-copy
Tensors = dict[str, "torch.Tensor"]  # the same arrays as tensors, on the device that encoded them

CHUNKED = {"n", "scale", "chunk"}  # the arrays of a codec with one fp32 scale per chunk of values


@dataclass(frozen=True)
class Codec:
    name: str  # as the config names it (`compression.codec`)
    key: str  # the payload's array of values: how a payload names its codec
    bits: int  # bits per value on the wire, scales aside
    encode: Callable[[np.ndarray, int], Payload]  # (fp32 values, chunk) -> payload
    decode: Callable[[Payload], np.ndarray]  # payload -> fp32 values
    encode_tensor: Callable[[torch.Tensor, int], Tensors]  # the same, on the values' device
    decode_tensor: Callable[[Tensors], torch.Tensor]
    dtypes: tuple[str, ...]  # what the `key` array may be
    per_element: int = 1  # values packed into each element of `key` (two nibbles a byte: 2)
    chunked: bool = False  # one fp32 scale per `chunk` values, with `n`, `scale`, `chunk` arrays
    about: str = ""  # one line for the config's documentation

    @property
    def layout(self) -> dict[str, tuple[str, ...]]:
        """Every array of the payload and the dtypes it may have."""
        if not self.chunked:
            return {self.key: self.dtypes}
        extra = {"scale": ("float32",), "chunk": ("int32",)}
        if self.per_element > 1:
            extra["n"] = ("int64",)
        return {self.key: self.dtypes, **extra}

    def values(self, payload: Payload) -> int:
        """How many values `payload` holds (-1: its arrays disagree)."""
        if self.per_element == 1:
            return int(payload[self.key].size)
        n = int(payload["n"][0]) if payload["n"].size == 1 else -1
        return n if n >= 0 and -(-n // self.per_element) == payload[self.key].size else -1


def blocks(x: np.ndarray, chunk: int) -> np.ndarray:
    """`x` as fp32 rows of `chunk` values, the last one zero-padded."""
    pad = (-x.size) % chunk
    flat = x.astype(np.float32, copy=False)
    return (np.concatenate([flat, np.zeros(pad, np.float32)]) if pad else flat).reshape(-1, chunk)


def chunk_scales(blocks: np.ndarray, top: float) -> np.ndarray:
    """One fp32 scale per row that maps the row's largest magnitude to `top` (1 for a row
    of zeros, so nothing divides by zero)."""
    scale = np.abs(blocks).max(axis=1) / top
    scale[scale == 0] = 1.0
    return scale.astype(np.float32)


def scaled(values: np.ndarray, scale: np.ndarray, chunk: int) -> np.ndarray:
    """Per-chunk `values` times their chunk's scale, as fp32."""
    n = values.size
    out = np.zeros(scale.size * chunk, dtype=np.float32)
    out[:n] = values
    return (out.reshape(-1, chunk) * scale[:, None]).reshape(-1)[:n]


def pack_nibbles(u: np.ndarray, fill: int) -> np.ndarray:
    """4-bit codes, two per byte (low nibble first); an odd count ends with `fill`."""
    if u.size % 2:
        u = np.append(u, np.uint8(fill))
    return u[0::2] | (u[1::2] << 4)


def unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    """The first `n` 4-bit codes of `packed`, as uint8."""
    u = np.empty(packed.size * 2, dtype=np.uint8)
    u[0::2] = packed & 0x0F
    u[1::2] = packed >> 4
    return u[:n]


def chunked_payload(key: str, values: np.ndarray, n: int, scale: np.ndarray, chunk: int) -> Payload:
    return {key: values, "n": np.array([n], np.int64), "scale": scale, "chunk": np.array([chunk], np.int32)}


def to_payload(tensors: Tensors) -> Payload:
    """Encoded tensors as the wire's arrays, brought to the host: the only bytes that leave
    a device. A CUDA tensor is copied into page-locked memory from torch's caching host
    allocator: a copy to pageable memory is staged by the driver and faults in fresh pages
    (80 ms for 100 MB on an H200, measured, against a few ms pinned), and the block goes back
    to the cache once the payload is dropped (sent), so each round reuses the last one's
    pages instead of pinning new ones."""
    import torch

    def host(t: torch.Tensor) -> np.ndarray:
        if t.device.type != "cuda":
            return t.cpu().numpy()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out.numpy()

    arrays = {key: host(t) for key, t in tensors.items()}
    if any(t.device.type == "cuda" for t in tensors.values()):
        torch.cuda.current_stream().synchronize()  # the copies landed before anyone reads them
    return arrays


# the helpers above over torch tensors, on whatever device the values are


def blocks_t(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """`blocks` over a tensor."""
    import torch

    flat = x.reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % chunk
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(-1, chunk)


def chunk_scales_t(rows: torch.Tensor, top: float) -> torch.Tensor:
    """`chunk_scales` over a tensor."""
    # by a tensor on the device, not the Python float: CUDA divides by a host scalar as a
    # product with its reciprocal, which differs from numpy's quotient in the last bit
    scale = rows.abs().amax(dim=1) / rows.new_tensor(top)
    return scale.masked_fill(scale == 0, 1.0)


def scaled_t(values: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    """`scaled` over a tensor: cast into the output, then scaled in place, whole chunks in one
    product and the last partial one apart (torch's mixed-dtype product took 3× as long)."""
    import torch

    n = values.numel()
    whole = n // chunk
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    out.copy_(values)
    out[: whole * chunk].view(whole, chunk).mul_(scale[:whole, None])
    if n > whole * chunk:
        out[whole * chunk :].mul_(scale[whole])
    return out


def pack_nibbles_t(u: torch.Tensor, fill: int) -> torch.Tensor:
    """`pack_nibbles` over a tensor."""
    import torch

    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), fill)])
    return u[0::2] | (u[1::2] << 4)


def unpack_nibbles_t(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`unpack_nibbles` over a tensor."""
    import torch

    return torch.stack((packed & 0x0F, packed >> 4), dim=1).view(-1)[:n]


def chunked_tensors(key: str, values: torch.Tensor, n: int, scale: torch.Tensor, chunk: int) -> Tensors:
    import torch

    device = values.device
    return {
        key: values,
        "n": torch.tensor([n], dtype=torch.int64, device=device),
        "scale": scale,
        "chunk": torch.tensor([chunk], dtype=torch.int32, device=device),
    }
