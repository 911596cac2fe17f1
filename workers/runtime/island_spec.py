"""What an island is built from: the part of the run config the coordinator hands each
island (its task, inner optimizer, codec, data shards, place in the schedule, and the
state it continues from). A frozen dataclass of plain values, so it crosses to an
island's process as is, and an island started ahead of its engine can tell whether it
was built for the spec it is now asked for (`Island.rejoin`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..wire.spec import InnerConfig, IslandRound, Sharding

if TYPE_CHECKING:  # the wire's messages import torch; the command builds specs without it
    from ..wire.messages import SavedState


@dataclass(frozen=True)
class IslandSpec:
    index: int
    num_islands: int
    seed: int
    task_factory: str
    task_kwargs: dict[str, Any]
    inner: InnerConfig
    total_inner_steps: int
    threads: int = 1
    device: str = "auto"
    codec: str = "none"  # compression of what the island sends
    chunk: int = 4096
    num_shards: int = 0  # data shards of the run (0: one per island, island i owns shard i)
    start_step: int = 0  # a joining island's place in the run's inner schedule
    rewarmup_steps: int = 0
    coordinator_shards: int = 1  # S > 1: the pseudo-gradient leaves as S slices, one per shard
    sharding: Sharding = Sharding.ZERO1
    error_feedback: bool = False  # keep what the codec rounds away for the next pseudo-gradient
    feedback_decay: float = 1.0  # ... as decay x residual + Δ (SparseLoCo's 0.95)
    round: IslandRound = IslandRound.INNER  # what it does with a work order (its mode's, `rounds.py`)
    tracks_copy: bool = False  # hold the published parameters and follow their changes (`workers/wire/sync.py`)
    fragments: int = 0  # streaming: P fragments; the island trains on and merges fragment by fragment
    merge_alpha: float = 0.0  # streaming: local <- alpha x local + (1 - alpha) x received global fragment
    eager_step: float = 0.0  # overlap, eager updates: the outer step size applied to its own last Δ
    eager_clip: float | None = None  # ... clipped elementwise like CO2's momentum
    state_folder: str | None = None  # where it writes its inner state when an order asks (None: never)
    restore_state: SavedState | None = None  # the inner state it continues from (a resumed run's island)
    run_id: str | None = None  # the run it serves: its log records carry it (`log_context`)
    probe: bool = True  # measure its speed before any work (only a pacing that sizes first work by speed needs it)
    builds_version0: bool = False  # keep the parameters it built, to start from them instead of a download
    version0_file: str | None = None  # ... loaded from this file (a warm start's, on shared storage) instead
