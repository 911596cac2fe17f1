"""The quality benchmark's protocol: every method is a valid config with the same token
budget, data-parallel and DiLoCo are tuned on the same kind of grid, and a grid whose
best setting is at an edge is widened past it."""

from __future__ import annotations

from archipelago.orchestrator.bench.quality_rows import DDP_LRS, MODEL, OUTER_LRS, ddp_row, h_row, methods
from archipelago.orchestrator.bench.simulation.config import load_simulated
from archipelago.orchestrator.config_load import load_config
from tests.helpers import run_tokens


def test_quality_methods_share_one_token_budget_and_the_required_keys():
    h_rows = {h: h_row(1200, h, 0.7) for h in (25, 50, 100)}
    table = {m.key: m for m in methods(1200, False, h_rows)}
    required = {"single_1x", "single_4x", "ddp_k", "diloco_k4_h25", "diloco_k4_h50", "diloco_k4_h100", "fedavg_k4_h50"}
    assert required <= set(table)
    # a row may set its simulated fleet's settings (the dropped row's simulation.drop_prob)
    budgets = {k: run_tokens(load_simulated(None, [*MODEL, *m.overrides])[0]) for k, m in table.items()}
    assert budgets["single_4x"] == budgets["ddp_k"] == 4 * budgets["single_1x"]
    assert len({v for k, v in budgets.items() if k != "single_1x"}) == 1, budgets
    assert load_config(None, [*MODEL, *table["ddp_k"].overrides]).mode.name == "ddp"
    # the headline rows run three seeds; quick keeps them and FedAvg
    assert all(table[k].seeds == (0, 1, 2) for k in ("ddp_k", "diloco_k4_h50", "fedavg_k4_h50"))
    quick = {m.key for m in methods(600, True, {50: h_row(600, 50, 0.7)})}
    assert quick == {"ddp_k", "diloco_k4_h50", "fedavg_k4_h50"}


def test_data_parallel_is_tuned_like_diloco_and_the_shipped_default_is_reported():
    """ddp_k gets as many lr settings as DiLoCo's outer lr per H (its AdamW lr, the
    only knob it has), each continuing the same warm start; when the sweep picks an
    outer lr other than the shipped one, the shipped one is a row of its own (3 seeds)."""
    assert len(DDP_LRS) >= len(OUTER_LRS) >= 3 and 3e-3 in DDP_LRS
    tuned = load_config(None, [*MODEL, *ddp_row(1200, DDP_LRS[-1]).overrides])
    assert tuned.mode.name == "ddp" and tuned.inner.lr == DDP_LRS[-1]
    h_rows = {h: h_row(1200, h, 1.0) for h in (25, 50, 100)}
    table = {m.key: m for m in methods(1200, False, h_rows, ddp_row(1200, DDP_LRS[-1]))}
    assert table["ddp_k"].overrides[-1] == f"inner.lr={DDP_LRS[-1]}"
    shipped = table["diloco_k4_h50_default"]
    assert shipped.seeds == (0, 1, 2) and load_config(None, [*MODEL, *shipped.overrides]).outer.lr == 0.7
    assert "diloco_k4_h50_default" not in {m.key for m in methods(1200, False, {**h_rows, 50: h_row(1200, 50, 0.7)})}


def test_a_grid_whose_best_is_its_top_is_widened_until_it_is_not():
    from archipelago.orchestrator.bench.quality_rows import WIDEN, widened

    tried: list[float] = []

    def loss_at(lr: float) -> float:
        tried.append(lr)
        return (lr - 0.02) ** 2  # best at 2e-2: past the grid's top

    losses = widened((1.5e-3, 3e-3, 6e-3, 1.2e-2), loss_at, lambda lr: 2 * lr)
    assert tried == [1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2, 4.8e-2]  # until the top is not the best
    assert min(losses, key=losses.__getitem__) == 2.4e-2
    far = widened((1.0, 2.0), lambda lr: -lr, lambda lr: lr + 1)  # better and better: at most WIDEN more
    assert sorted(far) == [1.0, 2.0, *(2.0 + i for i in range(1, WIDEN + 1))]
    inside = widened((1.0, 2.0, 3.0), lambda lr: abs(lr - 2.0), lambda lr: lr + 1)
    assert sorted(inside) == [1.0, 2.0, 3.0]  # a best inside the grid: nothing more


def test_diloco_s_inner_lr_is_tuned_like_data_parallel_s_and_the_tuned_row_can_be_the_best():
    from archipelago.orchestrator.bench.quality import _best
    from archipelago.orchestrator.bench.quality_rows import SHIPPED_INNER_LR, Method

    assert load_config(None, [*MODEL]).inner.lr == SHIPPED_INNER_LR  # the rows' untuned inner lr is the product's
    h_rows = {h: h_row(1200, h, 1.0) for h in (25, 50, 100)}
    inner = Method("diloco_k4_h50_tuned_inner", "", [*h_rows[50].overrides, "inner.lr=0.012"], (0, 1, 2), 1.0)
    table = {m.key: m for m in methods(1200, False, h_rows, ddp_row(1200, 1.2e-2), inner)}
    assert load_config(None, [*MODEL, *table["diloco_k4_h50_tuned_inner"].overrides]).inner.lr == 0.012
    losses = {"diloco_k4_h25": 1.52, "diloco_k4_h50": 1.54, "diloco_k4_h50_tuned_inner": 1.50, "fedavg_k4_h50": 1.4}
    assert _best({k: {"final_eval_loss": v} for k, v in losses.items()}) == "diloco_k4_h50_tuned_inner"


def test_a_grid_whose_best_is_its_bottom_is_widened_below_it_when_asked():
    from archipelago.orchestrator.bench.quality_rows import widened

    tried = []

    def loss_at(x: float) -> float:
        tried.append(x)
        return abs(x - 0.3)

    losses = widened((0.7, 1.0, 1.3), loss_at, lambda x: x + 0.3, lambda x: x / 2)
    assert tried == [0.7, 1.0, 1.3, 0.35, 0.175] and min(losses, key=losses.__getitem__) == 0.35
    assert widened((0.7, 1.0), lambda x: x, lambda x: x + 0.3) == {0.7: 0.7, 1.0: 1.0}  # no shrink: as before
