"""The coordinator's one-pass outer step (`fused_step.mean_step`, `OnePass`): bit for bit
the weighted mean (`WeightedMean.fill`) followed by `FlatSGD`'s step, for every rule it
takes, any number of updates and threads; the pass only reads the current state, so a
refused update leaves it exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from orchestrator.algorithms.aggregate import WeightedMean, sqnorm
from orchestrator.algorithms.fused_step import SGDRule, mean_step
from orchestrator.algorithms.outer import FlatSGD
from orchestrator.engine.outer_step import LocalOuter, OuterRule


@pytest.mark.parametrize(
    "k, momentum, nesterov, threads",
    [(1, 0.9, True, 1), (3, 0.9, True, 2), (4, 0.0, False, 1), (5, 0.8, False, 2), (2, 0.9, True, 3)],
)
def test_one_pass_is_bitwise_the_mean_then_flat_sgd(k: int, momentum: float, nesterov: bool, threads: int):
    """Three steps (the first creates the momentum), with token weights that are not
    float32-exact after scaling and a length that no thread split divides evenly."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(k)
    n = 300_007
    p0 = rng.normal(size=n).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    reference = FlatSGD([param], lr=0.7, momentum=momentum, nesterov=nesterov)
    mean = WeightedMean(n, torch.float32)
    p, b = p0.copy(), None
    p_out, b_out = np.empty_like(p), (np.empty_like(p) if momentum else None)
    for _ in range(3):
        parts = [(rng.normal(0, 1e-3, n).astype(np.float32), float(rng.integers(100, 5000)) / 3) for _ in range(k)]
        want_sq = [0.0] * k
        param.grad = mean.fill(parts, want_sq)
        reference.step()
        got_sq = mean_step(parts, SGDRule(0.7, momentum, nesterov), p, b, p_out, b_out, threads=threads)
        p, p_out = p_out, p
        if momentum:
            b, b_out = b_out, (b if b is not None else np.empty_like(p))
            assert np.array_equal(b, reference.state[param]["momentum_buffer"].numpy())
        assert np.array_equal(p, param.detach().numpy())
        assert got_sq == pytest.approx(want_sq, rel=1e-5)


def test_a_non_finite_update_shows_in_its_norm_and_the_state_the_pass_read_is_untouched():
    n = 100_000
    rng = np.random.default_rng(0)
    bad = rng.normal(size=n).astype(np.float32)
    bad[77] = np.inf
    good = rng.normal(size=n).astype(np.float32)
    p, b = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    p_before, b_before = p.copy(), b.copy()
    sq = mean_step([(good, 1.0), (bad, 1.0)], SGDRule(0.7, 0.9, True), p, b, np.empty_like(p), np.empty_like(b))
    assert sq[0] == pytest.approx(sqnorm(good), rel=1e-5) and not math.isfinite(sq[1])
    assert np.array_equal(p, p_before) and np.array_equal(b, b_before)
    with pytest.raises(ValueError, match="no contributions"):
        mean_step([(good, 0.0)], SGDRule(0.7, 0.9, True), p, b, np.empty_like(p), np.empty_like(b))


def test_the_outer_alternates_buffers_and_keeps_the_models_copy_and_a_checkpoint_right():
    """After one-pass steps the parameters may sit in the spare: `params()` reads them
    where they are, `copy_to` brings the model's buffer up to date, a rescaled step is
    taken from the state the pass left alone, and loading a state puts the parameters
    back in the model's buffer."""
    torch.set_num_threads(1)
    n = 50_000
    rng = np.random.default_rng(3)

    def rule(p: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, None]:
        return FlatSGD([p], lr=0.7, momentum=0.9, nesterov=True), None

    flat = torch.ones(n)
    outer = LocalOuter(flat, OuterRule(rule))
    ref_param = torch.nn.Parameter(torch.ones(n))
    reference = FlatSGD([ref_param], lr=0.7, momentum=0.9, nesterov=True)
    from orchestrator.engine.types import Contribution

    for version, scale in enumerate([1.0, 1.0, 0.5, 1.0]):
        deltas = [rng.normal(0, 1e-2, n).astype(np.float32) for _ in range(2)]
        key, _ = outer.inspect(
            [Contribution(island=i, version=version, delta=d, weight=1.0) for i, d in enumerate(deltas)]
        )
        outer.apply(key, {0: 1.0, 1: 1.0}, scale=scale)
        ref_param.grad = WeightedMean(n, torch.float32).fill([(d, 1.0) for d in deltas])
        ref_param.grad.mul_(scale)
        reference.step()
        assert np.array_equal(outer.params(), ref_param.detach().numpy())
    assert outer.steps[0].param.data_ptr() != flat.data_ptr()  # three commits: in the spare
    outer.copy_to(flat)
    assert torch.equal(flat, ref_param.detach())
    state = outer.state_dict()
    outer.load_state_dict(state, version=4)
    assert outer.steps[0].param.data_ptr() == flat.data_ptr()
    assert torch.equal(
        outer.steps[0].optimizer.state[outer.steps[0].param]["momentum_buffer"],
        reference.state[ref_param]["momentum_buffer"],
    )
