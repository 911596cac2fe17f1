"""An island: one model replica, its inner optimizer and its data stream.

A plain class, so unit tests drive it in-process and production wraps it with
`ray.remote`. Parameters arrive as a flat numpy array (one object-store read per
version) and leave as one flat numpy pseudo-gradient; the inner optimizer state and the
data position persist across rounds, as DiLoCo requires.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.compress import Payload, encode, payload_nbytes
from workers.flat import FlatParams
from workers.optim import InnerConfig, build_inner
from workers.task import load_task, to_device


@dataclass(frozen=True)
class IslandSpec:
    index: int
    num_islands: int
    seed: int
    task_factory: str
    task_kwargs: dict[str, Any]
    inner: InnerConfig
    total_inner_steps: int
    threads: int = 1
    device: str = "auto"
    slowdown: float = 1.0  # SIMULATION of a slower accelerator: each inner step takes this many times longer
    codec: str = "none"    # compression of what the island sends
    chunk: int = 4096


@dataclass(frozen=True)
class RoundResult:
    """What an island sends back: `payload` encodes Δ = θ_start − θ_end (a gradient in
    ddp mode) with the configured codec; `nbytes` is its size on the wire."""

    island: int
    version: int
    payload: Payload
    weight: int          # tokens (or examples) trained on this round
    steps: int
    mean_loss: float
    compute_s: float     # seconds training (simulated slowdown included)
    finished_at: float   # wall clock (time.time()) when the result was ready to send

    @property
    def nbytes(self) -> int:
        return payload_nbytes(self.payload)


class Island:
    def __init__(self, spec: IslandSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.spec = spec
        use_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.task = load_task(spec.task_factory, spec.task_kwargs)
        torch.manual_seed(spec.seed)
        self.model = self.task.build_model().to(self.device)
        self.flat = FlatParams(self.model)
        self.start = torch.empty_like(self.flat.data)
        self.optimizer, self.scheduler = build_inner(spec.inner, self.model.parameters(), spec.total_inner_steps)
        self.batches = self.task.train_batches(spec.index, spec.num_islands, spec.seed)

    def describe(self) -> dict[str, Any]:
        import os
        import socket

        return {"island": self.spec.index, "device": str(self.device), "host": socket.gethostname(),
                "pid": os.getpid(), "numel": self.flat.numel}

    def _forward_backward(self) -> tuple[float, int]:
        batch = to_device(next(self.batches), self.device)
        self.flat.grad.zero_()
        loss = self.task.loss(self.model, batch)
        loss.backward()
        return float(loss.detach()), self.task.batch_weight(batch)

    def _clip(self) -> None:
        clip = self.spec.inner.grad_clip
        if clip is not None:
            norm = float(self.flat.grad.norm())
            if norm > clip:
                self.flat.grad.mul_(clip / norm)

    def _encode(self, x: torch.Tensor) -> Payload:
        return encode(x.cpu().numpy(), self.spec.codec, self.spec.chunk)

    def run_round(self, version: int, params: np.ndarray, steps: int, start_delay_s: float = 0.0) -> RoundResult:
        """DiLoCo inner phase: start from the global `params`, take `steps` inner steps.
        `start_delay_s` is the simulated time still needed to download `params`."""
        if start_delay_s > 0:
            time.sleep(start_delay_s)
        t0 = time.perf_counter()
        self.flat.load(params)
        self.start.copy_(self.flat.data)
        self.model.train()
        losses, weight = 0.0, 0
        for _ in range(steps):
            t_step = time.perf_counter()
            loss, w = self._forward_backward()
            self._clip()
            self.optimizer.step()
            self.scheduler.step()
            losses += loss
            weight += w
            if self.spec.slowdown > 1:
                time.sleep((self.spec.slowdown - 1) * (time.perf_counter() - t_step))
        payload = self._encode(self.start - self.flat.data)
        return RoundResult(self.spec.index, version, payload, weight, steps, losses / steps,
                           time.perf_counter() - t0, time.time())

    def gradient(self, version: int, params: np.ndarray, start_delay_s: float = 0.0) -> RoundResult:
        """ddp step: the gradient of one batch at the global `params` (no local update)."""
        if start_delay_s > 0:
            time.sleep(start_delay_s)
        t0 = time.perf_counter()
        self.flat.load(params)
        self.model.train()
        loss, weight = self._forward_backward()
        payload = self._encode(self.flat.grad.clone())
        return RoundResult(self.spec.index, version, payload, weight, 1, loss, time.perf_counter() - t0, time.time())
