"""Which outer-step server a run uses, built over a flat parameter buffer: the whole
model on a single coordinator, or one slice of it on a coordinator shard (there without
the norm guard and the round drop, which are decided once for the whole vector)."""
from __future__ import annotations

import torch

from orchestrator.async_server import AsyncServer
from orchestrator.config import RunConfig
from orchestrator.outer import build_server_optimizer
from orchestrator.overlap_server import OverlapServer
from orchestrator.robust import NormGuard
from orchestrator.sync_server import SyncServer

Server = SyncServer | AsyncServer | OverlapServer


def build_server(cfg: RunConfig, flat: torch.Tensor, guard: NormGuard | None, whole: bool = True) -> Server:
    """`whole`: `flat` is the full parameter vector (a slice otherwise: no drop, no guard)."""
    if cfg.mode == "async":
        return AsyncServer(flat, cfg.outer, cfg.asynchronous, cfg.islands.count, guard)
    if cfg.mode == "overlap":
        return OverlapServer(flat, cfg.overlap, guard)
    return SyncServer(flat, lambda p: build_server_optimizer(cfg, p),
                      drop_prob=cfg.outer.drop_prob if whole else 0.0, seed=cfg.seed,
                      grad_clip=cfg.inner.grad_clip if cfg.mode == "ddp" else None, guard=guard)
