"""The asynchronous pacings' shared part and the per-arrival pacing of Delayed Nesterov
and naive async (`mode: async`); the quorum pacing builds on the same budget
(`engine/pacing/quorum.py`)."""

from __future__ import annotations

from ...algorithms.dylu import SpeedTracker
from ..state.flights import Close, Flight, RunState, Work


def final_shares(wanted: dict[int, int], left: int) -> dict[int, int]:
    """The inner steps of islands starting together: what each `wanted`, or, when the
    budget has less `left` than that, the rest shared in proportion (at least one step
    each while any is left; the first islands take the rounding). Handing the whole rest
    to the first island would end the run on one island's pseudo-gradient, stepped as if
    it were a round's mean: with outer momentum that last step cost 2 % of eval loss in
    `bench hetero`."""
    total = sum(wanted.values())
    if total <= left:
        return wanted
    shares = {i: max(1, h * left // total) for i, h in wanted.items()}
    spare = left - sum(shares.values())
    for i in list(shares)[: max(0, spare)]:
        shares[i] += 1
    return shares


class TokenBudget:
    """What the asynchronous pacings share: the synchronous run's token budget (rounds ×
    islands × H inner steps) handed out as work of H_i steps (from the island's measured
    speed with DyLU), results queued until their step, and a round recorded each time
    islands × H steps have come back."""

    lag = 0  # work starts from the newest version
    islands_wait = False  # the other islands train while one's arrival is stepped

    def __init__(self, dylu: bool, speeds: SpeedTracker, islands: int, schedule_offset: int = 0) -> None:
        """`speeds` is the run's tracker, fed by the engine with every arrival;
        `schedule_offset` is where the run's inner schedule starts (after a warm start)."""
        self.dylu, self.k, self.offset = dylu, islands, schedule_offset
        self.speeds = speeds
        self.handed = 0  # inner steps handed out (in flight or back)
        self.queue: list[Flight] = []  # arrived, waiting for their step
        self.recorded = 0

    def budget(self, run: RunState) -> int:
        return run.rounds * self.k * run.inner_steps

    def wanted(self, run: RunState, island: int) -> int:
        """The inner steps `island`'s next work would have with budget to spare."""
        self.speeds.add(island)
        return self.speeds.steps(run.inner_steps)[island] if self.dylu else run.inner_steps

    def left(self, run: RunState) -> int:
        return self.budget(run) - self.handed

    def work(self, run: RunState, island: int, steps: int | None = None) -> Work | None:
        """Work for `island` from the newest version (`steps` inner steps, or what it
        `wanted`), or None once the budget is out."""
        h = min(self.wanted(run, island) if steps is None else steps, self.left(run))
        if h <= 0:
            return None
        self.handed += h
        return Work(island, run.closes + 1, run.version, h, schedule_step=self.offset + run.completed_steps // self.k)

    def hand(self, run: RunState, idle: list[int], waiting: set[int]) -> list[Work]:
        """Work for the `idle` islands but those whose result waits for its step (in the
        queue, or in `waiting`): what each wants, or, once the budget has less left than
        that, the rest shared among them (`final_shares`) — the steps a straggler stopped
        at the budget's end gives back go to every idle island, not the first."""
        waiting = waiting | {f.work.island for f in self.queue}
        out = []
        starting = [i for i in idle if i not in waiting]
        for i, steps in final_shares({i: self.wanted(run, i) for i in starting}, self.left(run)).items():
            work = self.work(run, i, steps)
            if work is None:
                break
            out.append(work)
        return out

    def cancel(self, work: Work) -> None:
        self.handed -= work.steps

    def arrived(self, flight: Flight) -> None:
        self.queue.append(flight)

    def lost(self, flight: Flight) -> None:
        self.handed -= flight.work.steps  # a lost island's steps go back to the budget

    def shortened(self, flight: Flight, steps: int) -> None:
        self.handed -= flight.work.steps - steps  # the steps a stopped work did not take

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        return None

    def closed(self, run: RunState, close: Close) -> list[int]:
        """Every round whose islands × H steps came back with this close: an arrival of
        more steps than a round's (DyLU's long work, churn) completes several, and each is
        recorded (and checkpointed when due) — returning only the last once skipped the
        others' records and checkpoints."""
        per_round = self.k * run.inner_steps
        due = run.rounds if self.done(run) else min(run.completed_steps // per_round, run.rounds)
        completed = list(range(self.recorded + 1, due + 1))
        self.recorded = max(self.recorded, due)
        return completed

    def between_rounds(self, in_flight: list[Flight]) -> bool:
        return True

    def done(self, run: RunState) -> bool:
        return run.completed_steps >= self.budget(run) and not self.queue

    def spent(self, run: RunState) -> bool:
        return self.left(run) <= 0 and not run.stopping

    def resume(self, run: RunState, recorded: int) -> None:
        """The checkpoint's records stand: a round recorded when results had arrived that
        its step had not yet taken (their steps not in the checkpoint's `completed_steps`)
        was recorded again after the restart, when they were retrained."""
        self.handed = run.completed_steps
        self.recorded = max(recorded, min(run.completed_steps // (self.k * run.inner_steps), run.rounds))

    def restart(self, run: RunState) -> None:
        self.queue = []  # their steps went back to the budget as they were lost


class PerArrival(TokenBudget):
    """`token_weighted`: each arrival's update is scaled by its inner steps over the mean
    H of the islands' current work, so N arrivals of unequal H (DyLU) accumulate in
    Delayed Nesterov's buffer in proportion to the tokens behind them, not equally."""

    def __init__(
        self, dylu: bool, speeds: SpeedTracker, islands: int, schedule_offset: int = 0, token_weighted: bool = False
    ) -> None:
        super().__init__(dylu, speeds, islands, schedule_offset)
        self.token_weighted = token_weighted

    def plan(self, run: RunState, idle: list[int]) -> list[Work]:
        # an island whose result is queued restarts from the step that merges it
        return [] if run.stopping else self.hand(run, idle, set())

    def spent(self, run: RunState) -> bool:
        """Never: a straggler stopped at the budget's end would send its prefix and the idle
        islands their shares of its rest, each its own outer step, and Delayed Nesterov
        stepped on those small late updates lost more than the seconds gained (`bench
        fleet`, 16 islands, seed 0: 331 → 324 simulated s, final loss 2.9274 → 2.9903)."""
        return False

    def next_close(self, run: RunState, in_flight: list[Flight]) -> Close | None:
        """A step per result, in the order they finish crossing their links."""
        ready = [f for f in self.queue if f.usable_at <= run.now]
        if not ready:
            return None
        flight = min(ready, key=lambda f: f.usable_at)
        self.queue.remove(flight)
        scale = 1.0
        if self.token_weighted:
            h = self.speeds.steps(run.inner_steps) if self.dylu else {}
            mean_h = sum(h.values()) / len(h) if h else run.inner_steps
            scale = flight.work.steps / mean_h
        return Close(run.closes + 1, [flight], expected=None, advances=False, scale=scale)

    def wake(self, run: RunState, in_flight: list[Flight]) -> float | None:
        return min((f.usable_at for f in self.queue), default=None)
