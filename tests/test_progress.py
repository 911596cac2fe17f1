"""The progress line's ETA: from the pace of the rounds this process saw, per phase."""

from __future__ import annotations

from archipelago.orchestrator.runtime.progress import Eta, format_progress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_eta_follows_the_pace_of_the_rounds_seen_and_restarts_with_each_phase():
    clock = Clock()
    eta = Eta(clock)
    assert eta.update({"phase": "warm_start", "round": 0, "rounds": 2}) is None
    clock.t = 30
    assert eta.update({"phase": "warm_start", "round": 1, "rounds": 2}) == 30
    clock.t = 40  # the run's phase: its own pace, not the warm start's
    assert eta.update({"phase": "training", "round": 0, "rounds": 8}) is None
    clock.t = 50
    assert eta.update({"phase": "training", "round": 1, "rounds": 8}) == 70
    clock.t = 70
    assert eta.update({"phase": "training", "round": 2, "rounds": 8}) == 90  # 15 s a round, 6 to go
    clock.t = 160
    assert eta.update({"phase": "training", "round": 8, "rounds": 8}) is None  # done: no ETA


def test_a_resumed_run_is_timed_from_its_own_rounds():
    clock = Clock()
    eta = Eta(clock)
    assert eta.update({"round": 50, "rounds": 60}) is None  # 50 rounds done before this process
    clock.t = 4
    assert eta.update({"round": 52, "rounds": 60}) == 16


def test_the_line_carries_the_eta_only_when_there_is_one():
    p = {"round": 2, "rounds": 8, "eval_loss": 2.0, "tokens_per_s": 100, "islands_alive": 4, "wall_seconds": 30}
    assert format_progress(p).endswith("islands 4  30s")
    assert format_progress(p, 90).endswith("islands 4  30s  ETA 1m30s")
    assert format_progress(p, 7300).endswith("ETA 2h01m")
