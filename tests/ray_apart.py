"""The suite on two processes (pytest-xdist, `python -m pytest -n 2`), with every
test marked `ray` or `alone` on one of them, one after another.

Why: on 2 cores a serial suite leaves a core idle about 40 % of the time (measured with
`vmstat` during a full run: Ray tests mostly wait on processes and heartbeats, most other
tests are one-threaded), so a second process that runs the Ray-free tests beside the Ray
ones cuts the wall time by about the Ray-free tests' share. Ray tests stay serial: several
start `ray start` clusters and tear down with `tests/ray_processes.stop_ray`, which kills
every Ray process on the machine, and they assume the cores are theirs. A test marked
`alone` needs much of the machine's memory (the shipped configs rehearsed at their shapes:
fresh interpreters of several GiB each): beside the Ray tests the worker running it was
killed, twice in two runs (the memory cgroup's recorded peak: 23.2 GiB of the machine's 24).

How: xdist's own `--dist loadgroup` keys groups on item ids it rewrites, which pytest 9
no longer reads (`Node.nodeid` is derived from `_id`), so the ids reach the scheduler
unchanged and the group is lost. The scheduler here runs in the controlling process, which
collects nothing; it reads which tests are marked `ray` or `alone` from the test files' source
(`serial_tests`), and each worker checks that reading against the markers it collected
(`check_against_markers`), so a mark the reading misses fails the run instead of letting a
Ray test run beside another."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

GROUP = "serial"
MARKS = ("ray", "alone")  # the marks that put a test in the serial group


def _marks_ray(node: ast.expr) -> bool:
    """Whether a decorator or a `pytestmark` value names `pytest.mark.ray` or `.alone` (alone
    or in a list)."""
    return any(isinstance(n, ast.Attribute) and n.attr in MARKS for n in ast.walk(node))


@functools.cache
def serial_tests(path: Path) -> frozenset[str] | None:
    """The top-level names (functions, classes) of a test file whose tests are marked `ray`
    or `alone`; None when the whole module is (`pytestmark`)."""
    tree = ast.parse(path.read_text())
    names = set()
    for stmt in tree.body:
        module_mark = isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        )
        if module_mark and _marks_ray(stmt.value):
            return None
        decorated = isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        if decorated and any(_marks_ray(d) for d in stmt.decorator_list):
            names.add(stmt.name)
    return frozenset(names)


def is_serial(rootdir: Path, nodeid: str) -> bool:
    file, _, rest = nodeid.partition("::")
    marked = serial_tests(rootdir / file)
    return marked is None or rest.split("::")[0].split("[")[0] in marked


def check_against_markers(rootdir: Path, items: list[pytest.Item]) -> None:
    """Fail the collection where the source reading and the markers disagree."""
    wrong = [i.nodeid for i in items if is_serial(rootdir, i.nodeid) != any(i.get_closest_marker(m) for m in MARKS)]
    if wrong:
        raise pytest.UsageError(
            "tests/ray_apart.py reads these tests' `ray` or `alone` marks wrongly (mark them with a decorator or "
            f"`pytestmark`): {wrong[:5]}"
        )


def make_scheduler(config: pytest.Config, log):
    """xdist's load-by-scope scheduler with one scope for every Ray or `alone` test (sent to
    one worker as one unit, the largest, so first) and one per test otherwise."""
    from xdist.scheduler import LoadScopeScheduling

    root = Path(str(config.rootpath))

    class RayApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return GROUP if is_serial(root, nodeid) else nodeid

    return RayApart(config, log)
