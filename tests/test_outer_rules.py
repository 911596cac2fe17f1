"""The outer rules' registry: one row per rule, each row's declarations true of the
optimizer it builds (the planner's state figure, the one-pass flag), and each mode's rule."""

from __future__ import annotations

import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.config_sections import OuterOptimizer
from archipelago.orchestrator.engine.step.outer import OuterStep
from archipelago.orchestrator.engine.step.rules import RULES, rule_of
from archipelago.orchestrator.modes import RuleKind
from archipelago.workers.runtime.optim import build_inner
from tests.helpers import coordinator_plan

SETS = {
    RuleKind.NESTEROV: ["mode=diloco"],
    RuleKind.SGD: ["mode=diloco", "outer.optimizer=sgd"],
    RuleKind.ADAM: ["mode=diloco", "outer.optimizer=adam"],
    RuleKind.SPARSELOCO: [
        "mode=diloco",
        "outer.optimizer=sparseloco",
        "compression.error_feedback=true",
        "compression.codec=topk:0.02+int2",
    ],
    RuleKind.DELAYED_NESTEROV: ["mode=async", "mode.rule=delayed_nesterov", "mode.c=0.25"],
    RuleKind.CO2: ["mode=overlap"],
    RuleKind.DDP_ADAMW: ["mode=ddp", "warm_start.steps=0"],
}


def test_every_rule_has_one_row_and_every_outer_optimizer_is_a_rule():
    assert set(RULES) == set(RuleKind) == set(SETS)
    assert {k.value for k in OuterOptimizer} <= {k.value for k in RuleKind}
    for row in RULES.values():
        assert (row.optimizer is None) != (row.build is None), row.kind


@pytest.mark.parametrize("kind", list(RuleKind))
def test_a_rows_declarations_hold_for_the_optimizer_it_builds(kind):
    """After one step, the optimizer's state holds `state_values` tensors of the
    parameter's size."""
    cfg = load_config(None, [*SETS[kind], "islands.count=4", "warm_start.steps=0"])
    row = rule_of(cfg)
    assert row.kind == kind
    step = OuterStep(torch.zeros(64), row.rule(cfg))
    step.apply([(torch.randn(64).numpy(), 1.0)], anchor=0)
    state = step.optimizer.state[step.param]
    sized = [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() == 64]
    assert len(sized) == row.state_values(cfg)
    # the planner's "round starts" are kept exactly when the row says its step reads them
    kept = step.gap.anchors if step.gap is not None else {}
    assert row.anchored(cfg) == (step.gap is not None and step.gap.anchored) == bool(kept)


@pytest.mark.parametrize(("penalty", "anchored"), [("constant", False), ("adaptive", True)])
def test_co2_keeps_the_round_starts_only_for_a_penalty_that_reads_them_and_the_plan_counts_them(penalty, anchored):
    """CO2's constant Λ (the default) reads nothing of where a round started: no copy of
    any version is kept for it; the adaptive Λ keeps the versions rounds in flight started
    from, and the plan counts them on the coordinator."""
    cfg = load_config(None, ["mode=overlap", f"mode.penalty={penalty}", "warm_start.steps=0"])
    step = OuterStep(torch.zeros(64), rule_of(cfg).rule(cfg))
    for version in (1, 2, 3):
        step.apply([(torch.randn(64).numpy(), 1.0)], anchor=version - 1)
        step.anchor(version, keep_from=version - 1)
    assert step.gap is not None and sorted(step.gap.anchors) == ([2, 3] if anchored else [])
    coordinator = coordinator_plan(cfg)
    assert coordinator.parts.get("round starts", 0) == (2 * 4 * 1000 if anchored else 0)


@pytest.mark.parametrize("clip", [0.5, 100.0, None])
def test_the_data_parallel_rule_clips_the_mean_gradient_as_its_inner_steps_do(clip):
    """ddp's rule steps AdamW on the mean gradient scaled to norm `inner.grad_clip` when
    it is longer (the clip is its optimizer's step pre-hook, not a branch of the generic
    step): the parameters move as AdamW's on the gradient clipped by hand."""
    cfg = load_config(
        None, [*SETS[RuleKind.DDP_ADAMW], "islands.count=4", f"inner.grad_clip={clip if clip is not None else 'null'}"]
    )
    grad = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3  # norm ≈ 24
    step = OuterStep(torch.zeros(64), rule_of(cfg).rule(cfg))
    step.apply([(grad.numpy(), 1.0)], anchor=0)

    reference = torch.nn.Parameter(torch.zeros(64))
    optimizer, _ = build_inner(cfg.inner, [reference], cfg.schedule_steps)
    clipped = grad.clone()
    if clip is not None and float(clipped.norm()) > clip:
        clipped.mul_(clip / float(clipped.norm()))
    reference.grad = clipped
    optimizer.step()
    assert torch.equal(step.param.detach(), reference.detach())
    unclipped = torch.nn.Parameter(torch.zeros(64))
    plain, _ = build_inner(cfg.inner, [unclipped], cfg.schedule_steps)
    unclipped.grad = grad.clone()
    plain.step()
    assert torch.equal(step.param.detach(), unclipped.detach()) == (clip != 0.5)
