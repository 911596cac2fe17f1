"""Every codec, over numpy on the host and over torch on a device, against one set of
digests of its payloads and their decoded values (tests/data/codec_digests.json, written by
the numpy codecs before the torch ones existed): random values at sizes that leave partial
chunks and odd nibbles, heavy tails, a chunk of zeros, and values on every rounding
boundary (fp4's ties to even, the integers' halves). Bit for bit, so an island that encodes
on its GPU sends what it would have sent from the host, and its error feedback is the same."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from archipelago.workers.wire.codecs import CODECS
from archipelago.workers.wire.codecs.base import to_payload
from archipelago.workers.wire.compress import decode, encode
from tests.conftest import REPO

DIGESTS = json.loads((REPO / "tests" / "data" / "codec_digests.json").read_text())
CHUNKS = (4096, 512, 64)


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2026)
    out = {f"normal-{n}": rng.normal(0, 1e-2, n).astype(np.float32) for n in (1, 7, 511, 4096, 10_001)}
    out["heavy-9000"] = rng.standard_t(2, 9000).astype(np.float32)
    z = rng.normal(0, 1, 3000).astype(np.float32)
    z[512:1024] = 0.0
    out["zero-chunk-3000"] = z
    # on the rounding boundaries once a chunk's largest magnitude (6 for fp4, 7 for int4) scales them
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.5, -0.5, 3.0, 4.0]
    out["fp4-ties"] = np.tile(np.array(ties, np.float32), 40)
    out["int4-ties"] = np.tile(np.array([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, -6.5], np.float32), 50)
    return out


INPUTS = _inputs()


def _digest(payload: dict[str, np.ndarray], decoded: np.ndarray) -> str:
    h = hashlib.sha256()
    for key in sorted(payload):
        a = np.ascontiguousarray(payload[key])
        h.update(key.encode())
        h.update(a.dtype.str.encode())
        h.update(a.tobytes())
    h.update(np.ascontiguousarray(decoded, dtype=np.float32).tobytes())
    return h.hexdigest()[:32]


def test_the_digests_cover_every_codec_alone_and_after_top_k():
    named = {key.split("/")[1] for key in DIGESTS}
    assert set(CODECS) <= named and any(n.startswith("topk:") for n in named)
    assert len(DIGESTS) == len(INPUTS) * len(named) * len(CHUNKS)


@pytest.mark.parametrize("name", sorted({key.split("/")[1] for key in DIGESTS}))
def test_the_host_codecs_give_the_recorded_payloads(name):
    for label, x in INPUTS.items():
        for chunk in CHUNKS:
            payload = encode(x, name, chunk)
            assert _digest(payload, decode(payload)) == DIGESTS[f"{label}/{name}/{chunk}"], (label, chunk)


def _on_device(device: str) -> None:
    for name, codec in CODECS.items():
        for label, x in INPUTS.items():
            for chunk in CHUNKS:
                encoded = codec.encode_tensor(torch.from_numpy(x).to(device), chunk)
                assert all(t.device.type == device for t in encoded.values())  # nothing left the device
                decoded = codec.decode_tensor(encoded)
                assert decoded.device.type == device
                key = f"{label}/{name}/{chunk}"
                assert _digest(to_payload(encoded), decoded.cpu().numpy()) == DIGESTS[key], key


def test_the_tensor_codecs_give_the_recorded_payloads_on_the_cpu():
    _on_device("cpu")


@pytest.mark.cuda
def test_the_tensor_codecs_give_the_recorded_payloads_on_cuda():
    _on_device("cuda")
