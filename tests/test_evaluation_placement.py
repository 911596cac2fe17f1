"""Evaluation off the coordinator: records wait for their version's evaluation while the
run goes on, stay in round order and complete, and a checkpoint is written only after
the records before it; the Hugging Face task's loss without autograd is the whole-batch
loss in bounded memory; on Ray, an evaluation actor gives the coordinator's numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.outputs.evaluation import Evaluation
from tests.engine_scenarios import drive, scenario_cfg
from tests.helpers import in_process_engine, toy_quadratic


class Lagging:
    """Where the evaluation runs is the only fake: each evaluation is the coordinator's
    own (`LocalEvaluator`), handed back `lag` polls late, as an actor's would be."""

    def __init__(self, inner, lag: int) -> None:
        self.inner, self.lag = inner, lag
        self.held: list[list] = []
        self.published: dict[int, object] = {}  # version -> what the engine said was published

    def submit(self, *, version, params, published=None):
        self.published[version] = None if published is None else np.array(published)
        if published is not None:  # the published version is exactly what is evaluated
            np.testing.assert_array_equal(np.asarray(published), params.detach().numpy())
        self.inner.submit(version=version, params=params)
        self.held.extend([e, self.lag] for e in self.inner.results(wait=True))

    def results(self, *, wait: bool) -> list[Evaluation]:
        for h in self.held:
            h[1] -= 1
        done = [e for e, left in self.held if wait or left < 0]
        self.held = [h for h in self.held if not (wait or h[1] < 0)]
        return done

    def close(self) -> None:
        self.inner.close()


def _records(engine) -> list[dict]:
    return [json.loads(line) for line in (engine.recorder.out / "metrics.jsonl").read_text().splitlines()]


def test_records_wait_for_their_evaluation_in_order_while_the_run_goes_on(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=6", "checkpoint.every_rounds=0")
    reference, _ = in_process_engine(cfg.model_copy(update={"out_dir": str(tmp_path / "ref")}))
    reference.execute()
    engine, _ = in_process_engine(cfg.model_copy(update={"out_dir": str(tmp_path / "lag")}))
    engine.outputs.evaluator = Lagging(engine.outputs.evaluator, lag=3)
    behind = []  # (rounds recorded by the stats, records written) whenever they differ
    engine.start()
    while engine.step():
        written = len(engine.outputs.recorder.out.joinpath("metrics.jsonl").read_text().splitlines())
        if written < engine.stats.rounds_done:
            behind.append((engine.stats.rounds_done, written))
    summary = engine.summary
    assert behind, "the run never went on past a round whose evaluation was out"
    got, want = _records(engine), _records(reference)
    assert [r["round"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["eval_loss"] for r in got] == [r["eval_loss"] for r in want]
    assert summary["final_eval_loss"] == reference.summary["final_eval_loss"]
    assert summary["initial_eval_loss"] == reference.summary["initial_eval_loss"]


def test_a_checkpoint_waits_for_the_records_before_it(tmp_path, monkeypatch):
    """Captured only once the records through its round are on disk (their evaluations came
    back), whether the next outer step's fence or a later poll finds them there."""
    from archipelago.orchestrator.engine import engine as engine_module

    cfg = scenario_cfg(tmp_path, "diloco", "rounds=4", "checkpoint.every_rounds=2")
    engine, _ = in_process_engine(cfg)
    engine.outputs.evaluator = Lagging(engine.outputs.evaluator, lag=50)
    seen = []
    capture = engine_module.capture

    def spy(core, flights, location, name):
        state = capture(core, flights, location, name)
        seen.append((state["counters"]["rounds_done"], len(_records(engine))))
        return state

    monkeypatch.setattr(engine_module, "capture", spy)
    drive(engine)
    assert seen == [(2, 2), (4, 4)]
    assert all(r["eval_loss"] is not None for r in _records(engine))


def test_a_lost_evaluation_records_its_round_without_a_loss(tmp_path):
    cfg = scenario_cfg(tmp_path, "diloco", "rounds=2", "checkpoint.every_rounds=0")
    engine, _ = in_process_engine(cfg)

    class Losing:
        def __init__(self):
            self.out = []

        def submit(self, *, version, params, published=None):
            self.out.append(Evaluation(version=version, loss=None, error="the actor's node was lost"))

        def results(self, *, wait):
            out, self.out = self.out, []
            return out

        def close(self):
            pass

    engine.outputs.evaluator = Losing()
    drive(engine)
    assert [r["eval_loss"] for r in _records(engine)] == [None, None]
    assert engine.summary["state"] == "finished"


def test_the_hf_eval_loss_is_the_whole_batch_loss_in_chunks():
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from archipelago.workers.tasks.chunked_loss import causal_lm_eval_loss, splits_head

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    x = torch.randint(0, 97, (6, 20))
    y = torch.randint(0, 97, (6, 20))
    with torch.no_grad():
        whole = torch.nn.functional.cross_entropy(model(input_ids=x).logits.reshape(-1, 97), y.reshape(-1))
    assert splits_head(model)
    for rows, tokens in [(1, 7), (4, 64), (6, 1000)]:
        got = causal_lm_eval_loss(model, (x, y), rows=rows, tokens=tokens)
        assert float(got) == pytest.approx(float(whole), rel=1e-6, abs=1e-6)
    capped = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "gemma2",
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        ),
        dtype=torch.float32,
    ).eval()
    assert not splits_head(capped)  # soft-capped logits: through the model's own forward, rows at a time
    with torch.no_grad():
        whole = torch.nn.functional.cross_entropy(capped(input_ids=x).logits.reshape(-1, 97), y.reshape(-1))
    assert float(causal_lm_eval_loss(capped, (x, y), rows=2, tokens=5)) == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.ray
def test_an_evaluation_actor_evaluates_every_round_and_gives_the_coordinators_numbers(
    ray_local, tmp_path, corpus_cache
):
    """`evaluation.where: actor` on real Ray: every round's record has its loss, the run's
    initial and final losses are the evaluations of its models (the final one of
    final.pt, recomputed here), and the coordinator never evaluated."""
    from archipelago.orchestrator.engine.outputs.evaluation import evaluate_model
    from archipelago.orchestrator.runtime.driver import run
    from archipelago.workers.tasks.lm_task import make_task
    from tests.helpers import tiny_lm_config

    cfg = tiny_lm_config(
        tmp_path / "out",
        corpus_cache,
        "islands.count=2",
        "rounds=3",
        "inner_steps=5",
        "evaluation.where=actor",
        "evaluation.cpus=0",
    )
    summary = run(cfg, show_progress=False)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["eval_loss"], float) for r in records)
    assert summary["final_eval_loss"] == records[-1]["eval_loss"]
    task = make_task(**cfg.task.kwargs)
    model = task.build_model()
    model.load_state_dict(torch.load(tmp_path / "out" / "final.pt"))
    loss, _ = evaluate_model(task, model, list(task.eval_batches()), device=torch.device("cpu"), bf16=False)
    assert summary["final_eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["coordinator_seconds"]["evaluate"] < 0.5  # submitting and collecting only


@pytest.mark.parametrize(("downlink", "exact"), [("none", True), ("int8", False)])
def test_an_evaluation_reads_the_published_version_where_it_is_the_outer_parameters(tmp_path, downlink, exact):
    """An evaluation elsewhere reads the version the pool already published (no second
    copy of the model through the head a round) — unless the published copy is a lossy
    downlink's, which is not the model being evaluated."""
    cfg = load_config(
        None, [*toy_quadratic(2, 0.0, "rounds=3"), f"compression.downlink={downlink}", f"out_dir={tmp_path}"]
    )
    engine, _ = in_process_engine(cfg)
    lagging = Lagging(engine.outputs.evaluator, lag=0)
    engine.outputs.evaluator = lagging
    engine.execute()
    assert sorted(lagging.published) == [0, 1, 2, 3]
    assert all((p is not None) == exact for p in lagging.published.values()), lagging.published
