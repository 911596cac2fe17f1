"""Outer optimizers: the rules the coordinator steps on the global parameters, each a
`torch.optim.Optimizer` (state_dict, lr in `param_groups`) over the one flat parameter
whose `.grad` holds the aggregated pseudo-gradient. The maths and its sources are in
`docs/algorithms.md`; the tests that pin each rule are named there.

- `FlatSGD`: torch's SGD/Nesterov arithmetic computed in place. torch's step allocates
  a parameter-sized tensor for the Nesterov look-ahead on every call; at millions of
  parameters that allocation costs more than the arithmetic (8 M parameters: 10–24 ms a
  step against 8 ms in place, 1 thread). It runs block by block (`blocks`), so each
  vector crosses memory once per step, not once per op; in float32 with numba, one
  compiled loop (`fused_step.sgd_step`). Results are bitwise torch's (tested); `.grad`
  may be overwritten, which is fine: it is the coordinator's mean buffer, rebuilt per step.
- `DelayedNesterov` (Liu et al. 2024): momentum updated every N arrivals from their mean,
  each arrival applied with weight 1/N in between — Nesterov on every asynchronous
  arrival over-accelerates.
- `CO2Outer` (Sun et al. 2024): heavy-ball momentum on a one-round-stale pseudo-gradient
  scaled by a staleness gap penalty Λ, and element-wise momentum clipping between the
  momentum update and the parameter step (the authors' code discards the clip; here it
  clips). Λ is a rule of its own (`ConstantGap`, `AdaptiveGap`): the outer step computes
  it, over the whole vector even when the vector is split over coordinator slices.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from . import fused_step
from .aggregate import blocks

Params = Iterable[torch.nn.Parameter]


class CoordinatorOptimizer(torch.optim.Optimizer):
    """A torch optimizer built without importing `torch._dynamo`: torch guards
    `Optimizer.add_param_group` against dynamo, and the guard imports it on first use —
    1.5 s of a coordinator's start on a 2-core host, before its first dispatch (`bench
    startup`). The outer rules step one flat parameter on the coordinator and are never
    compiled, so their construction calls the unguarded method (the instance's own,
    for its `__init__` only; torch's class is untouched)."""

    def __init__(self, params: Params, defaults: dict[str, Any]) -> None:
        plain = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
        if plain is not None:
            self.add_param_group = types.MethodType(plain, self)  # type: ignore[method-assign]
        try:
            super().__init__(params, defaults)
        finally:
            self.__dict__.pop("add_param_group", None)


class FlatSGD(CoordinatorOptimizer):
    def __init__(self, params: Params, lr: float, momentum: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: .grad is a pseudo-gradient
        for group in self.param_groups:
            lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
            for p in group["params"]:  # the one flat parameter
                if p.grad is None:
                    continue
                buf, first, compiled = None, False, self._compiled(p)
                if momentum:
                    state = self.state[p]
                    first = state.get("momentum_buffer") is None
                    if first:
                        state["momentum_buffer"] = torch.empty_like(p.grad) if compiled else p.grad.clone()
                    buf = state["momentum_buffer"]
                flat, grad = p.detach(), p.grad.detach()
                if compiled:  # one compiled loop, the same bits (`fused_step`)
                    rule = fused_step.SGDRule(float(lr), float(momentum), bool(nesterov))
                    b = buf.numpy() if buf is not None else None
                    fused_step.sgd_step(rule, grad.numpy(), flat.numpy(), b, first, torch.get_num_threads())
                    continue
                for block in blocks(flat.numel()):  # every op on a block while it is in cache
                    g = grad[block]
                    if buf is not None:
                        b = buf[block]
                        if not first:
                            b.mul_(momentum).add_(g)
                        if nesterov:
                            g.add_(b, alpha=momentum)
                        else:
                            g = b
                    flat[block].add_(g, alpha=-lr)

    @staticmethod
    def _compiled(p: torch.Tensor) -> bool:
        """Whether the step is the compiled loop: float32 in host memory, contiguous, with
        numba installed (float64 is the reference vectors' precision: torch ops)."""
        return (
            p.dtype == torch.float32
            and p.device.type == "cpu"
            and p.is_contiguous()
            and p.grad is not None
            and p.grad.is_contiguous()
            and fused_step.available()
        )


class DelayedNesterov(CoordinatorOptimizer):
    """With c = 0, after every N-th arrival θ equals one synchronous Nesterov step (torch
    SGD, nesterov=True) on the mean of those N pseudo-gradients (tested)."""

    def __init__(self, params: Params, lr: float, momentum: float, delay: int, c: float = 0.0) -> None:
        if delay < 1:
            raise ValueError(f"delay N must be >= 1, got {delay}")
        if not 0.0 <= c <= 1.0 / delay:
            raise ValueError(f"c must be in [0, 1/N] = [0, {1 / delay:g}], got {c}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay, "c": c})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: .grad is a pseudo-gradient
        for group in self.param_groups:
            lr, beta, n, c = group["lr"], group["momentum"], group["delay"], group["c"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(m=torch.zeros_like(p), acc=torch.zeros_like(p), t=0)
                m, acc = state["m"], state["acc"]
                acc.add_(p.grad)
                if (state["t"] + 1) % n == 0:
                    m.mul_(beta).add_(acc, alpha=1.0 / n)
                    p.sub_(m, alpha=lr * (1 - c * n + c) * beta)
                    acc.zero_()
                elif c:
                    p.sub_(m, alpha=lr * c * beta)
                p.sub_(p.grad, alpha=lr / n)
                state["t"] += 1


@dataclass(frozen=True)
class ConstantGap:
    """CO2's staleness gap penalty as the released code has it: Λ = 1/p for every update."""

    p: float = 1.0
    anchored: ClassVar[bool] = False  # reads nothing of where a round started

    def __post_init__(self) -> None:
        if self.p < 1:
            raise ValueError(f"penalty p must be >= 1, got {self.p}")

    def gap(self, moved: float, delta_norm: float) -> float:
        return 1.0 / self.p


@dataclass(frozen=True)
class AdaptiveGap:
    """Λ = 1 / (1 + λ‖x_n − x_s‖ / (‖Δ‖ + ε)): shrinks an update by how far the global
    model moved while it was in flight (a sliced coordinator sums the squared norms of
    its slices first)."""

    lam: float = 1.0
    eps: float = 1e-8
    anchored: ClassVar[bool] = True  # ‖x_n − x_s‖ needs the parameters each round started from

    def gap(self, moved: float, delta_norm: float) -> float:
        return 1.0 / (1.0 + self.lam * moved / (delta_norm + self.eps))


GapPenalty = ConstantGap | AdaptiveGap


def gap_penalty(kind: str, p: float, lam: float) -> GapPenalty:
    """`mode.penalty`'s rule."""
    if kind not in ("constant", "adaptive"):
        raise ValueError(f"penalty must be 'constant' or 'adaptive', got {kind!r}")
    return ConstantGap(p) if kind == "constant" else AdaptiveGap(lam)


class CO2Outer(CoordinatorOptimizer):
    """`step()` applies `.grad` = Δ = x_s − x̄ from a round that started at x_s, scaled by
    the staleness gap penalty Λ its param group holds (`gap`, set before each step by
    whoever computed it from the rule's `GapPenalty`, as a scheduler sets `lr`): heavy-ball
    momentum, then the element-wise clip, then the step."""

    def __init__(self, params: Params, lr: float = 1.0, momentum: float = 0.0, clip: float | None = 1.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "clip": clip, "gap": 1.0})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: .grad is a pseudo-gradient
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                m = state["momentum"]
                m.mul_(group["momentum"]).add_(p.grad, alpha=group["gap"])
                if group["clip"] is not None:
                    m.clamp_(-group["clip"], group["clip"])
                p.sub_(m, alpha=group["lr"])


def clip_norm(param: torch.nn.Parameter, max_norm: float) -> Callable[..., None]:
    """An optimizer step pre-hook that scales `param`'s gradient to norm `max_norm` when it
    is longer: the data-parallel baseline's clip rides its stock optimizer (`engine/step/rules.py`
    registers it), so the generic outer step has no branch for one rule (and the clip is not
    in a checkpoint: it is rebuilt with the rule)."""

    def clip(_optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        grad = param.grad
        assert grad is not None  # the outer step sets it before every step
        norm = float(grad.norm())
        if norm > max_norm:
            grad.mul_(max_norm / norm)

    return clip
