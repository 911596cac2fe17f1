"""Every Ray process on this machine stopped at once, for tests' teardown: what `ray stop
--force` does (the same process list, then forgetting the cluster's address), without its
waits. `ray stop` kills the raylet, then the other processes, then the GCS, waiting after
each group for processes it still sees (killed ones not yet reaped among them): 6–13 s a
teardown in this suite, where this takes a fraction of a second. Linux only (`/proc`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from ray._common.utils import reset_ray_address
from ray._private.services import find_gcs_addresses
from ray.autoscaler._private.constants import RAY_PROCESSES


def _matches(pid: int) -> bool:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(key in (comm if by_name else args) for key, by_name in RAY_PROCESSES)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process its parent has not reaped yet is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_ray(timeout_s: float = 10.0) -> None:
    own = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != own and _matches(int(p))]
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    deadline = time.time() + timeout_s
    while any(_running(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.02)
    reset_ray_address()
    find_gcs_addresses.cache_clear()
