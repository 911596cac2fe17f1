"""Inner optimizers and their learning-rate schedule (linear warmup, then cosine decay).

Pure torch. Used by every island for its inner steps and by the coordinator in `ddp`
mode, where the same optimizer steps once per batch on the averaged gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import Enum
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


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


def lr_factor(step: int, cfg: InnerConfig, total_steps: int) -> float:
    """Multiplier of `cfg.lr` at inner step `step` (0-based) of `total_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def join_factor(step: int, start_step: int, cfg: InnerConfig, total_steps: int, rewarmup: int) -> float:
    """Schedule of an island that joins a run at global inner step `start_step`: it follows
    the run's schedule from there (not from the start: no spike from a fresh warmup peak
    late in training), ramping up linearly over `rewarmup` steps while its fresh Adam
    moments settle."""
    ramp = min(1.0, (step + 1) / rewarmup) if rewarmup else 1.0
    return ramp * lr_factor(start_step + step, cfg, total_steps)


def build_inner(
    cfg: InnerConfig, params: Iterable[torch.nn.Parameter], total_steps: int, start_step: int = 0, rewarmup: int = 0
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = list(params)
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=True
        )
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if start_step:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: join_factor(s, start_step, cfg, total_steps, rewarmup))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
    return opt, sched
