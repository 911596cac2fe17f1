"""Inner optimizers and their learning-rate schedule (linear warmup, then cosine decay).

Pure torch. Used by every island for its inner steps and by the coordinator in `ddp`
mode, where the same optimizer steps once per batch on the averaged gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ..wire.spec import InnerConfig
from .no_dynamo import plain_step

if TYPE_CHECKING:
    from ..wire.flat import FlatParams

# torch's own optimizers, stepped without importing torch._dynamo (`no_dynamo.py`)
AdamW = plain_step(torch.optim.AdamW)
Adam = plain_step(torch.optim.Adam)  # the outer step's (`outer.optimizer: adam`)
SGD = plain_step(torch.optim.SGD)


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


def muon_params(model: torch.nn.Module) -> set[int]:
    """The parameters Muon updates (by `id`): the weights of linear layers, except one an
    embedding shares (tied) and an output layer as wide as the vocabulary (the largest
    embedding); the rest (embeddings, the head, norms, biases) stays with AdamW, as in MuLoCo."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    shared = {id(m.weight) for m in embeddings}
    vocab = max((m.num_embeddings for m in embeddings), default=None)
    return {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in shared and m.out_features != vocab
    }


def inner_params(cfg: InnerConfig, model: torch.nn.Module, flat: FlatParams) -> list[torch.nn.Parameter]:
    """What the inner optimizer steps: for AdamW and SGD, which are elementwise and
    treat every parameter alike (one group, one weight decay), one parameter over the
    model's flat buffer, the same step in a few kernels instead of a few per tensor
    (0.78 → 0.24 ms a step for the 52 tensors of the benches' GPT, 1 thread); for Muon,
    which orthogonalises each matrix, the model's own parameters."""
    return list(model.parameters()) if cfg.optimizer == "muon" else [flat.parameter()]


def adamw_kernel(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """AdamW's implementation for `params`: torch's fused kernel on CUDA (one launch for the
    step, what a bare training loop uses — `bench bareloop`'s reference does — so a ratio
    against it measures the orchestration, not the optimizer), `foreach` elsewhere (the
    CPU's numbers, the default run's included, as they were)."""
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    return {"fused": True} if on_cuda else {"foreach": True}


def build_inner(
    cfg: InnerConfig,
    params: Iterable[torch.nn.Parameter],
    total_steps: int,
    start_step: int = 0,
    rewarmup: int = 0,
    muon: set[int] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The inner optimizer and its schedule; `muon` (ids from `muon_params`) are the
    parameters optimizer `muon` gives to Muon."""
    params = list(params)
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, **adamw_kernel(params)
        )
    elif cfg.optimizer == "muon":
        opt = _MuonAdamW(cfg, params, muon or set())
    else:
        opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return opt, inner_schedule(opt, cfg, total_steps, start_step, rewarmup)


def inner_schedule(
    opt: torch.optim.Optimizer, cfg: InnerConfig, total_steps: int, start_step: int = 0, rewarmup: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr schedule of an island that starts at the run's inner step `start_step`,
    counted in its own steps (a start past 0 re-warms over `rewarmup` of them)."""
    if start_step:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: join_factor(s, start_step, cfg, total_steps, rewarmup))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))


class _MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices and AdamW on the rest, stepped as one optimizer (one
    schedule, one state to save), each keeping its own parameter group and lr."""

    def __init__(self, cfg: InnerConfig, params: list[torch.nn.Parameter], muon: set[int]) -> None:
        hidden = [p for p in params if id(p) in muon and p.ndim == 2]
        rest = [p for p in params if not (id(p) in muon and p.ndim == 2)]
        self.muon = torch.optim.Muon(
            hidden,
            lr=cfg.muon_lr or cfg.lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = AdamW(rest, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, **adamw_kernel(rest))
        # the same group dicts: the schedule's lr reaches both; one state dict: saved and restored as one
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share_state()

    def _share_state(self) -> None:
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share_state()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: the island's inner step
        if self.muon.param_groups[0]["params"]:
            self.muon.step()
        self.adamw.step()
