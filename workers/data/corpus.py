"""The embedded default corpus: the Python standard library's own source files.

Real, varied text present on every machine that runs Python, so the default run and the
tests never download anything. It is prepared once with `datasets` into Parquet shards
in a cache folder (keyed by the interpreter's version and its stdlib folder, so a different
Python gets its own cache; a cached corpus is found without walking the stdlib or importing
`datasets`, which every island and the coordinator do at start: ~1.4 s of CPU each before);
held-out files form the eval split, and files keep their path so non-iid island splits
can give each island different packages.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
EXCLUDED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("ARCHIPELAGO_CACHE", Path.home() / ".cache" / "archipelago"))


def stdlib_files() -> list[Path]:
    """Sorted standard-library source files, minus test suites and third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not EXCLUDED_PARTS.intersection(p.relative_to(root).parts)]
    return sorted(files)


def _is_eval(rel_path: str, eval_every: int) -> bool:
    """Deterministic held-out choice by path hash, independent of file order."""
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % eval_every == 0


@dataclass(frozen=True)
class CorpusFiles:
    train: list[Path]
    eval: list[Path]


def prepare_stdlib_corpus(
    cache_dir: Path | None = None, eval_every: int = 20, shard_bytes: int = 2_000_000
) -> CorpusFiles:
    """Build (once) and return the Parquet shards of the standard-library corpus."""
    return _prepared(Path(cache_dir or default_cache_dir()).resolve(), eval_every, shard_bytes)


@functools.lru_cache(maxsize=8)
def _prepared(cache_dir: Path, eval_every: int, shard_bytes: int) -> CorpusFiles:
    root = Path(sysconfig.get_paths()["stdlib"])
    key_src = f"{FORMAT_VERSION}|{eval_every}|{shard_bytes}|{root}|{sys.version}|{sys.implementation.cache_tag}"
    target = cache_dir / f"stdlib-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
    if not (target / "DONE").exists():
        _build(root, target, eval_every, shard_bytes)
    return CorpusFiles(train=sorted(target.glob("train-*.parquet")), eval=[target / "eval.parquet"])


def _build(root: Path, target: Path, eval_every: int, shard_bytes: int) -> None:
    from datasets import Dataset, disable_progress_bars  # heavy import, only needed when building

    disable_progress_bars()
    files = stdlib_files()
    rows: dict[str, dict[str, list[str]]] = {"train": {"path": [], "text": []}, "eval": {"path": [], "text": []}}
    for p in files:
        rel = str(p.relative_to(root))
        text = p.read_text(encoding="utf-8", errors="replace")
        split = rows["eval" if _is_eval(rel, eval_every) else "train"]
        split["path"].append(rel)
        split["text"].append(text)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".stdlib-", dir=target.parent))
    train = Dataset.from_dict(rows["train"])
    total = sum(len(t) for t in rows["train"]["text"])
    n_shards = max(1, total // shard_bytes)
    for i in range(n_shards):
        train.shard(n_shards, i, contiguous=True).to_parquet(str(tmp / f"train-{i:05d}.parquet"))
    Dataset.from_dict(rows["eval"]).to_parquet(str(tmp / "eval.parquet"))
    (tmp / "DONE").write_text(f"{len(files)} files\n")
    try:
        os.rename(tmp, target)  # atomic publish; a concurrent builder may have won
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
