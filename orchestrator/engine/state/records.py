"""What a run leaves on disk: in `out_dir` the resolved config, `metrics.jsonl` (one record
per round), `events.jsonl` (joins, drains, crashes, rejections, restarts…), `summary.json`
(stable key names that scripts and dashboards rely on) and `final.pt`; in the checkpoint
folder the coordinator's state (`engine/state/checkpoints.py`). Writes are atomic and durable
(`durable_write`), so a crash mid-write never leaves a torn file behind. On a cluster
point `checkpoint.path` at shared storage so a coordinator restarted on another node
finds it."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archipelago.workers.runtime.storage import durable_write, is_storage_error

from ...config import RUN_PLACEHOLDER, RunConfig
from ...config_load import dump_config
from ...config_operations import RecordsConfig
from ..types import Event
from .logfiles import mend, read_lines, restart, rewind, rotate
from .views import EventRecord, RoundRecord

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# Events an operator should see in the job's logs without asking; the rest are logged at
# DEBUG (`archipelago -v run`) and are always in events.jsonl and /v1/events.
HISTORY = 10_000  # per-round records held in memory for the control plane
_WARN = frozenset({Event.CRASH, Event.QUARANTINED, Event.JOIN_FAILED, Event.LOST, Event.LATE, Event.RESTART})


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines to `path` (the one seam every record and event goes through), or
    none of them: a write that fails part-way (a full disk takes what fits) is cut back to
    where it began, so the lines a `Backlog` writes again never follow a partial one."""
    data = "".join(lines).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        began = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, began)
            raise
    finally:
        os.close(fd)


class DiskFaults:
    """The storage errors met writing a run's files (a full or unmounted disk, a read-only
    volume, an object store that cannot be reached: `storage.is_storage_error`). A run must
    not end because it could not write a record or a checkpoint: each failure is logged and
    counted here (the status and `archipelago_disk_errors_total` show both), and what was
    not written is written at the next chance (`Backlog`, the engine's owed checkpoint)."""

    def __init__(self) -> None:
        self.count = 0
        self.last: str | None = None

    def attempt(self, what: str, write: Callable[[], object]) -> bool:
        """Run `write`; False, logged and counted, if it raised a storage error (any other
        error is a bug and propagates)."""
        try:
            write()
        except Exception as err:
            if not is_storage_error(err):
                raise
            self.count += 1
            self.last = f"{what}: {type(err).__name__}: {err}"
            log.error("could not write %s (%s); the run goes on and retries at the next boundary", what, self.last)
            return False
        return True


class Backlog:
    """Lines for an append-only log, written in order: those a failed write left behind go
    out first with the next line, so a disk that fills and frees loses none of them. The
    log is rotated by size (`engine/state/logfiles.py`) before a write that finds it full."""

    def __init__(self, path: Path, faults: DiskFaults, rotation: RecordsConfig) -> None:
        self.path, self.faults, self.rotation = path, faults, rotation
        self.unwritten: list[str] = []
        self.size = path.stat().st_size if path.exists() else 0

    def add(self, line: str) -> None:
        self.unwritten.append(line)
        self.flush()

    def flush(self) -> None:
        if self.unwritten and self.faults.attempt(self.path.name, self._write):
            self.unwritten = []

    def _write(self) -> None:
        if self.size >= self.rotation.rotate_mib * 2**20:
            rotate(self.path, self.rotation.keep)
            self.size = 0
        append_lines(self.path, self.unwritten)
        self.size += sum(len(line) for line in self.unwritten)  # JSON lines are ASCII


RUN_ID = "run_id"  # in a run's out_dir: the id its checkpoints are kept under
CONFIG = "config.yaml"  # in a run's out_dir: the config it ran with, `auto` settings as chosen
LATEST = "latest"  # beside the runs' own folders: a link to the newest


def link_latest(out_dir: str, run_id: str) -> None:
    """Point `latest` beside the runs' own folders at this run's (`runs/latest` ->
    `<run id>`), replaced atomically, so `--resume runs/latest` and a reader of
    `runs/latest/metrics.jsonl` find the newest run while every run keeps its own records.
    Only for an `out_dir` ending in its `{run_id}` on a local disk; a `latest` that is a real
    folder (written by a version before per-run folders) is left as it is."""
    parent, last = out_dir.rsplit("/", 1) if "/" in out_dir else (".", out_dir)
    if last != RUN_PLACEHOLDER or "://" in out_dir:
        return
    link = Path(parent) / LATEST
    if link.exists() and not link.is_symlink():
        log.info("%s is a folder, not a link: left as it is (runs now go to %s/<run id>)", link, parent)
        return
    try:
        tmp = Path(parent) / f".{LATEST}-{run_id}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_id, target_is_directory=True)
        tmp.replace(link)
    except OSError as err:  # a filesystem without links: the run's own folder is all there is
        log.info("could not point %s at %s: %s", link, run_id, err)


class Recorder:
    def __init__(
        self,
        out_dir: str | Path,
        cfg: RunConfig,
        last_round: int | None = None,
        faults: DiskFaults | None = None,
        run_id: str = "local",
    ) -> None:
        """A fresh run starts `metrics.jsonl` anew; a resumed one keeps its records up to
        `last_round` (those the checkpoint covers) and appends after them.
        `RUN_ID` names the run whose outputs these are (`--resume` finds its checkpoints)."""
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        # a summary says a run finished: one left by an earlier run in this folder would
        # pass for this one's if this one is interrupted (a benchmark would reuse it)
        (self.out / "summary.json").unlink(missing_ok=True)
        durable_write(self.out / CONFIG, dump_config(cfg).encode())
        durable_write(self.out / RUN_ID, run_id.encode())
        path = self.out / "metrics.jsonl"
        if last_round is None:
            restart(path)
        else:
            mend(path, "round")
            rewind(path, last_round)
        self.faults = faults or DiskFaults()
        self._metrics = Backlog(path, self.faults, cfg.records)
        # the newest records for the control plane (the whole run is in metrics.jsonl), as
        # (round, the JSON line written): 2.4x less memory than the dicts at 64 islands
        # (157 MiB for 10,000 records), and a page parses only what it returns
        self.history: deque[tuple[int, str]] = deque(maxlen=HISTORY)
        self.last: RoundRecord | None = None  # the newest record
        if last_round is not None:
            lines = read_lines(path)
            for line in lines:
                self.history.append((json.loads(line)["round"], line))
            if lines:  # written by this version or an older one: its known keys (an older one's others are its own)
                known = {k: v for k, v in json.loads(lines[-1]).items() if k in RoundRecord.model_fields}
                self.last = RoundRecord.model_validate(known)

    def record(self, entry: RoundRecord) -> None:
        # json, not pydantic's serialiser: a NaN loss stays NaN, as every record before it wrote it
        line = json.dumps(entry.as_dict())
        self.history.append((entry.round, line))
        self.last = entry
        self._metrics.add(line + "\n")

    def page(self, since: int, limit: int) -> list[dict[str, Any]]:
        """Records after round `since`, at most `limit` (safe from the control plane's threads:
        the copy is one C-level step, which appends from the engine's thread cannot tear)."""
        after = [line for rnd, line in list(self.history) if rnd > since][:limit]
        return [json.loads(line) for line in after]

    def finish(self, summary: dict[str, Any], model: torch.nn.Module) -> None:
        """The final model and the summary; a disk still failing then is logged and counted
        (the summary is still returned to the driver, which prints it)."""
        import torch  # here: the command imports this module (its file names) without torch

        state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self._metrics.flush()
        self.faults.attempt("final.pt", lambda: durable_write(self.out / "final.pt", buffer.getvalue()))
        self.write_summary(summary)

    def write_summary(self, summary: dict[str, Any]) -> None:
        data = json.dumps(summary, indent=2).encode()
        self.faults.attempt("summary.json", lambda: durable_write(self.out / "summary.json", data))


class EventLog:
    """One JSON line per event with a timestamp, also kept in memory for the control plane."""

    def __init__(
        self,
        path: Path,
        rotation: RecordsConfig,
        keep: int = 1000,
        append: bool = False,
        faults: DiskFaults | None = None,
    ) -> None:
        self.path = path
        if not append or not path.exists():
            restart(path)
        else:
            mend(path, "kind")
        self._file = Backlog(path, faults or DiskFaults(), rotation)
        self.recent: deque[EventRecord] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.count = len(read_lines(path))  # events logged (those still kept, after a restart)

    def since(self, index: int, limit: int | None = None) -> list[EventRecord]:
        """Events from absolute index `index` on, at most `limit` (a cursor: pass how many
        you have seen). Only the last `keep` are held in memory; a reader further behind
        gets those, and the whole log is in the file."""
        with self._lock:  # read by the control plane's threads while the engine adds
            recent, first = list(self.recent), self.count - len(self.recent)
        start = max(0, index - first)
        return recent[start : None if limit is None else start + limit]

    def add(self, kind: Event, island: int | None = None, **detail: Any) -> EventRecord:
        event = EventRecord(time=time.time(), kind=kind, island=island, **detail)
        self._file.add(json.dumps(event.as_dict()) + "\n")
        with self._lock:
            self.recent.append(event)
            self.count += 1
        level = logging.WARNING if kind in _WARN else logging.DEBUG
        if log.isEnabledFor(level):  # the message is built only when it is shown
            where = "" if island is None else f" island {island}"
            more = " ".join(f"{k}={v}" for k, v in detail.items())
            log.log(level, "%s%s %s", event.kind.value, where, more)
        return event
