"""docs/algorithms.md, async Local-SGD in float64: Delayed Nesterov (A1, sync equivalence), DyLU (A2), staleness."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from archipelago.orchestrator.algorithms.dylu import SpeedTracker, dylu_steps
from archipelago.orchestrator.algorithms.outer import DelayedNesterov
from archipelago.orchestrator.algorithms.robust import NormGuard
from archipelago.orchestrator.config import RobustConfig
from archipelago.orchestrator.config_sections import OuterConfig
from archipelago.orchestrator.engine.step.admission import Admission, BoundedStaleness
from archipelago.orchestrator.engine.step.outer import LocalOuter, take_step
from archipelago.orchestrator.engine.step.rules import optimizer_rule
from archipelago.orchestrator.engine.types import Contribution
from archipelago.orchestrator.mode_settings import AsyncSettings


def _dn(theta: torch.Tensor, **kw) -> DelayedNesterov:
    """A `DelayedNesterov` over `theta`'s storage; `step(g)` sets `.grad` and steps."""
    p = torch.nn.Parameter(theta)
    opt = DelayedNesterov([p], **kw)

    def step(g: torch.Tensor) -> None:
        p.grad = g
        opt.step()

    opt.apply = step  # type: ignore[attr-defined]
    return opt


TOL = 1e-6


@pytest.mark.parametrize(
    "c, expected",
    [
        (0.0, [0.93, 0.601, 0.566, 0.4309]),
        (0.25, [0.93, 0.64825, 0.566, 0.473425]),
    ],
)
def test_vector_a1(c, expected):
    theta = torch.tensor([1.0], dtype=torch.float64)
    dn = _dn(theta, lr=0.7, momentum=0.9, delay=2, c=c)
    for g, want in zip([0.2, 0.4, 0.1, -0.1], expected):
        dn.apply(torch.tensor([g], dtype=torch.float64))
        assert theta.item() == pytest.approx(want, abs=TOL)


def test_dn_with_c0_equals_sync_nesterov_every_n_arrivals():
    rng = np.random.default_rng(0)
    n, dim = 3, 5
    theta_dn = torch.tensor(rng.normal(size=dim))
    param = torch.nn.Parameter(theta_dn.clone())
    sync = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)  # stock torch Nesterov
    dn = _dn(theta_dn, lr=0.7, momentum=0.9, delay=n)
    for _ in range(4):
        grads = [torch.tensor(rng.normal(size=dim)) for _ in range(n)]
        for g in grads:
            dn.apply(g.clone())
        param.grad = torch.stack(grads).mean(0)
        sync.step()
        np.testing.assert_allclose(theta_dn.numpy(), param.detach().numpy(), atol=1e-12)


def test_dn_rejects_bad_parameters():
    with pytest.raises(ValueError, match="1/N"):
        DelayedNesterov([torch.nn.Parameter(torch.zeros(1))], 0.7, 0.9, delay=2, c=0.6)
    with pytest.raises(ValueError, match=r"c must be at most 1/N = 0\.25"):
        AsyncSettings(delay=4, c=0.5).check_c(islands=8)  # N is the delay when given
    with pytest.raises(ValueError, match=r"c must be at most 1/N = 0\.5"):
        AsyncSettings(c=0.6).check_c(islands=2)  # else the islands
    from archipelago.orchestrator.config import RunConfig

    with pytest.raises(ValueError, match=r"mode\.c must be at most 1/N = 0\.25"):
        RunConfig(mode={"name": "async", "delay": 4, "c": 0.5})  # the config file's check is the same rule


def test_vector_a2_dylu():
    assert list(dylu_steps({0: 1.0, 1: 0.75, 2: 0.5, 3: 0.2}, 50).values()) == [50, 37, 25, 10]
    assert dylu_steps({0: 0.0, 1: 2.0}, 10) == {0: 10, 1: 10}
    assert dylu_steps({0: 1.0, 1: 0.001}, 10)[1] == 1


def test_speed_tracker_smooths():
    t = SpeedTracker(smoothing=0.5)
    t.observe(0, 10, 1.0)
    t.observe(0, 10, 0.5)
    assert t.speeds[0] == pytest.approx(15.0)
    t.observe(1, 10, 2.0)
    assert t.steps(30) == {0: 30, 1: 10}


def test_a_probed_speed_sizes_the_first_h_and_the_first_real_round_replaces_it():
    t = SpeedTracker(smoothing=0.5)
    t.observe(0, 10, 1.0)
    t.know(1, 1000.0)  # a probe that saw compute only
    assert t.steps(10) == {0: 1, 1: 10}
    t.observe(1, 5, 1.0)  # its first real round: 5 steps/s, not smoothed with the probe
    assert t.speeds[1] == 5.0
    t.observe(1, 15, 1.0)
    assert t.speeds[1] == pytest.approx(10.0)  # later rounds are smoothed


class _Async:
    """Per-arrival outer steps with bounded staleness, as the engine applies async arrivals."""

    def __init__(self, **cfg) -> None:
        a = AsyncSettings(**cfg)
        self.param = torch.zeros(2, dtype=torch.float64)
        self.outer = LocalOuter(
            self.param,
            optimizer_rule(OuterConfig(lr=1.0, momentum=0.0, optimizer="sgd")),
        )
        self.guard = NormGuard(RobustConfig(min_history=1))
        self.admission = Admission(2, self.guard, BoundedStaleness(a.max_staleness, a.stale_policy == "downweight"), 3)
        self.version = 0

    def submit(self, c: Contribution):
        out = take_step(self.outer, self.admission, [c], None, self.version)
        self.version += out.stepped
        return out.verdicts[0]


def _c(version, g=(1.0, 1.0), island=0):
    return Contribution(island=island, version=version, delta=np.asarray(g, dtype=np.float64), weight=1.0)


def test_staleness_reject_policy_leaves_params_untouched():
    s = _Async(rule="naive", max_staleness=1, stale_policy="reject")
    for _ in range(3):
        assert s.submit(_c(s.version)).admitted
    before = s.param.clone()
    norms = list(s.guard.norms)
    out = s.submit(_c(0, (100.0, 100.0)))
    assert not out.admitted and out.staleness == 3 and "max_staleness" in out.why
    assert torch.equal(s.param, before) and s.version == 3
    assert list(s.guard.norms) == norms  # a rejected update never enters the norm history


def test_staleness_downweight_and_bad_values():
    s = _Async(rule="naive", max_staleness=0, stale_policy="downweight")
    s.submit(_c(0))
    out = s.submit(_c(0))  # staleness 1 > 0: scale 1/2
    assert out.admitted and out.scale == 0.5
    np.testing.assert_allclose(s.param.numpy(), [-1.5, -1.5])
    assert not s.submit(_c(s.version, (np.nan, 0.0))).admitted
    assert "future" in s.submit(_c(s.version + 5)).why


def test_island_schedule_can_follow_global_progress():
    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.engine.specs import island_spec
    from archipelago.workers.runtime.island import Island

    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_quadratic",
            "warm_start.steps=0",
            "task.kwargs.centers=[[1.0,0.0]]",
            "islands.count=1",
            "rounds=10",
            "inner_steps=10",
            "inner.warmup_steps=0",
            "inner.optimizer=sgd",
            "inner.lr=1.0",
            "inner.min_lr_ratio=0.0",
            # an island's first work past where it was placed re-warms (tests/test_spares.py); not this one's concern
            "elastic.join_rewarmup_steps=0",
        ],
    )
    island = Island(island_spec(cfg, 0))
    params = np.zeros(2)
    island.run(dataclasses.replace(island.order(0, 5), schedule_step=50), params)  # half way: cosine at 0.5
    assert island.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + np.cos(np.pi * 55 / 100)))
    island.run(dataclasses.replace(island.order(0, 1), schedule_step=100), params)
    assert island.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
