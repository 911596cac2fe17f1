"""What an island does with a work order, one strategy per kind of round: the mode's
part of an island. Each mode's registry row (`orchestrator/modes.py`) names its kind
(`IslandRound`), the coordinator hands it over in the island's spec, and `Island._run`
runs one loop around it — the parameters put in place, the strategy's work, the result —
whatever the mode.

| kind        | modes                               | starts from                        | sends |
| ----------- | ----------------------------------- | ---------------------------------- | ----- |
| `GRADIENT`  | ddp                                 | the published parameters           | one batch's gradient, no local update |
| `INNER`     | diloco, async, overlap              | the published parameters           | Δ = θ_start − θ_end after H inner steps |
| `EAGER`     | overlap with eager updates          | those, moved by its own last Δ     | as `INNER` |
| `FRAGMENTS` | streaming                           | its own parameters (merged)        | one fragment's Δ against its copy, τ steps before the end |

A new kind is one class here and one row of `ROUNDS`; the training loop itself (steps,
notices, the detached tail) stays the island's."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..tasks.task import Task
from ..wire.compress import ErrorFeedback
from ..wire.flat import ParamStore
from ..wire.fragments import Fragments
from ..wire.messages import SavedState, Wire, WorkOrder
from ..wire.spec import IslandRound
from .island_spec import IslandSpec
from .order_steps import Tail, Tally
from .shard_streams import ShardStreams
from .uplink import encode_update


class Island(Protocol):
    """What a strategy uses of its island (`workers/runtime/island.py`): the training loop's
    steps and the buffers a round starts from and is measured against."""

    spec: IslandSpec
    device: torch.device
    task: Task
    data: ShardStreams
    flat: ParamStore
    start: torch.Tensor  # the parameters the round started from
    copy: torch.Tensor | None  # the published parameters as the island holds them (a tracked copy)
    fragments: Fragments | None
    feedback: dict[int | None, ErrorFeedback]
    tail: Tail | None

    def train_on(self, batches: Iterable[tuple[int, Any]], tally: Tally, *, stoppable: bool = False) -> bool: ...
    def inner_step(self, batch: Any) -> tuple[torch.Tensor, int]: ...
    def forward_backward(self, batch: Any) -> tuple[torch.Tensor, int]: ...
    def save_state(self) -> SavedState | None: ...


class Stopped(RuntimeError):
    """A preemption notice stopped the work before its first step: it has nothing to send
    (its batches go back to the ledger, as any lost work's)."""


@dataclass(frozen=True, kw_only=True)
class Trained:
    """What a round's work did, for its result."""

    payload: Wire
    steps: int  # what it reports: the order's steps, or the prefix a notice let it train
    tail_steps: int = 0  # steps after Δ was taken (Streaming DiLoCo's τ)
    tail_s: float = 0.0  # ... their seconds, trained before answering
    tail_pace_s: float = 0.0  # a detached tail's steps counted at the pace of those before
    saved: SavedState | None = None


class InnerSteps:
    """DiLoCo's inner phase: `order.steps` inner steps from the published parameters, and
    Δ = θ_start − θ_end of the whole model. An order with `send_after` takes Δ that many
    steps in and trains the rest after (inline, or detached where the pool asks for it);
    a preemption notice may stop the steps before Δ is taken."""

    def __init__(self, island: Island) -> None:
        self.island = island

    def start(self, order: WorkOrder, src: torch.Tensor | None) -> torch.Tensor | None:
        """The parameters the work starts from (None: the island continues from its own),
        kept in the island's `start`: on a GPU they have landed there already (`Island._landed`)."""
        if src is not None and src is not self.island.start:
            self.island.start.copy_(src)
        return src

    def delta(self, order: WorkOrder) -> torch.Tensor:
        """Δ = θ_start − θ_end."""
        return self.island.start - self.island.flat.full()

    def sent(self, delta: torch.Tensor) -> None:
        """Told the Δ it sent (a new tensor: later steps do not change it)."""

    def work(self, order: WorkOrder, tally: Tally, detach_tail: bool) -> Trained:
        island = self.island
        send = order.send_after if order.send_after and order.send_after < order.steps else order.steps
        batches = island.data.batches(order)
        stepping = time.perf_counter()
        stopped = island.train_on(itertools.islice(batches, send), tally, stoppable=True) and tally.steps < send
        if stopped and not tally.steps:
            raise Stopped(f"island {island.spec.index}: a preemption notice came before its first step")
        t_sent = time.perf_counter()
        delta = self.delta(order)
        tail_steps = 0 if stopped else order.steps - send  # a stopped work has no tail: it is leaving
        detach = detach_tail and tail_steps > 0 and not order.save_state
        tail_s = pace = 0.0
        if tail_steps and not detach:
            island.train_on(batches, tally)
            tail_s = time.perf_counter() - t_sent
        self.sent(delta)
        payload = encode_update(delta, island.spec, island.feedback, order.fragment)
        if detach:
            rest = list(batches)  # read now: the result reports what the tail reads
            for shard, batch in rest:
                tally.read(shard, island.task.batch_weight(batch))
            island.tail = Tail(island.inner_step, [batch for _, batch in rest])
            pace = (t_sent - stepping) / tally.steps
        return Trained(
            payload=payload,
            steps=tally.steps if stopped else order.steps,
            tail_steps=tail_steps,
            tail_s=tail_s,
            tail_pace_s=pace,
            saved=island.save_state() if order.save_state else None,
        )


class EagerSteps(InnerSteps):
    """Eager updates (Kale et al. 2025, on CO2): a round whose version lacks this island's
    last update starts from it moved by that update as CO2's outer step would move it were
    it the average (lr × Λ, clipped): the island's Δ stands in for the mean in flight."""

    def __init__(self, island: Island) -> None:
        super().__init__(island)
        self.last_delta: torch.Tensor | None = None

    def start(self, order: WorkOrder, src: torch.Tensor | None) -> torch.Tensor | None:
        if order.eager and self.last_delta is not None and src is not None:
            spec = self.island.spec
            step = self.last_delta.to(src.dtype) * spec.eager_step
            if spec.eager_clip is not None:
                step.clamp_(-spec.eager_clip * spec.eager_step, spec.eager_clip * spec.eager_step)
            src = src.to(self.island.device) - step
        return super().start(order, src)

    def sent(self, delta: torch.Tensor) -> None:
        self.last_delta = delta.clone()


class FragmentSteps(InnerSteps):
    """Streaming DiLoCo: the island trains on from its own parameters (each received
    fragment merged into them as it arrives, `Island._sync`) and sends one fragment's Δ:
    its global copy minus its local values."""

    def start(self, order: WorkOrder, src: torch.Tensor | None) -> torch.Tensor | None:
        return src if order.fragment is not None else super().start(order, src)

    def delta(self, order: WorkOrder) -> torch.Tensor:
        if order.fragment is None:  # every fragment at once
            return super().delta(order)
        island = self.island
        assert island.copy is not None and island.fragments is not None
        positions = island.fragments.positions(order.fragment, island.device)
        return island.copy[positions] - island.flat.full()[positions]


class GradientStep(InnerSteps):
    """The data-parallel baseline: one batch's gradient at the published parameters, no
    local update (the coordinator steps the islands' optimizer on the mean)."""

    def work(self, order: WorkOrder, tally: Tally, detach_tail: bool) -> Trained:
        island = self.island
        ((shard, batch),) = island.data.batches(order)
        loss, weight = island.forward_backward(batch)
        tally.trained(shard, loss, weight)
        payload = encode_update(island.flat.full_grad().clone(), island.spec, island.feedback)
        return Trained(payload=payload, steps=order.steps)

    def start(self, order: WorkOrder, src: torch.Tensor | None) -> torch.Tensor | None:
        return src  # no Δ to take: the round start is not kept


ROUNDS: dict[IslandRound, type[InnerSteps]] = {
    IslandRound.GRADIENT: GradientStep,
    IslandRound.INNER: InnerSteps,
    IslandRound.EAGER: EagerSteps,
    IslandRound.FRAGMENTS: FragmentSteps,
}


def rounds_for(island: Island) -> InnerSteps:
    """The strategy of the island's kind of round."""
    return ROUNDS[island.spec.round](island)
