"""The optimizer the coordinator steps on the global parameters.

DiLoCo's outer step is torch's optimizer update on the flat global buffer, whose `.grad`
is the mean pseudo-gradient (ALGORITHMS §0): Nesterov SGD by default, plain SGD (lr 1,
momentum 0 = parameter averaging), both as `FlatSGD` (torch's SGD arithmetic, in place),
or stock `torch.optim.Adam`. In `ddp` mode the
same slot holds the inner AdamW, stepping on the mean gradient every batch.
"""
from __future__ import annotations

import torch

from orchestrator.config import OuterConfig, RunConfig
from orchestrator.flat_sgd import FlatSGD
from workers.optim import build_inner


def build_outer(cfg: OuterConfig, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    if cfg.optimizer == "nesterov":
        return FlatSGD([param], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.optimizer == "sgd":
        return FlatSGD([param], lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.Adam([param], lr=cfg.lr, betas=cfg.betas)


def build_server_optimizer(cfg: RunConfig, param: torch.nn.Parameter
                           ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    """Outer optimizer for `diloco`; the inner optimizer and its schedule for `ddp`."""
    if cfg.mode == "ddp":
        return build_inner(cfg.inner, [param], cfg.total_inner_steps)
    return build_outer(cfg.outer, param), None
