"""The embedded corpus, island splits, batches, and the other text sources (offline)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from archipelago.workers.data.corpus import prepare_stdlib_corpus, stdlib_files
from archipelago.workers.tasks.lm_task import make_task
from archipelago.workers.tasks.text_data import fixed_batches, island_part, read_parquet_texts, window_batches
from tests.conftest import REPO


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_stdlib_corpus(tmp_path_factory.mktemp("cache"))


def test_corpus_is_real_stdlib_text_with_held_out_files(corpus):
    assert len(stdlib_files()) > 100
    train_paths = set(
        itertools.chain.from_iterable(
            pq.read_table(f, columns=["path"]).column("path").to_pylist() for f in corpus.train
        )
    )
    eval_paths = set(pq.read_table(corpus.eval[0], columns=["path"]).column("path").to_pylist())
    assert eval_paths and train_paths and not eval_paths & train_paths
    text = "".join(read_parquet_texts(corpus.eval))
    assert "def " in text and "import " in text


def test_prepare_is_cached(corpus):
    """A cached corpus is found by another process without rebuilding it, without walking
    the stdlib and without importing `datasets` (every island and the coordinator do this)."""
    cache, done = corpus.eval[0].parent.parent, corpus.eval[0].parent / "DONE"
    built_at = done.stat().st_mtime_ns
    probe = (
        "import sys; from pathlib import Path; import archipelago.workers.data.corpus as c\n"
        "c.stdlib_files = None  # a walk of the stdlib would fail\n"
        f"files = c.prepare_stdlib_corpus(Path({str(cache)!r}))\n"
        "print(len(files.train), files.eval[0], 'datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == [str(len(corpus.train)), str(corpus.eval[0]), "False"]
    assert done.stat().st_mtime_ns == built_at


def _packed(corpus, split):
    return make_task(split=split, cache_dir=str(corpus.eval[0].parent.parent)).packed()


@pytest.mark.parametrize("split", ["iid", "non_iid"])
def test_island_splits_partition_the_corpus(corpus, split):
    packed = _packed(corpus, split)
    parts = [island_part(packed, i, 3) for i in range(3)]
    assert np.array_equal(np.concatenate(parts), packed)
    assert len(packed) == sum(len(t.encode()) + 1 for t in read_parquet_texts(corpus.train)) - 1
    assert min(len(p) for p in parts) >= len(packed) // 3 - 1


def test_non_iid_islands_see_different_distributions(corpus):
    def hist(tokens):
        return np.bincount(tokens, minlength=256) / len(tokens)

    def spread(split):
        packed = _packed(corpus, split)
        h = [hist(island_part(packed, i, 4)) for i in range(4)]
        return max(np.abs(a - b).sum() for a, b in itertools.combinations(h, 2))

    assert spread("non_iid") > 2 * spread("iid")


def test_window_batches_are_deterministic_and_shifted():
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    a = next(window_batches(tokens, 16, 4, seed=3))
    b = next(window_batches(tokens, 16, 4, seed=3))
    c = next(window_batches(tokens, 16, 4, seed=4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    x, y = a
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_fixed_batches_refuse_too_small_eval():
    with pytest.raises(ValueError, match="windows"):
        fixed_batches(np.zeros(100, dtype=np.uint8), 32, 4, 4)


def test_parquet_source_and_streaming_hf_source_offline(tmp_path):
    rows = [f"document {i}: " + "lorem ipsum " * 40 for i in range(60)]
    for name, part in (("train", rows[:50]), ("eval", rows[50:])):
        pq.write_table(pa.table({"text": part}), tmp_path / f"{name}.parquet")
    common = {"context": 32, "batch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2, "eval_batches": 2}
    local = make_task(
        source="parquet",
        train_files=str(tmp_path / "train*.parquet"),
        eval_files=str(tmp_path / "eval*.parquet"),
        **common,
    )
    x, _y = next(local.train_batches(0, 2, seed=0))
    assert x.shape == (4, 32) and len(local.eval_batches()) == 2
    # the `hf` path streams through `datasets.load_dataset`; its local parquet builder needs no network
    streamed = make_task(
        source="hf",
        hf_dataset="parquet",
        hf_config=None,
        hf_data_files=str(tmp_path / "train.parquet"),
        hf_train_split="train",
        hf_eval_split="train",
        **common,
    )
    xs, _ = next(streamed.train_batches(1, 2, seed=0))
    assert xs.shape == (4, 32)
    assert bytes(xs[0].to(torch.uint8).numpy()).decode().startswith("document 1:")


def test_default_model_trains_on_the_corpus(tmp_path):
    task = make_task(cache_dir=str(tmp_path), d_model=32, n_layers=1, n_heads=2, context=32, batch_size=8)
    task.prepare()
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = task.train_batches(0, 1, seed=0)
    evals = task.eval_batches()
    with torch.no_grad():
        before = float(np.mean([float(task.loss(model, b)) for b in evals]))
    for _ in range(60):
        loss = task.loss(model, next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = float(np.mean([float(task.loss(model, b)) for b in evals]))
    assert after < before - 1.0


def test_a_source_without_its_text_column_or_files_is_refused_before_training(tmp_path):
    from archipelago.workers.data.manifest import DataError

    pq.write_table(pa.table({"body": ["some text"] * 20}), tmp_path / "train.parquet")
    files = {"train_files": str(tmp_path / "train*.parquet"), "eval_files": str(tmp_path / "train*.parquet")}
    with pytest.raises(DataError, match=r"no text column 'text'.*body"):
        make_task(source="parquet", **files).prepare()
    with pytest.raises(DataError, match="no Parquet files match"):
        make_task(source="parquet", train_files=str(tmp_path / "none*"), eval_files=str(tmp_path / "none*")).prepare()
    streamed = make_task(source="hf", hf_dataset="parquet", hf_config=None, hf_data_files=files["train_files"])
    with pytest.raises(DataError, match="streamed source parquet: no text column 'text'"):
        streamed.prepare()
