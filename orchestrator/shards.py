"""Data accounting across membership changes (pure logic).

The training data is cut into a fixed number of shards when the run starts. Islands own
contiguous blocks of shards (so a non-iid split keeps each island on related data), and
when islands join, drain or die the blocks are recomputed deterministically from the
sorted ids of the islands that remain. The coordinator is the source of truth for each
shard's position (batches consumed): an island is told where to start on every round,
and positions advance only when a result comes back — so no batch is trained twice
into the model and none is skipped, whatever the membership does. A result lost with a
crashed island leaves its shards where they were, and the next owner trains them.
"""
from __future__ import annotations

from typing import Any


def assign(shards: int, islands: list[int]) -> dict[int, list[int]]:
    """Contiguous blocks of shards for each island (sorted ids), as even as possible."""
    if not islands:
        return {}
    order = sorted(islands)
    out: dict[int, list[int]] = {i: [] for i in order}
    for s in range(shards):
        out[order[s * len(order) // shards]].append(s)
    return out


class ShardBook:
    def __init__(self, shards: int) -> None:
        if shards < 1:
            raise ValueError(f"need at least one data shard, got {shards}")
        self.shards = shards
        self.position = [0] * shards   # batches consumed, per shard
        self.tokens = [0] * shards     # tokens consumed, per shard

    def assignment(self, island: int, islands: list[int]) -> dict[int, int]:
        """{shard: start position} for `island` among the current `islands`."""
        return {s: self.position[s] for s in assign(self.shards, islands).get(island, [])}

    def commit(self, positions: dict[int, int], tokens: dict[int, int]) -> None:
        """Advance shards by what a returned result consumed."""
        for s, p in positions.items():
            self.position[int(s)] = max(self.position[int(s)], int(p))
        for s, t in tokens.items():
            self.tokens[int(s)] += int(t)

    def state(self) -> dict[str, Any]:
        return {"shards": self.shards, "position": list(self.position), "tokens": list(self.tokens)}

    def load(self, state: dict[str, Any]) -> None:
        self.shards, self.position, self.tokens = state["shards"], list(state["position"]), list(state["tokens"])
