"""Radial-Directional Averaging (`outer.merge: radial_directional`, Decoupled DiLoCo):
vector R1 of docs/algorithms.md in float64, its properties, the outer step taking it (and
not the one-pass mean), a whole run with it in two modes, and the configs it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archipelago.orchestrator.algorithms.aggregate import WeightedMean
from archipelago.orchestrator.config_load import ConfigError, load_config
from archipelago.orchestrator.config_sections import OuterConfig, OuterMerge
from archipelago.orchestrator.engine.step.outer import Commit, LocalOuter
from archipelago.orchestrator.engine.step.rules import optimizer_rule
from archipelago.orchestrator.engine.types import Contribution
from archipelago.orchestrator.engine.warm_start import warm_config
from tests.engine_scenarios import run_scenario, scenario_cfg
from tests.helpers import coordinator_plan

F64 = np.float64


def rda(parts: list[tuple[list[float], float]]) -> np.ndarray:
    merge = WeightedMean(len(parts[0][0]), torch.float64)
    return merge.radial_directional([(np.array(d, F64), w) for d, w in parts], None, 512).numpy().copy()


def test_vector_r1():
    """docs/algorithms.md, R1: norms 3 and 4 average to 3.5 along the diagonal; with token
    weights 3 and 1, the mean norm is 3.25 along (0.75, 0.25) normalised."""
    np.testing.assert_allclose(rda([([3, 0], 1), ([0, 4], 1)]), [3.5 / np.sqrt(2)] * 2, atol=1e-12)
    u = np.array([0.75, 0.25]) / np.linalg.norm([0.75, 0.25])
    np.testing.assert_allclose(rda([([3, 0], 3), ([0, 4], 1)]), 3.25 * u, atol=1e-12)
    np.testing.assert_allclose(rda([([3, 0], 3), ([0, 4], 1)]), [3.0832207, 1.0277402], atol=1e-6)


def test_its_properties_against_the_mean():
    """Aligned updates: the weighted mean. Opposed ones cancel to zero. A zero update adds
    to the mean norm only. Scaling every update scales the result; the norm of the result
    is the weighted mean of the norms whenever there is a direction."""
    rng = np.random.default_rng(0)
    d = rng.normal(size=6)
    np.testing.assert_allclose(rda([(list(2 * d), 1), (list(d), 3)]), (2 * d + 3 * d) / 4, atol=1e-12)
    np.testing.assert_allclose(rda([([1, 0], 1), ([-1, 0], 1)]), [0, 0])
    np.testing.assert_allclose(rda([([0, 0], 1), ([3, 4], 1)]), [1.5, 2.0], atol=1e-12)
    a, b = rng.normal(size=5), rng.normal(size=5)
    np.testing.assert_allclose(rda([(list(7 * a), 2), (list(7 * b), 1)]), 7 * rda([(list(a), 2), (list(b), 1)]))
    out = rda([(list(a), 2), (list(b), 1)])
    assert np.linalg.norm(out) == pytest.approx((2 * np.linalg.norm(a) + np.linalg.norm(b)) / 3)
    assert np.linalg.norm(out) > np.linalg.norm((2 * a + b) / 3)  # the mean shrinks what disagrees


def test_the_outer_step_takes_the_merge_and_not_the_mean_taken_while_screening():
    """SGD with lr 1 and no momentum applies the merged update whole: θ − RDA(Δ)."""
    outer = LocalOuter(
        torch.zeros(2), optimizer_rule(OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, merge="radial_directional"))
    )
    assert not outer.steps[0].prefills
    deltas = [np.array([3, 0], np.float32), np.array([0, 4], np.float32)]
    proposal = outer.propose([Contribution(island=i, version=0, delta=d, weight=1.0) for i, d in enumerate(deltas)])
    assert [f.sqnorm for f in proposal.facts] == [9.0, 16.0]
    outer.commit(proposal, Commit(weights={0: 1.0, 1: 1.0}))
    np.testing.assert_allclose(outer.params(), [-3.5 / np.sqrt(2)] * 2, rtol=1e-6)


def test_the_step_takes_the_norms_the_screen_measured(monkeypatch):
    """Each update is read once for its norm (while screening) and once for its direction:
    the merge takes the screened norms instead of reading every update again."""
    from archipelago.orchestrator.algorithms import aggregate

    outer = LocalOuter(
        torch.zeros(2), optimizer_rule(OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, merge="radial_directional"))
    )
    deltas = [np.array([3, 0], np.float32), np.array([0, 4], np.float32)]
    proposal = outer.propose([Contribution(island=i, version=0, delta=d, weight=1.0) for i, d in enumerate(deltas)])
    reads = []
    original = aggregate.sqnorm
    monkeypatch.setattr(aggregate, "sqnorm", lambda x: reads.append(x.size) or original(x))
    outer.commit(proposal, Commit(weights={0: 1.0, 1: 1.0}))
    assert reads == []  # the merge measured nothing again
    np.testing.assert_allclose(outer.params(), [-3.5 / np.sqrt(2)] * 2, rtol=1e-6)
    # and given norms, it takes them as they are: both 10, so the radius is 10 and the units
    # [0.3, 0] and [0, 0.4] point along (0.6, 0.8)
    out = WeightedMean(2, torch.float64).radial_directional([(d.astype(F64), 1.0) for d in deltas], [100.0, 100.0], 512)
    np.testing.assert_allclose(out.numpy(), [6.0, 8.0], rtol=1e-12)


def test_its_norms_are_exact_sums_that_any_slicing_adds_up_to():
    """`exact_sum` is the correctly rounded sum (math.fsum's) over values of every scale;
    `exact_sqnorm` cut at any row boundaries adds up to the whole vector's, bit for bit —
    what a plain dot product summed per slice does not (checked: it differs here)."""
    import itertools
    import math

    from archipelago.orchestrator.algorithms.aggregate import ExactSum, exact_sqnorm, exact_sum, sqnorm

    rng = np.random.default_rng(3)
    values = rng.random(50_000) * 10.0 ** rng.integers(-30, 30, 50_000)
    assert float(exact_sum(values)) == math.fsum(values)
    assert float(exact_sum(np.array([1e300, 1.0, -1e300]))) == 1.0  # no cancellation lost
    assert not exact_sum(np.array([1.0, np.nan])).finite
    x = rng.normal(0, 1, 10_000 * 64 + 37).astype(np.float32)
    whole = exact_sqnorm(x, 64)
    cuts = [0, 64 * 3, 64 * 5000, 64 * 9999, x.size]
    parts = [exact_sqnorm(x[lo:hi].copy(), 64) for lo, hi in itertools.pairwise(cuts)]
    assert sum(parts, ExactSum()) == whole and float(whole) == pytest.approx(float(np.dot(x.astype(F64), x)))
    assert sum(sqnorm(x[lo:hi]) for lo, hi in itertools.pairwise(cuts)) != sqnorm(x)


@pytest.mark.parametrize("mode", ["diloco", "streaming"])
def test_a_run_merging_radially_trains_each_batch_once(tmp_path, mode):
    summary = run_scenario(scenario_cfg(tmp_path, mode, "outer.merge=radial_directional"))
    assert summary["state"] == "finished" and summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_it_is_refused_where_it_cannot_be_taken():
    sets = ["mode=ddp", "warm_start.steps=0"]
    with pytest.raises(ConfigError, match=r"outer.merge radial_directional needs a DiLoCo-family mode"):
        load_config(None, ["outer.merge=radial_directional", *sets])
    assert load_config(None, sets).merge == OuterMerge.MEAN


def test_mode_async_merges_radially_by_default():
    """RDA ended lower than the mean in 11 of 12 bench fleet runs: mode async takes it
    unless asked otherwise, on one coordinator or sliced (test_sharded_outer: bit for bit);
    the other modes (and the warm start) keep the mean."""
    assert load_config(None, ["mode=async"]).merge == OuterMerge.RADIAL_DIRECTIONAL
    assert load_config(None, ["mode=async", "outer.merge=mean"]).merge == OuterMerge.MEAN
    assert load_config(None, ["mode=async", "coordinator.shards=2"]).merge == OuterMerge.RADIAL_DIRECTIONAL
    for mode in ("diloco", "overlap", "streaming"):
        assert load_config(None, [f"mode={mode}", "inner_steps=48"]).merge == OuterMerge.MEAN
    assert warm_config(load_config(None, ["mode=async"])).merge == OuterMerge.MEAN


@pytest.mark.parametrize("sets", [[], ["mode=async"]], ids=["mean", "radial_directional"])
def test_the_plan_sizes_one_mean_buffer_beside_the_parameters_whatever_the_merge(sets):
    """Either merge averages into one preallocated buffer and the step is taken in place:
    the plan counts one vector for it, and no spare copies of the parameters."""
    cfg = load_config(None, ["warm_start.steps=0", *sets])
    coordinator = coordinator_plan(cfg)
    assert coordinator.parts["mean buffer"] == 4 * 1000
    assert not [p for p in coordinator.parts if "spare" in p]
