"""The value codecs: one row each. A codec is a module (its encode and decode, and its
`Codec` row: name, wire key, bits, payload layout) and one entry in `CODECS`; the decoder,
the payload check, top-k chains and the config's codec names all read the registry.
Torch-free at import (bf16 imports it when used), so the run config can list the names."""

from __future__ import annotations

from . import fp4, integer, plain
from .base import Codec, Payload

CODECS: dict[str, Codec] = {
    c.name: c for c in (plain.NONE, plain.BF16, integer.INT8, integer.INT4, integer.INT2, fp4.FP4)
}


def codec_of(payload: Payload) -> Codec | None:
    """The codec whose values `payload` carries (None: no codec's)."""
    return next((c for c in CODECS.values() if c.key in payload), None)


__all__ = ["CODECS", "Codec", "Payload", "codec_of"]
