"""`data`: the data path at corpus sizes past memory's comfort. A corpus of random text is
generated at two sizes (the larger ≥ 200 M tokens; nothing downloads), written as Parquet,
and prepared with `archipelago data prepare` (timed). Then a fresh process per row builds a
real island of the default task (the default GPT, one thread) on it and measures:

- time to the first batch at the shard's start and at 90 % of its epoch, each in a new task
  (nothing opened or cached), median of five; the loader's throughput (batches read ahead
  on its thread, no training);
- in another process, an island as a run builds it, training its shards from their start
  and then from 90 % of their epoch: what its training consumes (inner steps of the
  default model, timed by the island) and its peak resident memory (`ru_maxrss`: torch,
  the model, training and the loader), at both corpus sizes.

The same measures for the Parquet source the task read before (`source: parquet`: every
text held in memory and the whole corpus packed in each island) are the "before" rows.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from archipelago.orchestrator.bench.report import BenchResult, Panel, checks_table, md_table, targets_met

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
FILE_CHARS = 16_000_000
ALPHABET = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz        \n", dtype=np.uint8)
SEEK_RATIO_TARGET = 1.5  # first batch at 90 % within 1.5x of the first batch at the start
LOADER_TARGET = 10.0  # the loader reads at least 10x what training consumes
RSS_TOLERANCE = 1.10  # peak memory at the larger corpus within 10 % of the smaller's
TRAIN_STEPS = 30


def generate(folder: Path, chars: int, seed: int) -> list[Path]:
    """Parquet files of random documents (500 to 5,000 characters) totalling `chars`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / "DONE"
    if done.exists():
        return sorted(folder.glob("*.parquet"))
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = 0
    for f in range(-(-chars // FILE_CHARS)):
        n = min(FILE_CHARS, chars - written)
        raw = ALPHABET[rng.integers(0, len(ALPHABET), n)].tobytes()
        cuts = np.cumsum(rng.integers(500, 5000, n // 500 + 1))
        cuts = np.concatenate([[0], cuts[cuts < n], [n]])
        docs = [raw[a:b].decode("ascii") for a, b in itertools.pairwise(cuts)]
        pq.write_table(pa.table({"text": docs}), folder / f"part-{f:04d}.parquet")
        written += n
    done.touch()
    return sorted(folder.glob("*.parquet"))


def _prepared(text: Path, out: Path) -> dict[str, Any]:
    """Prepare `text` into `out` once (its timing kept beside it)."""
    from archipelago.workers.data.encoders import ByteEncoder
    from archipelago.workers.data.prepare import PrepareOptions, prepare

    stats = out.parent / f"{out.name}.json"
    if stats.exists() and (out / "manifest.json").exists():
        return dict(json.loads(stats.read_text()))
    t0 = time.perf_counter()
    m = prepare(str(text), out, ByteEncoder(), PrepareOptions(workers=2), lambda *_: None)
    seconds = time.perf_counter() - t0
    tokens = m.splits["train"].tokens + m.splits["eval"].tokens
    result = {
        "tokens": m.splits["train"].tokens,
        "held_out_tokens": m.splits["eval"].tokens,
        "shards": len(m.splits["train"].shards),
        "prepare_seconds": seconds,
        "prepare_tokens_per_s": tokens / seconds,
    }
    stats.write_text(json.dumps(result))
    return result


def _sets(kind: str, location: Path) -> list[str]:
    if kind == "prepared":
        return ["task.kwargs.source=prepared", f"task.kwargs.prepared=[{{path: {location}}}]"]
    return [
        "task.kwargs.source=parquet",
        f"task.kwargs.train_files={location}/*.parquet",
        f"task.kwargs.eval_files={location}/part-0000.parquet",
    ]


def _config(kind: str, location: str) -> Any:
    from archipelago.orchestrator.config_load import load_config

    return load_config(None, ["warm_start.steps=0", *_sets(kind, Path(location))])


def _per_epoch(task: Any, kind: str, shards: int) -> int:
    """Batches in one epoch of data shard 0."""
    c = task.cfg
    if kind == "prepared":
        from archipelago.workers.data.order import ShardWindows

        corpus = task.corpus.prepared(task.encoder().identity)
        return ShardWindows(corpus.windows(0, "train"), 0, shards, iid=True).count // c.batch_size
    from archipelago.workers.tasks.text_data import island_part

    return (len(island_part(task.packed(), 0, shards)) - 1) // c.context // c.batch_size


def probe_reads(kind: str, location: str) -> dict[str, Any]:
    """In a fresh process: the first batch at the shard's start and at 90 % of its epoch,
    each from a new task (nothing opened, read or cached), and the loader's throughput."""
    from archipelago.workers.tasks.task import load_task

    cfg = _config(kind, location)
    shards, seed = cfg.num_shards, cfg.seed

    def first_batch(fraction: float, per_epoch: int) -> float:
        task = load_task(cfg.task.factory, cfg.task.kwargs)
        t0 = time.perf_counter()
        next(iter(task.train_batches(0, shards, seed, int(fraction * per_epoch))))
        return time.perf_counter() - t0

    task: Any = load_task(cfg.task.factory, cfg.task.kwargs)
    per_epoch = _per_epoch(task, kind, shards)
    repeats = 5 if kind == "prepared" else 1  # a parquet row reads and packs the whole corpus each time
    at_start = statistics.median(first_batch(0.0, per_epoch) for _ in range(repeats))
    at_end = statistics.median(first_batch(0.9, per_epoch) for _ in range(repeats))
    stream = iter(task.train_batches(1, shards, seed, 0))
    next(stream)
    t0 = time.perf_counter()
    n = 2000
    for _ in range(n):
        next(stream)
    c = task.cfg
    return {
        "first_batch_seconds_at_start": at_start,
        "first_batch_seconds_at_end": at_end,
        "batches_per_epoch": per_epoch,
        "loader_tokens_per_s": n * c.batch_size * c.context / (time.perf_counter() - t0),
    }


def probe_island(kind: str, location: str, steps: int = TRAIN_STEPS) -> dict[str, Any]:
    """In a fresh process, what an island does: built from the run config, it trains its
    shards from their start, then from 90 % of their epoch (a joiner's or a restart's
    seek); its training throughput (the island's own compute time) and peak memory."""
    import dataclasses
    import resource

    from archipelago.orchestrator.engine.specs import island_spec
    from archipelago.workers.runtime.island import Island

    cfg = _config(kind, location)
    island = Island(island_spec(cfg, 0))
    params = island.flat.full().detach().cpu().numpy().copy()
    island.run(island.order(0, 3), params)  # the first steps allocate and warm up
    result = island.run(island.order(0, steps), params)
    late = int(0.9 * _per_epoch(island.task, kind, cfg.num_shards))
    order = island.order(0, steps)
    island.run(dataclasses.replace(order, shards=dict.fromkeys(order.shards, late)), params)
    return {
        "train_tokens_per_s": result.weight / result.compute_s,
        "island_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _probe(kind: str, location: Path) -> dict[str, Any]:
    """Both probes, each in a process of its own."""
    out: dict[str, Any] = {}
    for name in ("probe_reads", "probe_island"):
        code = f"import json, sys; from archipelago.orchestrator.bench.data import {name}; print(json.dumps({name}(*sys.argv[1:])))"
        proc = subprocess.run(
            [sys.executable, "-c", code, kind, str(location)], cwd=REPO, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"data {name} {kind} {location} failed: {proc.stderr[-2000:]}")
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def _measure(sizes: tuple[int, ...], work: Path) -> dict[str, dict[str, Any]]:
    """For each corpus size: a generated text, prepared once, and the island's reads of
    the prepared corpus and of the text as Parquet."""
    methods: dict[str, dict[str, Any]] = {}
    for i, chars in enumerate(sizes):
        text = work / f"text-{chars // 1_000_000}M"
        generate(text, chars, seed=i)
        prepared = work / f"prepared-{chars // 1_000_000}M"
        stats = _prepared(text, prepared)
        log.info("prepared %s tokens in %.1f s", f"{stats['tokens']:,}", stats["prepare_seconds"])
        methods[f"prepared_{chars // 1_000_000}M"] = {**stats, **_probe("prepared", prepared), "source": "prepared"}
        methods[f"parquet_{chars // 1_000_000}M"] = {
            "tokens": stats["tokens"],
            **_probe("parquet", text),
            "source": "parquet",
        }
    return methods


def _checks(head: dict[str, Any], small: dict[str, Any], large: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Seeking, the loader's speed and the island's memory against their targets (no check
    of the corpus's size: the bench generates the size it is given, so such a check could
    only pass; the size is a fact of the report)."""
    return {
        f"first_batch_at_90pct_within_{SEEK_RATIO_TARGET}x_of_start": {
            "value": head["first_batch_seconds_at_end"] / head["first_batch_seconds_at_start"],
            "target": SEEK_RATIO_TARGET,
            "ok": head["first_batch_seconds_at_end"] <= SEEK_RATIO_TARGET * head["first_batch_seconds_at_start"],
        },
        f"loader_at_least_{LOADER_TARGET:.0f}x_training": {
            "value": head["loader_tokens_per_s"] / head["train_tokens_per_s"],
            "target": LOADER_TARGET,
            "ok": head["loader_tokens_per_s"] >= LOADER_TARGET * head["train_tokens_per_s"],
        },
        f"island_rss_at_larger_corpus_within_{RSS_TOLERANCE}x": {
            "value": large["island_rss_mb"] / small["island_rss_mb"],
            "target": RSS_TOLERANCE,
            "ok": large["island_rss_mb"] <= RSS_TOLERANCE * small["island_rss_mb"],
        },
    }


def _panels(methods: dict[str, dict[str, Any]], sizes: tuple[int, ...]) -> list[Panel]:
    """The island's peak memory and its first batch, against the corpus's size."""

    def curve(source: str, key: str) -> list[tuple[float, float]]:
        rows = (methods[f"{source}_{c // 1_000_000}M"] for c in sizes)
        return [(m["tokens"] / 1e6, m[key]) for m in rows]

    sources = ("prepared", "parquet")
    curves = {f"{source}: peak island RSS (MB)": curve(source, "island_rss_mb") for source in sources}
    firsts = {
        f"{source}: first batch at {where}": curve(source, key)
        for source in sources
        for where, key in (("start", "first_batch_seconds_at_start"), ("90%", "first_batch_seconds_at_end"))
    }
    return [
        Panel(x_label="corpus (M tokens)", curves=curves, y_label="peak island RSS (MB)"),
        Panel(x_label="corpus (M tokens)", curves=firsts, y_label="seconds to the first batch"),
    ]


def data(quick: bool, work: Path) -> BenchResult:
    sizes = (20_000_000, 60_000_000) if quick else (50_000_000, 205_000_000)
    methods = _measure(sizes, work)
    small, large = (f"prepared_{c // 1_000_000}M" for c in sizes)
    head = methods[large]
    rss = {str(methods[k]["tokens"]): methods[k]["island_rss_mb"] for k in (small, large)}
    checks = _checks(head, methods[small], methods[large])
    summary = (
        f"data: {head['tokens'] / 1e6:.0f}M tokens prepared at {head['prepare_tokens_per_s'] / 1e6:.1f}M tok/s; "
        f"first batch {head['first_batch_seconds_at_start'] * 1e3:.1f} ms at start, "
        f"{head['first_batch_seconds_at_end'] * 1e3:.1f} ms at 90%; loader "
        f"{head['loader_tokens_per_s'] / head['train_tokens_per_s']:.0f}x training; island RSS "
        f"{methods[small]['island_rss_mb']:.0f} / {methods[large]['island_rss_mb']:.0f} MB; {targets_met(checks)}"
    )
    return BenchResult(
        scenario="data",
        quick=quick,
        methods=methods,
        summary=summary,
        markdown=_markdown(methods, checks),
        panels=_panels(methods, sizes),
        extra={
            "checks": checks,
            "first_batch_seconds_at_start": head["first_batch_seconds_at_start"],
            "first_batch_seconds_at_end": head["first_batch_seconds_at_end"],
            "loader_tokens_per_s": head["loader_tokens_per_s"],
            "train_tokens_per_s": head["train_tokens_per_s"],
            "island_rss_mb_by_corpus_tokens": rss,
        },
    )


def _markdown(methods: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            f"{m['tokens'] / 1e6:.1f}M",
            f"{m['first_batch_seconds_at_start'] * 1e3:,.1f}",
            f"{m['first_batch_seconds_at_end'] * 1e3:,.1f}",
            f"{m['loader_tokens_per_s'] / 1e6:.2f}M",
            f"{m['train_tokens_per_s'] / 1e3:.1f}k",
            f"{m['island_rss_mb']:,.0f}",
            f"{m['prepare_seconds']:.1f} s" if "prepare_seconds" in m else "-",
        ]
        for name, m in methods.items()
    ]
    table = md_table(
        [
            "source",
            "train tokens",
            "first batch at start (ms)",
            "at 90% (ms)",
            "loader tok/s",
            "training tok/s",
            "island peak RSS (MB)",
            "prepare",
        ],
        rows,
    )
    return (
        "A corpus of random text at two sizes, prepared once (`archipelago data prepare`, 2 worker "
        "processes) and read by a fresh island process of the default task per row. `parquet` rows are "
        "the source the task read before (every text in memory, the whole corpus packed in each island).\n\n"
        f"{table}\n\n{checks_table(checks)}"
    )
