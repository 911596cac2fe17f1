"""Which windows of a prepared corpus a data shard reads, and in what order: pure
arithmetic, O(1) in time and memory for any position, whatever the corpus size.

A split of N tokens holds W = (N − 1) // context windows of context + 1 tokens (window w
starts at token w × context). Data shard s of S owns:
- `iid`: windows s, s + S, s + 2S, … (a sample spread over the whole corpus);
- `non_iid`: the contiguous run [s·W/S, (s+1)·W/S) (neighbouring documents: a real shift).
Row q of shard s is window `perm_e(q mod n)` of its n windows, e = q div n its epoch, where
`perm_e` is a keyed Feistel permutation: a fresh random order every epoch that needs no
table (a stored permutation would grow with the corpus) and seeks to any row directly.
A batch is B consecutive rows, so batch position b is rows [bB, (b+1)B): the exactly-once
ledger's positions mean the same thing here as for any task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROUNDS = 4
_MUL = np.uint64(0x9E3779B97F4A7C15)


def _round_keys(seed: int, shard: int, epoch: int) -> np.ndarray:
    return np.random.SeedSequence([seed, shard, epoch, 0xA5C1]).generate_state(ROUNDS, dtype=np.uint64)


def feistel(index: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A bijection of range(n) onto itself applied to `index` (balanced Feistel network
    over the smallest even-bit domain ≥ n, cycle-walking values that land outside)."""
    if n <= 1:
        return np.zeros_like(index, dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    x = index.astype(np.uint64)
    todo = np.ones(len(x), dtype=bool)
    while todo.any():
        left, right = x[todo] >> shift, x[todo] & mask
        for k in keys:
            mixed = (right ^ k) * _MUL
            mixed ^= mixed >> np.uint64(29)
            left, right = right, (left ^ mixed) & mask
        x[todo] = (left << shift) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass(frozen=True)
class ShardWindows:
    """The windows of one data shard of one split."""

    windows: int  # W of the split
    shard: int
    num_shards: int
    iid: bool

    @property
    def count(self) -> int:
        s, n = self.shard, self.num_shards
        if self.iid:
            return max(0, (self.windows - 1 - s) // n + 1)
        return (s + 1) * self.windows // n - s * self.windows // n

    def window(self, local: np.ndarray) -> np.ndarray:
        """Global window index of the shard's `local` windows."""
        if self.iid:
            return self.shard + local * self.num_shards
        return self.shard * self.windows // self.num_shards + local

    def rows(self, first: int, count: int, seed: int) -> np.ndarray:
        """Global window indices of rows [first, first + count) of the shard's endless,
        per-epoch reshuffled sequence."""
        n = self.count
        if n < 1:
            raise ValueError(f"data shard {self.shard} of {self.num_shards} has no window of this split")
        q = np.arange(first, first + count, dtype=np.int64)
        epochs, local = np.divmod(q, n)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            at = epochs == e
            out[at] = feistel(local[at], n, _round_keys(seed, self.shard, int(e)))
        return self.window(out)


class MixSchedule:
    """Which source each row of a batch comes from, for a weighted mixture: a fixed pattern
    of `period` batches in which source j holds its weight's share of the rows (largest
    remainders), shuffled once per seed. Source j's own row count before any batch b is
    then closed-form (whole periods × its count + a table within the period), so a
    mixture seeks in O(1) like a single source."""

    def __init__(self, weights: list[float], batch_size: int, seed: int, min_rows: int = 1024) -> None:
        if not weights or min(weights) <= 0:
            raise ValueError(f"mixture weights must all be > 0, got {weights}")
        self.batch_size = batch_size
        self.period = max(1, -(-min_rows // batch_size))
        rows = self.period * batch_size
        share = np.asarray(weights, dtype=np.float64) / sum(weights) * rows
        counts = np.floor(share).astype(np.int64)
        counts[np.argsort(-(share - counts), kind="stable")[: rows - counts.sum()]] += 1
        pattern = np.repeat(np.arange(len(weights)), counts)
        self.pattern = np.random.default_rng([seed, 0x313]).permutation(pattern)
        per_batch = self.pattern.reshape(self.period, batch_size)
        self.counts = counts  # rows per period, per source
        # before[b, j]: rows of source j in batches 0 .. b-1 of the period
        hits = np.stack([(per_batch == j).sum(axis=1) for j in range(len(weights))], axis=1)
        self.before = np.vstack([np.zeros(len(weights), dtype=np.int64), np.cumsum(hits, axis=0)])

    def batch(self, b: int) -> list[tuple[int, int, np.ndarray]]:
        """(source, its first row, the batch's slots it fills) for each source in batch b."""
        period, within = divmod(b, self.period)
        slots = self.pattern[within * self.batch_size : (within + 1) * self.batch_size]
        out = []
        for j in range(len(self.counts)):
            at = np.flatnonzero(slots == j)
            if len(at):
                out.append((j, int(period * self.counts[j] + self.before[within, j]), at))
        return out
