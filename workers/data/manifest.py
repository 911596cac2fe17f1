"""A prepared corpus's manifest (`manifest.json`): what tokenised it, what it holds, and
what each shard's bytes hash to. A run checks it before it trains: a corpus made with
another tokenizer, or a shard that changed since, is refused with the source named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

FORMAT = "archipelago-tokens/1"
MANIFEST = "manifest.json"
DTYPES = {"uint8": 1 << 8, "uint16": 1 << 16, "uint32": 1 << 32}


class DataError(ValueError):
    """Data a run or `data prepare` was pointed at cannot be used as it is. Raised before
    any training, with the source named; the command exits 2."""


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every token id."""
    return next(name for name, limit in DTYPES.items() if vocab_size <= limit)


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    file: str  # relative to the corpus folder
    tokens: int
    offset: int  # byte offset of the token buffer inside the Arrow IPC file
    nbytes: int  # the file's size
    sha256: str


class SplitEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: int
    documents: int
    shards: list[ShardEntry]
    index: str  # Arrow IPC file of the documents' first token positions


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: str = FORMAT
    source: str
    tokenizer: str  # the encoder's identity (`workers/data/encoders.py`)
    vocab_size: int
    separator: int  # token that ends every document
    dtype: str
    splits: dict[str, SplitEntry]

    @property
    def content_sha256(self) -> str:
        """One hash over every shard's hash: names the corpus's content as a whole."""
        h = hashlib.sha256()
        for name in sorted(self.splits):
            for s in self.splits[name].shards:
                h.update(f"{name}/{s.file}:{s.sha256}".encode())
        return h.hexdigest()

    def split(self, name: str, folder: Path) -> SplitEntry:
        if name not in self.splits:
            raise DataError(f"prepared corpus {folder} has no {name!r} split (it has {sorted(self.splits)})")
        return self.splits[name]

    def write(self, folder: Path) -> None:
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({**self.model_dump(), "content_sha256": self.content_sha256}, indent=1) + "\n")
        tmp.replace(folder / MANIFEST)


def read_manifest(folder: Path | str) -> Manifest:
    """The manifest of a prepared corpus, or a `DataError` naming what is wrong."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        what = "does not exist" if not folder.exists() else f"has no {MANIFEST} (not prepared, or unfinished)"
        raise DataError(f"prepared corpus {folder} {what}: run `archipelago data prepare SOURCE {folder}`")
    try:
        raw = json.loads(path.read_text())
        raw.pop("content_sha256", None)
        manifest = Manifest.model_validate(raw)
    except (ValueError, ValidationError) as err:
        raise DataError(f"prepared corpus {folder}: {MANIFEST} is not a manifest this version reads ({err})") from err
    if manifest.format != FORMAT:
        raise DataError(f"prepared corpus {folder} is format {manifest.format!r}; this version reads {FORMAT!r}")
    return manifest
