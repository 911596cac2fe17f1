"""Where checkpoints live: a local (or mounted) folder, or object storage named by URL
(`s3://bucket/prefix`, `gs://…`, any fsspec protocol whose package is installed: the `s3`
extra brings `s3fs`). KubeRay users have a bucket more often than a ReadWriteMany volume.

A local folder is written durably (unique temporary file, fsync, rename, fsync of the
folder), so a crash leaves whole files only. An object store has no rename, and needs
none: a PUT is atomic (an object is either the old one or the new one) and durable once
acknowledged. Listings are read afresh every time (`refresh`): a restarted coordinator on
another node must see what its predecessor wrote, not a cached view. Credentials and the
endpoint come from the environment, as the SDKs read them (`AWS_ACCESS_KEY_ID`,
`AWS_ENDPOINT_URL`, workload identity), never from the run's config."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import fsspec


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably (unique temp, fsync, rename, fsync dir)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def is_url(location: str | Path) -> bool:
    return "://" in str(location) and not str(location).startswith("file://")


class Folder:
    """A folder of files, local or in an object store, with the few operations checkpoints
    need. Named by its location as the user wrote it (`str(folder)`)."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location).rstrip("/")
        self.remote = is_url(self.location)
        # local folders go through pathlib (and `durable_write`); fsspec only for object storage
        self.fs: Any = None
        self.path: str = str(Path(self.location))
        if self.remote:
            self.fs, self.path = fsspec.core.url_to_fs(self.location)

    def __truediv__(self, name: str) -> Folder:
        return Folder(f"{self.location}/{name}")

    def __str__(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"Folder({self.location!r})"

    @property
    def name(self) -> str:
        return self.location.rsplit("/", 1)[-1]

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}"

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path) if self.remote else Path(self.path).is_dir()

    def entries(self) -> list[tuple[str, bool]]:
        """(name, is a folder) of what the folder holds; empty when it does not exist."""
        if not self.remote:
            folder = Path(self.path)
            return [(p.name, p.is_dir()) for p in folder.iterdir()] if folder.is_dir() else []
        try:
            listed = self.fs.ls(self.path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [(item["name"].rstrip("/").rsplit("/", 1)[-1], item["type"] == "directory") for item in listed]

    def read(self, name: str) -> bytes:
        if not self.remote:
            return (Path(self.path) / name).read_bytes()
        data: bytes = self.fs.cat_file(self._key(name))
        return data

    def write(self, name: str, data: bytes) -> None:
        """Atomically: a reader sees the old content or the new, never a part."""
        if not self.remote:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            durable_write(Path(self.path) / name, data)
        else:
            self.fs.pipe_file(self._key(name), data)

    def local_path(self, name: str) -> Path | None:
        """The local file `name` (None in an object store), for readers that stream it."""
        return None if self.remote else Path(self.path) / name

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[IO[bytes]]:
        """A file to stream `name` into, as atomic as `write` without holding the content in
        memory: locally a unique temporary file, fsynced and renamed into place when the
        block ends; in an object store an upload that completes only when the block ends
        (a multipart upload is aborted if it raises). A block that raises leaves nothing."""
        if self.remote:
            f = self.fs.open(self._key(name), "wb")
            try:
                yield f
            except BaseException:
                if hasattr(f, "discard"):  # fsspec's buffered files: abort instead of committing a part
                    f.discard()
                raise
            f.close()
            return
        folder = Path(self.path)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        tmp = path.with_name(f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(folder)

    def delete(self, name: str) -> None:
        if not self.remote:
            (Path(self.path) / name).unlink(missing_ok=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name))

    def modified(self, name: str) -> float:
        """When `name` was last written (seconds since the epoch)."""
        if not self.remote:
            return (Path(self.path) / name).stat().st_mtime
        return float(self.fs.modified(self._key(name)).timestamp())
