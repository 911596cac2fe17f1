"""SIMULATION on the real clock (`simulation:` without `virtual_step_s`): an island that
is slower than its hardware and whose downloads take its link's time, so modes can be
compared on one machine under a fleet's speeds and links. The `Island` itself knows
nothing of it: the actor builds this subclass of its island class when the spec says so
(under a virtual clock the pool keeps the time instead, and nothing sleeps)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from workers.runtime.island import Island
from workers.runtime.island_spec import IslandSpec
from workers.wire.messages import RoundResult, WorkOrder


class SimulatedIsland(Island):
    """Mixed in before an island class (`simulated`): each inner step stretched to
    `spec.slowdown` times its measured time by sleeping, the probed speed divided by it,
    and each order started `order.start_delay_s` after it was handed over (the download
    over the island's link went on beside any tail it waited for)."""

    called = 0.0

    def run(self, order: WorkOrder, params: np.ndarray, *, detach_tail: bool = False) -> RoundResult:
        self.called = time.perf_counter()
        return super().run(order, params, detach_tail=detach_tail)

    def _run(self, order: WorkOrder, params: np.ndarray, detach_tail: bool) -> RoundResult:
        delay = order.start_delay_s - (time.perf_counter() - self.called)
        if delay > 0:
            time.sleep(delay)
        return super()._run(order, params, detach_tail)

    def _inner_step(self, batch: Any) -> tuple[torch.Tensor, int]:
        started = time.perf_counter()
        out = super()._inner_step(batch)
        time.sleep((self.spec.slowdown - 1) * (time.perf_counter() - started))
        return out

    def probe(self, steps: int = 2) -> float | None:
        speed = super().probe(steps)
        return None if speed is None else speed / self.spec.slowdown


def simulated(cls: type[Island], spec: IslandSpec) -> type[Island]:
    """`cls`, or its simulated form when `spec` asks for one."""
    if not spec.simulated:
        return cls
    return type(f"Simulated{cls.__name__}", (SimulatedIsland, cls), {})
