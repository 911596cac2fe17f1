"""What a model costs in memory, measured by torch without allocating it.

The task's model is built under fake tensors (`FakeTensorMode`: shapes, dtypes and
devices, no storage), and a dispatch mode (`LiveBytes`, as torch's own `MemTracker`) follows every tensor alive while the
island's real code runs on it: the flat parameter and gradient buffers, the inner
optimizer the island builds (`build_inner`), a forward and backward at the configured
micro-batch under the configured precision, the gradient clip and the optimizer step —
two steps, so the optimizer state exists (an island keeps it across rounds). The
evaluation is measured the same way: one forward without autograd on a batch of the
evaluation's rows, through the task's loss (the Hugging Face task's chunked loss).

So a 1 B-parameter model is planned on a laptop in seconds, at its real shapes. What it
cannot see: allocator overheads and fragmentation (the caching allocator on CUDA, glibc
on the CPU), kernels' workspaces, and that a CPU measurement stands in for CUDA (the
same tensors; SDPA picks a flash kernel on both, linear in the context).
`docs/operations.md` gives the measured peaks beside the plan's.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from archipelago.workers.tasks.task import Batch, PlannableTask, Task

from ..config import RunConfig
from .fresh import Fresh
from .memory import ModelMemory

log = logging.getLogger(__name__)


def _model(task: Task) -> torch.nn.Module:
    return task.plan_model() if isinstance(task, PlannableTask) else task.build_model()


def _batch(task: Task, rows: int, seed: int) -> Batch:
    if isinstance(task, PlannableTask):
        return task.plan_batch(rows)
    first = next(iter(task.train_batches(0, 1, seed)))  # a task without the hooks: its own data
    return tuple(t[:rows] for t in first)


class LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage alive, and their peak, while the block runs: each
    op's outputs are counted once per storage and released when the storage is freed
    (a weak reference's callback), as torch's `MemTracker` does, without its per-module
    bookkeeping (which refuses a module called twice in one pass, as a chunked loss does)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refs: list[Any] = []
        self.now = self.peak = 0

    def add(self, tensors: Iterable[Any]) -> None:
        """Count tensors that exist already (parameters, gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self.seen:
            return
        size = st.nbytes()
        self.seen[st] = size
        self.refs.append(weakref.ref(st, functools.partial(self._freed, size)))
        self.now += size
        self.peak = max(self.peak, self.now)

    def _freed(self, size: int, _ref: Any) -> None:
        self.now -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: Any) -> list[Any]:
    held = [flat.data, flat.grad, *model.parameters(), *model.buffers()]
    for state in optimizer.state.values():
        held.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return held


def resident_bytes() -> int:
    """This process's resident memory now (Linux; elsewhere its peak so far)."""
    try:
        import os

        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _runtime_bytes() -> int:
    """What a process's first backward and optimizer step add, whatever the model: measured
    on a tiny real model (a no-op in a process that has trained before)."""
    before = resident_bytes()
    layer = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), foreach=True)
    layer(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return max(0, resident_bytes() - before)


def _data_bytes(task: Task, cfg: RunConfig) -> int:
    """What reading an island's first batch adds (its corpus loaded and packed), measured;
    0 for a streamed source, which holds a window of its stream (and is not read here:
    planning never downloads)."""
    corpus = getattr(task, "corpus", None)
    if corpus is not None and getattr(corpus, "streamed", False):
        return 0
    task.prepare()  # local data only: what the run's driver does before any island starts
    before = resident_bytes()
    next(iter(task.train_batches(0, cfg.num_shards, cfg.seed)))
    return max(0, resident_bytes() - before)


def _baseline() -> dict[str, int]:
    """In a fresh interpreter (`python -m archipelago.orchestrator.plan.measure`, the config on stdin):
    what a worker holds before any tensor of the run — the interpreter with torch and the
    task's libraries (building the model under fake tensors imports them) — then what
    torch's first backward and a local corpus add."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    from archipelago.workers.tasks.task import load_task

    cfg = RunConfig.model_validate_json(sys.stdin.read())
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        _model(task)
    process = resident_bytes()
    runtime = _runtime_bytes()
    outer = _outer_bytes(cfg)
    return {"process": process, "runtime": runtime, "outer": outer, "data": _data_bytes(task, cfg)}


def _outer_bytes(cfg: RunConfig) -> int:
    """What the coordinator's first outer step adds whatever the model (the compiled
    mean and step kernels: numba's LLVM), measured on a small vector."""
    import numpy as np

    from ..engine.step.outer import Commit, LocalOuter
    from ..engine.step.rules import outer_rule
    from ..engine.types import Contribution

    before = resident_bytes()
    outer = LocalOuter(torch.zeros(1 << 16), outer_rule(cfg))
    parts = [Contribution(island=i, version=0, delta=np.ones(1 << 16, np.float32), weight=1.0) for i in range(2)]
    outer.commit(outer.propose(parts), Commit(weights={c.island: c.weight for c in parts}))
    return max(0, resident_bytes() - before)


def _start_baseline(cfg: RunConfig) -> Fresh:
    """`_baseline`, started in a fresh interpreter (`plan/fresh.py`); it runs while this
    process measures the model under fake tensors."""
    return Fresh("archipelago.orchestrator.plan.measure", stdin=cfg.model_dump_json())


def micro_rows(cfg: RunConfig, task: Task) -> int:
    """Rows of one island worker's micro-batch: the batch split over micro-batches and workers."""
    batch_rows = getattr(getattr(task, "cfg", None), "batch_size", None)  # the text tasks' setting
    if not isinstance(batch_rows, int):
        batch_rows = int(next(iter(task.train_batches(0, 1, cfg.seed)))[0].shape[0])
    return max(1, batch_rows // (cfg.inner.micro_batches * cfg.islands.workers))


def measure(cfg: RunConfig, task: Task) -> ModelMemory:
    """The model's memory at `cfg`'s shapes (see the module's docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model(task)  # first: a missing vocabulary is named before anything starts
        baseline = _start_baseline(cfg)
        try:
            found = _under_fake_tensors(cfg, task, model)
        except BaseException:
            baseline.cancel()
            raise
    got = baseline.result()
    return ModelMemory(
        **found,
        process=int(got["process"]),
        runtime=int(got["runtime"]),
        outer_runtime=int(got["outer"]),
        data=int(got["data"]),
        measure_s=time.perf_counter() - t0,
    )


def _under_fake_tensors(cfg: RunConfig, task: Task, model: torch.nn.Module) -> dict[str, Any]:
    """`measure`'s tensors (inside its FakeTensorMode): an inner step's peak and parts, an
    evaluation forward's peak, the evaluation set."""
    from archipelago.workers.runtime.optim import build_inner, inner_params, muon_params
    from archipelago.workers.wire.flat import FlatParams
    from archipelago.workers.wire.spec import Precision

    rows = micro_rows(cfg, task)
    batch_rows = rows * cfg.inner.micro_batches * cfg.islands.workers
    eval_batches = getattr(getattr(task, "cfg", None), "eval_batches", 1)
    eval_rows = task.eval_rows() if isinstance(task, PlannableTask) else rows
    bf16 = cfg.inner.precision == Precision.BF16
    flat = FlatParams(model)
    params = flat.numel
    optimizer, _ = build_inner(cfg.inner, inner_params(cfg.inner, model, flat), 10, 0, 0, muon_params(model))
    batch = _batch(task, rows, cfg.seed)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = task.loss(model, batch)
        loss.backward()
        if cfg.inner.grad_clip is not None:
            flat.clip_grad(cfg.inner.grad_clip)
        optimizer.step()
        flat.zero_grad()

    step()  # creates the optimizer state an island keeps across rounds; the next step is measured
    training = LiveBytes()
    training.add(_state_tensors(model, optimizer, flat))
    held = training.now
    with training:
        step()
    optimizer_state = sum(
        v.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    )
    whole = _batch(task, batch_rows, cfg.seed)
    model.eval()
    evaluating = LiveBytes()
    evaluating.add([flat.data, *model.buffers()])
    eval_batch = _batch(task, eval_rows, cfg.seed)
    with evaluating, torch.no_grad():
        task.loss(model, eval_batch)
    return {
        "params": params,
        "train_rows": rows,
        "train_peak": training.peak,
        "train_parts": {
            "parameters": 4 * params,
            "gradients": 4 * params,
            "optimizer_state": optimizer_state,
            "activations_and_temporaries": training.peak - held,
        },
        "eval_rows": eval_rows,
        "eval_peak": evaluating.peak,
        "eval_set": int(eval_batches) * sum(t.untyped_storage().nbytes() for t in whole),
    }


if __name__ == "__main__":
    import json as _json
    import sys as _sys

    _sys.stdout.write(_json.dumps(_baseline()) + "\n")
