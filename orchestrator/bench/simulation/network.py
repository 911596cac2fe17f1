"""What a simulated fleet's clock charges for the run's transfers and for the head's own
work: the `Transfers` the engine reads (`orchestrator/engine/links.py`), which the
simulation's pools hand it.

What limits a real run, priced where the run meets it:
- each island's link (`simulation.link`/`links`), both ways, and every transfer scaled to
  `simulation.nominal_params` (a small model trains while its exchanges cost a large one's);
- the head's network card (`simulation.head_gbps`): every pseudo-gradient in and every
  version out goes through it one after the other (one card per coordinator slice, each on a
  node of its own), so 64 islands' 4 GB wait on each other rather than arriving together;
- the coordinator's step (`simulation.price_head`): the merge (the mean, or RDA, which
  reads each pseudo-gradient twice) and the outer optimizer over every merged update, a
  compressed uplink's updates decoded and a lossy downlink's change encoded, and the
  checkpoint spread over the rounds between two, at the rates measured on a CPU head
  (`orchestrator/plan/head.py`, the plan's own); the head does one step at a time and a
  version is ready for the islands only when its step is done;
- data-parallel (`mode: ddp`) has no head in its data path: each step's gradient is an
  all-reduce among the islands (in the run's codec: `compression.codec: bf16` is torch's
  bf16 compression hook), every replica steps itself, and a newcomer's copy is broadcast
  from a peer. With `simulation.ddp_overlap`
  it is PyTorch DDP's: buckets all-reduced while backward runs (backward is taken as two
  thirds of a step), by the better of a ring and a tree, so only what backward cannot hide
  and the last bucket are added to the step; without it, a ring all-reduce after the step.

Evaluation is not priced: a simulated run evaluates off the head, as `evaluation.where:
actor` does (a CPU head's forward pass over a 1 B model's eval set would take minutes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from archipelago.orchestrator.bench.simulation.config import SimulationConfig
from archipelago.orchestrator.bench.simulation.links import allreduce_s, ring_allreduce_s
from archipelago.orchestrator.config import RunConfig
from archipelago.orchestrator.config_sections import OuterMerge
from archipelago.orchestrator.engine.step.rules import rule_of
from archipelago.orchestrator.modes import mode_of
from archipelago.orchestrator.plan.head import (
    CHECKPOINT_BYTES_PER_S,
    DECODE_S_PER_VALUE,
    ENCODE_S_PER_VALUE,
    RATES_SOURCE,
    STEP_S_PER_VALUE,
    codec_s_per_value,
)

BACKWARD_SHARE = 2 / 3  # of a step's compute: what a bucketed all-reduce can hide behind
DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket (bucket_cap_mb = 25): the last one is never hidden


@dataclass
class Card:
    """A network card that moves one transfer at a time at `bytes_per_s` (infinite: none)."""

    bytes_per_s: float
    free: float = 0.0  # when it finishes what it was given
    busy: float = 0.0  # seconds it has moved bytes

    def done(self, at: float, nbytes: float, *, book: bool) -> float:
        """When `nbytes` handed to it at `at` are through (`book`: they are sent)."""
        if math.isinf(self.bytes_per_s):
            return at
        start, took = max(at, self.free), nbytes / self.bytes_per_s
        if book:
            self.free, self.busy = start + took, self.busy + took
        return start + took


@dataclass
class Network:
    """The run's transfers and the head's steps on the virtual clock (see the module)."""

    cfg: RunConfig
    sim: SimulationConfig
    numel: int
    card_in: Card = field(init=False)
    card_out: Card = field(init=False)
    head_free: float = 0.0  # when the coordinator is done with the steps it was given
    head_busy: float = 0.0  # seconds it spent stepping and checkpointing
    arrivals: dict[int, float] = field(default_factory=dict)  # island -> when its newest download is in

    def __post_init__(self) -> None:
        cards = self.cfg.coordinator.slices
        rate = math.inf if self.sim.head_gbps is None else self.sim.head_gbps * 1e9 / 8 * cards
        self.card_in, self.card_out = Card(rate), Card(rate)

    @property
    def scale(self) -> float:
        """Nominal parameters per real one."""
        return self.sim.nominal_params / self.numel if self.sim.nominal_params else 1.0

    @property
    def ddp(self) -> bool:
        return not mode_of(self.cfg).pseudo_gradients

    # -- Transfers -------------------------------------------------------------------------
    def download(self, island: int, nbytes: int, *, bootstrap: bool, ready: float) -> float:
        """Data-parallel's replicas compute each version themselves: only an island's first
        copy crosses its link, broadcast from a peer as DDP's constructor does (pipelined: the
        bytes once at the island's link's rate; no head in its path). Otherwise the bytes
        leave through the head's card and arrive over the island's link, whichever is slower."""
        n = nbytes * self.scale
        if self.ddp:
            arrival = ready + self.sim.link_of(island).seconds(n) if bootstrap else ready
        else:
            arrival = max(ready + self.sim.link_of(island).seconds(n), self.card_out.done(ready, n, book=True))
        self.arrivals[island] = arrival
        return arrival

    def upload_s(
        self, island: int, nbytes: int, *, islands: list[int], sent: float, compute_s: float, book: bool = True
    ) -> float:
        n = nbytes * self.scale
        if self.ddp:
            links = [self.sim.link_of(i) for i in islands]
            if not self.sim.ddp_overlap:
                return ring_allreduce_s(links, n)
            hidden = BACKWARD_SHARE * compute_s
            last = allreduce_s(links, min(n, DDP_BUCKET_BYTES))
            return max(allreduce_s(links, n) - hidden, last)
        return max(self.sim.link_of(island).seconds(n), self.card_in.done(sent, n, book=book) - sent)

    def stepped(self, *, at: float, merged: int, values: int) -> float:
        """The head takes the step when it is free, and the version is ready when it is
        done; data-parallel's replicas step themselves."""
        cost = self.step_s(merged, values)
        if not cost:
            return at
        start = max(at, self.head_free)
        self.head_free, self.head_busy = start + cost, self.head_busy + cost
        return self.head_free

    def arrival(self, island: int, now: float) -> float:
        """When the parameters `island` was last sent are in (now, if nothing is on its way),
        taken once: the pool starts its work then."""
        return max(now, self.arrivals.pop(island, now))

    # -- the head's prices -----------------------------------------------------------------
    def step_s(self, merged: int, values: int) -> float:
        """The head's seconds for a step over `merged` updates of `values` parameters: the
        merge and outer step at the measured rate, the codecs' decoding and encoding, and the checkpoint's share (a round's
        worth of results carries 1/`every_rounds` of one), over the coordinator's slices."""
        if not self.sim.price_head or self.ddp or not merged:
            return 0.0
        nominal = values * self.scale
        step = STEP_S_PER_VALUE[self.merge] * nominal * merged
        # a compressed uplink's updates decoded, a lossy downlink's change encoded once
        step += codec_s_per_value(DECODE_S_PER_VALUE, self.cfg.compression.codec) * nominal * merged
        step += codec_s_per_value(ENCODE_S_PER_VALUE, self.cfg.compression.downlink) * nominal
        every = self.cfg.checkpoint.every_rounds
        state = 4 * nominal * (1 + rule_of(self.cfg).state_values(self.cfg))
        checkpoint = state / CHECKPOINT_BYTES_PER_S / every * merged / self.cfg.islands.count if every else 0.0
        return (step + checkpoint) / self.cfg.coordinator.slices

    @property
    def merge(self) -> str:
        return "radial" if self.cfg.merge == OuterMerge.RADIAL_DIRECTIONAL else "mean"

    def seconds(self) -> dict[str, float]:
        """Where the head's time went: stepping, and its card moving bytes in and out."""
        return {"step": self.head_busy, "card_in": self.card_in.busy, "card_out": self.card_out.busy}

    def pricing(self) -> dict[str, object]:
        """What this network charges, for a report."""
        every = self.cfg.checkpoint.every_rounds
        return {
            "head_shared": self.sim.head_gbps is not None,
            "head_gbps": self.sim.head_gbps,
            "coordinator_priced": self.sim.price_head,
            "ddp_overlap": self.sim.ddp_overlap,
            "outer_step_s_per_value_and_island": dict(STEP_S_PER_VALUE) if self.sim.price_head else None,
            "checkpoint_bytes_per_s": CHECKPOINT_BYTES_PER_S if self.sim.price_head and every else None,
            "decode_s_per_value_and_island": codec_s_per_value(DECODE_S_PER_VALUE, self.cfg.compression.codec)
            if self.sim.price_head
            else None,
            "encode_s_per_value": codec_s_per_value(ENCODE_S_PER_VALUE, self.cfg.compression.downlink)
            if self.sim.price_head
            else None,
            "rates_source": RATES_SOURCE,
            "backward_share": BACKWARD_SHARE,
            "ddp_bucket_bytes": DDP_BUCKET_BYTES,
            "ddp_first_copy": "broadcast from a peer at its link's rate (no head in its path)",
            "evaluation": "off the head (evaluation.where: actor), not priced",
        }
