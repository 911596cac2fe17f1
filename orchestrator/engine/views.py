"""What a run shows of itself to the outside: the metrics every exporter publishes (the
control plane's `/metrics` and Ray's metrics pipeline alike), each named once here with
the status or island key it reads, and which islands still count as the run's."""

from __future__ import annotations

from typing import Any

from orchestrator.engine.types import IslandState

RUN_METRICS = [  # (metric, status key, help, type)
    ("archipelago_version", "version", "Global model version (outer steps applied)", "gauge"),
    ("archipelago_round", "round", "Rounds completed", "gauge"),
    ("archipelago_eval_loss", "eval_loss", "Latest eval loss of the global model", "gauge"),
    ("archipelago_tokens_total", "tokens", "Tokens trained by all islands", "counter"),
    ("archipelago_bytes_total", "bytes_communicated", "Bytes sent plus received by all islands", "counter"),
    ("archipelago_tokens_per_second", "tokens_per_s", "Training throughput", "gauge"),
    ("archipelago_islands_alive", "islands_alive", "Islands alive", "gauge"),
    ("archipelago_islands_target", "target_islands", "Target island count", "gauge"),
    ("archipelago_round_seconds", "round_seconds", "Duration of the latest round", "gauge"),
]
ISLAND_METRICS = [
    ("archipelago_island_staleness", "staleness_last", "Staleness of the island's latest submission", "gauge"),
    ("archipelago_island_staleness_max", "staleness_max", "Largest staleness of the island", "gauge"),
    ("archipelago_island_train_loss", "last_train_loss", "Island's latest mean train loss", "gauge"),
    ("archipelago_island_tokens_total", "tokens", "Tokens the island trained", "counter"),
    ("archipelago_island_bytes_sent_total", "bytes_sent", "Bytes the island sent", "counter"),
    ("archipelago_island_rejections_total", "rejections", "Island submissions rejected", "counter"),
    ("archipelago_island_inner_steps", "inner_steps", "H of the island's latest round", "gauge"),
    ("archipelago_island_steps_per_second", "steps_per_s", "Measured inner steps per second", "gauge"),
    ("archipelago_island_compute_seconds_total", "compute_s", "Seconds the island spent computing", "counter"),
    ("archipelago_island_tokens_per_second", "tokens_per_s", "Island tokens per second of compute", "gauge"),
    (
        "archipelago_island_last_contribution_timestamp_seconds",
        "last_contribution",
        "Unix time of the island's last applied update",
        "gauge",
    ),
]


def current(islands: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Islands still in the run: a released island's series end (a run with many
    replacements would otherwise grow its series without bound)."""
    return {i: s for i, s in islands.items() if not IslandState(s.get("state", "starting")).gone}
