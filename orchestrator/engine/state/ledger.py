"""The data ledger: which batches of which shard have been handed out and trained, so
every batch is trained exactly once into the run whatever the membership and the pacing
do. Pure logic.

The data is cut into a fixed number of shards when the run starts. Islands own
contiguous blocks of shards (a non-iid split keeps each island on related data); the
blocks are recomputed from the sorted ids of the islands that can train. The rules:

- a shard's position advances when its island is *given* the work (`reserve`), by
  exactly the batches the work order will read (`archipelago.workers.wire.messages.batch_counts`);
- a reserved shard belongs to that one island until the work resolves: it is never
  handed to another island meanwhile, even if the blocks moved (the same island may
  hold two reservations of it: in overlap mode round t waits for its close while
  round t+1 trains on the next batches);
- a work stopped by a preemption notice sends the first k of its batches: its
  reservation is `shorten`ed to them (what `batch_counts` gives k steps) and the rest go
  back, as a lost work's would;
- a result that arrives is `check`ed (the island read exactly what it was given); when
  the outer step consumes it (applied or dropped) it is `commit`ted and its tokens
  count as trained; work that is lost (island died, deadline missed, run stopped, or
  its update rejected while no later work holds its shards) is `rollback`ed: its shards go back to where it started and the next owner
  trains them, once. A checkpoint keeps only committed work (`state`).

So Σ over shards of tokens = tokens trained, and no batch index is committed twice (the
ledger checks both on every commit and raises `LedgerError` rather than miscount).

A streamed source cannot seek, so with each committed position the ledger keeps the
stream's saved state there (what the island reported) and hands it with the shard's next
work: the next owner, after a move or a coordinator restart, continues from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from archipelago.workers.wire.messages import batch_counts

from ..types import LedgerError

MAX_STREAM_STATE = 1 << 20  # bytes of JSON: a stream's state is a few numbers and a partial batch


def assign(shards: int, islands: list[int]) -> dict[int, list[int]]:
    """Contiguous blocks of shards for each island (sorted ids), as even as possible."""
    if not islands:
        return {}
    order = sorted(islands)
    out: dict[int, list[int]] = {i: [] for i in order}
    for s in range(shards):
        out[order[s * len(order) // shards]].append(s)
    return out


@dataclass(frozen=True)
class Reservation:
    island: int
    spans: dict[int, tuple[int, int]]  # shard -> (start, batches)
    turn: int

    @property
    def starts(self) -> dict[int, int]:
        return {s: start for s, (start, _) in self.spans.items()}


class DataLedger:
    def __init__(self, shards: int) -> None:
        if shards < 1:
            raise ValueError(f"need at least one data shard, got {shards}")
        self.shards = shards
        self.position = [0] * shards  # batches handed out (in flight or trained), per shard
        self.tokens = [0] * shards  # tokens trained, per shard
        self.turns: dict[int, int] = {}  # island -> round-robin offset over its shards
        self.flights: dict[int, Reservation] = {}  # ticket -> reservation
        self.streams: dict[int, tuple[int, Any]] = {}  # shard -> (committed position, its stream's state there)

    def busy_shards(self, except_island: int | None = None) -> set[int]:
        return {s for r in self.flights.values() if r.island != except_island for s in r.spans}

    def reserve(self, ticket: int, island: int, islands: list[int], steps: int) -> Reservation | None:
        """Hand `island` its shards for `steps` batches and advance their positions; None
        when it has no free shard (more islands than shards, or its shards are still in
        flight with an island that held them before the blocks moved)."""
        busy = self.busy_shards(except_island=island)
        own = [s for s in assign(self.shards, islands).get(island, []) if s not in busy]
        if not own:
            return None
        turn = self.turns.get(island, 0)
        counts = batch_counts(own, turn, steps)
        spans = {s: (self.position[s], counts[s]) for s in own}
        for s, n in counts.items():
            self.position[s] += n
        self.turns[island] = turn + steps
        reservation = Reservation(island, spans, turn)
        self.flights[ticket] = reservation
        return reservation

    def check(
        self, ticket: int, positions: dict[int, int], tokens: dict[int, int], states: dict[int, Any] | None = None
    ) -> str | None:
        """A result arrived: what is wrong with what the island says it read (exactly the
        batches it was given) and trained (tokens only on its own shards), or None. An
        island's report is input, not truth: a wrong one is refused, never committed."""
        reservation = self.flights.get(ticket)
        if reservation is None:
            raise LedgerError(f"ticket {ticket} is not in flight")
        try:
            for s, (start, n) in reservation.spans.items():
                got = int(positions.get(s, start))
                if got != start + n:
                    return f"shard {s}: read up to batch {got}, was given [{start}, {start + n})"
            stray = {int(s) for s in tokens} - set(reservation.spans)
            if stray:
                return f"tokens reported on shards {sorted(stray)} it was not given"
            if any(int(t) < 0 for t in tokens.values()):
                return "negative token counts"
            if not isinstance(states, (dict, type(None))):
                return f"stream states as a {type(states).__name__}, not a mapping"
            for s, state in (states or {}).items():
                if s not in reservation.spans:
                    return f"a stream state for shard {s} it was not given"
                if not isinstance(state, dict) or len(json.dumps(state)) > MAX_STREAM_STATE:
                    return f"shard {s}: its stream state is not a JSON object under {MAX_STREAM_STATE} bytes"
        except (TypeError, ValueError) as err:
            return f"malformed report ({err})"
        return None

    def commit(self, ticket: int, tokens: dict[int, int], states: dict[int, Any] | None = None) -> None:
        """The outer step consumed the result: its tokens count as trained, and its
        streams' states are where those shards now resume."""
        reservation = self.flights.pop(ticket, None)
        if reservation is None:
            raise LedgerError(f"ticket {ticket} is not in flight")
        for s, t in tokens.items():
            self.tokens[int(s)] += int(t)
        for s, state in (states or {}).items():
            start, n = reservation.spans[s]
            if self.streams.get(s, (-1, None))[0] < start + n:
                self.streams[s] = (start + n, state)

    def resume_points(self, shards: dict[int, int]) -> dict[int, tuple[int, Any]]:
        """The saved stream states at or before each of `shards`' start positions."""
        return {s: self.streams[s] for s, at in shards.items() if s in self.streams and self.streams[s][0] <= at}

    def shorten(self, ticket: int, steps: int) -> dict[int, tuple[int, int]] | None:
        """A stopped work trained only its first `steps` steps: its reservation keeps their
        batches and the rest go back (returned: shard -> (start, batches) given back). None
        if it cannot shrink: not in flight, not its shards' newest reservation (a later one
        continues from its end), or not shorter."""
        reservation = self.flights.get(ticket)
        total = sum(n for _, n in reservation.spans.values()) if reservation is not None else 0
        if reservation is None or not 0 <= steps < total or not self.newest(ticket):
            return None
        kept = batch_counts(list(reservation.spans), reservation.turn, steps)
        back = {s: (start + kept[s], n - kept[s]) for s, (start, n) in reservation.spans.items() if n > kept[s]}
        for s, (start, _) in reservation.spans.items():
            self.position[s] = start + kept[s]
        if self.turns.get(reservation.island) == reservation.turn + total:  # its last: the round-robin goes on from k
            self.turns[reservation.island] = reservation.turn + steps
        spans = {s: (start, kept[s]) for s, (start, _) in reservation.spans.items()}
        self.flights[ticket] = Reservation(reservation.island, spans, reservation.turn)
        return back

    def newest(self, ticket: int) -> bool:
        """Whether no later reservation continues any of this one's shards (so it can be
        rolled back)."""
        reservation = self.flights.get(ticket)
        return reservation is not None and all(
            self.position[s] == start + n for s, (start, n) in reservation.spans.items()
        )

    def rollback(self, ticket: int) -> Reservation | None:
        """The work is lost: its shards go back to where it started (they were never
        handed to another island; roll back an island's later reservation first)."""
        reservation = self.flights.pop(ticket, None)
        if reservation is None:
            return None
        for s, (start, n) in reservation.spans.items():
            if self.position[s] != start + n:
                raise LedgerError(f"shard {s} moved past a lost reservation ({self.position[s]} != {start + n})")
            self.position[s] = start
        return reservation

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: committed work only (a restarted coordinator redoes the rest)."""
        position = list(self.position)
        for r in self.flights.values():
            for s, (start, _) in r.spans.items():
                position[s] = min(position[s], start)
        return {
            "shards": self.shards,
            "position": position,
            "tokens": list(self.tokens),
            "turns": {str(i): t for i, t in self.turns.items()},
            "streams": {str(s): [at, st] for s, (at, st) in self.streams.items() if at <= position[s]},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shards, self.position, self.tokens = state["shards"], list(state["position"]), list(state["tokens"])
        self.turns = {int(i): int(t) for i, t in state.get("turns", {}).items()}
        self.streams = {int(s): (int(at), st) for s, (at, st) in state.get("streams", {}).items()}
        self.flights = {}
