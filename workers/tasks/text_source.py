"""Where a text task's documents come from: the embedded standard-library corpus, your
Parquet files, or a streamed Hugging Face dataset. Shared by the byte-level GPT task and
the Hugging Face task, which differ only in how they tokenise and what they train."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from glob import glob
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..data.corpus import default_cache_dir, prepare_stdlib_corpus
from ..data.manifest import DataError
from ..data.streams import Encode, ReadAhead, StreamBatches, can_resume, shard_stream
from .text_data import read_parquet_texts

if TYPE_CHECKING:
    from ..data.reader import PreparedCorpus

log = logging.getLogger(__name__)


class PreparedSource(BaseModel):
    """One corpus written by `archipelago data prepare`, and its share of a mixture."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="the prepared corpus's folder (it holds manifest.json)")
    weight: float = Field(1.0, gt=0, description="its share of every batch, relative to the other sources' weights")


class TextDataConfig(BaseModel):
    """The data keyword arguments of the text tasks (validated; unknown keys rejected)."""

    model_config = ConfigDict(extra="forbid")
    source: Literal["stdlib", "parquet", "hf", "prepared"] = Field(
        "stdlib",
        description="stdlib: the Python standard library's source (no download; 1 file in 20 held out); "
        "parquet: your files; hf: a streamed Hugging Face dataset; prepared: corpora written by "
        "`archipelago data prepare` (read by position, any size)",
    )
    prepared: list[PreparedSource] = Field(
        default_factory=list, description="source prepared: the corpora, mixed by weight (deterministic per seed)"
    )
    split: Literal["iid", "non_iid"] = Field(
        "iid", description="iid: documents shuffled; non_iid: path order, so each shard holds different packages"
    )
    context: int = Field(128, ge=8, le=32768, description="tokens per sequence")
    batch_size: int = Field(16, ge=1, description="sequences per batch")
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
    def _check_source(self) -> TextDataConfig:
        if self.source == "parquet" and not (self.train_files and self.eval_files):
            raise ValueError("source 'parquet' needs train_files and eval_files globs")
        if self.source == "hf" and self.split != "iid":
            raise ValueError("source 'hf' streams documents and supports only split 'iid'")
        if (self.source == "prepared") != bool(self.prepared):
            raise ValueError("source 'prepared' and the prepared list go together (give both or neither)")
        return self

    @property
    def cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()


class TextCorpus:
    """The documents of a `TextDataConfig`, read once per process: an island opens a stream
    per shard it owns, and each used to walk the standard library and read it again."""

    def __init__(self, cfg: TextDataConfig) -> None:
        self.cfg = cfg
        self._found: tuple[list[Path], list[Path]] | None = None
        self._texts: dict[str, list[str]] = {}
        self._prepared: PreparedCorpus | None = None

    @property
    def is_prepared(self) -> bool:
        return self.cfg.source == "prepared"

    def prepared(self, tokenizer: str) -> PreparedCorpus:
        """The prepared corpora, opened once per process and checked against `tokenizer`
        (the task's encoder identity)."""
        if self._prepared is None:
            from ..data.reader import PreparedCorpus, Source

            c = self.cfg
            sources = [Source(p.path, p.weight) for p in c.prepared]
            self._prepared = PreparedCorpus(sources, tokenizer, c.context, c.batch_size, iid=c.split == "iid")
        return self._prepared

    @property
    def streamed(self) -> bool:
        return self.cfg.source == "hf"

    def files(self) -> tuple[list[Path], list[Path]]:
        """(train, eval) Parquet files, the stdlib corpus prepared on first use."""
        if self._found is None:
            self._found = self._find_files()
        return self._found

    def _find_files(self) -> tuple[list[Path], list[Path]]:
        if self.cfg.source == "stdlib":
            files = prepare_stdlib_corpus(self.cfg.cache)
            return files.train, files.eval
        train = sorted(Path(p) for p in glob(self.cfg.train_files or ""))
        evals = sorted(Path(p) for p in glob(self.cfg.eval_files or ""))
        if not train or not evals:
            raise DataError(f"no Parquet files match {self.cfg.train_files!r} / {self.cfg.eval_files!r}")
        for f in (train[0], evals[0]):
            if self.cfg.text_column not in pq.read_schema(f).names:
                raise DataError(
                    f"source {f}: no text column {self.cfg.text_column!r} (it has {pq.read_schema(f).names})"
                )
        return train, evals

    def texts(self, part: Literal["train", "eval"]) -> list[str]:
        """All documents of a file-backed source's part, in path order."""
        if part not in self._texts:
            train, evals = self.files()
            self._texts[part] = read_parquet_texts(train if part == "train" else evals, self.cfg.text_column)
        return self._texts[part]

    def dataset(self, part: Literal["train", "eval"]) -> Any:
        """A streamed dataset's split (a `datasets.IterableDataset`)."""
        from datasets import load_dataset

        c = self.cfg
        return load_dataset(
            c.hf_dataset,
            c.hf_config,
            split=c.hf_train_split if part == "train" else c.hf_eval_split,
            streaming=True,
            data_files=c.hf_data_files,
        )

    def stream(self, part: Literal["train", "eval"]) -> Iterator[str]:
        """The documents of a streamed dataset's split, in order."""
        return (row[self.cfg.text_column] for row in self.dataset(part))

    def stream_batches(
        self, shard: int, num_shards: int, encode: Encode, start: int, state: dict | None = None
    ) -> ReadAhead:
        """Data shard `shard`'s batches from position `start`, read ahead on a thread:
        continued from `state` (the stream's saved state at `start`), or read from the
        stream's start and skipped."""
        c = self.cfg
        ds = shard_stream(self.dataset("train"), shard, num_shards)
        stream = StreamBatches(ds, c.text_column, encode, c.context, c.batch_size, state)
        if state is None:
            for _ in range(start):
                next(stream)
        return ReadAhead(stream)

    def eval_stream(self, encode: Encode, count: int) -> list[tuple[Any, Any]]:
        """The eval split's first `count` batches."""
        c = self.cfg
        stream = StreamBatches(self.dataset("eval"), c.text_column, encode, c.context, c.batch_size)
        return [next(stream) for _ in range(count)]

    def prepare(self, tokenizer: str | None = None) -> None:
        """On the driver, before any island: the files found (the embedded corpus built), or
        the prepared corpora checked whole (their hashes, unless unchanged since the last
        check this cache recorded) against the task's `tokenizer`."""
        if self.is_prepared:
            assert tokenizer is not None
            self.prepared(tokenizer).check(verified=self.cfg.cache / "verified-corpora.json")
        elif self.streamed:
            name, column = self.cfg.hf_dataset, self.cfg.text_column
            try:
                first = next(iter(self.dataset("train")))
            except (FileNotFoundError, ValueError, ConnectionError, StopIteration) as err:
                raise DataError(
                    f"streamed source {name}: cannot read its first item ({type(err).__name__}: {err})"
                ) from err
            if column not in first:
                raise DataError(f"streamed source {name}: no text column {column!r} (it has {sorted(first)})")
            if can_resume(self.dataset("train")):
                log.info("streamed source %s resumes each data shard from its saved state", name)
            else:
                log.warning(
                    "streamed source %s cannot save its state: a resumed shard re-reads up to its position", name
                )
        else:
            self.files()
