"""Live progress of a run on the terminal (one refreshed line on a TTY, one line per round
in logs such as `ray job logs`)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from ..logs import emits_json

log = logging.getLogger(__name__)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_progress(p: dict[str, Any], eta_s: float | None = None) -> str:
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
        + (f"  ETA {_duration(eta_s)}" if eta_s is not None else "")
    )


class Eta:
    """Time left in a phase, from the pace of the rounds this process has seen: a resumed
    run's earlier rounds, or a phase's first round (start-up, the first evaluation), do
    not distort it. None until two rounds of the phase were seen, and at its end."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.first: tuple[Any, int, float] | None = None  # (phase, round, when) of the phase's first round seen

    def update(self, p: dict[str, Any]) -> float | None:
        phase, done, rounds = p.get("phase"), p.get("round", 0), p.get("rounds") or 0
        now = self.clock()
        if self.first is None or self.first[0] != phase or done < self.first[1]:
            self.first = (phase, done, now)
        _, done0, t0 = self.first
        if done <= done0 or done >= rounds:
            return None
        return (now - t0) / (done - done0) * (rounds - done)


class ProgressPrinter:
    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last: tuple[Any, Any] = (None, -1)  # (phase, round) last written
        self.eta = Eta()

    def update(self, p: dict[str, Any]) -> None:
        if p.get("state") == "starting":
            return
        line = format_progress(p, self.eta.update(p))
        if emits_json():  # `--log-format json`: a record a round, its figures as fields
            if (p.get("phase"), p.get("round")) != self.last:
                log.info(line, extra={"fields": {"progress": p}})
            self.last = (p.get("phase"), p.get("round", -1))
            return
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
