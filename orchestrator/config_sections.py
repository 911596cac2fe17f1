"""The run config's sections that choose and tune what the coordinator steps with: the
outer optimizer and the codecs (each mode's own settings: `mode_settings.py`). Kept apart
from `config.py` (the run as a whole and its cross-field checks), which imports them;
every section is strict, so a misspelt key is an error naming it."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from archipelago.workers.wire.codecs import CODECS
from archipelago.workers.wire.spec import AUTO_CODEC, CodecSpecError, parse_codec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
        "reads each one twice (its norm first); coordinator slices sum each norm exactly, so S slices "
        "step as one coordinator does); not in mode ddp. null (default): radial_directional in mode async (its final loss was lower than the "
        "mean's in 11 of 12 bench fleet runs: 16 and 64 islands, 3 seeds, 2 outer lrs), mean elsewhere",
    )

    @property
    def merged(self) -> OuterMerge:
        """`merge` resolved: a run's config resolves null by its mode; this section alone
        (a rule built from it, as tests do) merges by the mean."""
        return self.merge or OuterMerge.MEAN


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
        "int8 only where islands can hold that copy (not FSDP islands); coordinator slices each keep their part "
        "of it",
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
