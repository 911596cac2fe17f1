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
import hashlib
import os
import re
import sys
import threading
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


READ_BLOCK = 4 << 20  # an object's reads: ranges of 4 MiB (16 MiB ranges peaked 30 MB higher)
TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")  # `_temporary`'s names


def _temporary(path: Path) -> Path:
    """A unique name beside `path` to write it under before the rename: its writer's pid and
    a random part, so two writers (two runs, two processes) never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def durable_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably (unique temp, fsync, rename, fsync dir)."""
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


DIGEST = ".sha256"  # the suffix of a file's SHA-256, written beside it once the file is whole


def digest_name(name: str) -> str:
    """Where the digest of file `name` is written (after it: a file without one was never finished)."""
    return name + DIGEST


BACKGROUND_NICE = 10  # how much lower a background write's thread runs than the work it goes beside


def yield_cpu() -> None:
    """Lower the calling thread's CPU priority (on Linux, where a nice value is per
    thread): a checkpoint streamed to storage beside training or a coordinator's serving
    then takes the cores they leave, not theirs. Elsewhere it does nothing (there the
    call would renice the whole process)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


class HashingWriter:
    """A write-only stream that hashes (SHA-256) what passes through it on its way to
    `out`: a file streamed by `Folder.open_write` gets its digest in the same pass."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha256 = out, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return int(self.out.write(data))

    def flush(self) -> None:
        self.out.flush()


class _Ranged:
    """An object's reading file whose `readinto` fills the caller's buffer range by range.
    `torch.load` reads each tensor with one `readinto` of its whole size: fsspec's own
    reads it into one `bytes` first, so a load from object storage peaked at the state plus
    its largest tensor again (measured: 1.5x a 100 MB state; 1.1x like this)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.f.read(n)
        return data

    def readinto(self, buffer: Any) -> int:
        view, done = memoryview(buffer).cast("B"), 0
        while done < len(view):
            data = self.f.read(min(READ_BLOCK, len(view) - done))
            if not data:
                break
            view[done : done + len(data)] = data
            done += len(data)
        return done

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self.f.seek(offset, whence))

    def tell(self) -> int:
        return int(self.f.tell())

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


class UnsafeName(ValueError):
    """A file name that is not one plain name inside its folder (a separator, `..`, an
    absolute path): names read from a checkpoint or a record come from a writable volume,
    and one like `../../victim` would have a folder's reads, writes and deletes reach
    outside it."""


def is_plain(name: str) -> bool:
    """Whether `name` is one plain name (`plain` would take it)."""
    try:
        plain(name)
    except UnsafeName:
        return False
    return True


def plain(name: str) -> str:
    """`name`, checked to be one plain name (a file or folder directly inside its folder)."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise UnsafeName(f"{name!r} is not a plain file name")
    return name


# the packages whose errors are storage's though they are no `OSError`: s3fs passes botocore's
# `EndpointConnectionError` through untranslated, gcsfs google-auth's and aiohttp's
STORAGE_PACKAGES = frozenset(
    {"botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "fsspec", "adlfs", "azure"}
)


def is_storage_error(err: BaseException) -> bool:
    """Whether `err` (or what it wraps: a Ray task's error, a `raise ... from`) is a storage
    error: an `OSError`, or one defined by a storage backend (`STORAGE_PACKAGES`), told by
    the module that defines it so that no backend is imported to ask."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) or any(
            c.__module__.split(".")[0] in STORAGE_PACKAGES for c in type(current).__mro__
        ):
            return True
        cause = getattr(current, "cause", None)  # a RayTaskError carries the task's as `cause`
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return False


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
        return Folder(f"{self.location}/{plain(name)}")

    def __str__(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"Folder({self.location!r})"

    @property
    def name(self) -> str:
        return self.location.rsplit("/", 1)[-1]

    def _key(self, name: str) -> str:
        return f"{self.path}/{plain(name)}"

    def _local(self, name: str) -> Path:
        return Path(self.path) / plain(name)

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
            return self._local(name).read_bytes()
        data: bytes = self.fs.cat_file(self._key(name))
        return data

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[IO[bytes]]:
        """`name` to read as a seekable stream: a local file, or an object read in ranges of
        `READ_BLOCK` as the reader asks for them, never held whole in memory beside what is
        made of it (`_Ranged`)."""
        if not self.remote:
            with open(self._local(name), "rb") as f:
                yield f
            return
        with self.fs.open(self._key(name), "rb", block_size=READ_BLOCK, cache_type="none") as f:
            yield _Ranged(f)  # type: ignore[misc]  # the reading half of a binary file is all it offers

    def sha256(self, name: str) -> str:
        """The SHA-256 of `name`, read as a stream."""
        digest = hashlib.sha256()
        with self.open_read(name) as f:
            while chunk := f.read(READ_BLOCK):
                digest.update(chunk)
        return digest.hexdigest()

    def write(self, name: str, data: bytes) -> None:
        """Atomically: a reader sees the old content or the new, never a part."""
        if not self.remote:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            durable_write(self._local(name), data)
        else:
            self.fs.pipe_file(self._key(name), data)

    def write_digest(self, name: str, sha256: str) -> None:
        """Write the SHA-256 of file `name` beside it (`digest_name`), once `name` is whole."""
        self.write(digest_name(name), sha256.encode())

    def digest(self, name: str) -> str:
        """The SHA-256 written beside file `name`; raises (an `OSError`) where there is none:
        its write never ended, and the file is not to be trusted."""
        return self.read(digest_name(name)).decode().strip()

    def local_path(self, name: str) -> Path | None:
        """The local file `name` (None in an object store), for readers that stream it."""
        return None if self.remote else self._local(name)

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
                    # s3fs's discard drops the buffer but leaves the file open: its finaliser's
                    # close would then flush a buffer that is gone (an AttributeError at collection)
                    f.closed = True
                raise
            f.close()
            return
        path = self._local(name)
        folder = path.parent
        folder.mkdir(parents=True, exist_ok=True)
        tmp = _temporary(path)
        try:
            with open(tmp, "wb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(folder)

    def sweep(self, deep: bool = False) -> list[str]:
        """Remove the temporary files a writer killed mid-write left here (a SIGKILL or a
        lost node skips the clean-up of `open_write` and `durable_write`: each crash during
        a checkpoint left a state-sized orphan), and in every folder below with `deep`.
        Only for folders whose writers are all gone. Object storage has none to remove (an
        upload not completed is no object). Returns the names removed, relative to here."""
        if self.remote:
            return []
        folder = Path(self.path)
        found = (folder.rglob if deep else folder.glob)("*.tmp") if folder.is_dir() else iter(())
        gone = [p for p in found if TEMPORARY.match(p.name) and p.is_file() and not p.is_symlink()]
        for path in gone:
            path.unlink(missing_ok=True)
        return [str(p.relative_to(folder)) for p in gone]

    def delete(self, name: str) -> None:
        if not self.remote:
            self._local(name).unlink(missing_ok=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name))

    def modified(self, name: str) -> float:
        """When `name` was last written (seconds since the epoch)."""
        if not self.remote:
            return self._local(name).stat().st_mtime
        return float(self.fs.modified(self._key(name)).timestamp())
