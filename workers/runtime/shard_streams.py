"""An island's data streams: one per data shard it has read, each where it stands, so the
next order that continues a shard reads on without seeking; a shard given at another
position is opened there (a streamed task from the state the coordinator kept for it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..tasks.task import ResumableTask, Task
from ..wire.messages import WorkOrder


class ShardStreams:
    def __init__(self, task: Task, num_shards: int, seed: int) -> None:
        self.task, self.num_shards, self.seed = task, num_shards, seed
        self.open: dict[int, tuple[int, Any]] = {}  # shard -> (position, iterator at that position)

    def position(self, shard: int) -> int:
        return self.open.get(shard, (0, None))[0]

    def batches(self, order: WorkOrder) -> Iterator[tuple[int, Any]]:
        """The order's batches: step j reads shard `sorted(shards)[(turn + j) % n]`, each
        shard from the position the coordinator's ledger gives (re-seeking only when the
        stream held for it stands elsewhere)."""
        shards = sorted(order.shards)
        at = dict(order.shards)
        for j in range(order.steps):
            shard = shards[(order.turn + j) % len(shards)]
            held = self.open.get(shard)
            if held is not None and held[0] == at[shard]:
                pos, stream = held
            else:
                pos = at[shard]
                stream = self._open(shard, pos, order.streams.get(shard))
            batch = next(stream)
            self.open[shard] = (pos + 1, stream)
            at[shard] = pos + 1
            yield shard, batch

    def _open(self, shard: int, pos: int, saved: tuple[int, Any] | None) -> Iterator[Any]:
        """Shard `shard` at batch `pos`: a streamed task continues from the state its stream
        saved at `saved[0]` ≤ `pos` (reading the few batches between), any other seeks."""
        if saved is not None and isinstance(self.task, ResumableTask) and saved[0] <= pos:
            at, state = saved
            stream = self.task.resume_batches(shard, self.num_shards, self.seed, at, state)
            for _ in range(pos - at):
                next(stream)
            return stream
        return self.task.train_batches(shard, self.num_shards, self.seed, pos)

    def close(self) -> None:
        """Stop every open stream (a read-ahead thread ends with its stream)."""
        for _, stream in self.open.values():
            if callable(getattr(stream, "close", None)):
                stream.close()
        self.open.clear()

    def states(self, shards: dict[int, int]) -> dict[int, Any]:
        """The saved state of each stream of `shards` that can save one, where it stands."""
        out = {}
        for shard in shards:
            stream = self.open.get(shard, (0, None))[1]
            state = stream.state() if callable(getattr(stream, "state", None)) else None
            if state is not None:
                out[shard] = state
        return out
