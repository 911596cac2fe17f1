"""What crosses between the coordinator and an island, in one home: the work order an
island is handed and the result it sends back.

The coordinator's data ledger decides, before the island starts, exactly which batches
it trains: `shards` gives each shard's start position, and step j of the round reads
shard `sorted(shards)[(turn + j) % len(shards)]`. `batch_counts` is that rule, shared by
both sides, so the ledger can advance positions when it hands out work and the island
consumes exactly what was reserved for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .spec import Payload, payload_nbytes

if TYPE_CHECKING:
    from .sync import Change


class WorkKind(str, Enum):
    TRAIN = "train"  # H inner steps from the global parameters; returns Δ = θ_start − θ_end
    GRADIENT = "gradient"  # one batch's gradient at the global parameters (the ddp baseline)


def batch_counts(shards: list[int], turn: int, steps: int) -> dict[int, int]:
    """Batches each shard gives to a round of `steps` steps starting at `turn` (round-robin
    over `sorted(shards)`)."""
    order = sorted(shards)
    n = len(order)
    base, extra = divmod(steps, n)
    return {s: base + (1 if (i - turn) % n < extra else 0) for i, s in enumerate(order)}


@dataclass(frozen=True, kw_only=True)
class SavedState:
    """Where an island wrote its inner state (`workers/runtime/inner_state.py`), and what
    the file's bytes hash to: None where the digest is beside the file instead (a state
    written after its result left, which could not carry a digest not yet computed)."""

    name: str
    sha256: str | None = None


@dataclass(frozen=True, kw_only=True)
class WorkOrder:
    island: int
    ticket: int  # the engine's id of this piece of work
    version: int  # global version the island starts from
    kind: WorkKind
    steps: int
    shards: dict[int, int]  # shard -> start position (batches already consumed)
    turn: int = 0  # round-robin offset over the shards
    schedule_step: int | None = None  # move the inner lr schedule to the run's progress (async mode)
    fragment: int | None = None  # streaming: the fragment whose pseudo-gradient to send (None: all)
    changes: tuple[Change, ...] = ()  # the published copy's changes since the version the island holds
    eager: bool = False  # overlap: start from `version` moved by this island's last update (not in it yet)
    send_after: int | None = None  # streaming: take Δ after this many steps (τ before the end); None: at the end
    handoff_sha256: str | None = None  # with full parameters: what they and this order's position hash to
    save_state: bool = False  # write the inner state after the last step (a checkpoint is near)
    streams: dict[int, tuple[int, Any]] = field(default_factory=dict)  # shard -> (position, its stream's saved state)
    built: bool = False  # start from the version-0 parameters the island built (they hash to the coordinator's)


@dataclass(frozen=True, kw_only=True)
class Sliced:
    """A pseudo-gradient as S aligned slices, one per coordinator slice: encoded payloads in
    the island's process, then (under Ray) references to them in its object store, which
    each slice pulls directly. A whole pseudo-gradient is a plain `Payload`."""

    parts: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.parts)


Wire = Payload | Sliced  # what a result carries


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    """What an island sends back: `payload` encodes Δ (a gradient for `GRADIENT` work)
    with the configured codec; `nbytes` is its size on the wire."""

    island: int
    version: int
    payload: Wire
    weight: int  # tokens (or examples) trained on this round
    steps: int
    mean_loss: float  # over the steps trained before it left (a detached tail trains after)
    compute_s: float  # seconds training (slowdown included; a detached tail at the pace of the steps before)
    finished_at: float  # clock time when the result was ready to send
    positions: dict[int, int]  # shard -> batches consumed after this round
    shard_tokens: dict[int, int]  # shard -> tokens (weight) trained this round
    ticket: int = -1
    sent_bytes: int | None = None  # set when `payload` holds references to the encoded slices
    fragment: int | None = None  # streaming: the fragment `payload` is the pseudo-gradient of
    tail_steps: int = 0  # streaming: steps trained after Δ was taken (τ): its exchange overlapped them
    tail_s: float = 0.0  # ... their seconds before it left (0: detached, on Ray); a virtual clock sets it
    saved_state: SavedState | None = None  # where the order's `save_state` went
    started_at: float | None = None  # wall time its first step began (start-up is measured to the run's first)
    stream_states: dict[int, Any] = field(default_factory=dict)  # shard -> its stream's state at `positions[shard]`

    def delta(self) -> Any:
        """Δ decoded to fp32, or its S slices as they came (each coordinator slice decodes its own)."""
        from .compress import decode  # here: the codecs import torch, the messages do not

        return self.payload if isinstance(self.payload, Sliced) else decode(self.payload)

    @property
    def nbytes(self) -> int:
        if self.sent_bytes is not None:
            return self.sent_bytes
        parts = self.payload.parts if isinstance(self.payload, Sliced) else (self.payload,)
        return sum(payload_nbytes(p) for p in parts)
