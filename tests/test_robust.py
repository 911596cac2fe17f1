"""Robust aggregation: norm outliers, quarantine streaks; and a NaN island on real Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest

from archipelago.orchestrator.algorithms.robust import NormGuard
from archipelago.orchestrator.config import RobustConfig
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.step.admission import Admission, ExactVersion
from archipelago.orchestrator.engine.types import Decision, Reason, Verdict
from archipelago.orchestrator.runtime.driver import run


def test_norm_guard_rejects_outliers_after_history():
    guard = NormGuard(RobustConfig(norm_ratio=10, min_history=3))
    for scale in (1.0, 1.2, 0.9):
        norm = float(np.linalg.norm(np.full(4, scale / 2)))
        assert guard.check_norm(norm) is None
        guard.accept(norm, 1.0)
    assert guard.check_norm(100.0) is not None  # > 10 x the median 1.0
    assert guard.check_norm(4.0) is None


def _admission(**robust) -> Admission:
    return Admission(3, NormGuard(RobustConfig(min_history=3, **robust)), ExactVersion(), quarantine_after=3)


def _judge(a: Admission, delta, weight: float = 64.0, steps: int = 4, island: int = 0) -> Verdict:
    from archipelago.orchestrator.engine.step.admission import Facts
    from archipelago.orchestrator.engine.types import Contribution

    d = np.asarray(delta, dtype=np.float32)
    return a.judge(
        Contribution(island=island, version=0, delta=d, weight=weight, steps=steps), Facts(3, True, float(d @ d)), 0, 0
    )


def test_an_island_cannot_outvote_the_others_with_a_huge_weight():
    """Before: an island-reported weight had no upper bound."""
    a = _admission()
    for _ in range(3):
        assert _judge(a, [1.0, 0.0, 0.0]).admitted  # 16 tokens per step
    heavy = _judge(a, [1.0, 0.0, 0.0], weight=1e9)
    assert heavy.decision == Decision.REJECT and heavy.reason == Reason.WEIGHT and "per step" in heavy.detail
    assert _judge(a, [1.0, 0.0, 0.0], weight=64.0 * 8, steps=32).admitted  # more steps, more tokens: fine


def test_zero_updates_are_refused_and_never_drag_the_median_to_zero():
    """Before: admitted zero-norm updates pulled the median to 0, after which every real
    update was rejected as a norm outlier."""
    a = _admission()
    for _ in range(5):
        zero = _judge(a, [0.0, 0.0, 0.0])
        assert zero.decision == Decision.REJECT and "zero" in zero.detail
    assert a.guard is not None and not a.guard.norms
    for scale in (1.0, 1.1, 0.9, 1.0):
        assert _judge(a, [scale, 0.0, 0.0]).admitted


def test_quarantine_needs_consecutive_fault_rejections():
    a = Admission(2, None, ExactVersion(), quarantine_after=2)
    bad, good = Verdict(Decision.REJECT, Reason.NON_FINITE), Verdict(Decision.ACCEPT)
    stale = Verdict(Decision.REJECT, Reason.STALE)
    assert not a.record(0, bad)
    assert not a.record(0, good)
    assert not a.record(0, bad)
    assert not a.record(1, stale) and not a.record(1, stale)  # staleness is the pacing's business, not a fault
    assert a.record(0, bad) and a.quarantined == {0}


@pytest.mark.ray
def test_nan_island_is_rejected_then_quarantined_and_the_model_stays_finite(ray_local, tmp_path):
    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_quadratic",
            "warm_start.steps=0",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0],[0.5,0.5]]",
            "task.kwargs.nan_island=2",
            "islands.count=3",
            "inner.optimizer=sgd",
            "inner.lr=0.1",
            "inner.warmup_steps=0",
            "inner.grad_clip=null",
            "rounds=4",
            "inner_steps=3",
            "robust.quarantine_after=2",
            "elastic.replace_dead=false",
            "data_shards=3",
            f"task.kwargs.fault_dir={tmp_path}",
            f"out_dir={tmp_path / 'out'}",
        ],
    )
    summary = run(cfg, show_progress=False)
    isl = summary["islands"]
    assert isl["2"]["state"] == "quarantined" and isl["2"]["rejections"] == 2
    assert isl["0"]["rounds_contributed"] == isl["1"]["rounds_contributed"] == 4
    assert np.isfinite(summary["final_eval_loss"])
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    kinds = [(e["kind"], e["island"]) for e in events]
    assert kinds.count(("rejection", 2)) == 2 and ("quarantined", 2) in kinds
    assert all("non-finite" in e["reason"] for e in events if e["kind"] == "rejection")
    assert sum(k == "join" for k, _ in kinds) == 3
