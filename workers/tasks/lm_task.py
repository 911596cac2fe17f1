"""The default task: a small byte-level GPT on real text.

`source` picks the text: `stdlib` (embedded default, the standard library's source,
prepared into Parquet shards once), `parquet` (your own Parquet files with a text
column), `hf` (a Hugging Face dataset, streamed, e.g. `allenai/c4` config `en`), or
`prepared` (corpora tokenised once by `archipelago data prepare`, read by position).

torch is imported where the model and the loss are built, not by the module: the command
(`archipelago run`) imports the task to prepare its data before any island starts, and
importing torch there would add 0.8 s to its start-up (`bench startup`). Your own task
can do the same, or not: it is only the command's start that differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field, model_validator

from ..data.encoders import ByteEncoder
from .task import Batch, token_batch
from .text_data import (
    document_order,
    encode,
    fixed_batches,
    island_part,
    window_batches,
)
from .text_source import TextCorpus, TextDataConfig

if TYPE_CHECKING:
    import torch

    from .gpt import GPT


class LMTaskConfig(TextDataConfig):
    """Keyword arguments of `archipelago.workers.tasks.lm_task:make_task` (validated; unknown keys rejected)."""

    context: int = Field(128, ge=8, le=4096, description="tokens (bytes) per sequence")
    d_model: int = Field(128, ge=8, description="GPT width")
    n_layers: int = Field(4, ge=1, description="GPT blocks")
    n_heads: int = Field(4, ge=1, description="attention heads (must divide d_model)")

    @model_validator(mode="after")
    def _check(self) -> LMTaskConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class LanguageModelTask:
    """Implements `archipelago.workers.tasks.task.Task` for next-byte prediction."""

    def __init__(self, cfg: LMTaskConfig) -> None:
        self.cfg = cfg
        self.corpus = TextCorpus(cfg)
        self._packed: np.ndarray | None = None

    # -- data -------------------------------------------------------------------------
    def encoder(self) -> ByteEncoder:
        """How this task turns text into tokens (`archipelago data prepare` uses it)."""
        return ByteEncoder()

    def prepare(self) -> None:
        self.corpus.prepare(self.encoder().identity)

    def packed(self) -> np.ndarray:
        """The training corpus encoded and in its split's document order, once per process
        (every data shard an island opens is a part of it)."""
        if self._packed is None:
            texts = self.corpus.texts("train")
            self._packed = encode(texts[i] for i in document_order(len(texts), self.cfg.split))
        return self._packed

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
        c = self.cfg
        if self.corpus.is_prepared:
            return self.corpus.prepared(self.encoder().identity).train_batches(shard, num_shards, seed, start)
        if self.corpus.streamed:
            return self.corpus.stream_batches(shard, num_shards, _encode, start)
        tokens = island_part(self.packed(), shard, num_shards)
        return window_batches(tokens, c.context, c.batch_size, seed * 1_000_003 + shard, start)

    def resume_batches(self, shard: int, num_shards: int, seed: int, start: int, state: dict) -> Iterator[Batch]:
        """A streamed shard's batches from position `start`, where `state` left it."""
        return self.corpus.stream_batches(shard, num_shards, _encode, start, state)

    def eval_batches(self) -> Sequence[Batch]:
        c = self.cfg
        if self.corpus.is_prepared:
            return self.corpus.prepared(self.encoder().identity).eval_batches(c.eval_batches)
        if self.corpus.streamed:
            return self.corpus.eval_stream(_encode, c.eval_batches)
        return fixed_batches(encode(self.corpus.texts("eval")), c.context, c.batch_size, c.eval_batches)

    # -- model ------------------------------------------------------------------------
    def build_model(self) -> GPT:
        from .gpt import GPT, GPTConfig

        c = self.cfg
        return GPT(GPTConfig(context=c.context, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads))

    # -- planning (`PlannableTask`): a byte-level model needs no data to be shaped --------------
    def plan_model(self) -> GPT:
        return self.build_model()

    def plan_batch(self, rows: int) -> Batch:
        return token_batch(rows, self.cfg.context, 256)

    def eval_rows(self) -> int:
        return self.cfg.batch_size

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        import torch.nn.functional as F

        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def batch_weight(self, batch: Batch) -> int:
        return int(batch[1].numel())


def _encode(text: str) -> np.ndarray:
    """A streamed document's bytes and its NUL separator."""
    return np.frombuffer(text.encode("utf-8", errors="replace") + b"\x00", dtype=np.uint8)


def make_task(**kwargs: object) -> LanguageModelTask:
    """Factory named in config as `archipelago.workers.tasks.lm_task:make_task`."""
    return LanguageModelTask(LMTaskConfig(**kwargs))
