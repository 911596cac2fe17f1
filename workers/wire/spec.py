"""The island's part of the run config: its inner optimizer, how a group of workers
shares its state, and the pseudo-gradient codecs it may name. Part of the contract the
coordinator hands an island (`IslandSpec`), so the run config can validate it without
importing the island runtime (or torch): `import archipelago.orchestrator.config` stays light. The
codecs' registry is torch-free at import, so this reads its names and payload type."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .codecs import CODECS, Payload

CODEC_NAMES = tuple(CODECS)  # the value codecs of the registry (`wire/codecs/`)
# `compression.codec` / `compression.downlink: auto`: the run's plan picks the codec at launch
# (`orchestrator/plan/head.py`), so no island or coordinator ever builds one by this name
AUTO_CODEC = "auto"


def payload_nbytes(payload: Payload) -> int:
    """The bytes a payload puts on the link."""
    return sum(a.nbytes for a in payload.values())


class CodecSpecError(ValueError):
    """A codec chain that cannot be built: the message says which part and why."""


@dataclass(frozen=True)
class CodecChain:
    """A codec as config names it: a value codec (`int2`), optionally after chunked top-k
    (`topk:0.02+int2`: in each chunk keep the 2 % largest magnitudes, then quantise them)."""

    value: str
    topk: float | None = None

    @property
    def name(self) -> str:
        return self.value if self.topk is None else f"topk:{self.topk:g}+{self.value}"


def parse_codec(spec: str) -> CodecChain:
    """A registered value codec (`none`, `bf16`, `int8`, `int4`, `int2`, `fp4`; also `int:B`
    for B bits), or `topk:K+<value codec>` with K in (0, 1]; raises `CodecSpecError`
    naming what is wrong."""
    if spec == AUTO_CODEC:
        raise CodecSpecError(
            f"{AUTO_CODEC!r} is not a codec but a choice the run's plan makes at launch (`archipelago run`, "
            "`archipelago plan`): a config of codec auto is resolved before anything builds a codec"
        )
    parts = [p.strip() for p in spec.split("+")]
    topk = None
    if len(parts) == 2 and parts[0].startswith("topk"):
        _, _, k = parts[0].partition(":")
        try:
            topk = float(k)
        except ValueError:
            raise CodecSpecError(f"{parts[0]!r}: top-k needs a fraction, as in topk:0.02") from None
        if not 0 < topk <= 1:
            raise CodecSpecError(f"top-k fraction {topk:g} is outside (0, 1]")
        parts = parts[1:]
    if len(parts) != 1:
        raise CodecSpecError(f"{spec!r}: a chain is one value codec, optionally after topk:K (as in topk:0.02+int2)")
    value = parts[0]
    if value.startswith("int:"):
        bits = value[4:]
        if bits not in {"2", "4", "8"}:
            raise CodecSpecError(f"{value!r}: quantisation bits must be 2, 4 or 8")
        value = f"int{bits}"
    if value not in CODEC_NAMES:
        raise CodecSpecError(f"unknown codec {value!r}; choose one of {sorted(CODEC_NAMES)}, optionally after topk:K")
    return CodecChain(value, topk)


class Sharding(str, Enum):
    """How an island of several workers splits its state (`islands.sharding`)."""

    ZERO1 = "zero1"  # every worker holds the model; the optimizer state is sliced
    FSDP = "fsdp"  # parameters, gradients and optimizer state are sharded (FSDP2)


class IslandRound(str, Enum):
    """What an island does with a work order, named by each mode's registry row
    (`orchestrator/modes.py`); one strategy each in `workers/runtime/rounds.py`."""

    GRADIENT = "gradient"  # one batch's gradient, no local update (ddp)
    INNER = "inner"  # H inner steps, Δ of the whole model (diloco, async, overlap)
    EAGER = "eager"  # as INNER, from the published parameters moved by its own last Δ (mode.eager)
    FRAGMENTS = "fragments"  # one fragment's Δ against its tracked copy (streaming)


class Precision(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"  # autocast: bf16 matmuls, fp32 master weights, optimizer state and pseudo-gradients


class InnerConfig(BaseModel):
    """Inner optimizer of each island (DiLoCo paper: AdamW lr 4e-4, warmup, wd 0.1)."""

    model_config = ConfigDict(extra="forbid")
    optimizer: Literal["adamw", "sgd", "muon"] = Field(
        "adamw",
        description="inner optimizer; each island keeps its state across rounds. muon (MuLoCo): torch's Muon for "
        "the hidden matrices (linear layers' weights), AdamW for embeddings, the output layer, norms and biases",
    )
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    muon_lr: float | None = Field(
        None,
        gt=0,
        description="optimizer muon: peak lr of the Muon group (null: lr; Muon's update is scaled to AdamW's RMS, "
        "so one lr suits both groups as a start)",
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="optimizer muon: Muon's Nesterov momentum")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay (adamw) or L2 (sgd)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="adamw betas")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (sgd only)")
    warmup_steps: int = Field(50, ge=0, description="linear warmup steps at the start of the run's inner schedule")
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="after warmup: cosine decay over the run's inner steps, or constant"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    schedule_steps: int | None = Field(
        None,
        ge=1,
        description="length of the schedule in inner steps per island (default: the run's, its warm start included)",
    )
    grad_clip: float | None = Field(1.0, gt=0, description="clip grad norm before each step; null disables")
    precision: Precision = Field(
        Precision.FP32,
        description="fp32, or bf16: forward and backward under bfloat16 autocast; weights, optimizer state and "
        "pseudo-gradients stay fp32",
    )
    micro_batches: int = Field(
        1, ge=1, description="gradient accumulation: each batch in this many equal parts (same step, less memory)"
    )
    compile: bool | None = Field(
        None,
        description="torch.compile the model for the islands' forward passes; null: where the island runs on "
        "CUDA (compiled once a process; the manifests keep Inductor's cache on the node), not on the CPU, where "
        "compiling costs more than it saves on the default's small model",
    )

    def compiles_on(self, device: str) -> bool:
        """Whether an island on `device` (a torch device type) compiles its forward."""
        return self.compile if self.compile is not None else device == "cuda"
