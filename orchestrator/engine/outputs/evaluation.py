"""Evaluating the global model: where it runs, and the results coming back.

The coordinator decides *when* a version is evaluated (`eval_every`, the run's first
and last version, a stop); an `Evaluator` decides *where*. `LocalEvaluator` runs in the
coordinator's own process, which suits a model small enough to evaluate on the head's
CPU (the default run). At the scale users train, evaluation grows with the model's
activations and the eval set, so it runs where the accelerators are: an evaluation
actor (`orchestrator/runtime/evaluator.py`, `evaluation.where: actor`) is sent the
version's flat parameters and answers with the loss, while the coordinator's loop goes
on; the coordinator's own work per round stays O(parameters).

Results come back as `Evaluation`s, in the order the versions were submitted. An
evaluation that failed or never came back (its actor lost for good, its node never
placed) is an `Evaluation` with `error` set: the run records the round without a loss
and goes on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from archipelago.workers.tasks.task import Batch, MetricTask, Task, load_task
from archipelago.workers.wire.flat import FlatParams
from archipelago.workers.wire.spec import Precision

from ..threads import torch_threads

if TYPE_CHECKING:
    import numpy as np

    from ...config import RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    version: int
    loss: float | None
    metrics: dict[str, float] | None = None
    error: str | None = None  # why there is no loss
    seconds: float = 0.0  # where it ran, from its start to its end


class Evaluator(Protocol):
    def submit(self, *, version: int, params: torch.Tensor, published: Any | None = None) -> None:
        """Evaluate `version`, whose flat parameters are `params` (read before this returns);
        `published`: the same parameters as the pool published them, if it did (an evaluator
        elsewhere reads them there rather than a copy of its own)."""

    def results(self, *, wait: bool) -> list[Evaluation]:
        """The evaluations finished since the last call, in submission order; with `wait`,
        every submitted one (each within its timeout)."""

    def close(self) -> None: ...


def evaluate_model(
    task: Task, model: torch.nn.Module, batches: Sequence[Batch], *, device: torch.device, bf16: bool
) -> tuple[float, dict[str, float] | None]:
    """The mean loss of `model` over `batches`, and a `MetricTask`'s own metrics (finite
    ones; none when its hook raises, which is logged: the loss is still worth recording),
    in eval mode without autograd, so the task's loss bounds its own memory (the Hugging
    Face task's chunked loss). The one evaluation every evaluator runs."""
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        total = 0.0
        for batch in batches:
            total += float(task.loss(model, tuple(t.to(device, non_blocking=True) for t in batch)))
        metrics = None
        if isinstance(task, MetricTask):
            try:
                found = task.eval_metrics(model, batches)
                metrics = {str(k): float(v) for k, v in found.items() if math.isfinite(float(v))}
            except Exception:
                log.exception("the task's eval_metrics failed; this evaluation records the loss only")
    return total / len(batches), metrics


class LocalEvaluator:
    """Evaluation in the coordinator's process, on its model (a view of the flat
    parameters, so `submit` is given them in place) and its threads: synchronous, each
    result is ready when `submit` returns."""

    def __init__(self, *, task: Task, model: torch.nn.Module, threads: Callable[[], int]) -> None:
        self.task, self.model, self.threads = task, model, threads
        self._batches: list[Batch] | None = None
        self.done: list[Evaluation] = []

    @property
    def batches(self) -> list[Batch]:
        if self._batches is None:  # read at the first evaluation, not when the run is built
            self._batches = list(self.task.eval_batches())
        return self._batches

    def submit(self, *, version: int, params: torch.Tensor, published: Any | None = None) -> None:
        t0 = time.perf_counter()
        with torch_threads(self.threads()):
            loss, metrics = evaluate_model(self.task, self.model, self.batches, device=params.device, bf16=False)
        self.done.append(Evaluation(version=version, loss=loss, metrics=metrics, seconds=time.perf_counter() - t0))

    def results(self, *, wait: bool) -> list[Evaluation]:
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        return None


class EvaluationWorker:
    """The evaluation actor's body (`orchestrator/runtime/evaluator.py`), Ray-free so that
    `plan --rehearse` measures the same process: the task's model on this process's device,
    its eval batches there once, and `evaluate` (flat parameters in, loss and metrics out)."""

    def __init__(self, cfg: RunConfig) -> None:
        threads = max(1, int(cfg.evaluation.cpus))
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if cfg.evaluation.gpus > 0 and torch.cuda.is_available() else "cpu")
        self.bf16 = cfg.inner.precision == Precision.BF16 and self.device.type == "cuda"
        self.task = load_task(cfg.task.factory, cfg.task.kwargs)
        torch.manual_seed(cfg.seed)
        self.model = self.task.build_model().to(self.device)
        self.flat = FlatParams(self.model, grads=False)
        self.batches = [tuple(t.to(self.device) for t in b) for b in self.task.eval_batches()]

    def evaluate(self, params: np.ndarray) -> tuple[float, dict[str, float] | None, float]:
        t0 = time.perf_counter()
        self.flat.load(params)
        loss, metrics = evaluate_model(self.task, self.model, self.batches, device=self.device, bf16=self.bf16)
        return loss, metrics, time.perf_counter() - t0
