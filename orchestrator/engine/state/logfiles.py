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


def _record(line: bytes, key: str) -> bytes | None:
    """The whole JSON record in `line` (an object holding `key`, which every record of its
    log has), or None. A line that does not parse may be a torn append's prefix with the
    next whole line glued to it (a full disk cut the first write, and a later one began
    where it ended: `{"r{"round": 140, ...}`): its record is the longest suffix that starts
    an object, parses and holds `key` (a nested object a tear left whole is not one)."""
    for start in (i for i in range(len(line)) if line[i : i + 1] == b"{"):
        try:
            value = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(value, dict) and key in value:
            return line[start:]
    return None


def mend(path: Path, key: str) -> int:
    """Repair the log wherever an append tore it, in every kept file (`key`: the field every
    record of the log holds): a line that is not a record keeps the whole record glued after
    a torn prefix (`_record`) or goes, a torn end included. A resumed run appends after what
    is left and a reader parses every line, so one torn line would have failed every restart
    (`JSONDecodeError`). Returns the bytes cut (logged)."""
    cut = 0
    for segment in segments(path):
        if not segment.exists():
            continue
        data = segment.read_bytes()
        lines = data.split(b"\n")
        kept = [record for line in lines if line.strip() and (record := _record(line.strip(), key)) is not None]
        mended = b"".join(record + b"\n" for record in kept)
        if mended == data:
            continue
        durable_write(segment, mended)
        lost = len(data) - len(mended)
        cut += max(lost, 0)
        log.warning("%s was torn (a write interrupted): %d byte(s) cut, every whole record kept", segment, lost)
    return cut


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
