"""The default task: a small byte-level GPT on real text.

`source` picks the text: `stdlib` (embedded default, the standard library's source,
prepared into Parquet shards once), `parquet` (your own Parquet files with a text
column), or `hf` (a Hugging Face dataset, streamed, e.g. `allenai/c4` config `en`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from glob import glob
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.corpus import default_cache_dir, prepare_stdlib_corpus
from workers.gpt import GPT, GPTConfig
from workers.task import Batch
from workers.text_data import (
    encode,
    fixed_batches,
    island_tokens,
    read_parquet_texts,
    stream_batches,
    stream_shard,
    window_batches,
)


class LMTaskConfig(BaseModel):
    """Keyword arguments of `workers.lm_task:make_task` (validated; unknown keys rejected)."""

    model_config = ConfigDict(extra="forbid")
    source: Literal["stdlib", "parquet", "hf"] = Field(
        "stdlib",
        description="stdlib: the Python standard library's source (no download; 1 file in 20 held out); "
        "parquet: your files; hf: a streamed Hugging Face dataset",
    )
    split: Literal["iid", "non_iid"] = Field(
        "iid", description="iid: documents shuffled; non_iid: path order, so each shard holds different packages"
    )
    context: int = Field(128, ge=8, le=4096, description="tokens (bytes) per sequence")
    batch_size: int = Field(16, ge=1, description="sequences per batch")
    d_model: int = Field(128, ge=8, description="GPT width")
    n_layers: int = Field(4, ge=1, description="GPT blocks")
    n_heads: int = Field(4, ge=1, description="attention heads (must divide d_model)")
    eval_batches: int = Field(8, ge=1, description="held-out batches averaged for the eval loss")
    cache_dir: str | None = Field(None, description="where prepared shards go (default ~/.cache/archipelago)")
    train_files: str | None = Field(None, description="glob of Parquet files (source: parquet)")
    eval_files: str | None = Field(None, description="glob of held-out Parquet files (source: parquet)")
    text_column: str = Field("text", description="column holding the documents (parquet, hf)")
    hf_dataset: str = Field("allenai/c4", description="dataset name or local builder such as 'parquet' (source: hf)")
    hf_config: str | None = Field("en", description="dataset config (source: hf)")
    hf_data_files: str | None = Field(None, description="data_files for local builders such as 'parquet'")
    hf_train_split: str = Field("train", description="training split (source: hf)")
    hf_eval_split: str = Field("validation", description="held-out split (source: hf)")

    @model_validator(mode="after")
    def _check(self) -> LMTaskConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.source == "parquet" and not (self.train_files and self.eval_files):
            raise ValueError("source 'parquet' needs train_files and eval_files globs")
        if self.source == "hf" and self.split != "iid":
            raise ValueError("source 'hf' streams documents and supports only split 'iid'")
        return self


class LanguageModelTask:
    """Implements `workers.task.Task` for next-byte prediction."""

    def __init__(self, cfg: LMTaskConfig) -> None:
        self.cfg = cfg
        # read once per process: an island opens a stream per shard it owns, and each used to
        # walk the standard library and read the whole corpus again (seconds apiece)
        self._found: tuple[list[Path], list[Path]] | None = None
        self._train_texts: list[str] | None = None

    # -- data -------------------------------------------------------------------------
    def _files(self) -> tuple[list[Path], list[Path]]:
        if self._found is None:
            self._found = self._find_files()
        return self._found

    def _find_files(self) -> tuple[list[Path], list[Path]]:
        if self.cfg.source == "stdlib":
            cache = Path(self.cfg.cache_dir) if self.cfg.cache_dir else default_cache_dir()
            files = prepare_stdlib_corpus(cache)
            return files.train, files.eval
        train = sorted(Path(p) for p in glob(self.cfg.train_files or ""))
        evals = sorted(Path(p) for p in glob(self.cfg.eval_files or ""))
        if not train or not evals:
            raise FileNotFoundError(f"no Parquet files match {self.cfg.train_files!r} / {self.cfg.eval_files!r}")
        return train, evals

    def _hf_texts(self, split: str) -> Iterator[str]:
        from datasets import load_dataset

        ds = load_dataset(
            self.cfg.hf_dataset, self.cfg.hf_config, split=split, streaming=True, data_files=self.cfg.hf_data_files
        )
        return (row[self.cfg.text_column] for row in ds)

    def prepare(self) -> None:
        if self.cfg.source != "hf":
            self._files()

    def train_batches(self, shard: int, num_shards: int, seed: int, start: int = 0) -> Iterator[Batch]:
        c = self.cfg
        if c.source == "hf":  # a stream cannot seek: skip what was already consumed
            stream = stream_batches(
                stream_shard(self._hf_texts(c.hf_train_split), shard, num_shards), c.context, c.batch_size
            )
            return itertools.islice(stream, start, None)
        if self._train_texts is None:
            self._train_texts = read_parquet_texts(self._files()[0], c.text_column)
        tokens = island_tokens(self._train_texts, shard, num_shards, c.split)
        return window_batches(tokens, c.context, c.batch_size, seed * 1_000_003 + shard, start)

    def eval_batches(self) -> Sequence[Batch]:
        c = self.cfg
        if c.source == "hf":
            stream = stream_batches(self._hf_texts(c.hf_eval_split), c.context, c.batch_size)
            return [next(stream) for _ in range(c.eval_batches)]
        _, evals = self._files()
        return fixed_batches(encode(read_parquet_texts(evals, c.text_column)), c.context, c.batch_size, c.eval_batches)

    # -- model ------------------------------------------------------------------------
    def build_model(self) -> GPT:
        c = self.cfg
        return GPT(GPTConfig(context=c.context, d_model=c.d_model, n_layers=c.n_layers, n_heads=c.n_heads))

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def batch_weight(self, batch: Batch) -> int:
        return int(batch[1].numel())


def make_task(**kwargs: object) -> LanguageModelTask:
    """Factory named in config as `workers.lm_task:make_task`."""
    return LanguageModelTask(LMTaskConfig(**kwargs))
