"""Tiny tasks for tests: the quadratic islands of vector D1 (docs/algorithms.md), with optional
fault injection for the integration tests.

A fault belongs to a *process* (a broken machine), not to data: the first island process
that reads the faulty shard is the faulty one (recorded in `fault_dir`); when its shard
moves to another island after the fault, that island is healthy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn


class Point(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim, dtype=dtype))


class _Coordinate(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(1, dtype=dtype))


class SplitPoint(nn.Module):
    """`Point` with one module per coordinate in a `ModuleList` (the same flat layout), so
    streaming's fragments have layers to stride over."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.coordinates = nn.ModuleList(_Coordinate(dtype) for _ in range(dim))

    @property
    def x(self) -> torch.Tensor:
        return torch.cat([c.value for c in self.coordinates])


def _is_faulty_process(fault_dir: str | None, kind: str) -> bool:
    if fault_dir is None:
        return True
    marker = Path(fault_dir) / f"{kind}.pid"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    except FileExistsError:
        return marker.read_text() == str(os.getpid())


class QuadraticTask:
    """Shard i minimises f_i(x) = ½‖x − c_i‖²; one batch is just c_i."""

    def __init__(
        self,
        centers: list[list[float]],
        dtype: str = "float64",
        crash_island: int | None = None,
        crash_after_batches: int = 0,
        stall_island: int | None = None,
        stall_s: float = 0.0,
        batch_s: float = 0.0,
        nan_island: int | None = None,
        fault_dir: str | None = None,
        split: bool = False,
        eval_stall_s: float = 0.0,
        repeat: int = 1,
    ) -> None:
        self.dtype = getattr(torch, dtype)
        # `repeat`: each center tiled that many times, a model of megabytes from a short config
        self.centers = torch.tensor(centers, dtype=self.dtype).repeat(1, repeat)
        self.crash_island, self.crash_after = crash_island, crash_after_batches
        self.stall_island, self.stall_s = stall_island, stall_s
        self.batch_s = batch_s  # every batch costs this long, like real compute (for speed tests)
        self.nan_island = nan_island  # this island's data is NaN: its pseudo-gradients are NaN
        self.fault_dir = fault_dir
        self.split = split  # a model of one layer per coordinate (`SplitPoint`)
        self.eval_stall_s = eval_stall_s  # reading the evaluation's batches takes this long (a busy coordinator)

    def prepare(self) -> None:
        pass

    def build_model(self) -> nn.Module:
        return (SplitPoint if self.split else Point)(self.centers.shape[1], self.dtype)

    def train_batches(
        self, shard: int, num_shards: int, seed: int, start: int = 0
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        crash = shard == self.crash_island and _is_faulty_process(self.fault_dir, "crash")
        nan = shard == self.nan_island and _is_faulty_process(self.fault_dir, "nan")
        stall = shard == self.stall_island and _is_faulty_process(self.fault_dir, "stall")
        n = start
        while True:
            n += 1
            if crash and n > self.crash_after:
                os._exit(1)  # a real process death, as a crashed node would look
            if stall and n > 1:
                time.sleep(self.stall_s)
            if self.batch_s:
                time.sleep(self.batch_s)
            center = self.centers[shard % len(self.centers)].clone()
            yield (center * float("nan"),) if nan else (center,)

    def eval_batches(self) -> Sequence[tuple[torch.Tensor, ...]]:
        time.sleep(self.eval_stall_s)
        return [(c.clone(),) for c in self.centers]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return 0.5 * ((model.x - batch[0]) ** 2).sum()

    def batch_weight(self, batch: tuple[torch.Tensor, ...]) -> int:
        return 1


def make_quadratic(**kwargs: object) -> QuadraticTask:
    return QuadraticTask(**kwargs)  # type: ignore[arg-type]


# (shard, batch index) of every batch an in-process island read, per recording key
READS: dict[str, list[tuple[int, int]]] = {}


class RecordingQuadratic(QuadraticTask):
    """The quadratic task whose batches carry their identity and are recorded when read
    (in-process islands only: the list lives in this process). A batch of shard s weighs
    s + 1 tokens, so token accounting is checked per shard, not just counted."""

    def __init__(self, record: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.record = record

    def train_batches(
        self, shard: int, num_shards: int, seed: int, start: int = 0
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        for n, (center,) in enumerate(super().train_batches(shard, num_shards, seed, start), start):
            READS.setdefault(self.record, []).append((shard, n))
            yield center, torch.tensor([shard, n])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return super().loss(model, batch[:1])

    def batch_weight(self, batch: tuple[torch.Tensor, ...]) -> int:
        return int(batch[1][0]) + 1


def make_recording(**kwargs: object) -> RecordingQuadratic:
    return RecordingQuadratic(**kwargs)  # type: ignore[arg-type]


def make_planted(marker: str) -> None:
    """A factory a planted config.yaml could name: calling it leaves `marker` behind, so a
    test sees whether anything imported and called it."""
    from pathlib import Path

    Path(marker).touch()
    raise RuntimeError("planted code ran")


# (shard, batch index) -> the rows of that batch as bytes, per recording key
ROWS: dict[str, dict[tuple[int, int], tuple[bytes, ...]]] = {}


class RecordingPrepared:
    """The default GPT task (tiny) over a prepared corpus, recording the (shard, batch
    index) and the rows of every batch an in-process island takes from its iterator, so a
    scenario checks exactly-once against the real shards' data, read ahead on threads."""

    def __init__(self, record: str, path: str) -> None:
        from archipelago.workers.tasks.lm_task import make_task

        self.record = record
        self.task = make_task(
            source="prepared", prepared=[{"path": path}], context=16, batch_size=2, d_model=8, n_layers=1, n_heads=1
        )

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.task, name)

    def train_batches(
        self, shard: int, num_shards: int, seed: int, start: int = 0
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        for n, batch in enumerate(self.task.train_batches(shard, num_shards, seed, start), start):
            READS.setdefault(self.record, []).append((shard, n))
            rows = tuple(bytes(r.numpy().astype("uint8")) for r in torch.cat([batch[0], batch[1][:, -1:]], dim=1))
            assert ROWS.setdefault(self.record, {}).setdefault((shard, n), rows) == rows  # a re-read is the same data
            yield batch


def make_recording_prepared(**kwargs: object) -> RecordingPrepared:
    return RecordingPrepared(**kwargs)  # type: ignore[arg-type]


# the ids of the items a streamed training source gave, in order, per recording key
SEEN: dict[str, list[int]] = {}


class _Recorded:
    """A task's batch iterator that records what it yields and keeps its `state()`."""

    def __init__(self, record: str, shard: int, start: int, stream: Iterator[tuple[torch.Tensor, ...]]) -> None:
        self.record, self.shard, self.at, self.stream = record, shard, start, stream

    def __iter__(self) -> _Recorded:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        batch = next(self.stream)
        READS.setdefault(self.record, []).append((self.shard, self.at))
        ROWS.setdefault(self.record, {})[(self.shard, self.at)] = tuple(
            bytes(r.numpy().astype("uint8")) for r in batch[0]
        )
        self.at += 1
        return batch

    def state(self) -> object:
        return self.stream.state()  # type: ignore[attr-defined]


class CountingStream:
    """The default GPT task (tiny) on a streamed local `datasets` source whose items carry
    an `id`: every item the source hands over is recorded (`SEEN`), and every batch."""

    def __init__(self, record: str, files: str) -> None:
        from archipelago.workers.tasks.lm_task import make_task

        self.record = record
        self.task = make_task(
            source="hf",
            hf_dataset="parquet",
            hf_config=None,
            hf_data_files=files,
            hf_eval_split="train",
            context=16,
            batch_size=2,
            d_model=8,
            n_layers=1,
            n_heads=1,
            eval_batches=2,
        )
        dataset = self.task.corpus.dataset
        self.task.corpus.dataset = lambda part: (  # type: ignore[method-assign]
            dataset(part).map(self._seen) if part == "train" else dataset(part)
        )

    def _seen(self, row: dict) -> dict:
        """The training stream's items only (the eval batches read the split's first items)."""
        SEEN.setdefault(self.record, []).append(int(row["id"]))
        return row

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.task, name)

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int = 0) -> _Recorded:
        return _Recorded(self.record, shard, start, self.task.train_batches(shard, num_shards, seed, start))

    def resume_batches(self, shard: int, num_shards: int, seed: int, start: int, state: dict) -> _Recorded:
        return _Recorded(self.record, shard, start, self.task.resume_batches(shard, num_shards, seed, start, state))


def make_counting_stream(**kwargs: object) -> CountingStream:
    return CountingStream(**kwargs)  # type: ignore[arg-type]


BUILDS: dict[str, int] = {}


class PlantedBuild(QuadraticTask):
    """The quadratic task whose third model built in this process (the coordinator's comes
    first, then island 0's, island 1's) starts elsewhere: an island whose version 0 differs."""

    def __init__(self, record: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.record = record

    def build_model(self) -> nn.Module:
        model = super().build_model()
        BUILDS[self.record] = BUILDS.get(self.record, 0) + 1
        if BUILDS[self.record] == 3:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
        return model


def make_planted_build(**kwargs: object) -> PlantedBuild:
    return PlantedBuild(**kwargs)  # type: ignore[arg-type]
