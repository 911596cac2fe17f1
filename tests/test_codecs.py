"""The value codecs' registry and FP4 (E2M1): its test vector, rounding ties to the even
mantissa, and what it buys over int4 where a pseudo-gradient's values are."""

from __future__ import annotations

import numpy as np
import pytest

from archipelago.workers.wire.codecs import CODECS, codec_of
from archipelago.workers.wire.compress import PayloadError, check_payload, decode, encode


def test_fp4_vector_e2m1_codes_ties_to_even_and_no_negative_zero():
    # one chunk whose largest magnitude is 6: the scale is 1, the values are the codes'
    x = np.array([0.3, -0.7, 1.2, 6.0, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, 1.75, 0.0], np.float32)
    p = encode(x, "fp4", chunk=12)
    assert p["fp4"].tolist() == [0x91, 0x72, 0x22, 0x64, 0x06, 0x04]  # codes 1,9 | 2,7 | 2,2 | 4,6 | 6,0 | 4,0
    assert p["scale"].tolist() == [1.0] and p["n"].tolist() == [12]
    assert decode(p).tolist() == [0.5, -0.5, 1.0, 6.0, 1.0, 1.0, 2.0, 4.0, 4.0, 0.0, 2.0, 0.0]


def test_fp4_scales_each_chunk_to_its_largest_magnitude():
    x = np.array([0.01, -0.03, 0.02, 0.0, 30.0, -10.0, 15.0, 1.0, 0.1], np.float32)
    p = encode(x, "fp4", chunk=4)
    assert np.allclose(p["scale"], [0.03 / 6, 30.0 / 6, 0.1 / 6])
    np.testing.assert_allclose(decode(p), [0.01, -0.03, 0.02, 0.0, 30.0, -10.0, 15.0, 0.0, 0.1], rtol=1e-6)
    check_payload(p, 9)
    with pytest.raises(PayloadError, match="holds 9 values, not the 10"):
        check_payload(p, 10)
    with pytest.raises(PayloadError, match="holds -1 values"):  # a count its bytes cannot hold
        check_payload({**p, "n": np.array([11], np.int64)}, 11)


def test_fp4_is_finer_than_int4_on_gaussian_values_at_the_same_bytes():
    """A pseudo-gradient's values bunch near zero: E2M1's codes do too, int4's are even."""
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    fp4, int4 = encode(x, "fp4", chunk=512), encode(x, "int4", chunk=512)
    assert sum(a.nbytes for a in fp4.values()) == sum(a.nbytes for a in int4.values())
    err = {name: float(np.linalg.norm(decode(p) - x) / np.linalg.norm(x)) for name, p in (("fp4", fp4), ("int4", int4))}
    assert err["fp4"] < 0.9 * err["int4"], err


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_codec_round_trips_its_layout_alone_and_after_top_k(name):
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32)
    for chain in (name, f"topk:0.1+{name}"):
        p = encode(x, chain, chunk=100)
        check_payload(p, x.size)
        assert decode(p).shape == x.shape
    plain = encode(x, name, chunk=100)
    assert codec_of(plain) is CODECS[name] and set(plain) == set(CODECS[name].layout)
