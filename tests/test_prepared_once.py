"""Exactly-once against prepared shards: the engine's fault scenarios (crash, join, drain,
coordinator restart, the warm-start fork) run with the default GPT task reading a prepared
corpus by position, prefetching on threads. Beyond the ledger's positions, the rows each
island trained are checked: every window trained once, and each batch the one its
(shard, position) names when read afresh."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from archipelago.orchestrator.bench.simulation.pool import Fault, FaultKind, InProcessPool
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.build import PhasedRun, build_engine
from archipelago.orchestrator.engine.commands import AddIslands, Drain
from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint
from archipelago.workers.data.encoders import ByteEncoder
from archipelago.workers.data.prepare import PrepareOptions, prepare
from archipelago.workers.tasks.lm_task import make_task
from tests.engine_scenarios import drive
from tests.helpers import assert_trained_once, events, in_process_engine
from tests.toy_tasks import ROWS

_keys = itertools.count()
ROW_TOKENS = 2 * 16  # batch_size x context of the recording task


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("once")
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz \n"))
    docs = ["".join(letters[rng.integers(0, len(letters), 400)]) for _ in range(300)]
    pq.write_table(pa.table({"text": docs}), folder / "docs.parquet")
    prepare(
        str(folder / "docs.parquet"),
        folder / "corpus",
        ByteEncoder(),
        PrepareOptions(shard_tokens=8192, eval_every=20, workers=1),
        lambda *_: None,
    )
    return folder / "corpus"


def _cfg(tmp_path: Path, corpus: Path, mode: str, *extra: str) -> RunConfig:
    key = f"p{next(_keys)}"
    return load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_recording_prepared",
            f"task.kwargs.record={key}",
            f"task.kwargs.path={corpus}",
            f"mode={mode}",
            "warm_start.steps=0",
            "islands.count=3",
            "rounds=6",
            "inner_steps=4",
            "inner.warmup_steps=0",
            "round_timeout_s=20",
            "step_timeout_s=0",
            "elastic.late_grace_s=100",
            "elastic.placement_timeout_s=100",
            "checkpoint.every_rounds=1",
            f"out_dir={tmp_path / key}",
            *extra,
        ],
    )


def _check(cfg: RunConfig, summary: dict[str, Any], lost: Counter | None = None, warm: bool = False) -> None:
    """Each batch once by its ledger position; each window once by its bytes; each batch
    the data its (shard, position) names, read again by a fresh reader."""
    record, position = cfg.task.kwargs["record"], summary["shards"]["position"]
    folders = [cfg.out_dir, *([Path(cfg.out_dir) / "warm_start"] if warm else [])]
    assert_trained_once(record, position, folders, lost)
    trained = {k: v for k, v in ROWS[record].items() if k[1] < position[k[0]]}
    rows = [r for batch in trained.values() for r in batch]
    assert len(rows) == len(set(rows)) == 2 * sum(position)
    tokens = summary["tokens"] + (summary["warm_start"]["tokens"] if warm else 0)
    assert tokens == ROW_TOKENS * sum(position)
    fresh = make_task(source="prepared", prepared=[{"path": cfg.task.kwargs["path"]}], context=16, batch_size=2)
    for s, i in list(trained)[:: max(1, len(trained) // 12)]:
        x, y = next(fresh.train_batches(s, cfg.num_shards, cfg.seed, i))
        assert tuple(bytes(r.numpy().astype("uint8")) for r in torch.cat([x, y[:, -1:]], dim=1)) == trained[(s, i)]


@pytest.mark.parametrize("mode", ["diloco", "async", "streaming"])
def test_a_crash_and_a_join_and_a_drain_train_each_window_once(tmp_path, corpus, mode):
    cfg = _cfg(tmp_path, corpus, mode, *(["mode.fragments=2"] if mode == "streaming" else []))
    engine, _ = in_process_engine(cfg, [Fault(FaultKind.CRASH, 1, order=2)])
    drive(engine, {2: lambda e: e.submit(AddIslands(count=1)), 4: lambda e: e.submit(Drain(island=0))})
    summary = engine.summary
    kinds = [(e["kind"], e.get("island")) for e in events(cfg.out_dir)]
    assert ("crash", 1) in kinds and ("drain", 0) in kinds and any(k == "join" and i >= 3 for k, i in kinds)
    assert summary["rounds_done"] == 6 and summary["final_eval_loss"] < summary["initial_eval_loss"]
    _check(cfg, summary)


@pytest.mark.parametrize("mode", ["diloco", "async"])
def test_a_coordinator_restart_trains_each_window_once(tmp_path, corpus, mode):
    cfg = _cfg(tmp_path, corpus, mode)
    first, pool = in_process_engine(cfg, run_id="restart")
    drive(first, until=3)
    saved = load_checkpoint(Path(cfg.checkpoint_dir) / "restart")["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="restart")
    assert second.resumed
    drive(second)
    _check(cfg, second.summary, lost)


@pytest.mark.parametrize("warm", ["average", "ddp"])
def test_the_warm_start_fork_trains_each_window_once(tmp_path, corpus, warm):
    cfg = _cfg(tmp_path, corpus, "diloco", "warm_start.steps=8", f"warm_start.mode={warm}", "warm_start.inner_steps=2")
    summary = PhasedRun(cfg, "fork", lambda c, rid: InProcessPool(c)).execute()
    assert summary["state"] == "finished" and summary["warm_start"]["steps"] == 8
    _check(cfg, summary, warm=True)
