"""Logging set-up: one handler for Archipelago's own loggers, installed once per process.

Every module logs through `logging.getLogger(__name__)`; nothing here is global until a
process opts in: the CLI calls `configure` with the level its `-v`/`-q` flags chose and the
format `--log-format` chose, and the coordinator actor calls it with the driver's
(`configured()`), so its messages land in Ray's log files for that actor (and in `ray job
logs` through Ray's log forwarding) alike. Used as a library, Archipelago adds no handler
and the application's logging config decides.

Each line carries its time and level (a platform's log pipeline sorts and filters on both);
`json` writes one object a line (`time` in ISO 8601 UTC, `level`, `logger`, `message`, and
`exception` when there is one) for collectors that parse rather than grep.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TextIO

from archipelago.workers.runtime.log_context import RUN_ATTRIBUTE, tag_records

PACKAGES = ("archipelago",)  # the one import root: every module's logger is under it
BRIEF = "%(asctime)s %(levelname)s archipelago: %(message)s"
DETAILED = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogFormat(enum.Enum):
    TEXT = "text"
    JSON = "json"


@dataclass(frozen=True)
class LogSetup:
    """What a process configured, for the processes it starts (the coordinator) to use too;
    `run_id` once the run it serves is known (every JSON record carries it)."""

    level: int
    format: LogFormat = LogFormat.TEXT
    run_id: str | None = None


class JsonFormatter(logging.Formatter):
    """One JSON object a line, with the run's id once this process knows it (`set_run`:
    every record is tagged), and a record's `fields` (`extra={"fields": {...}}`: a
    progress line's figures)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if (run_id := getattr(record, RUN_ATTRIBUTE, None)) is not None:  # `tag_records`
            line["run_id"] = run_id
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def level_for(verbose: int, quiet: int) -> int:
    """INFO by default; each -v one level more detail, each -q one level less."""
    return min(logging.CRITICAL, max(logging.DEBUG, logging.INFO + 10 * (quiet - verbose)))


class _Handler(logging.StreamHandler):
    """Ours (configuring again replaces it instead of adding one). Without an explicit
    stream it writes to whatever `sys.stderr` is at the time of each message, as logging's
    own last-resort handler does, so a replaced stderr (a test, a daemoniser) is followed."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._fixed = stream
        super().__init__(stream)

    @property
    def stream(self) -> TextIO:
        return self._fixed or sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        self._fixed = value if value is not sys.stderr else self._fixed


_CONFIGURED: list[LogSetup] = []  # what `configure` last installed in this process


def configured() -> LogSetup | None:
    """The level and format this process configured; None when embedded as a library."""
    return _CONFIGURED[-1] if _CONFIGURED else None


def set_run(run_id: str) -> None:
    """The run this process serves, known: the processes it starts are configured with it,
    and where this one writes JSON, every record carries it from now on (not otherwise: a
    program embedding Archipelago keeps its records as they are)."""
    if _CONFIGURED:
        _CONFIGURED[-1] = dataclasses.replace(_CONFIGURED[-1], run_id=run_id)
        if _CONFIGURED[-1].format == LogFormat.JSON:
            tag_records(run_id)


def json_line(message: str, fields: dict[str, object], logger: str = "archipelago") -> str:
    """A line of the same shape as the JSON log's, for what a command writes to stdout
    whatever the level (the summary)."""
    record = logging.getLogRecordFactory()(logger, logging.INFO, __file__, 0, message, None, None)  # tagged
    record.fields = fields
    return JsonFormatter().format(record)


def emits_json() -> bool:
    """Whether this process writes its lines as JSON (`--log-format json`)."""
    return bool(_CONFIGURED) and _CONFIGURED[-1].format == LogFormat.JSON


def configure(
    level: int, stream: TextIO | None = None, fmt: LogFormat = LogFormat.TEXT, run_id: str | None = None
) -> None:
    """`run_id` (JSON): every record of this process carries it from now on."""
    handler = _Handler(stream)
    if fmt == LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(DETAILED if level <= logging.DEBUG else BRIEF))
    _CONFIGURED[:] = [LogSetup(level, fmt, run_id)]
    if run_id is not None and fmt == LogFormat.JSON:
        tag_records(run_id)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
