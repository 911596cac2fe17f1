"""Admission: bad pseudo-gradients never touch the global model; drops are counted."""

from __future__ import annotations

import numpy as np
import torch

from orchestrator.algorithms.robust import NormGuard
from orchestrator.config import RobustConfig
from orchestrator.config_sections import OuterConfig
from orchestrator.engine.admission import Admission, ExactVersion
from orchestrator.engine.outer_step import LocalOuter, OuterRule, take_step
from orchestrator.engine.policies import outer_optimizer
from orchestrator.engine.types import Contribution


class _Harness:
    """One coordinator's outer step with admission, as the engine closes a barrier round."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        self.param = torch.ones(3, dtype=torch.float32)
        self.outer = LocalOuter(self.param, OuterRule(lambda p: (outer_optimizer(OuterConfig(), p), None)))
        self.admission = Admission(3, NormGuard(RobustConfig()), ExactVersion(), 3, drop_prob, seed=1)
        self.version = 0

    def close(self, contributions):
        out = take_step(self.outer, self.admission, contributions, self.version, self.version)
        self.version += 1
        return out


def test_nan_wrong_shape_stale_and_zero_weight_are_rejected_and_params_untouched():
    h = _Harness()
    before = h.param.clone()
    bad = [
        Contribution(island=0, version=0, delta=np.array([1.0, np.nan, 0.0], dtype=np.float32), weight=1.0),
        Contribution(island=1, version=0, delta=np.array([np.inf, 0.0, 0.0], dtype=np.float32), weight=1.0),
        Contribution(island=2, version=0, delta=np.zeros(4, dtype=np.float32), weight=1.0),
        Contribution(island=3, version=5, delta=np.zeros(3, dtype=np.float32), weight=1.0),
        Contribution(island=4, version=0, delta=np.zeros(3, dtype=np.float32), weight=0.0),
    ]
    out = h.close(bad)
    assert not out.stepped and out.accepted == []
    assert set(out.rejected) == {0, 1, 2, 3, 4}
    assert "non-finite" in out.rejected[0] and "shape" in out.rejected[2] and "stale" in out.rejected[3]
    assert "weight" in out.rejected[4] and "non-finite" in out.rejected[1]
    assert torch.equal(h.param, before)


def test_good_updates_apply_while_bad_ones_are_excluded():
    h = _Harness()
    good = Contribution(island=0, version=0, delta=np.full(3, 0.1, dtype=np.float32), weight=1.0)
    bad = Contribution(island=1, version=0, delta=np.full(3, np.nan, dtype=np.float32), weight=1.0)
    out = h.close([good, bad])
    assert out.accepted == [0] and 1 in out.rejected
    np.testing.assert_allclose(h.param.numpy(), 1 - 0.7 * 1.9 * 0.1, rtol=1e-6)


def test_drop_prob_drops_about_half_and_dropped_rounds_do_not_step():
    h = _Harness(drop_prob=0.5)
    dropped = accepted = 0
    for _ in range(200):
        out = h.close([Contribution(island=0, version=h.version, delta=np.ones(3, dtype=np.float32), weight=1.0)])
        dropped += len(out.dropped)
        accepted += len(out.accepted)
        assert out.stepped == bool(out.accepted)
    assert 70 < dropped < 130 and dropped + accepted == 200


def test_finiteness_from_the_norm_pass_and_its_overflow_fallback():
    from orchestrator.algorithms.aggregate import all_finite, sqnorm

    x = np.ones(10, dtype=np.float32)
    assert all_finite(x, sqnorm(x))
    huge = np.full(10, 3e38, dtype=np.float32)  # finite, but its squared norm overflows
    assert not np.isfinite(sqnorm(huge)) and all_finite(huge, sqnorm(huge))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3] = bad
        assert not all_finite(y, sqnorm(y))
