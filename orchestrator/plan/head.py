"""The head's share of a round: what the coordinator's node spends on each round, against
what the islands spend computing it, before anything starts.

At the users' scale the head is the bottleneck, not the islands: every island's
pseudo-gradient comes in through the head's one network card and every island's parameters
go out through it (1 B parameters on 16 islands in fp32: 64 GB in and 64 GB out a round),
and between the two the coordinator steps on one CPU host. The plan prices each phase of a
round at the head:

- `fan_in` and `fan_out`: every island's bytes through the card, at `link_gbps`, one after
  the other (in the synchronous modes the step needs every pseudo-gradient before it, and
  the new parameters exist only after it);
- `outer_step`: screening, merging (the mean, or RDA, which reads each pseudo-gradient
  twice) and the outer optimizer over every island's update, at rates measured on a 2-core
  CPU host (`bench coordinator`, `docs/findings/fleet.md`), per parameter and island,
  divided over the coordinator's slices;
- `codec`: a compressed uplink's updates decoded on the head (each island's, per value) and
  a lossy downlink's change encoded once a version, at the rates `bench head`'s
  `codec_rates` measured on the same host (int4 both ways at 1 B parameters and 16 islands:
  27 s of decoding and 3.4 s of encoding a step, against the fp32 mean's 4.8 s — the bytes a
  codec saves on the card are paid for in the head's CPU);
- `checkpoint`: the state streamed to storage at the rate measured there, spread over the
  rounds between two checkpoints (it is written while the islands train the next round,
  but it is the head's time all the same). Slices split it: each writes its part of the
  parameters and of the outer state from its own node, beside the coordinator's file.

Evaluation is not priced: on the head it reads the eval set at the task's own cost, which
the plan does not know; `evaluation.where: actor` takes it off the head.

`share` is the head's seconds over the islands' round (`H × step_s`): what fraction of the
fleet's time the head adds, or hides only if it overlaps. The lines say what would bring
it under `TARGET_SHARE`: a codec that shrinks the bytes, slices (on nodes of their own)
that split the bytes, the step and the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from archipelago.workers.wire.spec import AUTO_CODEC

from ..config import AUTO_SHARDS, MAX_SHARDS, RunConfig, WarmStartMode
from ..config_sections import OuterMerge
from ..engine.step.rules import rule_of
from ..modes import mode_of
from .memory import downlink_bytes_per_value, uplink_bytes_per_value

TARGET_SHARE = 0.10
# Ray re-requests a pull every object_manager_pull_timeout_ms (10 s as shipped) and the sender
# pushes the object again: on a link where one transfer lasts longer, its bytes repeat.
RAY_PULL_RETRY_S = 10.0
DEFAULT_LINK_GBPS = 100.0
DEFAULT_STEP_S = 1.0
# measured on this project's 2-core CPU host (bench coordinator, docs/findings/fleet.md):
# an outer step over 8 x 25 M fp32 updates took 0.06 s by the mean, 0.19 s by RDA (its norm
# while screening, its direction in the merge); a checkpoint streamed 800 MB in 2.75 s
STEP_S_PER_VALUE = {"mean": 0.06 / (8 * 25e6), "radial": 0.19 / (8 * 25e6)}
CHECKPOINT_BYTES_PER_S = 800e6 / 2.75
RATES_SOURCE = "bench coordinator on a 2-core CPU host (docs/findings/fleet.md), per parameter and island"
# seconds per value to decode one island's update on the head, and to encode the downlink's
# change once a version, by value codec (`orchestrator/bench/head.py:codec_rates`, one thread,
# the better of 3 on a 25 M vector, on the same host); a top-k chain (topk:K+codec) by TOPK
TOPK = "topk"  # a top-k chain, measured as topk:0.1+int4
_NS = 1e-9
DECODE_S_PER_VALUE = {
    "none": 0.0,
    "bf16": 2.58 * _NS,
    "int8": 1.21 * _NS,
    "int4": 1.71 * _NS,
    "int2": 2.94 * _NS,
    "fp4": 3.53 * _NS,
    TOPK: 6.33 * _NS,
}
ENCODE_S_PER_VALUE = {
    "none": 0.0,
    "bf16": 1.33 * _NS,
    "int8": 2.90 * _NS,
    "int4": 3.35 * _NS,
    "int2": 4.52 * _NS,
    "fp4": 20.7 * _NS,
    TOPK: 16.31 * _NS,
}


def codec_s_per_value(table: dict[str, float], spec: str) -> float:
    """Seconds per value of the codec `spec` (as `compression.codec` names it) by `table`."""
    from archipelago.workers.wire.spec import parse_codec

    chain = parse_codec(spec)
    return table[TOPK] if chain.topk is not None else table[chain.value]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadLoad:
    params: int
    islands: int
    slices: int
    link_gbps: float
    step_s: float
    inner_steps: int
    up_bytes: int  # one island's pseudo-gradient
    down_bytes: int  # what one island receives
    merge: str  # "mean" or "radial"
    uplink: str  # compression.codec
    downlink: str  # compression.downlink
    state_values: int  # the outer optimizer's values per parameter (Nesterov's momentum: 1)
    checkpoint_every: int  # rounds (0: none)
    hang_floor_s: float = 60.0  # elastic.hang_floor_s: the silence an island's transfer is set against
    sliceable: bool = (
        True  # the mode's outer step can be split over slices (a DiLoCo-family mode without a tracked copy)
    )

    @property
    def bytes_per_round(self) -> int:
        """Through the head's card, in and out."""
        return self.islands * (self.up_bytes + self.down_bytes)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds a round, each phase at the head; with slices, each on a node of its own
        (`coordinator.slice_resource`), everything splits over them: each slice's node takes
        its part of every island's bytes and of the step, and writes its part of the
        checkpoint beside the coordinator's file (`engine/state/checkpoints.py`), all of
        them at once."""
        card = self.link_gbps * 1e9 / 8
        state = 4 * self.params * (1 + self.state_values)  # parameters and outer state: what a checkpoint streams
        decode = codec_s_per_value(DECODE_S_PER_VALUE, self.uplink) * self.params * self.islands
        encode = codec_s_per_value(ENCODE_S_PER_VALUE, self.downlink) * self.params
        return {
            "fan_in": self.islands * self.up_bytes / card / self.slices,
            "outer_step": STEP_S_PER_VALUE[self.merge] * self.params * self.islands / self.slices,
            "codec": (decode + encode) / self.slices,
            "fan_out": self.islands * self.down_bytes / card / self.slices,
            "checkpoint": state / CHECKPOINT_BYTES_PER_S / self.slices / self.checkpoint_every
            if self.checkpoint_every
            else 0.0,
        }

    @property
    def seconds_per_round(self) -> float:
        return sum(self.phases.values())

    @property
    def round_seconds(self) -> float:
        """The islands' compute per round, which the head's time is set against."""
        return self.inner_steps * self.step_s

    @property
    def share(self) -> float:
        return self.seconds_per_round / self.round_seconds

    def to_fit(self) -> list[str]:
        """What would bring the share under `TARGET_SHARE`, each on its own (none: it fits)."""
        budget = TARGET_SHARE * self.round_seconds
        if self.seconds_per_round <= budget:
            return []
        p = self.phases
        bytes_s = p["fan_in"] + p["fan_out"]
        out = []
        if bytes_s > budget / 2:
            out.append(
                f"the bytes take {bytes_s:.1f} s of the {budget:.1f}-s budget: a codec both ways where the head "
                "decodes faster than the card carries (compression.codec and compression.downlink auto: the plan "
                "picks int8, about 1 byte a value, where it saves more than it costs) or a faster link"
            )
        if not self.sliceable:
            out.append(
                "a rarer checkpoint (checkpoint.every_rounds) or a longer round (inner_steps): this mode steps on "
                "one coordinator (no slices)"
            )
            return out
        need = max(self.slices + 1, math.ceil(self.slices * self.seconds_per_round / budget))
        if need > MAX_SHARDS:
            most = dataclasses.replace(self, slices=MAX_SHARDS)
            out.append(
                f"no number of slices fits: it would take {need}, and {MAX_SHARDS} (the most coordinator.shards "
                f"takes) leave a share of {most.share:.2f}; a longer round (inner_steps) or a faster link"
            )
            return out
        out.append(
            f"coordinator.shards >= {need}, each slice on a node of its own (coordinator.slice_resource: "
            "archipelago_slice, the manifests' slices group), or a rarer checkpoint (checkpoint.every_rounds)"
        )
        return out

    def lines(self) -> list[str]:
        p = self.phases
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in p.items())
        verdict = "within" if self.share <= TARGET_SHARE else "OVER"
        where = "its card" if self.slices == 1 else f"{self.slices} slices' cards"
        out = [
            f"head: {self.bytes_per_round / 1e9:,.2f} GB a round through {where} ({self.islands} islands, up "
            f"{self.up_bytes / 1e6:,.1f} MB and down {self.down_bytes / 1e6:,.1f} MB each) at {self.link_gbps:g} Gbit/s; "
            f"{self.seconds_per_round:.2f} s a round ({parts}) against the islands' {self.round_seconds:g} s "
            f"(H {self.inner_steps} x {self.step_s:g} s): share {self.share:.3f}, {verdict} {TARGET_SHARE:.2f}",
            f"head: the outer step and checkpoint priced at rates of {RATES_SOURCE}, a codec's decoding and "
            "encoding at bench head's codec_rates; evaluation not priced",
        ]
        out += [f"head: to fit, {fix}" for fix in self.to_fit()]
        out += self.slow_transfers()
        return out

    def slow_transfers(self) -> list[str]:
        """What to set where one island's transfer through the head lasts longer than Ray's
        pull retry or the hang floor (measured on the testbed, docs/wan-testbed.md)."""
        p = self.phases
        longest = max(p["fan_in"], p["fan_out"])
        out = []
        if longest > RAY_PULL_RETRY_S:
            out.append(
                f"head: a transfer takes up to {longest:.0f} s (fan-in {p['fan_in']:.0f} s, fan-out "
                f"{p['fan_out']:.0f} s), past Ray's pull retry ({RAY_PULL_RETRY_S:g} s), after which Ray pushes the "
                "object again (on the testbed, 4x the bytes): start the head with "
                '--system-config=\'{"object_manager_pull_timeout_ms": '
                f"{int(max(300, 3 * longest) * 1000)}}}' (docs/wan-testbed.md)"
            )
        if longest > self.hang_floor_s:
            out.append(
                f"head: a transfer takes up to {longest:.0f} s, past elastic.hang_floor_s ({self.hang_floor_s:g} s): "
                "an island moving bytes is not hung, but one whose link stalls that long is; raise the floor "
                "to leave a stalled transfer more time"
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_round": self.bytes_per_round,
            "seconds_per_round": self.seconds_per_round,
            "round_seconds": self.round_seconds,
            "share": self.share,
            "phases": self.phases,
            "link_gbps": self.link_gbps,
            "step_s": self.step_s,
            "islands": self.islands,
            "slices": self.slices,
            "merge": self.merge,
            "rates": {
                "outer_step_s_per_value": STEP_S_PER_VALUE[self.merge],
                "checkpoint_bytes_per_s": CHECKPOINT_BYTES_PER_S,
                "decode_s_per_value": codec_s_per_value(DECODE_S_PER_VALUE, self.uplink),
                "encode_s_per_value": codec_s_per_value(ENCODE_S_PER_VALUE, self.downlink),
                "source": RATES_SOURCE,
            },
            "to_fit": self.to_fit(),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmLoad:
    """The `average` warm start through the coordinator: every island's update in (in the
    run's `compression.codec`) and the average out in fp32 (`engine/warm_start.py`: islands
    and coordinator hold the same parameters) every `warm_start.inner_steps` steps, against
    the islands' compute over the warm steps. At 1 B parameters on 16 islands that is 64 GB
    out an average: one head, not the islands, would set the pace. The warm phase averages
    on the run's slices, each on a node of its own with its own card: the busiest card
    carries 1/`slices` of it."""

    params: int
    islands: int
    slices: int
    uplink: str  # compression.codec, which the warm phase's islands send in
    up_bytes: int  # what one island sends an average
    link_gbps: float
    step_s: float
    steps: int
    averages: int

    @property
    def bytes(self) -> int:
        """Through the coordinator's cards (the head's, or its slices'), in and out, over the
        whole warm start."""
        return self.islands * self.averages * (self.up_bytes + 4 * self.params)

    @property
    def seconds(self) -> float:
        """The busiest coordinator's (a slice's: each takes its part of every island's
        bytes, decoding and mean on its own node): each average's bytes in or out, whichever
        is more (a full-duplex card carries both at once; out, fp32, unless a codec grows
        the bytes), and decoding and averaging every island's update."""
        card = self.link_gbps * 1e9 / 8
        part = self.params / self.slices
        wire = self.islands * max(self.up_bytes, 4 * self.params) / self.slices / card
        decode = codec_s_per_value(DECODE_S_PER_VALUE, self.uplink)
        return self.averages * (wire + (STEP_S_PER_VALUE["mean"] + decode) * part * self.islands)

    @property
    def share(self) -> float:
        return self.seconds / (self.steps * self.step_s)

    def lines(self) -> list[str]:
        verdict = "within" if self.share <= TARGET_SHARE else "OVER"
        through = "the head" if self.slices == 1 else f"the {self.slices} coordinator slices"
        up = "fp32" if self.uplink == "none" else self.uplink
        out = [
            f"head: the average warm start moves {self.bytes / 1e12:,.2f} TB through {through} ({self.averages} "
            f"averages of {self.islands} islands, up in {up}, down fp32): {self.seconds:,.0f} s of the "
            "busiest against the "
            f"islands' {self.steps * self.step_s:,.0f} s of warm steps, share {self.share:.2f}, {verdict} "
            f"{TARGET_SHARE:.2f}"
        ]
        if self.share > TARGET_SHARE:
            out.append(
                "head: to fit the warm start, start from a trained model (init_from), average less often or "
                "step on more coordinator slices"
            )
        return out

    def refusal(self) -> str | None:
        if self.share <= 1.0:
            return None
        return (
            f"the average warm start would keep the head busy {self.share:.1f}x as long as the islands compute "
            f"({self.bytes / 1e12:,.2f} TB through {self.slices} card{'s' if self.slices > 1 else ''}): the head, "
            "not the islands, would set its pace. Start from a trained model (init_from), average less often "
            "(warm_start.inner_steps) or step on more coordinator slices (coordinator.shards, each on a node of "
            "its own)"
        )


def warm_load(cfg: RunConfig, params: int, *, link_gbps: float, step_s: float) -> WarmLoad | None:
    """The head's load of `cfg`'s warm start, if it averages through the head."""
    if not cfg.warm_steps or cfg.warm_start.mode != WarmStartMode.AVERAGE or cfg.islands.count < 2:
        return None
    return WarmLoad(
        params=params,
        islands=cfg.islands.count,
        slices=cfg.coordinator.slices,
        uplink=cfg.compression.codec,
        up_bytes=int(uplink_bytes_per_value(cfg) * params),
        link_gbps=link_gbps,
        step_s=step_s,
        steps=cfg.warm_steps,
        averages=math.ceil(cfg.warm_steps / cfg.warm_start.inner_steps),
    )


def head_load(cfg: RunConfig, params: int, *, link_gbps: float, step_s: float) -> HeadLoad:
    """The head's load for `cfg` at `params` parameters, each island's bytes a round by its codecs."""
    return HeadLoad(
        params=params,
        islands=cfg.islands.count,
        slices=cfg.coordinator.slices,
        link_gbps=link_gbps,
        step_s=step_s,
        inner_steps=cfg.inner_steps,
        up_bytes=int(uplink_bytes_per_value(cfg) * params),
        down_bytes=int(downlink_bytes_per_value(cfg) * params),
        merge="radial" if cfg.merge == OuterMerge.RADIAL_DIRECTIONAL else "mean",
        uplink=cfg.compression.codec,
        downlink=cfg.compression.downlink,
        state_values=rule_of(cfg).state_values(cfg),
        checkpoint_every=cfg.checkpoint.every_rounds,
        hang_floor_s=cfg.elastic.hang_floor_s,
        sliceable=mode_of(cfg).pseudo_gradients and not mode_of(cfg).tracks_copy,
    )


def _with_codecs(cfg: RunConfig, codec: str, downlink: str) -> RunConfig:
    return cfg.model_copy(
        update={"compression": cfg.compression.model_copy(update={"codec": codec, "downlink": downlink})}
    )


# what `compression.codec` and `.downlink: auto` choose between: exact, or int8 (a quarter of
# fp32's bytes with its scales). int8 both ways: the default run's eval loss 1.8990 against
# fp32's 1.8983 (64.4 MB exchanged, not 215.7), DiLoCo's in bench streaming 1.8401 against
# 1.8525 (docs/operations.md). The lossier codecs are left to a user who measured them on
# their model: int4 cost the bench's DiLoCo protocol 0.9 % of eval loss.
AUTO_CANDIDATES = ("none", "int8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecChoice:
    """What `auto` resolved to, and why: the head's seconds a round under each candidate
    pair, at the link the plan priced. A tie goes to the exact codec."""

    codec: str
    downlink: str
    seconds: dict[str, float]  # "codec/downlink" -> the head's seconds a round
    link_gbps: float

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with the chosen codecs in place of `auto` (what the run trains with and records)."""
        return _with_codecs(cfg, self.codec, self.downlink)

    def lines(self) -> list[str]:
        priced = ", ".join(f"{pair} {s:.2f} s" for pair, s in self.seconds.items())
        return [
            f"codecs: auto chose codec {self.codec}, downlink {self.downlink}: the head's seconds a round at "
            f"{self.link_gbps:g} Gbit/s by codec/downlink: {priced}"
        ]

    def as_dict(self) -> dict[str, Any]:
        return {"codec": self.codec, "downlink": self.downlink, "seconds": self.seconds, "link_gbps": self.link_gbps}


def choose_codecs(cfg: RunConfig, params: int, *, link_gbps: float, step_s: float) -> CodecChoice | None:
    """Resolve `compression.codec` / `.downlink: auto` (None: neither is auto): the pair of
    `AUTO_CANDIDATES` that costs the head fewest seconds a round — the bytes a codec saves
    on the card against the decoding and encoding it adds to the head's CPU. At 1 B
    parameters and 16 islands that is int8 at 1 and 10 Gbit/s and exact fp32 at 100; at the
    default run's size, exact. Gradients (mode ddp) stay exact: no codec was measured
    lossless on them. The downlink's codec needs islands that hold the published copy
    (whole islands or zero1 groups, under one coordinator or its slices, which keep a part
    each): for FSDP islands `auto` there is exact."""
    if not cfg.codecs_left_to_plan:
        return None
    c, family = cfg.compression, mode_of(cfg).pseudo_gradients
    holds_copy = family and cfg.copy_needs() is None
    seconds: dict[tuple[str, str], float] = {}
    for candidate in AUTO_CANDIDATES if family else AUTO_CANDIDATES[:1]:
        up = candidate if c.codec == AUTO_CODEC else c.codec
        down = (candidate if holds_copy else "none") if c.downlink == AUTO_CODEC else c.downlink
        trial = _with_codecs(cfg, up, down)
        seconds.setdefault((up, down), head_load(trial, params, link_gbps=link_gbps, step_s=step_s).seconds_per_round)
    codec, downlink = min(seconds, key=lambda pair: seconds[pair])  # the first of equals: exact
    return CodecChoice(
        codec=codec,
        downlink=downlink,
        seconds={f"{up}/{down}": s for (up, down), s in seconds.items()},
        link_gbps=link_gbps,
    )


def with_shards(cfg: RunConfig, shards: int) -> RunConfig:
    """`cfg` stepping on `shards` coordinator slices."""
    return cfg.model_copy(update={"coordinator": cfg.coordinator.model_copy(update={"shards": shards})})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceChoice:
    """What `coordinator.shards: auto` resolved to, and why: the head's share of a round by
    the number of slices tried (each priced with the codecs `auto` picks for it), up to the
    nodes the cluster offers slices on. `why`: the reason it is one coordinator untried."""

    shards: int
    offered: int  # nodes offering coordinator.slice_resource (a slices group's most)
    shares: dict[int, float]  # slices -> the head's share of a round
    why: str | None = None

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with the chosen shards in place of `auto`."""
        return with_shards(cfg, self.shards)

    def lines(self) -> list[str]:
        chose = f"slices: auto chose coordinator.shards {self.shards}"
        if self.why is not None:
            return [f"{chose}: {self.why}"]
        offered = f"the cluster offers {self.offered} slice nodes"
        if self.shards == 1:
            return [
                f"{chose}: one coordinator's share of a round is {self.shares[1]:.3f}, within {TARGET_SHARE:.2f} ({offered})"
            ]
        tried = ", ".join(f"{s} {share:.3f}" for s, share in self.shares.items())
        verdict = (
            f"the fewest within a share of {TARGET_SHARE:.2f}"
            if self.shares[self.shards] <= TARGET_SHARE
            else f"none is within a share of {TARGET_SHARE:.2f}, so all {self.shards} (for more, raise the slices "
            "group's maxReplicas and the head's archipelago.io/slice-nodes with it)"
        )
        return [f"{chose}, {verdict} ({offered}; the head's share by slices: {tried})"]

    def as_dict(self) -> dict[str, Any]:
        return {"shards": self.shards, "offered": self.offered, "shares": self.shares, "why": self.why}


def choose_slices(cfg: RunConfig, params: int, *, link_gbps: float, step_s: float, offered: int) -> SliceChoice | None:
    """Resolve `coordinator.shards: auto` (None: it is a number): the fewest slices, each on
    one of the `offered` nodes, that bring the head's share of a round within
    `TARGET_SHARE`, each count priced with the codecs `auto` would pick for it; all of them
    when none does, since every slice takes the islands' bytes through a card of its own.
    One coordinator where the mode steps on one (streaming's fragments, data-parallel) or
    where the cluster offers fewer than two slice nodes: the head's lines then say what it
    would take."""
    if cfg.coordinator.shards != AUTO_SHARDS:
        return None
    row = mode_of(cfg)
    resource = cfg.coordinator.slice_resource
    why = None
    if not row.pseudo_gradients or row.tracks_copy:
        why = f"mode {cfg.mode.name.value} steps on one coordinator"
    elif offered < 2:
        why = f"the cluster offers {offered} node{'s' if offered != 1 else ''} of {resource} (the manifests' slices group)"
    shares: dict[int, float] = {}
    for slices in range(1, 2 if why else min(offered, MAX_SHARDS) + 1):
        trial = with_shards(cfg, slices)
        codecs = choose_codecs(trial, params, link_gbps=link_gbps, step_s=step_s)
        load = head_load(codecs.apply(trial) if codecs else trial, params, link_gbps=link_gbps, step_s=step_s)
        shares[slices] = load.share
        if load.share <= TARGET_SHARE:
            break
    return SliceChoice(shards=max(shares), offered=offered, shares=shares, why=why)


def choose_head(
    cfg: RunConfig, params: int, *, link_gbps: float, step_s: float, offered: int
) -> tuple[SliceChoice | None, CodecChoice | None]:
    """What a plan resolves of the head `cfg` leaves `auto`: the slices first (each count
    priced with the codecs it would take), then the codecs for the slices chosen."""
    slices = choose_slices(cfg, params, link_gbps=link_gbps, step_s=step_s, offered=offered)
    if slices is not None:
        cfg = slices.apply(cfg)
    return slices, choose_codecs(cfg, params, link_gbps=link_gbps, step_s=step_s)
