"""Simulated links between islands and the coordinator, and the collectives over them.

A transfer of `n` bytes over a link takes `latency + n·8 / bandwidth`. Presets name
typical links; `bandwidth_gbps` / `latency_ms` override them. `network.py` prices every
transfer of a simulated run with them.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PRESETS: dict[str, tuple[float, float]] = {  # name -> (bandwidth Gbit/s, latency ms)
    "none": (float("inf"), 0.0),
    "rdma-800g": (800.0, 0.005),
    "tcp-80g": (80.0, 0.1),
    "wan-1g": (1.0, 30.0),
    "wan-100m": (0.1, 50.0),
}


class LinkConfig(BaseModel):
    """Simulated link of an island (both directions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    preset: Literal["none", "rdma-800g", "tcp-80g", "wan-1g", "wan-100m"] = Field(
        "none", description="a transfer of n bytes is delivered latency + 8n/bandwidth later; none = instant"
    )
    bandwidth_gbps: float | None = Field(None, gt=0, description="overrides the preset's bandwidth")
    latency_ms: float | None = Field(None, ge=0, description="overrides the preset's latency")

    @property
    def gbps(self) -> float:
        """Bandwidth in Gbit/s (infinite: `none`)."""
        return self.bandwidth_gbps if self.bandwidth_gbps is not None else PRESETS[self.preset][0]

    @property
    def latency_s(self) -> float:
        return (self.latency_ms if self.latency_ms is not None else PRESETS[self.preset][1]) / 1000.0

    def seconds(self, nbytes: float) -> float:
        """Simulated time to move `nbytes` over this link."""
        if self.gbps == float("inf") and self.latency_s == 0:
            return 0.0
        return self.latency_s + nbytes * 8 / (self.gbps * 1e9)


def _slowest(links: list[LinkConfig]) -> tuple[float, float] | None:
    """The slowest bandwidth and the worst latency of `links`, which pace a collective over
    them (None: fewer than two islands, or instant links: it costs nothing)."""
    if len(links) < 2:
        return None
    gbps, latency = min(link.gbps for link in links), max(link.latency_s for link in links)
    return None if gbps == float("inf") and latency == 0 else (gbps, latency)


def ring_allreduce_s(links: list[LinkConfig], nbytes: float) -> float:
    """Simulated time of a ring all-reduce of `nbytes` over islands joined by `links`: each
    of the 2 (k - 1) hops moves 1/k of the bytes, paced by the slowest link and paying the
    worst latency (reduce-scatter, then all-gather)."""
    if (pace := _slowest(links)) is None:
        return 0.0
    k, (gbps, latency) = len(links), pace
    return 2 * (k - 1) * (latency + nbytes / k * 8 / (gbps * 1e9))


def tree_allreduce_s(links: list[LinkConfig], nbytes: float) -> float:
    """Simulated time of a pipelined tree all-reduce (NCCL's double binary tree) of
    `nbytes`: a reduce up and a broadcast down the tree, each paying log2(k) latencies, the
    bytes streamed through once each way at the slowest link's bandwidth. Better than the
    ring when latency dominates (many islands, small messages)."""
    if (pace := _slowest(links)) is None:
        return 0.0
    gbps, latency = pace
    return 2 * math.ceil(math.log2(len(links))) * latency + 2 * nbytes * 8 / (gbps * 1e9)


def allreduce_s(links: list[LinkConfig], nbytes: float) -> float:
    """The better of the ring and the tree, as NCCL picks by size and scale."""
    return min(ring_allreduce_s(links, nbytes), tree_allreduce_s(links, nbytes))
