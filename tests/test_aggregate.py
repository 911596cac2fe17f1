"""Bad pseudo-gradients never touch the global model; drops are counted."""
from __future__ import annotations

import numpy as np
import torch

from orchestrator.aggregate import Contribution
from orchestrator.config import OuterConfig
from orchestrator.outer import build_outer
from orchestrator.sync_server import SyncServer


def _server(drop_prob: float = 0.0) -> SyncServer:
    return SyncServer(torch.ones(3, dtype=torch.float32), lambda p: (build_outer(OuterConfig(), p), None),
                      drop_prob=drop_prob, seed=1)


def test_nan_wrong_shape_stale_and_zero_weight_are_rejected_and_params_untouched():
    server = _server()
    before = server.param.detach().clone()
    bad = [
        Contribution(0, 0, np.array([1.0, np.nan, 0.0], dtype=np.float32), 1.0),
        Contribution(1, 0, np.array([np.inf, 0.0, 0.0], dtype=np.float32), 1.0),
        Contribution(2, 0, np.zeros(4, dtype=np.float32), 1.0),
        Contribution(3, 5, np.zeros(3, dtype=np.float32), 1.0),
        Contribution(4, 0, np.zeros(3, dtype=np.float32), 0.0),
    ]
    out = server.close_round(bad)
    assert not out.stepped and out.accepted == []
    assert set(out.rejected) == {0, 1, 2, 3, 4}
    assert "non-finite" in out.rejected[0] and "shape" in out.rejected[2] and "stale" in out.rejected[3]
    assert torch.equal(server.param.detach(), before)


def test_good_updates_apply_while_bad_ones_are_excluded():
    server = _server()
    good = Contribution(0, 0, np.full(3, 0.1, dtype=np.float32), 1.0)
    bad = Contribution(1, 0, np.full(3, np.nan, dtype=np.float32), 1.0)
    out = server.close_round([good, bad])
    assert out.accepted == [0] and 1 in out.rejected
    expected = 1 - 0.7 * 1.9 * 0.1
    np.testing.assert_allclose(server.param.detach().numpy(), expected, rtol=1e-6)


def test_drop_prob_drops_about_half_and_dropped_rounds_do_not_step():
    server = _server(drop_prob=0.5)
    dropped = accepted = 0
    for _ in range(200):
        out = server.close_round([Contribution(0, server.version, np.zeros(3, dtype=np.float32), 1.0)])
        dropped += len(out.dropped)
        accepted += len(out.accepted)
        assert out.stepped == bool(out.accepted)
    assert 70 < dropped < 130 and dropped + accepted == 200


def test_finiteness_from_the_norm_pass_and_its_overflow_fallback():
    from orchestrator.aggregate import all_finite, sqnorm

    x = np.ones(10, dtype=np.float32)
    assert all_finite(x, sqnorm(x))
    huge = np.full(10, 3e38, dtype=np.float32)  # finite, but its squared norm overflows
    assert not np.isfinite(sqnorm(huge)) and all_finite(huge, sqnorm(huge))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3] = bad
        assert not all_finite(y, sqnorm(y))
