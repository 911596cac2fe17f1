"""The two rules that judge work in flight by its pace: the tail stop (which works to stop
at the budget's end, so idle islands train their rest) and hang detection (which island
has stopped making progress). Policies like the fleet's scaling and failure policies:
they read the flights, the islands' speeds and the clock, and return decisions; the
ledger of flights (`inflight.py`) carries them out, and the composition root
(`build.assemble`) builds them from the config."""

from __future__ import annotations

from dataclasses import dataclass

from archipelago.workers.wire.messages import WorkKind

from ...config_operations import ElasticConfig
from ..state.flights import Flight


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """Stop this work: its `left` steps would take `keep_s` more where it is, `instead_s`
    on the idle islands."""

    flight: Flight
    left: int
    keep_s: float
    instead_s: float


class TailStop:
    """`elastic.tail_stop`: at the budget's end, stop a work when its remaining steps, at
    the pace its heartbeats report, take more than `factor` × as long as the idle islands
    would take to train them (and the rest of every work stopped before it)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def decide(self, flights: list[Flight], rate: float, trip_s: float, now: float) -> list[Straggler]:
        """`rate`: the idle islands' steps per second together; `trip_s`: their typical time
        off their steps (download, upload, waits). A work's pace is counted between its
        first read with a step and its latest (not from when it was handed out, which would
        count its download, a first step compiling, as slowness), read as fast as the whole
        counts allow; one with no pace yet, or none left to take, is left alone. The
        furthest behind is looked at first; a work about to end is left to end, and so is
        one the idle islands could not finish much sooner (few idle islands, many works out)."""
        if not rate:
            return []
        candidates = []
        for flight in flights:
            done, first = flight.work_steps, flight.first_step
            if flight.stopping or flight.work.kind != WorkKind.TRAIN or first is None or done is None:
                continue
            if not first[1] < done < flight.work.steps or flight.heard_at <= first[0]:
                continue  # no pace yet (one read with steps), or all its steps taken
            # counts are whole steps taken: between the two reads it took more than
            # done − first − 1 steps and fewer than done − first + 1; each side is read at
            # its least favourable to a stop
            span, steps = flight.heard_at - first[0], done - first[1]
            left = flight.work.steps - done
            keep = max(0.0, left * span / (steps + 1) - (now - flight.heard_at))
            candidates.append((keep, span / steps, left, flight))
        out, moved = [], 0
        for keep, step_s, left, flight in sorted(candidates, key=lambda c: -c[0]):
            instead = step_s + trip_s + (moved + left) / rate
            if keep > self.factor * instead:
                moved += left
                out.append(Straggler(flight=flight, left=left, keep_s=keep, instead_s=instead))
        return out


# A card moving at least this many bytes a second carries a transfer. Ray's own traffic on an
# idle island's node (GCS heartbeats, resource reports, metrics) measured on the testbed
# (`archipelago testbed`): 6 KB/s out, under 1 KB/s in; this is 5x that, and a link slower
# than it (256 kbit/s) cannot keep a Ray node joined anyway.
MOVING_BYTES_PER_S = 32_768


class HangRule:
    """When an island is hung: its overdue result `elastic.late_grace_s` past its deadline,
    or — with heartbeats — its progress stalled past `elastic.stall_limit_s`. Progress is a
    step taken, or, before its first step and after its last, bytes moving on its card: a
    download or an upload longer than `elastic.hang_floor_s` is slow, not hung; a link cut
    or a frozen process moves nothing, and is found as before."""

    def __init__(self, elastic: ElasticConfig) -> None:
        self.elastic = elastic

    def overdue(self, now: float, deadline: float) -> str | None:
        """Why an island whose result was due at `deadline` is hung (None: not yet)."""
        grace = self.elastic.late_grace_s
        return (
            f"hung: no result {grace:g}s past its deadline (elastic.late_grace_s)" if now - deadline > grace else None
        )

    @staticmethod
    def moving(before: tuple[float, int] | None, at: float, card_bytes: int | None) -> bool:
        """Whether an island's card, read `card_bytes` at `at`, moved a transfer's bytes since
        `before` (when, bytes) — at least `MOVING_BYTES_PER_S` on average between the reads."""
        if before is None or card_bytes is None or at <= before[0]:
            return False
        return card_bytes - before[1] >= MOVING_BYTES_PER_S * (at - before[0])

    def stalled(self, flight: Flight, now: float, speed: float | None, hang_after_steps: float | None) -> str | None:
        """Why the island of `flight` is hung (None: it is not): a count taken past the limit
        that has not moved; or silence past the floor (a frozen process answers nothing). A
        coordinator that was busy reads old answers late, and those are not a stall."""
        limit = self.elastic.stall_limit_s(speed, hang_after_steps, stepping=flight.stepping)
        if limit is None:
            return None
        silence = self.elastic.stall_limit_s(speed, hang_after_steps, stepping=False) or limit
        if flight.heard_at - flight.progress_at > limit or now - flight.progress_at > max(limit, silence):
            return f"hung: no progress for {now - flight.progress_at:.0f}s (elastic.hang_after_steps)"
        return None
