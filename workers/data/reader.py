"""Training and evaluation batches from prepared corpora (one, or a weighted mixture),
read by position: an island that joins, replaces another, restarts or forks from the warm
start reads its first batch at once, wherever its shard stands, and its memory does not
depend on the corpus's size."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .manifest import DataError, Manifest, read_manifest
from .order import MixSchedule, ShardWindows
from .prefetch import Prefetch
from .shards import TokenStore
from .windows import as_batch

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Source:
    path: str
    weight: float = 1.0


class PreparedCorpus:
    """The sources of a run, opened and checked against the task's tokenizer."""

    def __init__(self, sources: Sequence[Source], tokenizer: str, context: int, batch_size: int, iid: bool) -> None:
        if not sources:
            raise DataError("a prepared source needs at least one corpus")
        self.sources = list(sources)
        self.context, self.batch_size, self.iid = context, batch_size, iid
        self.manifests: list[Manifest] = []
        for s in self.sources:
            m = read_manifest(s.path)
            if m.tokenizer != tokenizer:
                raise DataError(
                    f"prepared corpus {s.path} was tokenised by {m.tokenizer!r}, this task tokenises with "
                    f"{tokenizer!r}: prepare it again with this task's config"
                )
            self.manifests.append(m)
        self._stores: dict[tuple[int, str], TokenStore] = {}

    def store(self, source: int, split: str) -> TokenStore:
        key = (source, split)
        if key not in self._stores:
            folder, m = Path(self.sources[source].path), self.manifests[source]
            self._stores[key] = TokenStore(folder, m.split(split, folder), m.dtype)
        return self._stores[key]

    def windows(self, source: int, split: str) -> int:
        return (self.store(source, split).tokens - 1) // self.context

    def check(self, verified: Path | None, num_shards: int = 1) -> None:
        """Before a run: every shard present and of its size, its hash checked unless
        `verified` (a stamp file) records the file unchanged since it was last hashed; every
        data shard of every source has windows to read; the eval split has enough."""
        for j, s in enumerate(self.sources):
            for split in ("train", "eval"):
                store = self.store(j, split)
                key = f"{Path(s.path).resolve()}#{split}"
                store.check(deep=not _stamped(verified, key, store))
                _stamp(verified, key, store)
            if self.windows(j, "train") < num_shards:
                raise DataError(
                    f"prepared corpus {s.path} has {self.windows(j, 'train')} training windows of "
                    f"{self.context} tokens: too few for {num_shards} data shards"
                )
            if self.windows(j, "eval") < 1:
                raise DataError(f"prepared corpus {s.path} holds out too few tokens for one eval window")

    # -- training ---------------------------------------------------------------------
    def train_batch(self, shard: int, num_shards: int, seed: int, b: int, schedule: MixSchedule) -> Batch:
        rows = np.empty((self.batch_size, self.context + 1), dtype=np.int64)
        for j, first, slots in schedule.batch(b):
            order = ShardWindows(self.windows(j, "train"), shard, num_shards, self.iid)
            rows[slots] = self.store(j, "train").windows(order.rows(first, len(slots), seed), self.context)
        return as_batch(rows, pin=True)

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int, prefetch: int = 4) -> Prefetch[Batch]:
        """Batch `start`, `start + 1`, … of data shard `shard`, read ahead on a thread."""
        schedule = MixSchedule([s.weight for s in self.sources], self.batch_size, seed)
        return Prefetch(lambda b: self.train_batch(shard, num_shards, seed, b, schedule), start, prefetch)

    # -- evaluation -------------------------------------------------------------------
    def eval_batches(self, count: int) -> list[Batch]:
        """`count` fixed batches of windows spread evenly over each source's eval split,
        the sources sharing the rows by their weights."""
        schedule = MixSchedule([s.weight for s in self.sources], count * self.batch_size, seed=0)
        rows = np.empty((count * self.batch_size, self.context + 1), dtype=np.int64)
        for j, _, slots in schedule.batch(0):
            n = self.windows(j, "eval")
            index = np.linspace(0, n - 1, len(slots)).astype(np.int64)
            rows[slots] = self.store(j, "eval").windows(index, self.context)
        return [as_batch(rows[i * self.batch_size : (i + 1) * self.batch_size], pin=True) for i in range(count)]


def _stat_key(store: TokenStore) -> str:
    h = hashlib.sha256()
    for s in store.entry.shards:
        st = (store.folder / s.file).stat()
        h.update(f"{s.file}:{s.sha256}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    return h.hexdigest()


def _stamped(stamp: Path | None, key: str, store: TokenStore) -> bool:
    if stamp is None or not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get(key) == _stat_key(store)
    except (OSError, ValueError):
        return False


def _stamp(stamp: Path | None, key: str, store: TokenStore) -> None:
    """Record that `store`'s files, as they are now, matched their hashes."""
    if stamp is None:
        return
    try:
        known = json.loads(stamp.read_text()) if stamp.is_file() else {}
    except (OSError, ValueError):
        known = {}
    known[key] = _stat_key(store)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_name(f".{stamp.name}.{id(known)}")
    tmp.write_text(json.dumps(known))
    tmp.replace(stamp)
