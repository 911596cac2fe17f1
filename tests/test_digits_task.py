"""The Task contract is not GPT-specific: DiLoCo on scikit-learn's digits with an MLP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.workers.wire.flat import FlatParams
from tests.helpers import in_process_run

pytest.importorskip("sklearn", reason="the digits example needs the 'examples' extra (scikit-learn)")


@pytest.mark.parametrize("split", ["iid", "non_iid"])
def test_diloco_trains_digits_classifier(split):
    cfg = load_config(
        None,
        [
            "task.factory=archipelago.workers.tasks.digits_task:make_task",
            "warm_start.steps=0",
            f"task.kwargs.split={split}",
            "islands.count=3",
            "rounds=8",
            "inner_steps=20",
            "inner.lr=0.01",
            "inner.warmup_steps=0",
        ],
    )
    engine, islands, _ = in_process_run(cfg)
    task = islands[0].task
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    x, y = task.eval_batches()[0]
    with torch.no_grad():
        before = float(task.loss(model, (x, y)))
        FlatParams(model).load(engine.flat.data)
        after = float(task.loss(model, (x, y)))
        accuracy = float((model(x).argmax(1) == y).float().mean())
    assert after < before / 2 and accuracy > 0.8
    # the task's own metric (`MetricTask`), computed by the coordinator at each evaluation
    assert engine.summary["eval_metrics"] == {"accuracy": pytest.approx(accuracy)}
    records = [json.loads(line) for line in (Path(engine.cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["eval_metrics"]["accuracy"] <= 1 for r in records) and len(records) == 8
    assert records[-1]["eval_metrics"]["accuracy"] > records[0]["eval_metrics"]["accuracy"]
