"""Token shards on disk: fixed-size Arrow IPC files of one `tokens` column (any Arrow tool
memory-maps them: `pyarrow.ipc.open_file(pyarrow.memory_map(path))`), and a reader that
fetches any window with positional reads.

Why positional reads and not a memory map on the island: reading random windows through a
map makes every page it touched resident, so an island's memory would grow with the
corpus over a long run. `os.pread` of the window's bytes costs one system call, needs no
shared file offset (prefetch threads read concurrently) and keeps memory flat.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from .manifest import DataError, ShardEntry, SplitEntry

HASH_BLOCK = 1 << 22


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _write_arrow(path: Path, column: str, values: np.ndarray) -> int:
    """Write `values` as a one-column Arrow IPC file (by rename); return the byte offset of
    its data buffer in the file."""
    schema = pa.schema([(column, pa.from_numpy_dtype(values.dtype))])
    tmp = path.with_name(f".{path.name}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(pa.record_batch([pa.array(values)], schema=schema))
    mapped = pa.memory_map(str(tmp))
    base = mapped.read_buffer(1).address
    data = pa.ipc.open_file(mapped).get_batch(0).column(0).buffers()[1]
    offset = data.address - base
    mapped.close()
    tmp.replace(path)
    return offset


class SplitWriter:
    """Appends tokenised documents to one split's shards, cutting a shard every
    `shard_tokens` tokens (documents run across shard ends: the split is one stream)."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        (folder / split).mkdir(parents=True, exist_ok=True)
        self.pending: list[np.ndarray] = []
        self.held = 0
        self.tokens = 0
        self.starts: list[np.ndarray] = []  # each document's first token, per appended part
        self.shards: list[ShardEntry] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents laid end to end in `tokens` (each ending in its separator), `lengths` long."""
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths[:-1])]) if len(lengths) else lengths
        self.starts.append(np.asarray(starts, dtype=np.int64))
        self.pending.append(tokens.astype(self.dtype, copy=False))
        self.held += len(tokens)
        self.tokens += len(tokens)
        while self.held >= self.shard_tokens:
            self._cut(self.shard_tokens)

    def _cut(self, n: int) -> None:
        buf = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = [buf[n:]] if n < len(buf) else []
        self.held = len(buf) - n
        name = f"{self.split}/tokens-{len(self.shards):05d}.arrow"
        path = self.folder / name
        offset = _write_arrow(path, "tokens", np.ascontiguousarray(buf[:n]))
        self.shards.append(
            ShardEntry(file=name, tokens=n, offset=offset, nbytes=path.stat().st_size, sha256=file_sha256(path))
        )

    def close(self) -> SplitEntry:
        if self.held:
            self._cut(self.held)
        index = f"{self.split}/documents.arrow"
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, dtype=np.int64)
        _write_arrow(self.folder / index, "start", starts)
        return SplitEntry(tokens=self.tokens, documents=len(starts), shards=self.shards, index=index)


class TokenStore:
    """One split of a prepared corpus as a single token stream, read by position."""

    def __init__(self, folder: Path, entry: SplitEntry, dtype: str) -> None:
        self.folder, self.entry = folder, entry
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.ends = np.cumsum([s.tokens for s in entry.shards]).tolist()
        self.firsts = [0, *self.ends[:-1]]
        self._fds: dict[int, int] = {}

    @property
    def tokens(self) -> int:
        return self.entry.tokens

    def check(self, deep: bool) -> None:
        """Every shard there with its size; `deep`: with its hash too (reads every byte)."""
        for s in self.entry.shards:
            path = self.folder / s.file
            if not path.is_file():
                raise DataError(f"prepared corpus {self.folder}: shard {s.file} is missing")
            if path.stat().st_size != s.nbytes:
                raise DataError(f"prepared corpus {self.folder}: shard {s.file} is not the size its manifest records")
            if deep and file_sha256(path) != s.sha256:
                raise DataError(f"prepared corpus {self.folder}: shard {s.file} does not match its manifest's hash")

    def _fd(self, i: int) -> int:
        if i not in self._fds:
            self._fds[i] = os.open(self.folder / self.entry.shards[i].file, os.O_RDONLY)
        return self._fds[i]

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the split, across shard ends."""
        if start < 0 or start + count > self.tokens:
            raise IndexError(f"tokens [{start}, {start + count}) outside a split of {self.tokens}")
        parts = []
        i = bisect.bisect_right(self.ends, start)
        while count:
            entry, local = self.entry.shards[i], start - self.firsts[i]
            n = min(count, entry.tokens - local)
            size = self.dtype.itemsize
            raw = os.pread(self._fd(i), n * size, entry.offset + local * size)
            parts.append(np.frombuffer(raw, dtype=self.dtype))
            start, count, i = start + n, count - n, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def windows(self, index: np.ndarray, context: int) -> np.ndarray:
        """Windows `index` (window w = tokens [w·context, w·context + context + 1)) as int64 rows."""
        out = np.empty((len(index), context + 1), dtype=np.int64)
        for r, w in enumerate(index.tolist()):
            out[r] = self.read(w * context, context + 1)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()
