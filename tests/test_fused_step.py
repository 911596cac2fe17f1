"""The coordinator's compiled hot path (`fused_step`): the weighted mean with each update's
norm in one pass, and `FlatSGD`'s step in place — bit for bit the torch ops they stand for,
for every rule, any number of updates and threads; the proposal's mean, taken while
screening, is what a clean run steps on, and the parameters never leave the model's buffer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from archipelago.orchestrator.algorithms import fused_step
from archipelago.orchestrator.algorithms.aggregate import WeightedMean, sqnorm
from archipelago.orchestrator.algorithms.outer import FlatSGD
from archipelago.orchestrator.engine.step.outer import Commit, LocalOuter, OuterRule, OuterStep
from archipelago.orchestrator.engine.types import Contribution
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine


@pytest.mark.parametrize(
    "k, momentum, nesterov, threads, scale",
    [
        (1, 0.9, True, 1, 1.0),
        (3, 0.9, True, 2, 0.37),
        (4, 0.0, False, 1, 1.0),
        (5, 0.8, False, 2, 1.0),
        (2, 0.9, True, 3, 0.61),
    ],
)
def test_the_compiled_mean_and_step_are_bitwise_the_torch_ops(
    k: int, momentum: float, nesterov: bool, threads: int, scale: float, monkeypatch
):
    """Three steps (the first creates the momentum), with token weights that are not
    float32-exact after scaling, a pacing's scale or none, and a length that no thread
    split divides evenly: the compiled mean and step against the same calls with numba
    switched off."""
    assert fused_step.available()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(k)
    n = 300_007
    p0 = rng.normal(size=n).astype(np.float32)
    params = [torch.nn.Parameter(torch.from_numpy(p0.copy())) for _ in range(2)]
    optimizers = [FlatSGD([p], lr=0.7, momentum=momentum, nesterov=nesterov) for p in params]
    means = [WeightedMean(n, torch.float32) for _ in range(2)]
    try:
        for _ in range(3):
            parts = [(rng.normal(0, 1e-3, n).astype(np.float32), float(rng.integers(100, 5000)) / 3) for _ in range(k)]
            sqs = []
            for compiled, param, optimizer, mean in zip((True, False), params, optimizers, means):
                with monkeypatch.context() as m:
                    if not compiled:
                        m.setattr(fused_step, "available", lambda: False)
                    sq = [0.0] * k
                    param.grad = mean.fill(parts, sq, scale)
                    optimizer.step()
                    sqs.append(sq)
            assert np.array_equal(params[0].detach().numpy(), params[1].detach().numpy())
            if momentum:
                got, want = (o.state[p]["momentum_buffer"].numpy() for o, p in zip(optimizers, params))
                assert np.array_equal(got, want)
            assert sqs[0] == pytest.approx(sqs[1], rel=1e-5)
    finally:
        torch.set_num_threads(1)


def test_a_non_finite_update_shows_in_its_norm_and_a_mean_of_nothing_is_refused():
    n = 100_000
    rng = np.random.default_rng(0)
    bad = rng.normal(size=n).astype(np.float32)
    bad[77] = np.inf
    good = rng.normal(size=n).astype(np.float32)
    sq = fused_step.weighted_mean([(good, 1.0), (bad, 1.0)], np.empty(n, np.float32))
    assert sq[0] == pytest.approx(sqnorm(good), rel=1e-5) and not math.isfinite(sq[1])
    with pytest.raises(ValueError, match="no contributions"):
        fused_step.weighted_mean([(good, 0.0)], np.empty(n, np.float32))


def test_the_proposals_mean_is_stepped_on_when_admitted_as_taken_and_the_parameters_stay_in_the_model():
    """The mean the screening pass took is the one stepped on when admission asks for
    exactly its weights and scale; a rescaled admission or one island refused averages
    again from the updates the proposal holds; a proposal discarded leaves nothing behind.
    Every step is in place in the model's buffer (no copy to make, no storage swapped), and
    a state loaded back holds the same momentum."""
    torch.set_num_threads(1)
    n = 50_000
    rng = np.random.default_rng(3)

    def rule(p: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, None]:
        return FlatSGD([p], lr=0.7, momentum=0.9, nesterov=True), None

    flat = torch.ones(n)
    outer = LocalOuter(flat, OuterRule(rule))
    ref_param = torch.nn.Parameter(torch.ones(n))
    reference = FlatSGD([ref_param], lr=0.7, momentum=0.9, nesterov=True)
    prefilled = []
    apply = OuterStep.apply

    def counted(self: OuterStep, parts, *args, **kwargs):  # type: ignore[no-untyped-def]
        prefilled.append(parts is None)
        return apply(self, parts, *args, **kwargs)

    OuterStep.apply = counted  # type: ignore[method-assign]
    try:
        # (the pacing's scale the pass took, the scale admission asks for, the islands admitted)
        steps = [(1.0, 1.0, {0, 1}), (1.0, 0.5, {0, 1}), (0.25, 0.25, {0, 1}), (1.0, 1.0, {1})]
        for version, (paced, scale, admitted) in enumerate(steps):
            deltas = [rng.normal(0, 1e-2, n).astype(np.float32) for _ in range(2)]
            contributions = [Contribution(island=i, version=version, delta=d, weight=1.0) for i, d in enumerate(deltas)]
            outer.discard(outer.propose(contributions, paced))  # a proposal dropped: nothing of it is kept
            proposal = outer.propose(contributions, paced)
            assert proposal.prefilled is not None and proposal.prefilled.scale == paced
            outer.commit(proposal, Commit(weights={i: 1.0 for i in admitted}, scale=scale))
            ref_param.grad = WeightedMean(n, torch.float32).fill([(deltas[i], 1.0) for i in sorted(admitted)])
            ref_param.grad.mul_(scale)
            reference.step()
            assert outer.steps[0].param.data_ptr() == flat.data_ptr()
            assert torch.equal(flat, ref_param.detach())
    finally:
        OuterStep.apply = apply  # type: ignore[method-assign]
    assert prefilled == [True, False, True, False]
    state = outer.state_dict()
    outer.load_state_dict(state, version=4)
    assert torch.equal(
        outer.steps[0].optimizer.state[outer.steps[0].param]["momentum_buffer"],
        reference.state[ref_param]["momentum_buffer"],
    )


@pytest.mark.parametrize("mode", ["diloco", "quorum"])
def test_every_step_of_a_clean_run_steps_on_the_mean_taken_while_screening(tmp_path, monkeypatch, mode: str):
    """The screening pass's mean is not wasted: with nothing refused, every outer step steps
    on it, the quorum's pacing scale (its youngest result's factor) included. (Mode async's
    default merge, Radial-Directional Averaging, reads each update twice and is left out.)"""
    cfg = scenario_cfg(tmp_path, mode, "task.kwargs.dtype=float32", "outer.merge=mean")
    engine, _ = in_process_engine(cfg)
    assert isinstance(engine.outer, LocalOuter)
    prefilled: list[bool] = []
    apply = OuterStep.apply

    def counted(self: OuterStep, parts, *args, **kwargs):  # type: ignore[no-untyped-def]
        prefilled.append(parts is None)
        return apply(self, parts, *args, **kwargs)

    monkeypatch.setattr(OuterStep, "apply", counted)
    drive(engine)
    assert engine.summary["outer_steps"] > 0 and prefilled == [True] * engine.summary["outer_steps"]


@pytest.mark.parametrize("mode", ["diloco", "quorum"])
def test_a_run_through_faults_and_a_restart_is_bitwise_the_torch_ops_run(tmp_path, monkeypatch, mode: str):
    """The engine's fault scenarios run in float64, which takes torch's ops; in float32 the
    compiled path meets them all here: NaN updates refused (the screening's mean dropped),
    a crash, a malformed result, a corrupted hand-off and a coordinator restart from its
    checkpoint. Same parameters, bit for bit, and the same verdicts as with numba off."""
    from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind
    from archipelago.orchestrator.engine.build import build_engine

    faults = [
        Fault(FaultKind.NAN, 2, order=2),
        Fault(FaultKind.NAN, 0, order=4),
        Fault(FaultKind.CRASH, 1, order=3),
        Fault(FaultKind.MALFORMED, 0, order=5, payload=None),
        Fault(FaultKind.CORRUPT, 2, order=5),
    ]

    def run(compiled: bool) -> tuple[torch.Tensor, dict]:
        with monkeypatch.context() as m:
            if not compiled:
                m.setattr(fused_step, "available", lambda: False)
            cfg = scenario_cfg(tmp_path, mode, "task.kwargs.dtype=float32", "outer.merge=mean", "rounds=8")
            first, pool = in_process_engine(cfg, faults, run_id=f"r{compiled}")
            drive(first, until=5)
            pool.coordinator_lost()
            second = build_engine(cfg, pool, run_id=f"r{compiled}")
            drive(second)
            return second.flat.data.clone(), second.summary

    compiled, summary = run(True)
    plain, reference = run(False)
    assert summary["state"] == "finished" and summary["outer_steps"] == reference["outer_steps"]
    assert torch.equal(compiled, plain)
    assert [summary["islands"][i]["rejections"] for i in sorted(summary["islands"])] == [
        reference["islands"][i]["rejections"] for i in sorted(reference["islands"])
    ]
    assert sum(s["rejections"] for s in summary["islands"].values()) >= 2  # the NaNs were refused


_WITHOUT_NUMBA = """
import sys
sys.modules["numba"] = None  # as if the `fast` extra were not installed: `import numba` fails
from pathlib import Path
from archipelago.orchestrator.algorithms.fused_step import available
from archipelago.orchestrator.plan.cluster import this_machine
from archipelago.orchestrator.plan.planner import plan_run
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine
cfg = scenario_cfg(Path(sys.argv[1]), "diloco", "task.kwargs.dtype=float32", "outer.merge=mean")
engine, _ = in_process_engine(cfg)
drive(engine)
needs = [n.parts for n in plan_run(cfg, this_machine(), under_ray=False).needs if n.process == "coordinator"]
print(available(), engine.summary["state"], engine.summary["outer_steps"], any("mean buffer" in p for p in needs))
"""


def test_without_numba_the_coordinator_steps_with_torch_ops_and_the_plan_sizes_the_same(tmp_path):
    """numba is the `fast` extra, not a core dependency: in a process where it cannot be
    imported, a run steps with torch's ops to the end (the same numbers, tested above), and
    the plan sizes the coordinator's mean buffer as it does with numba."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NUMBA, str(tmp_path)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    available, state, steps, mean_buffer = proc.stdout.split()[-4:]
    assert (available, state, mean_buffer) == ("False", "finished", "True")
    assert int(steps) > 0
