"""The `mode` section: one settings class per mode, chosen by its `name` (a discriminated
union), so a run's config holds the settings of its own mode and no other — a CO2
momentum in a DiLoCo run is an unknown key, refused by name like a typo, instead of a
section every run carries and most ignore.

```yaml
mode:
  name: async          # or the shorthand `mode: async`, every setting at its default
  quorum: 3
```

Settings more than one mode reads are one mixin, written once: the quorum rule's
(`QuorumSettings`: mode async, and streaming's quorum pacing) and the staleness bound of a
pacing that admits late results (`StalenessSettings`: async, DiLoCo with DyLU, streaming's
quorum). Where one setting decides whether others are read (streaming's `pacing`, DiLoCo's
`dylu`), the class says so in `unread`, and one changed from its default where it is not
read is refused, naming both. Torch-free and below the registry (`modes.py`), whose rows
name these classes; the config builds the union from those rows."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, model_validator

from .config_sections import Strict


class Mode(str, Enum):
    """How rounds are paced and which outer rule steps (one row of `modes.MODES` each)."""

    DILOCO = "diloco"  # barrier rounds, one outer step per round
    DDP = "ddp"  # barrier per batch: the data-parallel baseline
    ASYNC = "async"  # per-arrival: every pseudo-gradient applied when it lands (Delayed Nesterov)
    OVERLAP = "overlap"  # one-round lag: CO2, the exchange of round t hidden behind round t+1
    STREAMING = "streaming"  # Streaming DiLoCo: P fragments synchronised on a staggered schedule


NAME = "the mode: `mode: M` alone is short for `mode: {name: M}`, every setting of the mode at its default"


class ModeSettings(Strict):
    """What every mode's settings have: the mode's name (the union's discriminator), and
    which of its own settings these leave unread."""

    name: Mode

    def unread(self) -> tuple[frozenset[str], str]:
        """The settings these leave unread, and the setting that would read them."""
        return frozenset(), ""

    @model_validator(mode="after")
    def _read(self) -> ModeSettings:
        fields, needs = self.unread()
        for name in sorted(fields):
            field = type(self).model_fields[name]
            if getattr(self, name) != field.get_default(call_default_factory=True):
                raise ValueError(
                    f"mode.{name} is set, but a run of mode {self.name.value} reads it only with {needs}: "
                    "remove it or change that setting"
                )
        return self


class StalenessSettings(ModeSettings):
    """A pacing that admits results of older versions (DyLU's, the quorum's) bounds them."""

    max_staleness: int | None = Field(None, ge=0, description="beyond this, apply stale_policy")
    stale_policy: Literal["reject", "downweight"] = Field(
        "reject",
        description="past max_staleness: reject, or scale by 1/(1 + staleness - max_staleness)",
    )


STALENESS = frozenset(StalenessSettings.model_fields) - {"name"}


class QuorumSettings(StalenessSettings):
    """The quorum rule: a step per quorum of results and an adaptive grace window (mode async,
    and streaming's quorum pacing); its four numbers can be changed live (`PATCH /settings`)."""

    quorum: int | None = Field(
        None, ge=1, description="rule quorum: results that open a step (null: half the live islands, rounded up)"
    )
    grace_cap: float = Field(
        0.25, ge=0, description="rule quorum: the grace window is at most this fraction of a round's duration"
    )
    grace_k: float = Field(
        3.0, ge=0, description="rule quorum: grace window = median + k x MAD of recent arrival offsets (capped)"
    )
    age_power: float = Field(
        1.0, ge=0, description="rule quorum: a result a versions old merges with weight tokens x (1 + a)^-age_power"
    )
    dylu: bool = Field(True, description="Dynamic Local Updates: H per island from its measured speed")


QUORUM = frozenset(QuorumSettings.model_fields) - {"name"} - STALENESS


def check_quorum(quorum: int | None, islands: int) -> None:
    """A quorum no larger than the islands there are (at launch, or the run's target)."""
    if quorum is not None and quorum > islands:
        raise ValueError(f"mode.quorum = {quorum} is above the run's {islands} islands")


class DilocoSettings(StalenessSettings):
    """`mode: diloco`: synchronous DiLoCo, one outer step per round of every island."""

    name: Literal[Mode.DILOCO] = Field(Mode.DILOCO, description=NAME)
    dylu: bool = Field(
        False,
        description="Dynamic Local Updates in a barrier round: each island's H follows its measured speed, so "
        "the islands of a round finish together and none waits for the slowest (sync_dylu); a late result is "
        "then admitted by max_staleness / stale_policy",
    )

    def unread(self) -> tuple[frozenset[str], str]:
        return (frozenset(), "") if self.dylu else (STALENESS, "mode.dylu: true")


class DdpSettings(ModeSettings):
    """`mode: ddp`: the data-parallel baseline (gradients averaged every step, one AdamW
    using `inner`); no settings of its own."""

    name: Literal[Mode.DDP] = Field(Mode.DDP, description=NAME)


class AsyncRule(str, Enum):
    QUORUM = "quorum"  # a step per quorum + adaptive grace window, token-weighted and age-aware
    DELAYED_NESTEROV = "delayed_nesterov"  # Liu et al. 2024: a step per arrival, momentum every N
    NAIVE = "naive"  # the `outer` optimizer stepped on every arrival (over-accelerates)


class AsyncSettings(QuorumSettings):
    """`mode: async`: asynchronous Local-SGD, the coordinator stepping as results arrive."""

    name: Literal[Mode.ASYNC] = Field(Mode.ASYNC, description=NAME)
    rule: AsyncRule = Field(
        AsyncRule.QUORUM,
        description="quorum (the `outer` optimizer stepped on what a quorum and its grace window bring, "
        "token-weighted, stale results discounted by age; the default: in `bench hetero` it reached sync's loss in "
        "a third of its time, beat delayed_nesterov at equal time and on the harsh fleet, and tied it at equal "
        "tokens), delayed_nesterov (Liu et al. 2024, per arrival, the paper's method), or "
        "naive (the `outer` optimizer stepped on every arrival: the paper's baseline that over-accelerates)",
    )
    delay: int | None = Field(None, ge=1, description="DN's N (default: the number of islands)")
    token_weighted: bool = Field(
        True,
        description="delayed_nesterov / naive: scale each arrival by its inner steps over the islands' mean H, so "
        "DyLU's short and long updates weigh by their tokens (false: equally, as in the paper)",
    )
    c: float = Field(0.0, ge=0, le=1, description="DN momentum fraction between updates, in [0, 1/N]")

    def check_c(self, islands: int) -> None:
        """Delayed Nesterov's momentum fraction between updates may not exceed 1/N (N: `delay`,
        else the islands): the rule, once for the config file and the algorithm's callers."""
        n = self.delay or islands
        if self.c > 1.0 / n:
            raise ValueError(f"mode.c must be at most 1/N = {1 / n:g}")


class OverlapSettings(ModeSettings):
    """`mode: overlap`: CO2, communication hidden behind the next round's computation.
    Defaults: the best CO2 of `bench overlap` (docs/benchmarks.md): alpha 1, beta 0.5, eager
    updates, no gap penalty, clip 1 (2.0054 against 2.0962 for the authors' <= 16-worker
    defaults, alpha 1 and beta 0, without eager updates, which needed alpha 0.7 here)."""

    name: Literal[Mode.OVERLAP] = Field(Mode.OVERLAP, description=NAME)
    lr: float = Field(1.0, gt=0, description="alpha, outer learning rate")
    momentum: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="beta, heavy-ball outer momentum (0.5 beat 0 by 4 % with eager updates in `bench overlap`)",
    )
    clip: float | None = Field(1.0, gt=0, description="phi, element-wise outer momentum clip; null disables")
    penalty: Literal["constant", "adaptive"] = Field(
        "constant",
        description="staleness gap penalty Lambda: constant = 1/p (the released code), "
        "adaptive = 1/(1 + lambda ||x_n - x_s|| / (||delta|| + eps))",
    )
    penalty_p: float = Field(1.0, ge=1, description="constant penalty: Lambda = 1/p (1 = none)")
    penalty_lambda: float = Field(1.0, ge=0, description="adaptive penalty strength")
    eager: bool = Field(
        True,
        description="eager updates (Kale et al. 2025): an island starting round t+1 from the version before its "
        "round t landed starts from that version moved by its own round-t pseudo-gradient, standing in for the "
        "average still in flight (lr x Lambda, clipped like the momentum), instead of from the lagged version",
    )


class StreamingPacing(str, Enum):
    BARRIER = "barrier"  # every island's segment, then the fragment's step (Streaming DiLoCo)
    QUORUM = "quorum"  # the quorum rule per fragment (Decoupled DiLoCo's pacing)


class StreamingSettings(QuorumSettings):
    """`mode: streaming` (Streaming DiLoCo, Douillard et al. 2025): the model is cut into P
    fragments by layer; a round of H inner steps is P segments of H/P, and the segment
    that ends at step t sends fragment (t / (H/P) - 1) mod P, so each fragment is
    synchronised every H steps and the link carries 1/P of the model at a time. Each
    fragment has its own outer optimizer state. The quorum rule's settings are read with
    `pacing: quorum` only."""

    name: Literal[Mode.STREAMING] = Field(Mode.STREAMING, description=NAME)
    fragments: int = Field(4, ge=1, le=64, description="P: fragments (inner_steps must be a multiple of it)")
    tau: int | None = Field(
        None,
        ge=0,
        description="overlap in inner steps: a fragment's pseudo-gradient leaves tau steps before its segment "
        "ends and the new global fragment is merged when the segment ends, so its exchange hides behind tau "
        "steps of compute; 0 to H/P - 1; null: a fifth of a segment (5 steps at H = 100, P = 4)",
    )
    pacing: StreamingPacing = Field(
        StreamingPacing.BARRIER,
        description="barrier (a fragment steps once every island sent it) or quorum (asynchronous: the quorum "
        "rule and its grace window, mode.quorum/grace_cap/grace_k/age_power/dylu, each fragment stepped on its "
        "own results)",
    )
    alpha: float = Field(
        0.0,
        ge=0,
        le=1,
        description="merge of a received fragment: local <- alpha x local + (1 - alpha) x global (0: replace, "
        "as DiLoCo does; the paper uses 0.5 with overlap, 0 measured better here: see docs/modes.md)",
    )

    def unread(self) -> tuple[frozenset[str], str]:
        quorum = self.pacing == StreamingPacing.QUORUM
        return (frozenset(), "") if quorum else (QUORUM | STALENESS, "mode.pacing: quorum")

    def tau_of(self, inner_steps: int) -> int:
        """τ resolved: `tau`, or a fifth of a segment when null."""
        return self.tau if self.tau is not None else inner_steps // self.fragments // 5

    def check_inner_steps(self, inner_steps: int) -> None:
        """H a whole number of segments, and τ shorter than one: a fragment leaves after at
        least one step of its segment (at launch, and when an operator changes H)."""
        if inner_steps % self.fragments:
            raise ValueError(f"inner_steps = {inner_steps} must be a multiple of mode.fragments = {self.fragments}")
        segment = inner_steps // self.fragments
        if self.tau is not None and self.tau >= segment:
            raise ValueError(
                f"mode.tau = {self.tau} must be shorter than a segment (inner_steps / fragments = {segment}): "
                "a fragment leaves after at least one step of its segment"
            )
