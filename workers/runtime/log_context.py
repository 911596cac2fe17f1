"""Every log record of this process tagged with the run it serves (`run_id`), for the JSON
lines a log collector groups by run: ours (`orchestrator/logs.py`), and Ray's own JSON
formatter's (`ray.LoggingConfig(encoding="JSON")`), which writes every attribute a record
carries. Through the record factory, so a handler Ray replaces or a logger that propagates
elsewhere cannot lose it."""

from __future__ import annotations

import logging
from typing import Any

_RUN: list[str] = []  # the run this process serves, once told


def tag_records(run_id: str) -> None:
    """From now on, every record made in this process carries `run_id` (installed once)."""
    if not _RUN:
        make = logging.getLogRecordFactory()

        def tagged(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            record.run_id = _RUN[-1]
            return record

        logging.setLogRecordFactory(tagged)
    _RUN[:] = [run_id]
