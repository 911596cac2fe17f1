"""Where `data prepare` reads text from, cut into pieces that are tokenised in parallel.

A SOURCE is one of:
- `stdlib`: the embedded corpus (the standard library's source);
- a Parquet or JSON-lines file, a folder of them, or a glob (`data/*.parquet`);
- a folder written by `datasets.Dataset.save_to_disk`;
- `hf:NAME` or `hf:NAME:CONFIG`: a `datasets` dataset by name (a local builder such as
  `hf:json` with `--data-files`, or one on the Hub or in its cache).
Every piece is read again inside the worker that tokenises it, so only its description
travels.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any

from .corpus import prepare_stdlib_corpus
from .manifest import DataError

FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
DATASET_PIECES = 64  # a datasets dataset is cut into this many contiguous pieces at most
PIECE_ROWS = 200  # ... of at least this many rows each


@dataclass(frozen=True)
class Piece:
    kind: str  # "parquet" | "jsonl" | "saved" | "hub"
    location: str
    column: str
    index: int = 0  # which of `count` contiguous parts of a dataset
    count: int = 1
    config: str | None = None
    split: str = "train"
    data_files: str | None = None


def find_pieces(source: str, column: str, split: str = "train", data_files: str | None = None) -> list[Piece]:
    """The pieces of `source`, its text column checked to exist before any work."""
    if source == "stdlib":
        stdlib = prepare_stdlib_corpus()
        return [Piece("parquet", str(f), "text") for f in [*stdlib.train, *stdlib.eval]]
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        ds = _load_hub(name, config or None, split, data_files, source)
        _check_column(list(ds.column_names), column, source)
        n = min(DATASET_PIECES, max(1, len(ds) // PIECE_ROWS))
        return [Piece("hub", name, column, i, n, config or None, split, data_files) for i in range(n)]
    path = Path(source)
    if path.is_dir() and (path / "state.json").is_file():
        ds = _load_saved(str(path))
        _check_column(list(ds.column_names), column, source)
        n = min(DATASET_PIECES, max(1, len(ds) // PIECE_ROWS))
        return [Piece("saved", str(path), column, i, n) for i in range(n)]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in FILE_SUFFIXES and p.is_file())
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob(source) if Path(p).suffix in FILE_SUFFIXES)
    if not files:
        raise DataError(f"source {source!r}: no Parquet or JSON-lines files there")
    pieces = [Piece("parquet" if f.suffix == ".parquet" else "jsonl", str(f), column) for f in files]
    _check_column(_file_columns(pieces[0]), column, str(files[0]))
    return pieces


def read_piece(piece: Piece) -> list[str]:
    """The documents of one piece, in order (empty and missing texts skipped)."""
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        texts = pq.ParquetFile(piece.location).read(columns=[piece.column]).column(0).to_pylist()
    elif piece.kind == "jsonl":
        from pyarrow import json as pa_json

        table = pa_json.read_json(piece.location)
        _check_column(table.column_names, piece.column, piece.location)
        texts = table.column(piece.column).to_pylist()
    else:
        ds = (
            _load_saved(piece.location)
            if piece.kind == "saved"
            else _load_hub(piece.location, piece.config, piece.split, piece.data_files, piece.location)
        )
        texts = ds.shard(piece.count, piece.index, contiguous=True)[piece.column]
    return [t for t in texts if isinstance(t, str) and t]


def _file_columns(piece: Piece) -> list[str]:
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(piece.location).names)
    from pyarrow import json as pa_json

    with open(piece.location, "rb") as f:  # the first lines are enough to name the fields
        head = b"".join(f.readline() for _ in range(16))
    try:
        return list(pa_json.read_json(io.BytesIO(head)).column_names)
    except Exception as err:  # pyarrow's ArrowInvalid: not JSON lines
        raise DataError(f"source {piece.location}: not JSON lines ({err})") from err


def _check_column(columns: list[str], column: str, source: str) -> None:
    if column not in columns:
        raise DataError(f"source {source}: no text column {column!r} (it has {columns}); pass --text-column")


def _load_saved(path: str) -> Any:
    from datasets import load_from_disk

    ds = load_from_disk(path)
    if hasattr(ds, "keys"):  # a DatasetDict: its train split
        if "train" not in ds:
            raise DataError(f"source {path}: a dataset dict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    return ds


def _load_hub(name: str, config: str | None, split: str, data_files: str | None, source: str) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(name, config, split=split, data_files=data_files)
    except (FileNotFoundError, ValueError, ConnectionError) as err:
        raise DataError(f"source {source}: {type(err).__name__}: {err}") from err
