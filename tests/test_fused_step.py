"""The coordinator's one-pass outer step (`fused_step.mean_step`, `OnePass`): bit for bit
the weighted mean (`WeightedMean.fill`) followed by `FlatSGD`'s step, for every rule it
takes, any number of updates and threads; the pass only reads the current state, so a
refused update leaves it exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from archipelago.orchestrator.algorithms.aggregate import WeightedMean, sqnorm
from archipelago.orchestrator.algorithms.fused_step import SGDRule, mean_step
from archipelago.orchestrator.algorithms.outer import FlatSGD
from archipelago.orchestrator.engine.step.outer import Commit, LocalOuter, OuterRule
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
def test_one_pass_is_bitwise_the_mean_then_flat_sgd(
    k: int, momentum: float, nesterov: bool, threads: int, scale: float
):
    """Three steps (the first creates the momentum), with token weights that are not
    float32-exact after scaling, a pacing's scale or none, and a length that no thread
    split divides evenly."""
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
        if scale != 1.0:
            param.grad.mul_(scale)  # as `OuterStep.apply` scales the mean
        reference.step()
        got_sq = mean_step(parts, SGDRule(0.7, momentum, nesterov), p, b, p_out, b_out, threads=threads, scale=scale)
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
    where they are, `copy_to` brings the model's buffer up to date, a step at the scale
    the pass took (the pacing's) is committed, one admission rescaled is taken from the
    state the pass left alone, and loading a state puts the parameters back in the
    model's buffer."""
    torch.set_num_threads(1)
    n = 50_000
    rng = np.random.default_rng(3)

    def rule(p: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, None]:
        return FlatSGD([p], lr=0.7, momentum=0.9, nesterov=True), None

    flat = torch.ones(n)
    outer = LocalOuter(flat, OuterRule(rule, one_pass=True))
    ref_param = torch.nn.Parameter(torch.ones(n))
    reference = FlatSGD([ref_param], lr=0.7, momentum=0.9, nesterov=True)
    from archipelago.orchestrator.engine.types import Contribution

    # (the pacing's scale the pass took, the scale of the step admission asks for)
    for version, (paced, scale) in enumerate([(1.0, 1.0), (1.0, 1.0), (1.0, 0.5), (0.25, 0.25)]):
        deltas = [rng.normal(0, 1e-2, n).astype(np.float32) for _ in range(2)]
        proposal = outer.propose(
            [Contribution(island=i, version=version, delta=d, weight=1.0) for i, d in enumerate(deltas)], paced
        )
        before = outer.steps[0].param.data_ptr()
        outer.commit(proposal, Commit(weights={0: 1.0, 1: 1.0}, scale=scale))
        assert (outer.steps[0].param.data_ptr() != before) == (paced == scale)  # committed: the buffers swapped
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


@pytest.mark.parametrize("mode", ["diloco", "quorum"])
def test_every_step_of_a_clean_run_is_the_one_pass_one(tmp_path, monkeypatch, mode: str):
    """The pass is not wasted: with nothing refused, every outer step commits what it
    computed, the quorum's pacing scale (its youngest result's factor) included. (The
    one-pass kernel merges by the mean; mode async's default, Radial-Directional Averaging,
    reads each update twice and takes the other path.)"""
    # float64 takes the other path
    cfg = scenario_cfg(tmp_path, mode, "task.kwargs.dtype=float32", "outer.merge=mean")
    engine, _ = in_process_engine(cfg)
    assert isinstance(engine.outer, LocalOuter) and engine.outer.one_pass is not None
    one_pass, commits = engine.outer.one_pass, []
    take = one_pass.take

    def counted(*args: object) -> bool:
        taken = take(*args)  # type: ignore[arg-type]
        commits.extend([1] if taken else [])
        return taken

    monkeypatch.setattr(one_pass, "take", counted)
    drive(engine)
    assert engine.summary["outer_steps"] > 0 and len(commits) == engine.summary["outer_steps"]


@pytest.mark.parametrize("mode", ["diloco", "quorum"])
def test_a_run_through_faults_and_a_restart_is_bitwise_the_mean_then_step_run(tmp_path, monkeypatch, mode: str):
    """The engine's fault scenarios run in float64, which takes the mean-then-step path; in
    float32 the one pass meets them all here: NaN updates refused (the pass's spares
    dropped), a crash, a malformed result, a corrupted hand-off and a coordinator restart
    from its checkpoint (written from wherever the one pass left the parameters). Same
    parameters, bit for bit, and the same verdicts as with the one pass switched off."""
    from archipelago.orchestrator.engine.build import build_engine
    from archipelago.orchestrator.engine.step.outer import OuterStep
    from archipelago.orchestrator.simulation.pool import Fault, FaultKind

    faults = [
        Fault(FaultKind.NAN, 2, order=2),
        Fault(FaultKind.NAN, 0, order=4),
        Fault(FaultKind.CRASH, 1, order=3),
        Fault(FaultKind.MALFORMED, 0, order=5, payload=None),
        Fault(FaultKind.CORRUPT, 2, order=5),
    ]

    def run(one_pass: bool) -> tuple[torch.Tensor, dict]:
        if not one_pass:
            monkeypatch.setattr(OuterStep, "one_pass", lambda self: None)
        cfg = scenario_cfg(tmp_path, mode, "task.kwargs.dtype=float32", "outer.merge=mean", "rounds=8")
        first, pool = in_process_engine(cfg, faults, run_id=f"r{one_pass}")
        assert (isinstance(first.outer, LocalOuter) and first.outer.one_pass is not None) == one_pass
        drive(first, until=5)
        pool.coordinator_lost()
        second = build_engine(cfg, pool, run_id=f"r{one_pass}")
        drive(second)
        second.outer.copy_to(second.flat.data)
        return second.flat.data.clone(), second.summary

    with_pass, summary = run(True)
    without, reference = run(False)
    assert summary["state"] == "finished" and summary["outer_steps"] == reference["outer_steps"]
    assert torch.equal(with_pass, without)
    assert [summary["islands"][i]["rejections"] for i in sorted(summary["islands"])] == [
        reference["islands"][i]["rejections"] for i in sorted(reference["islands"])
    ]
    assert sum(s["rejections"] for s in summary["islands"].values()) >= 2  # the NaNs were refused


_WITHOUT_NUMBA = """
import sys
sys.modules["numba"] = None  # as if the `fast` extra were not installed: `import numba` fails
from pathlib import Path
from archipelago.orchestrator.algorithms.fused_step import available
from archipelago.orchestrator.engine.step.rules import takes_one_pass
from archipelago.orchestrator.plan.cluster import this_machine
from archipelago.orchestrator.plan.planner import plan_run
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine
cfg = scenario_cfg(Path(sys.argv[1]), "diloco", "task.kwargs.dtype=float32", "outer.merge=mean")
engine, _ = in_process_engine(cfg)
drive(engine)
needs = [n.parts for n in plan_run(cfg, this_machine(), under_ray=False).needs if n.process == "coordinator"]
print(available(), takes_one_pass(cfg), engine.outer.one_pass is None, engine.summary["state"],
      engine.summary["outer_steps"], any("mean buffer" in parts for parts in needs))
"""


def test_without_numba_the_coordinator_steps_mean_then_step_and_the_plan_sizes_that(tmp_path):
    """numba is the `fast` extra, not a core dependency: in a process where it cannot be
    imported, a run whose rule the one pass would take steps mean-then-step to the end (the
    same numbers, tested above with the pass switched off), and the plan sizes the
    coordinator's mean buffer instead of the pass's spares."""
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
    available, fused, plain, state, steps, mean_buffer = proc.stdout.split()[-6:]
    assert (available, fused, plain, state, mean_buffer) == ("False", "False", "True", "finished", "True")
    assert int(steps) > 0
