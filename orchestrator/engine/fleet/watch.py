"""Is an island stuck? What the exporters add to an island's view when they answer:
seconds since its last news (placed, given work, a result back) and its last applied update, and whether that silence
is long past what its work takes. A hung island holds its resources (and, in synchronous
modes, the round) until `elastic.late_grace_s` releases it; an operator watching the
dashboard should see it long before that, within one poll of opening the page.

The rule: an island with work out and no news for `STUCK_ROUNDS` times its own round of
work, and never less than `STUCK_FLOOR_S` (a fast island's round would make an evaluation
look like a hang). The alert rule `ArchipelagoIslandStuck` (`k8s/monitoring/prometheusrule.yaml`)
applies it in PromQL to the exported `working`, `last_progress` and `stuck_after_s`, since
a hung synchronous run publishes nothing new through Ray's metrics."""

from __future__ import annotations

from typing import Any

from ..types import IslandState, Merge

STUCK_ROUNDS = 5
STUCK_FLOOR_S = 30.0
UNMEASURED_WORK_S = 60.0  # an island's round of work before it has reported a speed


def stuck_after_s(island: dict[str, Any]) -> float:
    """Seconds of silence after which `island` counts as stuck: its round of work
    (H over its measured steps per second) times `STUCK_ROUNDS`."""
    steps, speed = island.get("inner_steps") or 0, island.get("steps_per_s") or 0.0
    work = steps / speed if steps > 0 and speed > 0 else UNMEASURED_WORK_S
    return max(STUCK_FLOOR_S, STUCK_ROUNDS * work)


def watched(island: dict[str, Any], now: float) -> dict[str, Any]:
    """`island`'s view with its ages (from the wall-clock times it carries) and its verdict.
    Only an island with work out can be stuck: one waiting for its outer step, idle in a
    paused run or released has nothing to report."""
    progress, contribution = island.get("last_progress"), island.get("last_contribution")
    progress_age = None if progress is None else max(0.0, now - progress)
    after = stuck_after_s(island)
    state = IslandState(island.get("state", IslandState.STARTING.value))
    working = state.alive and island.get("merge") == Merge.TRAINING.value
    return {
        **island,
        "working": working,
        "progress_age_s": progress_age,
        "contribution_age_s": None if contribution is None else max(0.0, now - contribution),
        "stuck_after_s": after,
        "stuck": working and progress_age is not None and progress_age > after,
    }
