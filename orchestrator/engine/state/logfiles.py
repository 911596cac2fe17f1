"""A run's append-only JSON-lines logs (`metrics.jsonl`, `events.jsonl`) rotated by size, as
logrotate does: past `records.rotate_mib` the file becomes `<name>.1`, the older ones move
up one (`.2`, `.3`, ...) and the one past `records.keep` is deleted. Every rename is atomic,
so a crash mid-rotation leaves whole files in order. Readers go through `read_lines`, which
returns the kept lines oldest first, whatever has rotated. An append can still be torn (the
process killed mid-write, a full disk): a run that continues a log `mend`s it first."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from archipelago.workers.runtime.storage import durable_write

log = logging.getLogger(__name__)


def rotated(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def segments(path: Path) -> list[Path]:
    """The log's files, newest first: `path` itself, then `.1`, `.2`, ... as they exist."""
    numbers = sorted(
        int(p.name.rpartition(".")[2])
        for p in path.parent.glob(f"{path.name}.*")
        if p.name.rpartition(".")[2].isdigit()
    )
    return [path, *(rotated(path, n) for n in numbers)]


def read_lines(path: Path) -> list[str]:
    """Every kept line of the log, oldest first."""
    lines: list[str] = []
    for segment in reversed(segments(path)):
        if segment.exists():
            lines.extend(segment.read_text().splitlines())
    return lines


def mend(path: Path) -> int:
    """Cut a torn end off the log: bytes after its last newline (an append killed mid-line)
    and whole lines at its end that are not JSON (a line a full disk cut and a later append
    ended). Only the newest file can end torn: a rotated one was renamed whole. A resumed
    run appends after what is left, and a reader parses every line, so one torn line would
    have failed every restart (`JSONDecodeError`). Returns the bytes cut (logged)."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    while end > 0:
        start = data.rfind(b"\n", 0, end - 1) + 1
        try:
            json.loads(data[start:end])
            break
        except ValueError:
            end = start
    if end == len(data):
        return 0
    durable_write(path, data[:end])
    log.warning(
        "%s ended with %d torn byte(s) (a write interrupted): cut back to its last whole line", path, len(data) - end
    )
    return len(data) - end


def restart(path: Path) -> None:
    """A fresh run's log: empty, and no rotated file of an earlier run in this folder."""
    for segment in segments(path)[1:]:
        segment.unlink()
    path.write_text("")


def rotate(path: Path, keep: int) -> None:
    """`path` becomes `.1`, each `.n` becomes `.n+1`, and what would pass `.keep` is deleted
    (oldest first, so an interrupted rotation never overwrites a kept file)."""
    for segment in segments(path)[1:]:
        n = int(segment.name.rpartition(".")[2])
        if n >= keep:
            segment.unlink(missing_ok=True)
    for n in range(keep - 1, 0, -1):
        if rotated(path, n).exists():
            os.replace(rotated(path, n), rotated(path, n + 1))
    if keep:
        os.replace(path, rotated(path, 1))
    else:
        path.unlink(missing_ok=True)


def rewind(path: Path, last_round: int) -> None:
    """A resumed run's `metrics.jsonl` back to the records its checkpoint covers (rounds up
    to `last_round`), even when the log rotated after that checkpoint: the newer files go,
    the one holding the boundary becomes `path` again and the older ones follow it."""
    chain = segments(path)
    n, kept = len(chain) - 1, []
    for index, segment in enumerate(chain):
        lines = segment.read_text().splitlines() if segment.exists() else []
        kept = [line for line in lines if json.loads(line)["round"] <= last_round]
        if kept:
            n = index
            break
    durable_write(path, "".join(line + "\n" for line in kept).encode())
    for segment in chain[1 : n + 1]:
        segment.unlink()
    for j, segment in enumerate(chain[n + 1 :], start=1):
        os.replace(segment, rotated(path, j))
