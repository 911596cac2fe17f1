"""A measurement in a fresh interpreter: the planning process (a test runner, a notebook,
the command itself) may hold far more than the process it stands for, and a process's peak
memory is only its own in a process of its own. Used by the plan's baseline, the
rehearsal's processes and `bench coordinator`'s probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_fresh(module: str, *args: str, stdin: str = "", timeout_s: float | None = None) -> dict[str, Any]:
    """`python -m module args` with this checkout importable and `stdin` as its input;
    its last line of output, as JSON. Raises `RuntimeError` with the tail of its errors."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
