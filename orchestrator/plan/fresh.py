"""A measurement in a fresh interpreter: the planning process (a test runner, a notebook,
the command itself) may hold far more than the process it stands for, and a process's peak
memory is only its own in a process of its own. Used by the plan's baseline, the
rehearsal's processes and `bench coordinator`'s probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any


class Fresh:
    """`python -m module args` started in a fresh interpreter with this checkout importable,
    `env` added to this process's environment and `stdin` as its input; `result()` waits
    for its last line of output, as JSON. Started at once, so the caller can go on (the
    plan's baseline runs beside its fake-tensor measurement; the rehearsal's processes
    beside each other: most of each is a single-threaded import of torch)."""

    def __init__(
        self,
        module: str,
        *args: str,
        stdin: str = "",
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        self.what, self.stdin, self.timeout_s = f"python -m {module} {' '.join(args)}", stdin, timeout_s
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": path},
        )

    def result(self) -> dict[str, Any]:
        """Its answer; raises `RuntimeError` with the tail of its errors (or on timeout, killed)."""
        try:
            out, err = self.process.communicate(self.stdin, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise RuntimeError(f"{self.what} did not finish within {self.timeout_s} s") from None
        if self.process.returncode != 0:
            raise RuntimeError(f"{self.what} failed:\n{err[-3000:]}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def cancel(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def run_fresh(module: str, *args: str, stdin: str = "", timeout_s: float | None = None) -> dict[str, Any]:
    """`Fresh(...)`, waited for."""
    return Fresh(module, *args, stdin=stdin, timeout_s=timeout_s).result()
