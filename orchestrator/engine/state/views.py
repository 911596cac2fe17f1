"""What a run shows of itself to the outside, typed: the run's status, an island's view, a
round's record, an event and the summary (the control plane's response models, checked
against what the engine produces), and the metrics every exporter publishes (the control
plane's `/metrics` and Ray's metrics pipeline alike), each named once here with the key
it reads."""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from ..types import Event, IslandState, Merge, Phase, RunPhase


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CoordinatorState(str, Enum):
    """The coordinator as the Ray handle reports it in `RunStatus` (unanswered reads show the
    last answer seen)."""

    RUNNING = "running"
    RESTARTING = "restarting"  # Ray is restarting it
    SLOW = "slow"  # alive but it did not answer a read in time (starting, or a loaded host)


class RunStatus(_View):
    """`GET /v1/run`. Before training begins only `state`, `round` and `rounds` are known."""

    state: RunPhase
    phase: Phase = Phase.MAIN
    round: int
    rounds: int
    mode: str | None = None
    run_id: str | None = None
    version: int = 0
    eval_loss: float | None = None
    initial_eval_loss: float | None = None
    tokens: int = 0
    tokens_per_s: float = 0.0
    bytes_communicated: int = 0
    islands_alive: int = 0
    wall_seconds: float | None = None
    round_seconds: float | None = None
    target_islands: int | None = None
    pending_islands: list[int] = []
    inner_steps: int | None = None
    outer_lr: float | None = None
    hang_after_steps: float | None = None  # heartbeats' live threshold (null: none)
    quorum: int | None = None  # async quorum rule: its live settings (absent under other rules)
    grace_cap: float | None = None
    grace_k: float | None = None
    age_power: float | None = None
    paused: bool = False
    stopping: bool = False
    disk_errors: int = 0
    last_disk_error: str | None = None
    coordinator: CoordinatorState | None = None  # set by the Ray handle
    histograms: dict[str, HistogramView] = {}  # `HISTOGRAMS`' keys: round seconds, update staleness

    def as_dict(self) -> dict[str, Any]:
        """What crosses to the control plane and the progress line: plain values, the keys set
        (a rule's own settings only under that rule; before training, what is known)."""
        return self.model_dump(mode="json", exclude_unset=True)


class HistogramView(_View):
    """Observations per bucket (`counts` has one more entry than `bounds`: +Inf) and their sum."""

    bounds: list[float]
    counts: list[int]
    sum: float


class IslandRecord(_View):
    """What the run keeps of an island, declared once: the engine's live record of it
    (`IslandStats`, `engine/state/membership.py`) and every view of it (`IslandView`) are
    this record, so a view is the engine's record validated where it is made."""

    node: str = ""
    rounds_contributed: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    last_train_loss: float | None = None
    rejections: int = 0
    downweighted: int = 0  # stale submissions applied with a reduced weight (async)
    late_results: int = 0
    error: str | None = None
    joined_version: int = 0  # global version when it joined (0: from the start)
    last_contribution: float | None = None  # wall-clock time of its last applied update
    # wall-clock time of its latest news: placed, given work, a result back (taken, late or
    # refused). A hung island's stops moving: the dashboard and the alert rules watch it.
    last_progress: float | None = None
    inner_steps: int = 0  # H of its latest round (DyLU changes it in async mode)
    steps_per_s: float = 0.0  # measured (smoothed) inner steps per second
    staleness_last: int = 0
    staleness_max: int = 0
    staleness_total: int = 0
    submissions: int = 0
    merge: Merge | None = None  # where its latest work stands against the outer step
    inner_state: str | None = None  # its newest saved inner state (a resumed run's island continues from it)
    inner_state_sha256: str | None = None


class IslandView(IslandRecord):
    """One island of `GET /v1/islands` (and of `summary.json`'s `islands`): its record and
    what is derived from it."""

    state: IslandState
    id: int | None = None  # the control plane's list carries it
    index: int | None = None
    resources: dict[str, float] | None = None  # what the island holds (set by the coordinator actor)
    # set by the exporters when they answer (`engine/fleet/watch.py`): whether it has work out,
    # seconds since its news and its last update, and whether that silence is a hang
    working: bool = False
    progress_age_s: float | None = None
    contribution_age_s: float | None = None
    stuck_after_s: float | None = None
    stuck: bool = False
    staleness_mean: float = 0.0
    staleness_recent_max: int = 0
    staleness_recent_mean: float = 0.0
    tokens_per_s: float = 0.0
    idle_fraction: float | None = None  # in the summary: the share of the run it was not computing


class RoundRecord(_View):
    """One line of `metrics.jsonl` (and of `GET /v1/run/history`): made by the engine's
    accounting (`RunStats.record`), completed by its evaluation, written, and handed to the
    exporters as this record; its keys are those set (a mode's own, such as `gap_penalty`,
    only where it has them)."""

    round: int
    version: int  # global version after the round's step
    mode: str | None = None
    time: float | None = None
    eval_loss: float | None = None
    eval_metrics: dict[str, float] | None = None  # the task's own (`MetricTask`), when it evaluated
    train_loss: float | None = None
    island_train_loss: dict[str, float] = {}
    contributed: list[int] = []
    rejected: dict[str, str] = {}
    dropped: list[int] = []
    staleness: int = 0
    staleness_updates: list[int] = []
    island_staleness: dict[str, int] = {}  # per island that sent results: the most versions they were behind
    inner_steps: dict[str, int] = {}
    gap_penalty: float | None = None  # overlap with an adaptive penalty: CO2's Λ of the step
    tokens: int = 0
    tokens_total: int = 0
    tokens_applied_total: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    round_seconds: float | None = None
    coordinator_seconds: dict[str, float] = {}  # the round's seconds per part of the coordinator's loop (`Part`)
    wall_seconds: float | None = None
    train_seconds: float | None = None
    tokens_per_s: float = 0.0
    lr: float | None = None
    islands_alive: int = 0
    island_idle_fraction: dict[str, float] = {}
    island_compute_seconds: dict[str, float] = {}  # so far: what a round's computation took is a difference
    clock_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The line's keys and values (those set), as `metrics.jsonl` holds them."""
        return self.model_dump(exclude_unset=True)


class EventRecord(BaseModel):
    """One line of `events.jsonl` (and of `GET /v1/events`): its details depend on its kind.
    Made by the engine's event log (`EventLog.add`), served and handed to the trackers as this
    record."""

    model_config = ConfigDict(extra="allow")
    time: float
    kind: Event
    island: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The line's keys and values: time, kind, island, then its details."""
        return self.model_dump()


class RetiredView(_View):
    """Released islands folded into totals (a run lists its newest 64 released islands)."""

    islands: int
    last_index: int
    rounds_contributed: int
    tokens: int
    compute_s: float
    bytes_sent: int
    bytes_received: int
    rejections: int
    downweighted: int
    late_results: int
    submissions: int
    staleness_total: int
    staleness_max: int


class StalenessView(_View):
    """Versions the run's judged updates were behind: their mean and the most."""

    mean: float
    max: int


class Summary(_View):
    """`summary.json`: the keys scripts and dashboards rely on. Made by the engine at the
    end of a phase (`Outputs.summarise`) as this record, then written and returned as plain
    values (`as_dict`: the keys set; the driver adds its start-up figures)."""

    mode: str
    state: RunPhase
    phase: Phase | None = None  # set when a run ended in its warm start
    rounds: int
    rounds_done: int
    inner_steps: int
    initial_eval_loss: float | None
    final_eval_loss: float | None
    tokens: int
    tokens_applied: int
    outer_steps: int
    bytes_sent: int
    bytes_received: int
    bytes_communicated: int
    peak_exchange_bytes: int
    bytes_bootstrap: int
    fragments: dict[str, dict[str, int]] | None
    wall_seconds: float
    train_seconds: float
    coordinator_seconds: dict[str, float] = {}  # per part of the coordinator's loop, since training (re)started
    tokens_per_s: float
    compute_seconds: float
    useful_compute_seconds: float = 0.0  # island-seconds of work whose update reached the model
    idle_fraction: float
    num_params: int
    islands: dict[str, IslandView]  # the live islands and the newest released ones
    retired_islands: RetiredView | None = None  # the totals of released islands no longer listed
    shards: dict[str, list[int]]
    staleness: StalenessView
    out_dir: str
    clock_seconds: float
    init_from: dict[str, str] | None
    warm_start: dict[str, Any] | None
    final_params_digest: str | None = None  # XXH3-128 of the final global parameters (None: sliced on Ray)
    export: str | None = None
    export_error: str | None = None  # the export's library refused it (the run's own outputs stand)
    eval_metrics: dict[str, float] | None = None  # the task's own metrics at the final evaluation
    # where start-up went (`engine/outputs/startup.py`): seconds per part, epoch times of the first steps
    startup: dict[str, Any] | None = None
    startup_seconds: float | None = None  # the command's start to the first inner step (set by the driver)
    first_outer_step_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class MetricKind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"  # named `_total`: cumulative, only reset by a restarted coordinator
    HISTOGRAM = "histogram"


class Metric(NamedTuple):
    name: str  # units in the name (`_seconds`, `_bytes`); a counter's ends in `_total`
    key: str  # what it reads: a key of the status (run), of an island's view, or of `histograms`
    help: str
    kind: MetricKind


G, C, H = MetricKind.GAUGE, MetricKind.COUNTER, MetricKind.HISTOGRAM
RUN_METRICS = [
    Metric("archipelago_model_version", "version", "Global model version (outer steps applied)", G),
    Metric("archipelago_rounds_completed_total", "round", "Rounds completed", C),
    Metric("archipelago_eval_loss", "eval_loss", "Latest eval loss of the global model", G),
    Metric("archipelago_tokens_total", "tokens", "Tokens trained by all islands", C),
    Metric("archipelago_bytes_total", "bytes_communicated", "Bytes sent plus received by all islands", C),
    Metric("archipelago_tokens_per_second", "tokens_per_s", "Training throughput", G),
    Metric("archipelago_islands_alive", "islands_alive", "Islands alive", G),
    Metric("archipelago_islands_target", "target_islands", "Target island count", G),
    Metric("archipelago_round_seconds", "round_seconds", "Duration of the latest round", G),
    Metric("archipelago_disk_errors_total", "disk_errors", "Writes the disk refused (the run went on)", C),
]
HISTOGRAMS = [
    Metric("archipelago_round_duration_seconds", "round_seconds", "Duration of each round", H),
    Metric("archipelago_update_staleness_versions", "staleness", "Versions each judged update was behind", H),
]
ISLAND_METRICS = [  # labelled run_id and island only: an island's state is `ISLAND_STATE`'s
    Metric(
        "archipelago_island_staleness_versions",
        "staleness_last",
        "Versions behind of the island's latest submission",
        G,
    ),
    Metric(
        "archipelago_island_max_staleness_versions",
        "staleness_max",
        "Most versions behind of any of the island's submissions",
        G,
    ),
    Metric("archipelago_island_train_loss", "last_train_loss", "Island's latest mean train loss", G),
    Metric("archipelago_island_tokens_total", "tokens", "Tokens the island trained", C),
    Metric("archipelago_island_bytes_sent_total", "bytes_sent", "Bytes the island sent", C),
    Metric("archipelago_island_bytes_received_total", "bytes_received", "Bytes the island received", C),
    Metric("archipelago_island_rejections_total", "rejections", "Island submissions rejected", C),
    Metric("archipelago_island_inner_steps_per_round", "inner_steps", "H of the island's latest round", G),
    Metric("archipelago_island_steps_per_second", "steps_per_s", "Measured inner steps per second", G),
    Metric("archipelago_island_compute_seconds_total", "compute_s", "Seconds the island spent computing", C),
    Metric("archipelago_island_tokens_per_second", "tokens_per_s", "Island tokens per second of compute", G),
    Metric(
        "archipelago_island_last_contribution_timestamp_seconds",
        "last_contribution",
        "Unix time of the island's last applied update",
        G,
    ),
    Metric(
        "archipelago_island_last_progress_timestamp_seconds",
        "last_progress",
        "Unix time of the island's latest news: placed, given work, a result back",
        G,
    ),
    Metric(
        "archipelago_island_stuck_after_seconds",
        "stuck_after_s",
        "Silence after which the island counts as stuck (engine/fleet/watch.py)",
        G,
    ),
    Metric("archipelago_island_working", "working", "1 while the island has work out, else 0", G),
]
# a state set: one series per state, 1 for the island's state, so no series changes a label
ISLAND_STATE = Metric("archipelago_island_state", "state", "1 for the island's current state, else 0", G)


def current(islands: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Islands still in the run: a released island's series end (a run with many
    replacements would otherwise grow its series without bound)."""
    return {i: s for i, s in islands.items() if not IslandState(s.get("state", "starting")).gone}
