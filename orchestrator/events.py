"""The run's event log: joins, drains, crashes, replacements, rejections, quarantines,
restarts — one JSON line each with a timestamp, in `out_dir/events.jsonl`, and kept in
memory for the control plane."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, path: Path, keep: int = 1000, append: bool = False) -> None:
        self.path = path
        if not append:
            path.write_text("")
        self.keep = keep
        self.recent: list[dict[str, Any]] = []

    def add(self, kind: str, island: int | None = None, **detail: Any) -> dict[str, Any]:
        event = {"time": time.time(), "kind": kind, "island": island, **detail}
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        self.recent.append(event)
        del self.recent[:-self.keep]
        return event
