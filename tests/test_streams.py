"""Streamed `datasets` sources: each data shard reads its own files, and a shard resumed
after a coordinator restart continues from the stream's saved state (kept in the
checkpoint) without reading any item before its position again."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from archipelago.orchestrator.bench.simulation.pool import InProcessPool
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.build import build_engine
from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint
from archipelago.workers.data.streams import shard_stream
from tests.engine_scenarios import drive
from tests.toy_tasks import ROWS, SEEN, make_counting_stream

SHARDS = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(1)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    for f in range(8):  # a multiple of the data shards: each shard reads two whole files
        ids = list(range(f * 100, f * 100 + 40))
        docs = ["".join(letters[rng.integers(0, len(letters), 60)]) for _ in ids]
        pq.write_table(pa.table({"id": ids, "text": docs}), folder / f"part-{f}.parquet")
    return str(folder / "part-*.parquet")


def test_a_shard_reads_only_its_files_and_resumes_from_its_state(files):
    counting = make_counting_stream(record="unit", files=files)
    task = counting.task
    ds = task.corpus.dataset("train")
    owned = [{row["id"] // 100 for row in shard_stream(ds, s, SHARDS)} for s in range(SHARDS)]
    assert sorted(f for o in owned for f in o) == list(range(8)) and all(len(o) == 2 for o in owned)
    stream = task.train_batches(1, SHARDS, seed=0)
    walked = [next(stream) for _ in range(30)]
    fresh = task.train_batches(1, SHARDS, seed=0)
    for _ in range(12):
        next(fresh)
    state = fresh.state()
    mark = len(SEEN["unit"])
    resumed = task.resume_batches(1, SHARDS, 0, 12, state)
    assert all((a == b).all() for x, y in zip(walked[12:30], (next(resumed) for _ in range(18))) for a, b in zip(x, y))
    assert resumed.state()["items"] == stream.state()["items"]  # both after batch 30, read ahead or not
    after = set(SEEN["unit"][mark:])
    before = {row["id"] for row in itertools.islice(shard_stream(ds, 1, SHARDS), state["items"])}
    assert before and after and not before & after  # it read on from there, nothing before


def test_a_restarted_coordinator_resumes_each_stream_without_reading_before_its_position(tmp_path, files):
    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_counting_stream",
            "task.kwargs.record=restart",
            f"task.kwargs.files={files}",
            "warm_start.steps=0",
            "islands.count=2",
            f"data_shards={SHARDS}",
            "rounds=6",
            "inner_steps=4",
            "inner.warmup_steps=0",
            "checkpoint.every_rounds=1",
            "round_timeout_s=20",
            "step_timeout_s=0",
            f"out_dir={tmp_path / 'run'}",
        ],
    )
    first = build_engine(cfg, InProcessPool(cfg), run_id="s")
    drive(first, until=3)
    saved = load_checkpoint(Path(cfg.checkpoint_dir) / "s")["ledger"]
    assert sorted(int(s) for s in saved["streams"]) == list(range(SHARDS))  # each shard's state is checkpointed
    # the whole job restarts: a new coordinator and new islands, with no stream open (the
    # driver's check of the text column may read the first item: the streams start after it)
    second = build_engine(cfg, InProcessPool(cfg), run_id="s")
    assert second.resumed
    mark = len(SEEN["restart"])
    drive(second)
    assert second.summary["rounds_done"] == 6
    after = set(SEEN["restart"][mark:])
    reference = make_counting_stream(record="reference", files=files).task
    ds = reference.corpus.dataset("train")
    for s, p in enumerate(saved["position"]):
        ref = reference.train_batches(s, SHARDS, seed=cfg.seed)
        batches = [next(ref) for _ in range(second.ledger.position[s])]
        upto = reference.train_batches(s, SHARDS, seed=cfg.seed)
        for _ in range(p):
            next(upto)
        consumed = {row["id"] for row in itertools.islice(shard_stream(ds, s, SHARDS), upto.state()["items"])}
        assert consumed and not consumed & after, f"shard {s} read items before its position again"
        for i in range(p, second.ledger.position[s]):  # and it trained on what followed them
            assert ROWS["restart"][(s, i)] == tuple(bytes(r.numpy().astype("uint8")) for r in batches[i][0])


def test_the_ledger_keeps_committed_stream_states_and_refuses_malformed_ones():
    from archipelago.orchestrator.engine.state.ledger import DataLedger

    ledger = DataLedger(2)
    r = ledger.reserve(1, island=0, islands=[0], steps=4)
    assert r is not None and r.starts == {0: 0, 1: 0}
    done = {0: 2, 1: 2}
    assert "not given" in ledger.check(1, done, {0: 1, 1: 1}, {5: {}})
    assert "mapping" in ledger.check(1, done, {0: 1, 1: 1}, ["x"])  # type: ignore[arg-type]
    assert "JSON object" in ledger.check(1, done, {0: 1, 1: 1}, {0: "state"})
    assert ledger.check(1, done, {0: 1, 1: 1}, {0: {"items": 3}}) is None
    ledger.commit(1, {0: 1, 1: 1}, {0: {"items": 3}})
    ledger.reserve(2, island=0, islands=[0], steps=4)  # in flight: a checkpoint keeps committed work only
    assert ledger.resume_points({0: 2, 1: 2}) == {0: (2, {"items": 3})}
    again = DataLedger(2)
    again.load_state_dict(ledger.state_dict())
    assert again.position == [2, 2] and again.resume_points({0: 2}) == {0: (2, {"items": 3})}
