"""How an island steps through a work order: what it read and trained, as its result
reports it (`Tally`), and the last τ steps of a streaming order, trained after the
order's result has left (`Tail`).

Streaming DiLoCo takes a fragment's pseudo-gradient τ steps before its segment ends so
that the exchange (the upload, the coordinator's outer step, the download of the merged
fragment) hides behind those τ steps. An island that trained them before answering would
serialise the exchange after them instead: its result would leave only at the segment's
end, and the island would wait for the next order with nothing to do. So the island
answers at the send point and trains the tail in a thread of its own process while the
coordinator steps; the next order waits for the tail before it touches the model. The
steps, their batches and their order are the ones the island would have taken inline,
so the numbers are the same either way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Tail:
    """Trains `batches` with `step` in a daemon thread; `wait` joins it and raises what
    it raised (the next order then fails as that island's, as an inline step would)."""

    def __init__(self, step: Callable[[Any], object], batches: list[Any]) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._train, args=(step, batches), daemon=True, name="streaming-tail")
        self._thread.start()

    def _train(self, step: Callable[[Any], object], batches: list[Any]) -> None:
        try:
            for batch in batches:
                step(batch)
        except BaseException as err:  # handed to the next order's thread, which fails with it
            self.error = err

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


@dataclass(kw_only=True)
class Tally:
    """What an order read and trained, as its result reports it: the shards' positions
    after every batch read, the tokens per shard, and the losses of the steps taken."""

    positions: dict[int, int]
    shard_tokens: dict[int, int]
    losses: Any = 0.0  # a float, or a device tensor summed without reading it back per step
    steps: int = 0

    @property
    def weight(self) -> int:
        return sum(self.shard_tokens.values())

    def read(self, shard: int, weight: int) -> None:
        self.positions[shard] += 1
        self.shard_tokens[shard] += weight

    def trained(self, shard: int, loss: Any, weight: int) -> None:
        self.read(shard, weight)
        self.losses = self.losses + loss
        self.steps += 1
