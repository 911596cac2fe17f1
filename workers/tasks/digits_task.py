"""Second example task: handwritten-digit classification on scikit-learn's bundled digits
(an MLP). It proves the Task contract is not GPT-specific; needs the `examples` extra
(`pip install -e '.[examples]'`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from .task import Batch


class DigitsConfig(BaseModel):
    """Keyword arguments of `archipelago.workers.tasks.digits_task:make_task` (needs the `examples` extra)."""

    model_config = ConfigDict(extra="forbid")
    hidden: int = Field(64, ge=1, description="MLP hidden width")
    batch_size: int = Field(32, ge=1, description="examples per batch")
    eval_fraction: float = Field(0.2, gt=0, lt=1, description="examples held out for the eval loss")
    split: Literal["iid", "non_iid"] = Field("iid", description="non_iid: each shard gets a different set of labels")


class DigitsTask:
    """8x8 digit images → 10 classes. `non_iid` gives each island a different set of labels."""

    def __init__(self, cfg: DigitsConfig) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = (data.data / 16.0).astype(np.float32)
        y = data.target.astype(np.int64)
        order = np.random.default_rng(0).permutation(len(y))
        n_eval = int(len(y) * cfg.eval_fraction)
        self.eval_x, self.eval_y = x[order[:n_eval]], y[order[:n_eval]]
        self.train_x, self.train_y = x[order[n_eval:]], y[order[n_eval:]]
        self.cfg = cfg

    def prepare(self) -> None:
        """Nothing to do: the data ships inside scikit-learn."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(64, self.cfg.hidden), nn.ReLU(), nn.Linear(self.cfg.hidden, 10))

    def _island_rows(self, island: int, num_islands: int) -> np.ndarray:
        rows = np.arange(len(self.train_y))
        if self.cfg.split == "non_iid":
            rows = rows[np.argsort(self.train_y, kind="stable")]
        return np.array_split(rows, num_islands)[island]

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
        rows = self._island_rows(shard, num_shards)
        rng = np.random.default_rng(seed * 1_000_003 + shard)
        n = 0
        while True:
            pick = rng.choice(rows, size=self.cfg.batch_size, replace=len(rows) < self.cfg.batch_size)
            n += 1
            if n > start:  # sampling is sequential: resume by replaying the generator
                yield torch.from_numpy(self.train_x[pick]), torch.from_numpy(self.train_y[pick])

    def eval_batches(self) -> Sequence[Batch]:
        return [(torch.from_numpy(self.eval_x), torch.from_numpy(self.eval_y))]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def batch_weight(self, batch: Batch) -> int:
        return int(batch[1].shape[0])

    def eval_metrics(self, model: nn.Module, batches: Sequence[Batch]) -> dict[str, float]:
        """Classification accuracy on the held-out digits (the `MetricTask` hook)."""
        right = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in batches)
        return {"accuracy": right / sum(int(y.shape[0]) for _, y in batches)}


def make_task(**kwargs: object) -> DigitsTask:
    return DigitsTask(DigitsConfig(**kwargs))
