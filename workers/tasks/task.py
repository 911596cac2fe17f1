"""The Task contract: how a user plugs their own model and data into Archipelago.

A task is any object with the methods of `Task`, built by a factory named in config as
`module:function` with keyword arguments (`task.factory`, `task.kwargs`). The islands and
the coordinator only ever talk to a task through this protocol, so the default GPT task
is just one task among many.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is named, not imported: the run config's checks (and so the command line) import
# this contract without importing torch (0.8 s), which only the processes that build
# models and batches need
Batch = tuple["torch.Tensor", ...]


class TaskError(ValueError):
    """A task factory could not be imported or rejected its keyword arguments."""


@runtime_checkable
class Task(Protocol):
    """What Archipelago needs from a model + data pair.

    Methods must be deterministic given their arguments: island *i* of *k* with seed *s*
    always sees the same batches, which is what makes runs reproducible and comparable.
    """

    def prepare(self) -> None:
        """One-time, idempotent data preparation (download, tokenise, cache). Runs on the
        driver before any island starts, so islands never race to build the same cache."""

    def build_model(self) -> nn.Module:
        """A freshly initialised model. Called with the same torch seed everywhere."""

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
        """Endless batches of data shard `shard` of `num_shards`, from batch index `start`.

        Shards are how data follows membership changes: islands own shards, and when an
        island leaves, another continues its shards at the recorded `start`, so nothing
        is trained twice or skipped. There are more shards than islands (`data_shards`,
        default 4 per island), so an island's data is a block of shards. A task that
        cannot seek may skip `start` batches."""

    def eval_batches(self) -> Sequence[Batch]:
        """A fixed, held-out set of batches; the eval loss is their mean loss."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar mean loss of `model` on `batch`."""

    def batch_weight(self, batch: Batch) -> int:
        """How much a batch counts (tokens for a language model, examples otherwise);
        pseudo-gradients are averaged with these weights."""


@runtime_checkable
class ResumableTask(Protocol):
    """A task whose data is a stream that cannot seek but can save where it stands (a
    streamed `datasets` source): its `train_batches` iterators have a `state()` (JSON-able,
    or None when the source cannot save one), which the island reports with each result and
    the coordinator keeps with the shard's committed position, so whoever continues the
    shard, after a move or a restart, resumes there instead of reading the stream again."""

    def resume_batches(self, shard: int, num_shards: int, seed: int, start: int, state: dict) -> Iterator[Batch]:
        """Shard `shard`'s batches from position `start`, at which its stream's state was `state`."""


@runtime_checkable
class MetricTask(Protocol):
    """A task with evaluation metrics beyond the loss (accuracy, a downstream score): the
    coordinator computes them with each evaluation of the global model and records them
    (`eval_metrics` in `metrics.jsonl`, the summary and the trackers)."""

    def eval_metrics(self, model: nn.Module, batches: Sequence[Batch]) -> dict[str, float]:
        """Named numbers for `model` (in eval mode, under `no_grad`) on the eval batches."""


@runtime_checkable
class PlannableTask(Protocol):
    """A task whose model and batches can be shaped without reading data or downloading
    anything: `archipelago plan` builds the model under fake tensors (no memory, no weights)
    and runs an inner step and an evaluation on batches of the real shapes, to know each
    process's peak before launch. A task without these is planned from `build_model` and
    its first training batch."""

    def plan_model(self) -> nn.Module:
        """The model `build_model` builds, from its architecture alone (its weights unused)."""

    def plan_batch(self, rows: int) -> Batch:
        """A batch of `rows` rows with the shapes and dtypes `train_batches` yields."""

    def eval_rows(self) -> int:
        """How many rows one forward of the evaluation takes (bounds its activations)."""


def token_batch(rows: int, context: int, vocab: int) -> Batch:
    """A language model's batch shape: (inputs, next-token labels), int64 ids below `vocab`."""
    import torch

    return torch.randint(0, vocab, (rows, context)), torch.randint(0, vocab, (rows, context))


@runtime_checkable
class ExportableTask(Protocol):
    """A task whose model can be written in its ecosystem's own format (the Hugging Face
    task: `save_pretrained` with safetensors and the tokenizer)."""

    def save_pretrained(self, model: Any, out_dir: Path) -> None:
        """Write `model` (a freshly built model holding the trained weights) to `out_dir`."""


def export_pretrained(task: Task, state: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write trained weights `state` (a `final.pt`) in the task's own format: loaded into a
    freshly built model, so what is saved owns its tensors (the live model's parameters
    are views of one flat buffer, which safetensors rightly refuses)."""
    if not isinstance(task, ExportableTask):
        raise TaskError(f"task {type(task).__name__} cannot export its model (it has no save_pretrained)")
    model = task.build_model()
    model.load_state_dict(state)
    out_dir.mkdir(parents=True, exist_ok=True)
    task.save_pretrained(model, out_dir)
    return out_dir


def resolve_factory(spec: str) -> Any:
    """Import `module:attribute`; raise `TaskError` naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task factory {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise TaskError(f"cannot import task module {module_name!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise TaskError(f"module {module_name!r} has no attribute {attr!r}") from err


def load_task(spec: str, kwargs: dict[str, Any] | None = None) -> Task:
    """Build the task `spec` names with `kwargs`; errors name the bad argument."""
    factory = resolve_factory(spec)
    try:
        task = factory(**(kwargs or {}))
    except (TypeError, ValueError) as err:
        raise TaskError(f"task {spec!r} rejected its kwargs: {err}") from err
    missing = [
        m
        for m in ("prepare", "build_model", "train_batches", "eval_batches", "loss", "batch_weight")
        if not callable(getattr(task, m, None))
    ]
    if missing:
        raise TaskError(f"task {spec!r} lacks the Task method(s) {', '.join(missing)}")
    return task


def split_batch(batch: Batch, part: int, parts: int, setting: str) -> Batch:
    """Part `part` of `parts` equal parts of every tensor of `batch` along the first
    dimension (an island worker's share, or a micro-batch); `setting` is the config field
    that asked for the split, named when the batch does not divide evenly."""
    rows = batch[0].shape[0]
    if rows % parts:
        raise ValueError(
            f"a batch of {rows} rows does not split into {parts} equal parts: make it a multiple of {setting}"
        )
    return tuple(t.chunk(parts)[part] for t in batch)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return tuple(t.to(device, non_blocking=True) for t in batch)
