"""docs/algorithms.md: DiLoCo's outer step (vectors O1, D1) in float64, through the production classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_sections import OuterConfig
from archipelago.orchestrator.engine.step.outer import OuterStep
from archipelago.orchestrator.engine.step.rules import optimizer_rule
from tests.helpers import in_process_run

TOL = 1e-6
CENTERS = [[1.0, 0.0], [-0.5, 2.0]]


def _step(theta0, outer: OuterConfig) -> OuterStep:
    return OuterStep(torch.tensor(theta0, dtype=torch.float64), optimizer_rule(outer))


def _g(g, w=1.0):
    return [(np.asarray(g, dtype=np.float64), w)]


def test_vector_o1_outer_nesterov():
    step = _step([1.0, -2.0], OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9))
    expected = [[0.867, -1.734], [0.7438, -1.7536], [0.66442, -1.70824]]
    for g, want in zip([[0.1, -0.2], [0.05, 0.1], [0.0, 0.0]], expected):
        step.apply(_g(g))
        np.testing.assert_allclose(step.param.detach().numpy(), want, atol=TOL)


def test_first_nesterov_step_is_lr_times_one_plus_mu():
    step = _step([0.0], OuterConfig(lr=0.7, momentum=0.9))
    step.apply(_g([1.0]))
    assert step.param.item() == pytest.approx(-0.7 * 1.9, abs=1e-12)


def _d1_config(inner: dict, rounds: int = 3) -> RunConfig:
    return RunConfig.model_validate(
        {
            "rounds": rounds,
            "inner_steps": 3,
            "islands": {"count": 2},
            "data_shards": 2,  # island i sees c_i
            "warm_start": {"steps": 0},
            "inner": {"warmup_steps": 0, "schedule": "constant", "grad_clip": None, "weight_decay": 0.0, **inner},
            "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.9},
            "task": {"factory": "tests.toy_tasks:make_quadratic", "kwargs": {"centers": CENTERS}},
        }
    )


def test_vector_d1_inner_sgd():
    _, _, history = in_process_run(_d1_config({"optimizer": "sgd", "lr": 0.1}))
    expected = [[0.090107, 0.36043], [0.186152, 0.744607], [0.268306, 1.073224]]
    for got, want in zip(history, expected):
        np.testing.assert_allclose(got.numpy(), want, atol=TOL)


def test_vector_d1_inner_adamw_state_kept_across_rounds():
    cfg = _d1_config({"optimizer": "adamw", "lr": 0.1, "betas": (0.9, 0.999)})
    _, _, history = in_process_run(cfg)
    expected = [[0.002185, 0.199085], [0.006609, 0.346221], [0.012179, 0.47675]]
    for got, want in zip(history, expected):
        np.testing.assert_allclose(got.numpy(), want, atol=TOL)


def test_outer_sgd_lr1_mu0_is_parameter_averaging():
    cfg = _d1_config({"optimizer": "sgd", "lr": 0.1}, rounds=1)
    cfg.outer = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    _, islands, history = in_process_run(cfg)
    local = np.mean([isl.flat.data.numpy() for isl in islands], axis=0)
    np.testing.assert_allclose(history[0].numpy(), local, atol=1e-12)


def test_h1_sgd_outer_lr1_is_synchronous_data_parallel_sgd():
    cfg = _d1_config({"optimizer": "sgd", "lr": 0.1}, rounds=4)
    cfg.inner_steps = 1
    cfg.outer = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    _, _, history = in_process_run(cfg)
    x = np.zeros(2)
    c = np.array(CENTERS)
    for got in history:
        x = x - 0.1 * np.mean(x - c, axis=0)  # mean gradient of the two quadratics
        np.testing.assert_allclose(got.numpy(), x, atol=1e-12)


def test_token_weighted_mean():
    step = _step([0.0, 0.0], OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    step.apply([*_g([1.0, 0.0], 3.0), *_g([0.0, 1.0], 1.0)])
    np.testing.assert_allclose(step.param.detach().numpy(), [-0.75, -0.25], atol=1e-12)


@pytest.mark.parametrize("momentum, nesterov", [(0.9, True), (0.9, False), (0.0, False)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flat_sgd_is_bitwise_torch_sgd(momentum, nesterov, dtype):
    """The in-place outer SGD/Nesterov, block by block, computes exactly what
    `torch.optim.SGD` computes over the whole vector (a size of several blocks and a tail)."""
    from archipelago.orchestrator.algorithms.aggregate import CHUNK
    from archipelago.orchestrator.algorithms.outer import FlatSGD

    gen, n = torch.Generator().manual_seed(0), 2 * CHUNK + 1001
    a = torch.nn.Parameter(torch.randn(n, dtype=dtype, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    ours, stock = (
        FlatSGD([a], 0.7, momentum, nesterov),
        torch.optim.SGD([b], lr=0.7, momentum=momentum, nesterov=nesterov),
    )
    for _ in range(6):
        g = torch.randn(n, dtype=dtype, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        stock.step()
        assert torch.equal(a, b)
    if momentum:
        assert torch.equal(ours.state[a]["momentum_buffer"], stock.state[b]["momentum_buffer"])


def test_the_outer_optimizers_are_built_without_importing_dynamo():
    """torch guards `Optimizer.add_param_group` against dynamo and imports `torch._dynamo` on
    its first call: 1.5 s of a coordinator's start before its first dispatch (`bench
    startup`). The outer rules are built without it (in a fresh interpreter), their groups
    as torch's `add_param_group` makes them, and torch's class stays guarded."""
    import subprocess
    import sys

    code = """
import sys, torch
from archipelago.orchestrator.algorithms.outer import CO2Outer, DelayedNesterov, FlatSGD
p = torch.nn.Parameter(torch.zeros(3))
made = [FlatSGD([p], lr=0.7, momentum=0.9, nesterov=True), DelayedNesterov([p], 0.7, 0.9, 4), CO2Outer([p], 0.5)]
print("torch._dynamo" in sys.modules, [sorted(o.param_groups[0]) for o in made][0], any("add_param_group" in vars(o) for o in made))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False ['lr', 'momentum', 'nesterov', 'params'] False", out
    assert hasattr(torch.optim.Optimizer.add_param_group, "__wrapped__")  # torch's guard, untouched
