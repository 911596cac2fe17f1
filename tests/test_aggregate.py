"""Admission: bad pseudo-gradients never touch the global model; drops are counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archipelago.orchestrator.algorithms.robust import NormGuard
from archipelago.orchestrator.config import RobustConfig
from archipelago.orchestrator.config_sections import OuterConfig
from archipelago.orchestrator.engine.step.admission import Admission, ExactVersion
from archipelago.orchestrator.engine.step.outer import LocalOuter, OuterStep, take_step
from archipelago.orchestrator.engine.step.rules import optimizer_rule
from archipelago.orchestrator.engine.types import Contribution


class _Harness:
    """One coordinator's outer step with admission, as the engine closes a barrier round."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        self.param = torch.ones(3, dtype=torch.float32)
        self.outer = LocalOuter(self.param, optimizer_rule(OuterConfig()))
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
    from archipelago.orchestrator.algorithms.aggregate import all_finite, sqnorm

    x = np.ones(10, dtype=np.float32)
    assert all_finite(x, sqnorm(x))
    huge = np.full(10, 3e38, dtype=np.float32)  # finite, but its squared norm overflows
    assert not np.isfinite(sqnorm(huge)) and all_finite(huge, sqnorm(huge))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3] = bad
        assert not all_finite(y, sqnorm(y))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_blocked_mean_and_norms_are_the_whole_vector_ones(dtype):
    """`WeightedMean.fill` runs block by block (each update read once, norms from the same
    reads): its mean is bitwise the whole-vector ops' Σ wΔ / Σ w, its norms equal `sqnorm`'s."""
    from archipelago.orchestrator.algorithms.aggregate import CHUNK, WeightedMean, sqnorm

    rng = np.random.default_rng(0)
    n = 3 * CHUNK + 77
    parts = [(rng.normal(size=n).astype(dtype), w) for w in (3.0, 1.0, 5.5)]
    ttype = torch.float32 if dtype == np.float32 else torch.float64
    want = torch.from_numpy(parts[0][0]) * parts[0][1]
    for d, w in parts[1:]:
        want.add_(torch.from_numpy(d), alpha=w)
    want.div_(9.5)
    sq = [0.0] * 3
    got = WeightedMean(n, ttype).fill(parts, sq)
    assert torch.equal(got, want)
    assert sq == pytest.approx([sqnorm(d) for d, _ in parts], rel=1e-5)
    with pytest.raises(ValueError, match="no contributions"):
        WeightedMean(n, ttype).fill([])


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch_ops"])
def test_a_mean_taken_while_screening_steps_exactly_as_one_taken_after_it(compiled: bool, monkeypatch):
    """`LocalOuter.propose` averages every update in the pass that screens them; when all
    are admitted `commit` steps on that mean, else it averages the admitted ones again
    from the updates the proposal holds. Both must give bitwise the model of averaging
    after admission, in island order whatever the arrival order — with numba's compiled
    loops and with torch's ops."""
    rng = np.random.default_rng(1)
    n = 70_000
    deltas = {i: rng.normal(0, 1e-2, n).astype(np.float32) for i in range(3)}
    weights = {0: 2.0, 1: 3.0, 2: 1.0}

    if not compiled:
        from archipelago.orchestrator.algorithms import fused_step

        monkeypatch.setattr(fused_step, "available", lambda: False)

    def stepped(arrivals: list[int], poisoned: int | None = None) -> torch.Tensor:
        param = torch.ones(n)
        outer = LocalOuter(param, optimizer_rule(OuterConfig()))
        admission = Admission(n, NormGuard(RobustConfig()), ExactVersion(), 3, 0.0, seed=1)
        batch = [
            Contribution(island=i, version=0, delta=deltas[i] * (np.nan if i == poisoned else 1), weight=weights[i])
            for i in arrivals
        ]
        take_step(outer, admission, batch, 0, 0)
        assert np.array_equal(outer.params(), param.numpy())  # stepped in the model's buffer
        return param

    def reference(islands: list[int]) -> torch.Tensor:
        param = torch.ones(n)
        step = OuterStep(param, optimizer_rule(OuterConfig()))
        step.apply([(deltas[i], weights[i]) for i in islands])
        return param

    assert torch.equal(stepped([2, 0, 1]), reference([0, 1, 2]))
    assert torch.equal(stepped([1, 2, 0], poisoned=1), reference([0, 2]))
