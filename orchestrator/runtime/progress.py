"""Live progress of a run on the terminal (one refreshed line on a TTY, one line per round
in logs such as `ray job logs`)."""

from __future__ import annotations

import sys
from typing import Any, TextIO


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_progress(p: dict[str, Any]) -> str:
    rounds = p.get("rounds") or 1
    done = p.get("round", 0)
    width = 20
    filled = int(width * done / rounds)
    eval_loss = p.get("eval_loss")
    loss = f"{eval_loss:.4f}" if eval_loss is not None else "   -  "
    phase = "warm start " if p.get("phase") == "warm_start" else ""
    return (
        f"{phase}[{'#' * filled}{'.' * (width - filled)}] round {done}/{rounds}  eval loss {loss}  "
        f"{p.get('tokens_per_s', 0):,.0f} tok/s  {_bytes(p.get('bytes_communicated', 0))} exchanged  "
        f"islands {p.get('islands_alive', 0)}  {p.get('wall_seconds', 0):.0f}s"
    )


class ProgressPrinter:
    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last: tuple[Any, Any] = (None, -1)  # (phase, round) last written

    def update(self, p: dict[str, Any]) -> None:
        if p.get("state") == "starting":
            return
        line = format_progress(p)
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif (p.get("phase"), p.get("round")) != self.last:
            self.stream.write(line + "\n")
            self.stream.flush()
        self.last = (p.get("phase"), p.get("round", -1))

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
