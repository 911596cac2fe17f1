"""Turn the signals that end a job into a clean stop. `ray job stop` sends SIGTERM to the
driver and SIGKILLs it a few seconds later (`RAY_JOB_STOP_WAIT_TIME_S`, default 3), and
Ctrl-C sends SIGINT: either one asks the coordinator to stop now, so the run abandons the
round in flight, checkpoints the last outer step and writes its outputs in well under a
second. A second Ctrl-C interrupts for real."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class StopRequest:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""

    def _handle(self, signum: int, _frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        self.event.set()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block SIGTERM/SIGINT set `request.event` instead of killing the process
    (only in the main thread, where Python delivers signals; elsewhere nothing changes)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
