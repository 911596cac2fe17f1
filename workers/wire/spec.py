"""The island's part of the run config: its inner optimizer, how a group of workers
shares its state, and the names of the pseudo-gradient codecs. Part of the contract the
coordinator hands an island (`IslandSpec`), so the run config can validate it without
importing the island runtime (or torch): `import orchestrator.config` stays light."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# the codecs `wire/compress.py` registers (a test keeps the two in step)
CODEC_NAMES = ("none", "bf16", "int8", "int4")


class Sharding(str, Enum):
    """How an island of several workers splits its state (`islands.sharding`)."""

    ZERO1 = "zero1"  # every worker holds the model; the optimizer state is sliced
    FSDP = "fsdp"  # parameters, gradients and optimizer state are sharded (FSDP2)


class Precision(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"  # autocast: bf16 matmuls, fp32 master weights, optimizer state and pseudo-gradients


class InnerConfig(BaseModel):
    """Inner optimizer of each island (DiLoCo paper: AdamW lr 4e-4, warmup, wd 0.1)."""

    model_config = ConfigDict(extra="forbid")
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="inner optimizer; each island keeps its state across rounds"
    )
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
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
    compile: bool = Field(False, description="torch.compile the model for the islands' forward passes")
