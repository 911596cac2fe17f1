"""SIMULATION: what a transfer costs on the islands' simulated links (`simulation:`).

Two things make the price a fleet's rather than this machine's:
- `simulation.nominal_params` prices every transfer as if the model had that many
  parameters (its bytes scaled by nominal ÷ actual, so a codec's ratio holds): a small model
  really trains while its exchanges cost what a 1 B model's would, keeping compute and
  communication in the ratio of the regime being studied;
- data-parallel training (`mode: ddp`) has no coordinator in its data path: each step's
  gradient is a ring all-reduce over the islands' links (`ring_allreduce_s`), and every
  replica applies the same step, so only an island's first download of the model crosses its
  link. The DiLoCo family sends each pseudo-gradient up its island's link and the new
  parameters (or their changes) down it.

The engine's byte counts stay the bytes that really moved; only the clock is priced here.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import Mode, RunConfig, SimulationConfig
from workers.wire.links import ring_allreduce_s


@dataclass(frozen=True)
class LinkPrices:
    sim: SimulationConfig
    scale: float  # nominal parameters per real one (1 without `nominal_params`)
    ring: bool  # data-parallel: each exchange is a ring all-reduce

    @classmethod
    def of(cls, cfg: RunConfig, numel: int) -> LinkPrices:
        nominal = cfg.simulation.nominal_params
        return cls(cfg.simulation, nominal / numel if nominal else 1.0, cfg.mode == Mode.DDP)

    def download_s(self, island: int, nbytes: int, *, bootstrap: bool) -> float:
        """Time for `island` to receive `nbytes` of parameters (data-parallel: only its first
        copy; later versions it computes itself)."""
        if self.ring and not bootstrap:
            return 0.0
        return self.sim.link_of(island).seconds(nbytes * self.scale)

    def upload_s(self, island: int, nbytes: int, islands: list[int]) -> float:
        """Time until `island`'s result of `nbytes` is in the coordinator's hands
        (data-parallel: until the all-reduce over `islands`, the ones training, is done)."""
        if self.ring:
            return ring_allreduce_s([self.sim.link_of(i) for i in islands], nbytes * self.scale)
        return self.sim.link_of(island).seconds(nbytes * self.scale)
