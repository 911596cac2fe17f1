"""Logging set-up: one handler for Archipelago's own loggers, installed once per process.

Every module logs through `logging.getLogger(__name__)`; nothing here is global until a
process opts in: the CLI calls `configure` with the level its `-v`/`-q` flags chose, and the
coordinator actor calls it with the driver's level, so its messages land in Ray's log files
for that actor (and in `ray job logs` through Ray's log forwarding). Used as a library,
Archipelago adds no handler and the application's logging config decides.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

PACKAGES = ("orchestrator", "workers", "api")
BRIEF = "archipelago: %(message)s"
DETAILED = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def configure(level: int, stream: TextIO | None = None) -> None:
    handler = _Handler(stream)
    handler.setFormatter(logging.Formatter(DETAILED if level <= logging.DEBUG else BRIEF))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
