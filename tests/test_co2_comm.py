"""docs/algorithms.md, CO2 (vectors C1, C2); codecs and link simulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archipelago.orchestrator.algorithms.outer import AdaptiveGap, CO2Outer, ConstantGap
from archipelago.orchestrator.bench.simulation.links import LinkConfig
from archipelago.workers.wire.compress import decode, encode
from archipelago.workers.wire.spec import payload_nbytes

TOL = 1e-6
f64 = torch.float64


def _co2(x: torch.Tensor, **kw) -> tuple[CO2Outer, torch.nn.Parameter]:
    p = torch.nn.Parameter(x)
    return CO2Outer([p], **kw), p


def test_vector_c1_constant_penalty_and_real_clipping():
    x = torch.tensor([1.0, -0.5, 0.2], dtype=f64)
    x_start = x.clone()
    co2, p = _co2(x, lr=1.0, momentum=0.5, clip=0.05)
    co2.state[p]["momentum"] = torch.tensor([0.02, -0.1, 0.0], dtype=f64)
    x_bar = torch.tensor([0.9, -0.3, 0.25], dtype=f64)
    p.grad = x_start - x_bar
    co2.param_groups[0]["gap"] = ConstantGap(p=2.0).gap(0.0, 0.0)
    assert co2.param_groups[0]["gap"] == 0.5 and not ConstantGap.anchored
    co2.step()
    np.testing.assert_allclose(co2.state[p]["momentum"].numpy(), [0.05, -0.05, -0.025], atol=TOL)
    np.testing.assert_allclose(x.numpy(), [0.95, -0.45, 0.225], atol=TOL)


def test_vector_c1_momentum_before_clipping():
    x = torch.tensor([1.0, -0.5, 0.2], dtype=f64)
    co2, p = _co2(x, lr=1.0, momentum=0.5, clip=None)
    co2.state[p]["momentum"] = torch.tensor([0.02, -0.1, 0.0], dtype=f64)
    p.grad = torch.tensor([0.1, -0.2, -0.05], dtype=f64)
    co2.param_groups[0]["gap"] = ConstantGap(p=2.0).gap(0.0, 0.0)
    co2.step()
    np.testing.assert_allclose(co2.state[p]["momentum"].numpy(), [0.06, -0.15, -0.025], atol=TOL)


def test_vector_c2_adaptive_penalty():
    x_now = torch.tensor([0.97, -0.44, 0.21], dtype=f64)
    delta, x_s = torch.tensor([0.1, -0.2, -0.05], dtype=f64), torch.tensor([1.0, -0.5, 0.2], dtype=f64)
    moved, norm = float(torch.linalg.vector_norm(x_now - x_s)), float(torch.linalg.vector_norm(delta))
    assert AdaptiveGap(lam=1.0).gap(moved, norm) == pytest.approx(0.7716019, abs=TOL) and AdaptiveGap.anchored
    # through the outer step, which measures both norms over the buffer from the round's anchor
    from archipelago.orchestrator.engine.step.outer import OuterRule, OuterStep

    step = OuterStep(
        x_s.clone(), OuterRule(lambda q: (CO2Outer([q], momentum=0.0, clip=None), None), penalty=AdaptiveGap())
    )
    step.param.data.copy_(x_now)
    gap = step.apply([(delta.numpy(), 1.0)], anchor=0)
    assert gap == pytest.approx(0.7716019, abs=TOL)
    np.testing.assert_allclose(step.param.detach().numpy(), (x_now - gap * delta).numpy(), atol=TOL)


@pytest.mark.parametrize(
    "codec, ratio, rel_err", [("none", 1.0, 0.0), ("bf16", 2.0, 4e-3), ("int8", 4.0, 1.2e-2), ("int4", 8.0, 0.2)]
)
def test_codecs_shrink_bytes_and_bound_the_error(codec, ratio, rel_err):
    x = np.random.default_rng(0).normal(size=100_003).astype(np.float32)
    payload = encode(x, codec, chunk=4096)
    back = decode(payload)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert x.nbytes / payload_nbytes(payload) == pytest.approx(ratio, rel=0.01)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) <= rel_err
    levels = {"int8": 127, "int4": 7}.get(codec)
    if levels:  # per-chunk bound: |error| <= scale/2 = max|chunk| / (2 levels)
        chunk_max = np.abs(np.pad(x, (0, (-x.size) % 4096)).reshape(-1, 4096)).max(1).repeat(4096)[: x.size]
        assert np.all(np.abs(back - x) <= chunk_max / (2 * levels) * (1 + 1e-6) + 1e-7)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_integer_codecs_handle_zero_chunks_and_odd_lengths(codec):
    assert np.all(decode(encode(np.zeros(10, np.float32), codec, chunk=4)) == 0)
    x = np.array([0.7, -0.7, 0.1, 0.0, -0.35], np.float32)  # odd length: int4 pads one nibble
    back = decode(encode(x, codec, chunk=16))
    assert back.shape == (5,) and back[0] == pytest.approx(0.7) and back[1] == pytest.approx(-0.7)
    assert np.abs(back - x).max() <= 0.7 / (2 * (127 if codec == "int8" else 7)) + 1e-7


def test_link_times():
    assert LinkConfig().seconds(10**9) == 0.0
    assert LinkConfig(preset="wan-1g").seconds(125_000_000) == pytest.approx(1.03)
    assert LinkConfig(preset="tcp-80g", latency_ms=0).seconds(10**9) == pytest.approx(0.1)


def test_one_round_lag_applies_each_round_one_round_late():
    """The overlap pacing's versions and the CO2 step with anchors, through the production classes."""
    from archipelago.orchestrator.config import RunConfig
    from archipelago.orchestrator.engine.pacing.base import start_version
    from archipelago.orchestrator.engine.step.outer import OuterStep
    from archipelago.orchestrator.engine.step.rules import outer_rule

    # one synchronous round, then the lag: round 2 waits for v1, round 3 starts from v1 too
    assert [start_version(t) for t in (1, 2, 3, 4, 5)] == [0, 1, 1, 2, 3]
    assert [start_version(t, base=5) for t in (6, 7, 8, 9)] == [5, 6, 6, 7]
    cfg = RunConfig(mode={"name": "overlap", "lr": 1.0, "momentum": 0.0, "clip": None, "penalty": "adaptive"})
    step = OuterStep(torch.zeros(2, dtype=f64), outer_rule(cfg))
    d = lambda *v: np.asarray(v, dtype=np.float64)  # noqa: E731
    step.apply([(d(0.1, 0.0), 1.0), (d(0.3, 0.0), 1.0)], anchor=start_version(1))
    step.anchor(1, keep_from=0)
    np.testing.assert_allclose(step.param.detach().numpy(), [-0.2, 0.0])
    step.apply([(d(0.0, 0.2), 1.0)], anchor=start_version(2))
    step.anchor(2, keep_from=1)
    np.testing.assert_allclose(step.param.detach().numpy(), [-0.2, -0.2])
    assert step.gap is not None and set(step.gap.anchors) == {1, 2}  # round 3 starts from v1, round 4 from v2


def test_int4_pseudo_gradients_with_and_without_error_feedback_train_on_an_eighth_of_the_bytes(corpus_cache, tmp_path):
    from archipelago.orchestrator.config_load import load_config
    from tests.helpers import TINY_LM, in_process_run

    runs = {}
    for name, codec, feedback in (("none", "none", False), ("int4", "int4", False), ("int4_ef", "int4", True)):
        cfg = load_config(
            None,
            [
                *TINY_LM,
                f"task.kwargs.cache_dir={corpus_cache}",
                "islands.count=2",
                "rounds=4",
                "inner_steps=10",
                f"compression.codec={codec}",
                f"compression.error_feedback={feedback}",
                f"out_dir={tmp_path / name}",
            ],
        )
        runs[name] = in_process_run(cfg)[0].summary
    fp32 = runs["none"]
    for name in ("int4", "int4_ef"):
        run = runs[name]
        assert fp32["bytes_sent"] / run["bytes_sent"] == pytest.approx(8.0, rel=0.02)
        assert run["final_eval_loss"] < 0.8 * run["initial_eval_loss"]  # it trained
        assert abs(run["final_eval_loss"] / fp32["final_eval_loss"] - 1) < 0.02, (
            name,
            fp32["final_eval_loss"],
            run["final_eval_loss"],
        )
    print({k: round(v["final_eval_loss"], 4) for k, v in runs.items()})


def test_error_feedback_keeps_the_sum_of_what_was_sent_within_one_step():
    from archipelago.workers.wire.compress import ErrorFeedback

    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=4096).astype(np.float32) * 0.01 + 0.002 for _ in range(50)]  # a consistent drift
    feedback = ErrorFeedback()
    plain_sum, fed_sum = np.zeros(4096, np.float32), np.zeros(4096, np.float32)
    for d in deltas:
        plain_sum += decode(encode(d, "int4", chunk=512))
        values = feedback.compensate(d)
        sent = decode(encode(values, "int4", chunk=512))
        feedback.sent(values, sent)
        fed_sum += sent
    truth = np.sum(deltas, axis=0)
    fed_err, plain_err = np.abs(fed_sum - truth).max(), np.abs(plain_sum - truth).max()
    assert fed_err <= np.abs(feedback.residual).max() + 1e-5  # exactly the last residual
    assert fed_err < plain_err / 4, (fed_err, plain_err)
