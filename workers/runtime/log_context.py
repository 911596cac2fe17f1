"""Every log record of this process tagged with the run it serves (`run_id`), for the JSON
lines a log collector groups by run: ours (`orchestrator/logs.py`), and Ray's own JSON
formatter's (`ray.LoggingConfig(encoding="JSON")`), which writes every attribute a record
carries. Through the record factory, so a handler Ray replaces or a logger that propagates
elsewhere cannot lose it."""

from __future__ import annotations

import logging
from typing import Any

RUN_ATTRIBUTE = "run_id"  # what Ray's JSON formatter writes it as (every attribute a record has)
_RUN: list[str] = []  # the run this process serves, once told


def tag_records(run_id: str) -> None:
    """From now on, every record made in this process carries `run_id` (the factory is
    installed once, after the id is set: a record made meanwhile on another thread finds
    it). Only where the process writes JSON lines for the run (the command's `--log-format
    json`, its coordinator and islands): a program embedding Archipelago keeps its records."""
    first = not _RUN
    _RUN[:] = [run_id]
    if first:
        make = logging.getLogRecordFactory()

        def tagged(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make(*args, **kwargs)
            setattr(record, RUN_ATTRIBUTE, _RUN[-1])
            return record

        logging.setLogRecordFactory(tagged)
