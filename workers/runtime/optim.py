"""Inner optimizers and their learning-rate schedule (linear warmup, then cosine decay).

Pure torch. Used by every island for its inner steps and by the coordinator in `ddp`
mode, where the same optimizer steps once per batch on the averaged gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from workers.wire.spec import InnerConfig


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
