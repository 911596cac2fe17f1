"""The fleet `archipelago bench fleet` simulates, as the user describes it on the command
line (`--islands 16,64 --speeds 1,0.5 --mttf 1800 --mix hang=1,crash=1 --links 1,10,100
--nominal-params 1e9 --rows quorum,sync_dylu --seeds 3`): the defaults give the published
report. Kept apart from the scenario so the command line reads it without importing the
engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from archipelago.orchestrator.bench.simulation.chaos import Strike, parse_mix

RESTART_ROW = "restart_from_checkpoint"  # the baseline run on a fleet that stands still at each failure
SLICED_ROW = "quorum_sliced"  # quorum with coordinator.shards auto: its head sized by the plan
EQUAL_ROW = "quorum_sliced_equal"  # SLICED_ROW on the machines data-parallel uses: islands + head + slices
SLICED_SETTINGS = [  # the head its plan sizes: slices on nodes of their own, codecs `auto` picks
    "mode=async",
    "mode.rule=quorum",
    "compression.codec=auto",
    "compression.downlink=auto",
    "coordinator.shards=auto",
    "coordinator.slice_resource=archipelago_slice",
]
# name -> (what it is, its overrides); every DiLoCo-family row's outer lr comes from LR_GRID
ROWS: dict[str, tuple[str, list[str]]] = {
    "ddp": (
        "data-parallel as PyTorch DDP runs it under torchrun's elastic agent: each step's gradient all-reduced "
        "among the islands in fp32 in buckets overlapped with backward (the better of a ring and a tree); a "
        "failure anywhere, in an all-reduce too, stops every island for the restart time (the agent restarts "
        "the group, which meets again: a re-rendezvous; a crash inside an all-reduce is found at the next step, "
        "whose predecessor is kept, and a preempted island leaves without a stop, both in DDP's favour); a "
        "newcomer's copy is broadcast from a peer; its lr tuned on a grid of its own size",
        ["mode=ddp"],
    ),
    "ddp_bf16": (
        "`ddp` with torch's bf16 compression hook (`bf16_compress_hook`): gradients all-reduced in bf16, half "
        "the bytes; its own lr grid",
        ["mode=ddp", "compression.codec=bf16"],
    ),
    "ddp_int8": (
        "`ddp` with gradients all-reduced in int8, one fp32 scale per 512 values: a quarter of the bytes, priced "
        "as if int8 summed in flight (no all-reduce does: a ring re-quantises at each hop, so this flatters "
        "data-parallel); torch ships no int8 hook, and its low-rank one (PowerSGD, far fewer bytes) is not "
        "simulated; its own lr grid",
        ["mode=ddp", "compression.codec=int8"],
    ),
    RESTART_ROW: (
        "synchronous DiLoCo; every failure stops every island and resumes from the last outer step after "
        "a restart (Ray Train's elastic restarts)",
        ["mode=diloco"],  # on a fleet with simulation.restart_s (`fleet.run_one`)
    ),
    "sync": ("synchronous DiLoCo: every round waits for its slowest island", ["mode=diloco"]),
    "sync_dylu": (
        "synchronous DiLoCo with Dynamic Local Updates (steps sized by speed)",
        ["mode=diloco", "mode.dylu=true"],
    ),
    "quorum": (
        "mode async, quorum rule (DyLU, ⌈k/2⌉ islands, adaptive grace, Radial-Directional Averaging)",
        ["mode=async", "mode.rule=quorum"],
    ),
    "dn_dylu": (
        "mode async, Delayed Nesterov + DyLU, token-weighted",
        ["mode=async", "mode.rule=delayed_nesterov", "mode.dylu=true"],
    ),
    "streaming_quorum": (
        "Streaming DiLoCo, fragments stepped by quorum",
        ["mode=streaming", "mode.pacing=quorum"],
    ),
    "quorum_no_heartbeats": (
        "ablation: `quorum` with hangs found by deadlines only (no heartbeats), at quorum's lr",
        ["mode=async", "mode.rule=quorum", "elastic.hang_after_steps=null"],
    ),
    "quorum_mean": (
        "ablation: `quorum` merging by the token-weighted mean instead of Radial-Directional Averaging (the "
        "default in mode async), at quorum's lr",
        ["mode=async", "mode.rule=quorum", "outer.merge=mean"],
    ),
    "sync_dylu_radial": (
        "ablation: `sync_dylu` merging by Radial-Directional Averaging, at sync_dylu's lr (the barrier given the "
        "merge the async default took, so the two are compared at equal merges)",
        ["mode=diloco", "mode.dylu=true", "outer.merge=radial_directional"],
    ),
    "quorum_spares": (
        "ablation: `quorum` with hot spares (`elastic.spares`, one per `--spare-every` islands, paid for in "
        "goodput), at quorum's lr",
        ["mode=async", "mode.rule=quorum"],
    ),
    "quorum_int4": (
        "`quorum` with int4 both ways (`compression.codec` and `compression.downlink`, error feedback as "
        "shipped): the head's bytes cut about 7.5x, at quorum's lr",
        ["mode=async", "mode.rule=quorum", "compression.codec=int4", "compression.downlink=int4"],
    ),
    SLICED_ROW: (
        "`quorum` with the head its plan asks for on this fleet (`coordinator.shards: auto`, as the shipped "
        "cluster configs): the fewest coordinator slices, each on a node of its own (a card and a CPU of its "
        "own), that bring the head's share of a round under 0.10, given one slice node per island, and the "
        "codecs `auto` picks for them (int8 both ways where its bytes save more than its coding costs, each "
        "slice keeping its part of the islands' copy), at quorum's lr",
        SLICED_SETTINGS,
    ),
    EQUAL_ROW: (
        "`quorum_sliced` on as many machines as the data-parallel rows (their islands): islands and the head "
        "the plan sizes for them on the machines left (its node and one per slice), as many islands as give "
        "the most planned work a second (islands / (1 + the head's planned share of a round)); the same tokens "
        "(more rounds of fewer islands), at quorum's lr",
        SLICED_SETTINGS,
    ),
    "quorum_no_partial": (
        "ablation: `quorum` whose preempted islands send nothing early (no partial pseudo-gradient at the "
        "notice: a work that would not finish in time is lost), at quorum's lr",
        ["mode=async", "mode.rule=quorum", "elastic.partial_on_notice=false"],
    ),
}
ABLATION_OF = {
    "quorum_no_heartbeats": "quorum",
    "quorum_mean": "quorum",
    "sync_dylu_radial": "sync_dylu",
    "quorum_spares": "quorum",
    "quorum_no_partial": "quorum",
    "quorum_int4": "quorum",
    SLICED_ROW: "quorum",  # slices compute what one coordinator does, bit for bit: only the timing differs
    EQUAL_ROW: "quorum",
}  # rows at another row's tuned lr
DDP_ROWS = ("ddp", "ddp_bf16", "ddp_int8")  # data-parallel with each of its compression hooks
HEADLINE = (RESTART_ROW, "sync_dylu", "quorum", *DDP_ROWS)  # the rows the targets compare
REFERENCE_LINK = 100.0  # Gbit/s: the regime every row runs in (the lr grid is tuned there); the others run `link_rows`


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    islands: tuple[int, ...] = (16, 64)  # and 32 on request: two cores run 16 and 64 in about an hour
    speeds: tuple[float, ...] = (1.0, 1.0, 0.75, 0.5)  # repeated over the fleet
    mttf_s: float = 1800.0  # per island, simulated
    mix: str = "hang=1,crash=1,slow=1,preempt=1"
    links: tuple[float, ...] = (1.0, 10.0, 100.0)  # Gbit/s between each island and the head, and the head's card
    link_rows: tuple[str, ...] = (
        *HEADLINE,
        "quorum_int4",
        SLICED_ROW,
        EQUAL_ROW,
    )  # the rows run at the links other than REFERENCE_LINK
    latency_ms: float = 30.0
    nominal_params: int = 1_000_000_000
    rows: tuple[str, ...] = tuple(ROWS)
    seeds: int = 3
    rounds: int = 12  # the token budget: this many synchronous rounds' worth
    inner_steps: int = 20
    step_s: float = 1.0  # simulated seconds of an inner step at speed 1
    join_s: float = 30.0  # a replacement's placement and start
    restart_s: float = 60.0  # restart_from_checkpoint and DDP: the fleet stands still this long per failure
    hang_after_steps: int = 5  # heartbeats: hung after this many expected steps without progress
    spare_every: int = 16  # quorum_spares: one hot spare per this many islands (at least one)
    notice_s: tuple[float, float] = (5.0, 120.0)  # a preemption's notice, drawn uniformly (some shorter than a round)
    speed_noise: float = 0.1  # the spread of every speed the engine measures (log-normal, mean 1)
    ablation_seeds: int = 1  # seeds of the rows neither headline nor in `link_rows` (at most `seeds`)
    # each brackets its rows' best, the same size for every row: on three values sync's 0.5
    # and data-parallel's 2x sat at their edges, on four restart's 0.35 and ddp's 4x
    lr_grid: tuple[float, ...] = (0.25, 0.35, 0.5, 0.7, 1.0)
    ddp_lr_grid: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)  # data-parallel's lr, times the shipped inner.lr
    jobs: int = 1  # runs side by side, each in a process of its own

    def __post_init__(self) -> None:
        unknown = [r for r in (*self.rows, *self.link_rows) if r not in ROWS]
        if unknown:
            raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
        if not self.islands or min(self.islands) < 1 or not self.speeds or min(self.speeds) <= 0:
            raise ValueError("need islands >= 1 and speeds > 0")
        if self.seeds < 1 or self.rounds < 1 or self.spare_every < 1 or self.mttf_s <= 0 or not self.links:
            raise ValueError("need seeds, rounds, spare-every >= 1, mttf > 0 and at least one link")
        if min(self.links) <= 0 or REFERENCE_LINK not in self.links:
            raise ValueError(f"links are Gbit/s > 0 and include the reference {REFERENCE_LINK:g}, not {self.links}")
        if len(self.notice_s) != 2 or not 0 <= self.notice_s[0] <= self.notice_s[1]:
            raise ValueError(f"need a notice range LO,HI with 0 <= LO <= HI, not {self.notice_s}")
        if self.ablation_seeds < 1:
            raise ValueError("need ablation-seeds >= 1")
        self.strikes()  # the mix parses

    def strikes(self) -> dict[Strike, float]:
        return parse_mix(self.mix)

    @property
    def round_s(self) -> float:
        """A synchronous round: the slowest island's H steps."""
        return self.inner_steps * self.step_s / min(self.speeds)

    @property
    def chaos_horizon_s(self) -> float:
        """Failures are drawn up to this simulated time (50 synchronous rounds' worth per
        round of budget): a run that lasts longer runs its rest without failures."""
        return 50 * self.rounds * self.round_s

    def grid_of(self, row: str) -> tuple[float, ...]:
        """The lr grid `row` is tuned on: data-parallel's factors on its inner lr, or the outer lr's."""
        return self.ddp_lr_grid if row in DDP_ROWS else self.lr_grid

    def spares_of(self, islands: int) -> int:
        """`quorum_spares`' hot spares on a fleet of `islands`."""
        return max(1, round(islands / self.spare_every))

    def quick(self) -> FleetSpec:
        """A few minutes' version (`--quick`): one small fleet, one seed, a short budget."""
        return replace(
            self,
            islands=(min(self.islands),),
            seeds=1,
            rounds=min(self.rounds, 4),
            lr_grid=(0.7,),
            ddp_lr_grid=(1.0,),
        )


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _mix(text: str) -> str:
    parse_mix(text)
    return text


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


# flag -> (field, parser, help)
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--islands": ("islands", _ints, "fleet sizes, e.g. 16,32,64"),
    "--speeds": ("speeds", _floats, "relative island speeds, repeated over the fleet, e.g. 1,1,0.75,0.5"),
    "--mttf": ("mttf_s", float, "mean simulated seconds between failures of one island"),
    "--mix": ("mix", _mix, "failure kinds by weight, e.g. hang=1,crash=1,slow=1,preempt=1"),
    "--links": (
        "links",
        _floats,
        f"link regimes, Gbit/s between each island and the head (and its card); with {REFERENCE_LINK:g}",
    ),
    "--link-rows": ("link_rows", lambda t: tuple(x for x in t.split(",") if x), "the rows run at the other links"),
    "--latency-ms": ("latency_ms", float, "its latency"),
    "--nominal-params": ("nominal_params", lambda t: int(float(t)), "model size the links price, e.g. 1e9"),
    "--rows": ("rows", lambda t: tuple(x for x in t.split(",") if x), f"methods among {','.join(ROWS)}"),
    "--seeds": ("seeds", int, "seeds per fleet size"),
    "--rounds": ("rounds", int, "token budget in synchronous rounds"),
    "--step-s": ("step_s", float, "simulated seconds of an inner step at speed 1"),
    "--spare-every": ("spare_every", int, "quorum_spares: one hot spare per this many islands"),
    "--notice": ("notice_s", _floats, "a preemption's notice, LO,HI simulated seconds (drawn uniformly)"),
    "--speed-noise": ("speed_noise", float, "spread of measured speeds (log-normal sigma)"),
    "--ablation-seeds": ("ablation_seeds", int, "seeds of the rows neither headline nor run at every link"),
    "--jobs": ("jobs", int, "runs side by side, a process each (changes the wall time only)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench fleet: the fleet to simulate (defaults: the published report)")
    defaults = {f.name: f.default for f in fields(FleetSpec)}
    for flag, (name, _, text) in FLAGS.items():
        group.add_argument(flag, dest=f"fleet_{name}", default=None, help=f"{text} (default {defaults[name]})")


def given(args: argparse.Namespace) -> list[str]:
    """The fleet flags given on the command line."""
    return [flag for flag, (name, _, _) in FLAGS.items() if getattr(args, f"fleet_{name}", None) is not None]


def spec_of(args: argparse.Namespace) -> FleetSpec:
    """The fleet the command line describes; ValueError naming the flag that is wrong."""
    values: dict[str, Any] = {}
    for flag, (name, parse, _) in FLAGS.items():
        text = getattr(args, f"fleet_{name}", None)
        if text is None:
            continue
        try:
            values[name] = parse(text)
        except ValueError as err:
            raise ValueError(f"{flag} {text!r}: {err}") from None
    return FleetSpec(**values)
