"""The evaluation actor (`evaluation.where: actor`): the global model evaluated where the
accelerators are, not on the head.

A KubeRay head is a CPU pod with a memory limit; evaluating a 120 M-parameter model there
costs minutes of its CPU and gigabytes of activations every round. This actor is placed
on the resources `evaluation.cpus`/`evaluation.gpus` name (a GPU node's accelerator), builds
the task's model once, and for each version is sent its flat parameters (one numpy
array through the object store, read zero-copy) and answers with the loss. The
coordinator submits and goes on; `RayEvaluator.results` hands back what finished.

The actor restarts if its process or node is lost (`max_restarts=-1`) and each call is
retried once there; an evaluation that still fails, or is not back within
`evaluation.timeout_s` (no node could host the actor), comes back as an error and the
round is recorded without its loss. The run never waits on it beyond that.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import ray

from ..config import RunConfig
from ..engine.outputs.evaluation import Evaluation, EvaluationWorker
from .names import NAMESPACE

log = logging.getLogger(__name__)


class RayEvaluator:
    """`Evaluator` over one `EvaluationWorker` actor, owned by the coordinator (it goes
    when the coordinator goes; a restarted coordinator starts its own)."""

    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        e = cfg.evaluation
        self.timeout_s = e.timeout_s
        self.actor: Any = (
            ray.remote(EvaluationWorker)
            .options(
                name=f"archipelago-{run_id}-evaluator-{time.time_ns() % 10**9}",
                namespace=NAMESPACE,
                num_cpus=e.cpus,
                num_gpus=e.gpus,
                max_restarts=-1,
                max_task_retries=1,
            )
            .remote(cfg)
        )
        self.out: list[tuple[int, Any, float]] = []  # (version, answer, when submitted), in order

    def submit(self, *, version: int, params: Any, published: Any | None = None) -> None:
        """The published version where it already is (Ray moves it to the evaluator's node
        once, or not at all if it is there), else one put of `params`."""
        if published is None:
            values = params.detach().cpu().numpy() if hasattr(params, "detach") else np.asarray(params)
            published = ray.put(values)
        self.out.append((version, self.actor.evaluate.remote(published), time.monotonic()))

    def results(self, *, wait: bool) -> list[Evaluation]:
        done: list[Evaluation] = []
        while self.out:
            version, answer, asked = self.out[0]
            left = self.timeout_s - (time.monotonic() - asked)
            ready, _ = ray.wait([answer], timeout=max(0.0, left) if wait else 0)
            if not ready and left > 0:
                break  # the first in order is not back: later ones are recorded after it
            self.out.pop(0)
            if not ready:  # dropped: the actor's answer, when it comes, is freed unread
                done.append(Evaluation(version=version, loss=None, error=f"not back in {self.timeout_s:g} s"))
                continue
            try:
                loss, metrics, seconds = ray.get(answer)
            except Exception as err:  # the actor lost for good, or the task's evaluation raised
                done.append(Evaluation(version=version, loss=None, error=f"{type(err).__name__}: {err}"))
            else:
                done.append(Evaluation(version=version, loss=loss, metrics=metrics, seconds=seconds))
        return done

    def close(self) -> None:
        self.out.clear()
        ray.kill(self.actor, no_restart=True)


def start_evaluator(cfg: RunConfig, run_id: str) -> RayEvaluator | None:
    """The run's evaluator when it is an actor; None: the coordinator evaluates itself."""
    from ..config_operations import EvalPlace

    return RayEvaluator(cfg, run_id) if cfg.evaluation.where == EvalPlace.ACTOR else None
