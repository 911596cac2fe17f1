"""Prepared corpora: `archipelago data prepare`, the shards' format, reading by position,
mixtures, and every bad input refused with exit 2 before any training."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from archipelago.orchestrator.cli import main
from archipelago.workers.data.encoders import ByteEncoder
from archipelago.workers.data.manifest import DataError, read_manifest
from archipelago.workers.data.order import MixSchedule, ShardWindows, feistel
from archipelago.workers.data.prepare import PrepareOptions, prepare
from archipelago.workers.tasks.lm_task import make_task

WORDS = np.array(list("abcdefghijklmnopqrstuvwxyz      \n"))


def texts(n: int, seed: int, length: int = 300) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(WORDS[rng.integers(0, len(WORDS), rng.integers(length // 2, length))]) for _ in range(n)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two Parquet files and one JSON-lines file of random text (every window distinct)."""
    folder = tmp_path_factory.mktemp("source")
    docs = texts(600, 0)
    pq.write_table(pa.table({"text": docs[:250], "id": list(range(250))}), folder / "a.parquet")
    pq.write_table(pa.table({"text": docs[250:500]}), folder / "b.parquet")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[500:]))
    return folder, docs


@pytest.fixture(scope="module")
def corpus(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    assert (
        main(["-q", "data", "prepare", str(source[0]), str(out), "--shard-tokens", "20000", "--eval-every", "10"]) == 0
    )
    return out


def lm(corpus, **kw):
    return make_task(source="prepared", prepared=[{"path": str(corpus)}], context=32, batch_size=4, **kw)


def test_feistel_is_a_fresh_permutation_every_key_and_seeks_anywhere():
    for n in (1, 2, 7, 1000, 4097):
        a = feistel(np.arange(n), n, np.arange(4, dtype=np.uint64))
        assert sorted(a.tolist()) == list(range(n))
    a = feistel(np.arange(1000), 1000, np.arange(4, dtype=np.uint64))
    b = feistel(np.arange(1000), 1000, np.arange(1, 5, dtype=np.uint64))
    assert (a != b).mean() > 0.9 and not np.array_equal(a, np.arange(1000))
    sw = ShardWindows(windows=10_007, shard=2, num_shards=5, iid=True)
    whole = sw.rows(0, 3 * sw.count, seed=4)
    assert np.array_equal(sw.rows(1234, 3000, seed=4), whole[1234:4234])  # across an epoch's end
    for e in range(3):  # each epoch is every window of the shard once, in a new order
        epoch = whole[e * sw.count : (e + 1) * sw.count]
        assert sorted(epoch.tolist()) == sorted(sw.window(np.arange(sw.count)).tolist())
    assert not np.array_equal(whole[: sw.count], whole[sw.count : 2 * sw.count])


@pytest.mark.parametrize("iid", [True, False])
def test_data_shards_partition_the_windows(iid):
    shards = [ShardWindows(1001, s, 7, iid) for s in range(7)]
    owned = np.concatenate([s.window(np.arange(s.count)) for s in shards])
    assert sorted(owned.tolist()) == list(range(1001))
    first = shards[3].window(np.arange(shards[3].count))
    assert (np.diff(first) == (7 if iid else 1)).all()


def test_a_mixture_keeps_its_weights_and_seeks_in_closed_form():
    mix = MixSchedule([3.0, 1.0, 0.5], batch_size=16, seed=0)
    seen = [0, 0, 0]
    for b in range(3 * mix.period + 5):  # each source's rows continue where its last batch left them
        parts = mix.batch(b)
        assert sum(len(slots) for _, _, slots in parts) == 16
        assert sorted(np.concatenate([slots for *_, slots in parts]).tolist()) == list(range(16))
        for j, first, slots in parts:
            assert first == seen[j]
            seen[j] += len(slots)
    share = np.array(seen) / sum(seen)
    assert np.allclose(share, [3 / 4.5, 1 / 4.5, 0.5 / 4.5], atol=0.01)
    with pytest.raises(ValueError, match="> 0"):
        MixSchedule([1.0, 0.0], 16, 0)


def test_prepare_writes_arrow_shards_a_document_index_and_a_manifest(source, corpus):
    _, docs = source
    m = read_manifest(corpus)
    assert m.tokenizer == ByteEncoder.identity and m.dtype == "uint8" and m.separator == 0
    train, held = m.splits["train"], m.splits["eval"]
    assert train.documents + held.documents == len(docs) and 0 < held.documents < len(docs) / 4
    assert train.tokens + held.tokens == sum(len(t) + 1 for t in docs)
    assert len(train.shards) > 3 and all(s.tokens == 20000 for s in train.shards[:-1])
    tokens = np.concatenate(  # any Arrow tool memory-maps the shards
        [
            pa.ipc.open_file(pa.memory_map(str(corpus / s.file))).read_all().column("tokens").to_numpy()
            for s in train.shards
        ]
    )
    starts = pa.ipc.open_file(pa.memory_map(str(corpus / train.index))).read_all().column("start").to_numpy()
    assert len(starts) == train.documents and (tokens[starts[1:] - 1] == 0).all()  # a NUL before each next document
    first = bytes(tokens[: starts[1] - 1]).decode()
    assert first in docs
    assert (tokens == 0).sum() == train.documents


def test_batches_seek_exactly_and_agree_across_processes_views(corpus):
    a, b = lm(corpus), lm(corpus)
    stream = a.train_batches(2, 5, seed=7, start=0)
    walked = [next(stream) for _ in range(40)]
    again = next(b.train_batches(2, 5, seed=7, start=33))
    assert all(torch.equal(u, v) for u, v in zip(walked[33], again))
    x, y = walked[0]
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    other = next(b.train_batches(2, 5, seed=8, start=0))
    assert not torch.equal(other[0], x)
    assert len(a.eval_batches()) == 8 and torch.equal(a.eval_batches()[3][0], b.eval_batches()[3][0])


def test_a_mixture_draws_rows_from_each_corpus_by_weight(corpus, tmp_path, source):
    other = tmp_path / "upper"
    docs = [t.upper() for t in texts(200, 1)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "u.parquet")
    prepare(
        str(tmp_path / "u.parquet"), other, ByteEncoder(), PrepareOptions(eval_every=10, workers=1), lambda *_: None
    )
    task = make_task(
        source="prepared",
        prepared=[{"path": str(corpus), "weight": 3}, {"path": str(other), "weight": 1}],
        context=32,
        batch_size=8,
    )
    stream = task.train_batches(0, 2, seed=0)
    rows = torch.cat([next(stream)[0] for _ in range(64)])
    upper = ((rows >= ord("A")) & (rows <= ord("Z"))).any(dim=1).float().mean().item()
    assert 0.22 < upper < 0.28  # a quarter of the rows, from the second corpus


def test_an_interrupted_prepare_resumes_with_the_pieces_it_had_not_done(source, tmp_path):
    out = tmp_path / "corpus"
    calls = []

    def stop_after_two(done, total, tokens):
        calls.append(done)
        if done == 2:
            raise KeyboardInterrupt

    opts = PrepareOptions(shard_tokens=20000, eval_every=10, workers=1)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(source[0]), out, ByteEncoder(), opts, stop_after_two)
    assert not (out / "manifest.json").exists() and len(list((out / ".parts").glob("part-*.npz"))) == 2
    calls.clear()
    m = prepare(str(source[0]), out, ByteEncoder(), opts, lambda done, *_: calls.append(done))
    assert calls == [3]  # only the third piece was tokenised again
    assert m.content_sha256 == read_manifest(tmp_path.parent / tmp_path.name / "corpus").content_sha256
    with pytest.raises(DataError, match="another prepared corpus"):
        prepare("stdlib", out, ByteEncoder(), opts, lambda *_: None)


def test_prepare_refuses_bad_sources_with_exit_2(source, tmp_path, capsys):
    missing = tmp_path / "nothing-here"
    assert main(["-q", "data", "prepare", str(missing), str(tmp_path / "o1")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["-q", "data", "prepare", str(source[0]), str(tmp_path / "o2"), "--text-column", "body"]) == 2
    assert "no text column 'body'" in capsys.readouterr().err


def _run(corpus, tmp_path, *extra):
    return main(
        [
            "-q",
            "run",
            "--set",
            "task.kwargs.source=prepared",
            "--set",
            f"task.kwargs.prepared=[{{path: {corpus}}}]",
            "--set",
            f"out_dir={tmp_path / 'run'}",
            *extra,
        ]
    )


def test_a_run_refuses_bad_prepared_data_with_exit_2_before_ray(corpus, tmp_path, capsys, monkeypatch):
    import shutil

    import archipelago.orchestrator.runtime.driver as driver

    monkeypatch.setattr(driver, "init_ray", lambda cfg: pytest.fail("Ray started for refused data"))
    monkeypatch.setenv("ARCHIPELAGO_CACHE", str(tmp_path / "cache"))
    assert _run(tmp_path / "absent", tmp_path) == 2 and "does not exist" in capsys.readouterr().err
    assert _run(corpus, tmp_path, "--set", "task.kwargs.prepared=[{path: x, weight: 0}]") == 2
    assert "task.kwargs.prepared.0.weight" in capsys.readouterr().err
    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = copy / manifest["splits"]["train"]["shards"][1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 1  # same size, one bit changed
    shard.write_bytes(bytes(raw))
    assert _run(copy, tmp_path) == 2 and "does not match its manifest's hash" in capsys.readouterr().err
    manifest["tokenizer"] = "hf/0123456789abcdef"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert _run(copy, tmp_path) == 2 and "tokenised by 'hf/0123456789abcdef'" in capsys.readouterr().err


def test_a_process_exits_cleanly_with_prefetching_iterators_dropped_or_alive(corpus):
    """A producer thread still inside torch at the interpreter's teardown aborted the
    process ("terminate called without an active exception"): each is stopped first."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "from archipelago.workers.tasks.lm_task import make_task\n"
        f"t = make_task(source='prepared', prepared=[{{'path': {str(corpus)!r}}}], context=32, batch_size=4)\n"
        "kept = [t.train_batches(s % 5, 5, 0, s) for s in range(12)]\n"
        "for s in range(12): next(t.train_batches(s % 5, 5, 0, s))\n"
        "[next(k) for k in kept]\n"
    )
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
        assert proc.returncode == 0 and "terminate" not in proc.stderr, proc.stderr[-500:]


@pytest.mark.ray
def test_ray_tasks_prepare_the_same_corpus_and_a_ray_run_trains_on_it(
    ray_local, source, corpus, tmp_path, corpus_cache
):
    from archipelago.orchestrator.runtime.driver import run
    from tests.helpers import tiny_lm_config

    out = tmp_path / "by-ray"
    opts = PrepareOptions(shard_tokens=20000, eval_every=10, ray_address="auto")
    m = prepare(str(source[0]), out, ByteEncoder(), opts, lambda *_: None)
    assert m.content_sha256 == read_manifest(corpus).content_sha256  # the same bytes as worker processes made
    cfg = tiny_lm_config(
        tmp_path / "run",
        corpus_cache,
        "task.kwargs.source=prepared",
        f"task.kwargs.prepared=[{{path: {out}}}]",
        "islands.count=2",
        "rounds=2",
        "inner_steps=10",
    )
    summary = run(cfg, show_progress=False)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["shards"]["position"] == [5] * 8 and summary["tokens"] == 2 * 2 * 10 * 8 * 32


def test_datasets_sources_prepare_the_same_documents_as_their_files(source, corpus, tmp_path):
    """A `save_to_disk` folder and `hf:json` with data files give the documents of the
    same texts; pieces are slices of the dataset instead of files."""
    from datasets import Dataset

    _, docs = source
    Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    opts = PrepareOptions(shard_tokens=20000, eval_every=10, workers=1)
    saved = prepare(str(tmp_path / "saved"), tmp_path / "o1", ByteEncoder(), opts, lambda *_: None)
    hub = prepare(
        "hf:json",
        tmp_path / "o2",
        ByteEncoder(),
        PrepareOptions(**{**opts.__dict__, "data_files": str(tmp_path / "all.jsonl")}),
        lambda *_: None,
    )
    for m in (saved, hub):  # every document once, in one split or the other
        assert m.splits["train"].documents + m.splits["eval"].documents == len(docs)
        assert m.splits["train"].tokens + m.splits["eval"].tokens == sum(len(t) + 1 for t in docs)
    assert saved.content_sha256 == hub.content_sha256  # the same pieces of the same rows
    with pytest.raises(DataError, match="no text column 'body'"):
        prepare(str(tmp_path / "saved"), tmp_path / "o3", ByteEncoder(), PrepareOptions(column="body"), lambda *_: None)
