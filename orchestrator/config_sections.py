"""The run config's sections that choose and tune the outer step of each mode: the outer
optimizer, the asynchronous rules, sync + DyLU, CO2, Streaming DiLoCo and the codecs. Kept
apart from `config.py` (the run as a whole and its cross-field checks), which imports
them; every section is strict, so a misspelt key is an error naming it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from archipelago.workers.wire.codecs import CODECS
from archipelago.workers.wire.spec import AUTO_CODEC, CodecSpecError, parse_codec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# What a run reads of the mode sections: section -> its fields (None: all of them). Every
# mode's speed tracker (deadlines, DyLU) reads `asynchronous.speed_smoothing`; a pacing that
# admits late results reads its staleness settings, and the quorum rule its own.
Reads = dict[str, frozenset[str] | None]
SPEEDS = frozenset({"speed_smoothing"})
STALENESS = frozenset({"max_staleness", "stale_policy"})
QUORUM = frozenset({"quorum", "grace_cap", "grace_k", "age_power", "dylu"})


class ModeSection(Strict, ABC):
    """A mode's own section: it says what a run of its mode reads of every mode section, so
    a setting the run would never read is refused (`RunConfig.settings_read`)."""

    @abstractmethod
    def reads(self) -> Reads: ...


class OuterOptimizer(str, Enum):
    """The outer optimizers of the `outer` section (`engine/step/rules.py` has their rows)."""

    NESTEROV = "nesterov"
    SGD = "sgd"
    ADAM = "adam"
    SPARSELOCO = "sparseloco"


class OuterMerge(str, Enum):
    """How the admitted pseudo-gradients become the one the outer optimizer steps on."""

    MEAN = "mean"  # token-weighted mean (DiLoCo)
    RADIAL_DIRECTIONAL = "radial_directional"  # mean norm x mean direction (Decoupled DiLoCo)


class OuterConfig(Strict):
    """Outer optimizer stepped on the token-weighted mean pseudo-gradient (docs/algorithms.md)."""

    optimizer: OuterOptimizer = Field(
        OuterOptimizer.NESTEROV,
        description="nesterov (torch SGD's Nesterov update, in place); sgd with lr 1 and momentum 0 is plain "
        "parameter averaging (FedAvg); adam; sparseloco (SparseLoCo: a plain step on the mean of what the islands "
        "sent, their error-feedback buffers taking momentum's place; needs compression.error_feedback)",
    )
    lr: float = Field(0.7, gt=0, description="outer learning rate (DiLoCo paper: 0.7)")
    momentum: float = Field(0.9, ge=0, lt=1, description="nesterov/sgd momentum")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam betas")
    merge: OuterMerge | None = Field(
        None,
        description="mean (the token-weighted mean of the pseudo-gradients) or radial_directional (Decoupled "
        "DiLoCo's Radial-Directional Averaging: the token-weighted mean of their norms times the direction of the "
        "token-weighted mean of their unit vectors, so updates that disagree do not shrink the step; its merge "
        "reads each one twice and has no one-pass kernel; coordinator slices sum each norm exactly, so S slices "
        "step as one coordinator does); not in mode ddp. null (default): radial_directional in mode async (its final loss was lower than the "
        "mean's in 11 of 12 bench fleet runs: 16 and 64 islands, 3 seeds, 2 outer lrs), mean elsewhere",
    )

    @property
    def merged(self) -> OuterMerge:
        """`merge` resolved: a run's config resolves null by its mode; this section alone
        (a rule built from it, as tests do) merges by the mean."""
        return self.merge or OuterMerge.MEAN


class AsyncRule(str, Enum):
    QUORUM = "quorum"  # a step per quorum + adaptive grace window, token-weighted and age-aware
    DELAYED_NESTEROV = "delayed_nesterov"  # Liu et al. 2024: a step per arrival, momentum every N
    NAIVE = "naive"  # the `outer` optimizer stepped on every arrival (over-accelerates)


class AsyncConfig(ModeSection):
    """`mode: async` settings (section `asynchronous`)."""

    rule: AsyncRule = Field(
        AsyncRule.QUORUM,
        description="quorum (the `outer` optimizer stepped on what a quorum and its grace window bring, "
        "token-weighted, stale results discounted by age; the default: in `bench hetero` it reached sync's loss in "
        "a third of its time, beat delayed_nesterov at equal time and on the harsh fleet, and tied it at equal "
        "tokens), delayed_nesterov (Liu et al. 2024, per arrival, the paper's method), or "
        "naive (the `outer` optimizer stepped on every arrival: the paper's baseline that over-accelerates)",
    )
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
    delay: int | None = Field(None, ge=1, description="DN's N (default: the number of islands)")
    token_weighted: bool = Field(
        True,
        description="delayed_nesterov / naive: scale each arrival by its inner steps over the islands' mean H, so "
        "DyLU's short and long updates weigh by their tokens (false: equally, as in the paper)",
    )
    c: float = Field(0.0, ge=0, le=1, description="DN momentum fraction between updates, in [0, 1/N]")
    dylu: bool = Field(True, description="Dynamic Local Updates: H per island from its measured speed")
    speed_smoothing: float = Field(0.5, ge=0, lt=1, description="EMA factor of measured steps/s")
    max_staleness: int | None = Field(None, ge=0, description="beyond this, apply stale_policy")
    stale_policy: Literal["reject", "downweight"] = Field(
        "reject",
        description="past max_staleness: reject, or scale by 1/(1 + staleness - max_staleness)",
    )

    def reads(self) -> Reads:
        return {"asynchronous": None}

    def check_c(self, islands: int) -> None:
        """Delayed Nesterov's momentum fraction between updates may not exceed 1/N (N: `delay`,
        else the islands): the rule, once for the config file and the algorithm's callers."""
        n = self.delay or islands
        if self.c > 1.0 / n:
            raise ValueError(f"asynchronous.c must be at most 1/N = {1 / n:g}")

    @staticmethod
    def check_quorum(quorum: int | None, islands: int) -> None:
        """A quorum no larger than the islands there are (at launch, or the run's target)."""
        if quorum is not None and quorum > islands:
            raise ValueError(f"asynchronous.quorum = {quorum} is above the run's {islands} islands")


class DilocoConfig(ModeSection):
    """`mode: diloco` settings (section `diloco`)."""

    dylu: bool = Field(
        False,
        description="Dynamic Local Updates in a barrier round: each island's H follows its measured speed, so "
        "the islands of a round finish together and none waits for the slowest (sync_dylu)",
    )

    def reads(self) -> Reads:
        """With DyLU a barrier admits late results by `asynchronous`'s staleness settings."""
        return {"diloco": None, "asynchronous": SPEEDS | STALENESS if self.dylu else SPEEDS}


class OverlapConfig(ModeSection):
    """`mode: overlap` (CO2) outer step. Defaults: the best CO2 of `bench overlap` (docs/benchmarks.md):
    alpha 1, beta 0.5, eager updates, no gap penalty, clip 1 (2.0054 against 2.0962 for the authors'
    <= 16-worker defaults, alpha 1 and beta 0, without eager updates, which needed alpha 0.7 here)."""

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

    def reads(self) -> Reads:
        return {"overlap": None, "asynchronous": SPEEDS}


class StreamingPacing(str, Enum):
    BARRIER = "barrier"  # every island's segment, then the fragment's step (Streaming DiLoCo)
    QUORUM = "quorum"  # the quorum rule per fragment (`asynchronous.*` settings; Decoupled DiLoCo's pacing)


class StreamingConfig(ModeSection):
    """`mode: streaming` (Streaming DiLoCo, Douillard et al. 2025): the model is cut into P
    fragments by layer; a round of H inner steps is P segments of H/P, and the segment
    that ends at step t sends fragment (t / (H/P) - 1) mod P, so each fragment is
    synchronised every H steps and the link carries 1/P of the model at a time. Each
    fragment has its own outer optimizer state."""

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
        "rule and its grace window, `asynchronous.quorum/grace_cap/grace_k/age_power/dylu`, each fragment "
        "stepped on its own results)",
    )
    alpha: float = Field(
        0.0,
        ge=0,
        le=1,
        description="merge of a received fragment: local <- alpha x local + (1 - alpha) x global (0: replace, "
        "as DiLoCo does; the paper uses 0.5 with overlap, 0 measured better here: see docs/modes.md)",
    )

    def reads(self) -> Reads:
        """Streaming's quorum pacing is the quorum rule, with its settings."""
        quorum = self.pacing == StreamingPacing.QUORUM
        return {"streaming": None, "asynchronous": SPEEDS | STALENESS | QUORUM if quorum else SPEEDS}

    def check_inner_steps(self, inner_steps: int) -> None:
        """H must be a whole number of segments (at launch, and when an operator changes it)."""
        if inner_steps % self.fragments:
            raise ValueError(
                f"inner_steps = {inner_steps} must be a multiple of streaming.fragments = {self.fragments}"
            )


class CompressionConfig(Strict):
    """Codecs of what islands send (pseudo-gradients; gradients in ddp) and receive."""

    codec: str = Field(
        "none",
        description="one of "
        + ", ".join(f"{c.name} ({c.about})" for c in CODECS.values())
        + ", the quantised ones with one fp32 scale per chunk; or a chain topk:K+<codec>: in each chunk only the fraction K of "
        "largest magnitudes, their positions (2 bytes each) and values in that codec (SparseLoCo: topk:0.02+int2 "
        "with error_feedback); decoded and accumulated in fp32; or auto: the run's plan picks none or int8 "
        "(a quarter of the bytes; both ways the default run's loss 1.8990 against 1.8983) by the head's seconds a "
        "round at the head's stated link, once at launch (DiLoCo-family modes; needs preflight)",
    )
    downlink: str = Field(
        "none",
        description="codec of what islands receive: none sends the new parameters (a fragment of them in mode "
        "streaming); a lossy codec sends the change of the copy islands hold, and the coordinator applies the "
        "same decoded change to its published copy, so islands and coordinator never drift; auto: as for codec, "
        "int8 only where islands can hold that copy (one coordinator, zero1)",
    )
    chunk: int = Field(
        512,
        ge=16,
        description="values per int8/int4 scale (also the alignment of coordinator slices, and the rows RDA's "
        "exact norms are summed over); 512 costs int4 1.6% "
        "more bytes than 4096 and cost streaming 0.25% of eval loss against 1.4% (bench streaming)",
    )
    error_feedback: bool = Field(
        False,
        description="islands keep what a lossy codec rounded away and add it to their next pseudo-gradient, so "
        "the rounding does not accumulate over rounds",
    )
    feedback_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="error feedback's residual is decay x residual + the new pseudo-gradient (1: classic error "
        "feedback; SparseLoCo uses 0.95, the buffer then acting as outer momentum)",
    )

    @field_validator("codec", "downlink")
    @classmethod
    def _chain(cls, spec: str) -> str:
        if spec == AUTO_CODEC:
            return spec
        try:
            parse_codec(spec)
        except CodecSpecError as err:
            raise ValueError(str(err)) from None
        return spec
