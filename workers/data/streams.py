"""Batches from a streamed `datasets` source, split by data shard and resumable from a
saved state instead of by reading everything before the position again.

Each data shard reads its own part of the stream (`split_dataset_by_node`: whole files
when the file count divides by the shards, else every k-th item). Documents are tokenised
as they arrive and packed into fixed windows; a batch's windows may end inside a document,
so a shard's state at a position is the dataset's own `state_dict()` after the last item
read plus the tokens carried into the next batch. The island reports that state with its
result, the coordinator's ledger keeps it with the committed position (and in its
checkpoint), and whichever island takes the shard next continues from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .prefetch import Prefetch
from .windows import as_batch

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

Batch = tuple["torch.Tensor", "torch.Tensor"]
Encode = Callable[[str], np.ndarray]  # a document's tokens, its separator included


def shard_stream(dataset: Any, shard: int, num_shards: int) -> Any:
    """Data shard `shard` of `num_shards` of an iterable dataset."""
    from datasets.distributed import split_dataset_by_node

    if dataset.num_shards % num_shards:
        log.warning(
            "the stream has %d files, not a multiple of %d data shards: every shard reads every item and keeps "
            "its own (datasets' fallback); a multiple of the shard count reads each file once",
            dataset.num_shards,
            num_shards,
        )
    return split_dataset_by_node(dataset, rank=shard, world_size=num_shards)


def can_resume(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class StreamBatches(Iterator[Batch]):
    """Batches of `batch_size` × `context` from a shard's stream, from `state` (a previous
    `state()`, or None for the stream's start); `state()["items"]` counts the items read
    since the stream's start."""

    def __init__(
        self, dataset: Any, column: str, encode: Encode, context: int, batch_size: int, state: dict | None = None
    ) -> None:
        self.dataset, self.column, self.encode = dataset, column, encode
        self.need = batch_size * (context + 1)
        self.shape = (batch_size, context + 1)
        self.resumable = can_resume(dataset)
        self.carry = np.zeros(0, dtype=np.int64)
        self.items = 0
        self.saved: dict | None = None
        if state is not None:
            if state["dataset"] is not None:  # None: saved before its first batch
                dataset.load_state_dict(state["dataset"])
            self.carry = np.asarray(state["carry"], dtype=np.int64)
            self.items = int(state["items"])
            self.saved = state["dataset"]
        self._rows = iter(dataset)

    def __next__(self) -> Batch:
        parts, held = [self.carry], len(self.carry)
        while held < self.need:
            row = next(self._rows)  # StopIteration: the stream ran out
            self.items += 1
            text = row[self.column]
            if isinstance(text, str) and text:
                tokens = self.encode(text).astype(np.int64)
                parts.append(tokens)
                held += len(tokens)
        buf = np.concatenate(parts)
        self.carry = buf[self.need :]
        if self.resumable:
            self.saved = self.dataset.state_dict()
        return as_batch(buf[: self.need].reshape(self.shape))

    def state(self) -> dict | None:
        """Where this stream stands after its last batch (None: the source cannot resume)."""
        if not self.resumable:
            return None
        return {"dataset": self.saved, "carry": self.carry.tolist(), "items": self.items}


class ReadAhead(Iterator[Batch]):
    """A stream's next batches read, tokenised and packed on a background thread, each
    with the stream's state after it: `state()` is the state after the last batch taken,
    not after what was read ahead."""

    def __init__(self, stream: StreamBatches, depth: int = 4) -> None:
        self._state = stream.state()
        self._ahead = Prefetch(lambda _: (next(stream), stream.state()), 0, depth)

    def __next__(self) -> Batch:
        batch, self._state = next(self._ahead)
        return batch

    def state(self) -> dict | None:
        return self._state
