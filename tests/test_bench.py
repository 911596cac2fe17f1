"""Benchmark plumbing: every quality method is a valid config with the same token budget,
and results are written as JSON, PNG and Markdown (plus the docs index)."""

from __future__ import annotations

import json

from orchestrator.bench.quality import HEADLINE, MODEL, methods
from orchestrator.bench.registry import available
from orchestrator.bench.report import BenchResult, Panel, write_docs_index, write_result
from orchestrator.cli import main
from orchestrator.config_load import load_config


def _tokens(cfg) -> int:
    per_step = cfg.task.kwargs["batch_size"] * cfg.task.kwargs["context"]
    return cfg.islands.count * cfg.rounds * cfg.inner_steps * per_step


def test_quality_methods_share_one_token_budget_and_the_required_keys():
    table = methods(400)
    assert {"single", "ddp_k", HEADLINE, "diloco_k4_h10", "diloco_k4_h200"} <= set(table)
    budgets = {name: _tokens(load_config(None, [*MODEL, *ov])) for name, (_, ov) in table.items()}
    assert len(set(budgets.values())) == 1, budgets
    assert load_config(None, [*MODEL, *table["ddp_k"][1]]).mode == "ddp"


def test_report_files_and_docs_index(tmp_path):
    result = BenchResult(
        "demo",
        True,
        {"a": {"final_eval_loss": 1.0}},
        "demo: ok",
        "| x |\n| - |",
        [Panel("tokens", {"a": [(0, 2.0), (10, 1.0)]})],
    )
    write_result(result, tmp_path)
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["methods"]["a"]["final_eval_loss"] == 1.0 and data["machine"]["cpus"]
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "architecture.md").write_text("# Architecture\n")  # another docs page: not a report
    write_docs_index(tmp_path, ["demo", "absent"])
    index = (tmp_path / "benchmarks.md").read_text()
    assert "## demo" in index and "demo.png" in index and "# Architecture" not in index


def test_unknown_scenario_is_a_clear_error(capsys):
    assert "quality" in available()
    assert main(["bench", "nope", "--out", "unused"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_hetero_methods_share_one_budget_and_time_to_reach():
    from orchestrator.bench.hetero import methods as hetero_methods
    from orchestrator.bench.hetero import time_to_reach

    table = hetero_methods(4)
    assert set(table) == {"sync", "naive_async", "dn_dylu"}
    budgets = {name: _tokens(load_config(None, [*MODEL, *ov])) for name, (_, ov) in table.items()}
    assert len(set(budgets.values())) == 1
    assert time_to_reach([(0, 5.0), (10, 3.0), (20, 1.0)], 2.0) == 15.0
    assert time_to_reach([(0, 5.0), (10, 3.0)], 2.0) is None
