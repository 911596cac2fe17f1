"""Batches read ahead on a background thread, so an island's step never waits on data.

The thread owns nothing the island needs: when the island drops the iterator (its shard
moved, or it re-seeks) the thread sees the stop flag within a poll and ends. At the
interpreter's exit every producer is stopped and joined first: a daemon thread still
inside torch while the interpreter tears down aborts the process."""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
POLL_S = 0.1
_LIVE: dict[threading.Thread, threading.Event] = {}  # producers still running, dropped iterators' included


class _Failed:
    def __init__(self, err: BaseException) -> None:
        self.err = err


class Prefetch(Generic[T]):
    """`make(start)`, `make(start + 1)`, … produced `depth` ahead of the consumer."""

    def __init__(self, make: Callable[[int], T], start: int, depth: int = 4) -> None:
        self._queue: queue.Queue[T | _Failed] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce, args=(make, start, self._queue, self._stop), name="archipelago-prefetch", daemon=True
        )
        _LIVE[self._thread] = self._stop
        self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        item = self._queue.get()
        if isinstance(item, _Failed):
            raise item.err
        return item

    def close(self) -> None:
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


def _produce(make: Callable[[int], object], at: int, out: queue.Queue, stop: threading.Event) -> None:
    try:
        _fill(make, at, out, stop)
    finally:
        _LIVE.pop(threading.current_thread(), None)


def _fill(make: Callable[[int], object], at: int, out: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            item: object = make(at)
        except Exception as err:  # handed to the consumer, raised on its thread
            item = _Failed(err)
        while not stop.is_set():
            try:
                out.put(item, timeout=POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failed):
            return
        at += 1


@atexit.register
def _stop_all() -> None:
    running = list(_LIVE.items())
    for _, stop in running:
        stop.set()
    for thread, _ in running:
        thread.join(2 * POLL_S)
