"""Text batches for language-model tasks, from Parquet files or a streamed Hugging Face
dataset: bytes as tokens (the default GPT) or any tokenizer's ids (`Documents`), documents
joined by a separator token and packed into fixed-length windows.

Island splits:
- `iid`: documents are shuffled (one fixed corpus-level order) before the stream is cut
  into k equal parts, so each island sees a random mix of documents;
- `non_iid`: documents stay in path order, so each island gets a contiguous run of
  different files (different packages of the standard library): a real distribution shift.
Within its part an island reads non-overlapping windows in a per-epoch random order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq

from ..data.windows import as_batch

if TYPE_CHECKING:
    import torch

Split = str  # "iid" | "non_iid"
CORPUS_ORDER_SEED = 1234  # the same on every island: the iid shuffle must agree everywhere


def read_parquet_texts(files: Sequence[Path | str], column: str = "text") -> list[str]:
    """The column's texts, file by file. `ParquetFile.read`, not `read_table`: the latter
    imports `pyarrow.dataset` and pandas (0.27 s against 5 ms for the default corpus, on
    the coordinator's path to its first dispatch)."""
    texts: list[str] = []
    for f in files:
        table = pq.ParquetFile(f).read(columns=[column])
        texts.extend(table.column(column).to_pylist())
    return texts


def encode(texts: Iterable[str]) -> np.ndarray:
    """UTF-8 bytes of the documents, joined by a NUL separator, as uint8 tokens."""
    return np.frombuffer(b"\x00".join(t.encode("utf-8", errors="replace") for t in texts), dtype=np.uint8)


def document_order(n: int, split: Split) -> np.ndarray:
    """The corpus-level order of `n` documents: shuffled once (the same everywhere) for
    `iid`, path order for `non_iid`."""
    if split == "iid":
        return np.random.default_rng(CORPUS_ORDER_SEED).permutation(n)
    return np.arange(n)


def island_part(tokens: np.ndarray, island: int, num_islands: int) -> np.ndarray:
    """Part `island` of `num_islands` equal contiguous parts of a packed token stream."""
    if not 0 <= island < num_islands:
        raise ValueError(f"island {island} out of range for {num_islands} islands")
    bounds = np.linspace(0, len(tokens), num_islands + 1).astype(np.int64)
    return tokens[bounds[island] : bounds[island + 1]]


@dataclass(frozen=True)
class Documents:
    """Tokenised documents stored flat (document i is `tokens[offsets[i]:offsets[i + 1]]`),
    so a corpus is two arrays to cache and pack, not a list of thousands of arrays."""

    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, docs: Sequence[Sequence[int]], dtype: type = np.int32) -> Documents:
        arrays: list[np.ndarray] = [np.asarray(d, dtype=dtype) for d in docs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(tokens, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def packed(self, order: np.ndarray, sep: int) -> np.ndarray:
        """The documents in `order`, each followed by the separator token `sep`."""
        lengths = np.diff(self.offsets)[order] + 1
        out = np.full(int(lengths.sum()), sep, dtype=self.tokens.dtype)
        at = 0
        for i, n in zip(order, lengths, strict=True):
            out[at : at + n - 1] = self.tokens[self.offsets[i] : self.offsets[i + 1]]
            at += n
        return out


def window_batches(
    tokens: np.ndarray, context: int, batch_size: int, seed: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input, target) batches of non-overlapping windows, in a fresh random order
    every epoch; batch `start` onwards (any position can be resumed exactly)."""
    n_windows = (len(tokens) - 1) // context
    if n_windows < batch_size:
        raise ValueError(f"{len(tokens)} tokens are too few for batches of {batch_size}x{context}")
    per_epoch = n_windows // batch_size
    offsets = np.arange(context + 1)
    epoch, j = divmod(start, per_epoch)
    while True:
        perm = np.random.default_rng([seed, epoch]).permutation(n_windows)
        for b in range(j, per_epoch):
            starts = perm[b * batch_size : (b + 1) * batch_size] * context
            yield as_batch(tokens[starts[:, None] + offsets])
        epoch, j = epoch + 1, 0


def fixed_batches(
    tokens: np.ndarray, context: int, batch_size: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` deterministic batches spread evenly over `tokens` (the eval set)."""
    n_windows = (len(tokens) - 1) // context
    need = count * batch_size
    if n_windows < need:
        raise ValueError(f"eval split has {n_windows} windows of {context}, need {need}")
    starts = np.linspace(0, n_windows - 1, need).astype(np.int64) * context
    windows = tokens[starts[:, None] + np.arange(context + 1)]
    return [as_batch(windows[i * batch_size : (i + 1) * batch_size]) for i in range(count)]
