"""The suite on two processes (pytest-xdist, `python -m pytest -n 2`): which test may run
beside which, and in what order.

Why: on 2 cores a serial suite leaves a core idle about 40 % of the time (measured with
`vmstat` during a full run: Ray tests mostly wait on processes and heartbeats, most other
tests are one-threaded). Measured over a whole run (`--durations=0`, 868 s): 314 s of tests
without Ray, 433 s of tests on the shared local Ray instance (`ray_local`), 421 s of tests
that bring their own Ray or need much memory. With every Ray test on one worker, the wall
was the Ray tests' sum and the other worker idled for 540 s of it.

Each test has a `Turn`, read from its marks and fixtures:
- `SHARED` (marked `ray`, asks for `ray_local`): on either worker, each worker with its own
  local instance; both run these first, taking them module by module as they free up.
- `OWN` (marked `ray` without `ray_local`: a `ray.cluster_utils.Cluster`, a command's own
  instance; or marked `alone`: fresh interpreters of several GiB each): one after another
  on one worker, never beside another worker's Ray (a Cluster's nodes and a rehearsal's
  memory beside another instance: the worker running the 120 M Llama's rehearsal beside the
  Ray tests was killed twice in two runs, the memory cgroup's peak 23.2 GiB of 24), beside
  tests without Ray.
- `FREE` (no Ray): on either worker, any time.
- `QUIET` (marked `quiet`: `ray start` processes, torn down by `tests/ray_processes.stop_ray`,
  which kills every Ray process on the machine; or a wall-clock comparison): last, when the
  other worker has run out of tests (beside another worker's load, Ray's job server once
  answered "No available agent to submit job" for the whole 120 s a submission was retried,
  and the real-clock overlap test's margin ran out beside another worker's instance).

How: the scheduler (`make_scheduler`) hands out units in the collection's order, which
`turn_of_item` sorts SHARED, OWN, FREE, QUIET: one unit per SHARED module, one for every OWN
test, one per FREE test, one for every QUIET test. Order alone cannot keep a worker's shared
instance from running beside the other's OWN tests (one worker may still be in its last
SHARED module when the other starts its OWN unit), so a lock file shared by the session's
workers does (`Turns`): a worker holds it shared while its local instance is up and
exclusively through OWN and QUIET tests, and lets it go (its instance shut down first) at its
first test without Ray.

xdist's own `--dist loadgroup` keys groups on item ids it rewrites, which pytest 9 no longer
reads (`Node.nodeid` is derived from `_id`), so the ids reach the scheduler unchanged and the
group is lost. The scheduler runs in the controlling process, which collects nothing; it
reads each test's turn from the test files' source (`turns_in`), and each worker checks that
reading against the marks and fixtures it collected (`check_against_markers`), so a reading
that is wrong fails the run instead of letting a Ray test run beside another."""

from __future__ import annotations

import ast
import enum
import fcntl
import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

MARKS = ("ray", "alone", "quiet")  # the marks a turn is read from
SHARED_FIXTURE = "ray_local"


class Turn(enum.IntEnum):
    """A test's turn, in the session's order (the values sort the collection)."""

    SHARED = 0
    OWN = 1
    FREE = 2
    QUIET = 3


def _turn(marks: set[str], fixtures: set[str]) -> Turn:
    if "quiet" in marks:
        return Turn.QUIET
    if "alone" in marks:
        return Turn.OWN
    if "ray" in marks:
        return Turn.SHARED if SHARED_FIXTURE in fixtures else Turn.OWN
    return Turn.FREE


def _marks_of(node: ast.expr) -> set[str]:
    """The marks among `MARKS` a decorator or a `pytestmark` value names (alone or in a list)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr in MARKS}


def _arguments(stmt: ast.stmt) -> set[str]:
    """The parameters a test function (or any method of a test class) asks for."""
    return {a.arg for f in ast.walk(stmt) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for a in f.args.args}


@functools.cache
def turns_in(path: Path) -> dict[str, Turn]:
    """Each top-level test (function or class) of a test file, and its turn."""
    tree = ast.parse(path.read_text())
    module_marks = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            module_marks |= _marks_of(stmt.value)
    turns = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            marks = module_marks.union(*(_marks_of(d) for d in stmt.decorator_list))
            turns[stmt.name] = _turn(marks, _arguments(stmt))
    return turns


def turn_of(rootdir: Path, nodeid: str) -> Turn:
    """A test's turn, read from its file."""
    file, _, rest = nodeid.partition("::")
    return turns_in(rootdir / file).get(rest.split("::")[0].split("[")[0], Turn.FREE)


def turn_of_item(item: pytest.Item) -> Turn:
    """A collected test's turn, from its marks and the fixtures it asks for (directly or not)."""
    marks = {m for m in MARKS if item.get_closest_marker(m)}
    return _turn(marks, set(getattr(item, "fixturenames", ())))


def check_against_markers(rootdir: Path, items: list[pytest.Item]) -> None:
    """Fail the collection where the source reading and the collected marks disagree."""
    wrong = [i.nodeid for i in items if turn_of(rootdir, i.nodeid) is not turn_of_item(i)]
    if wrong:
        raise pytest.UsageError(
            "tests/ray_apart.py reads these tests' turns wrongly (mark them `ray`, `alone` or `quiet` with a "
            f"decorator or `pytestmark`, and ask for `{SHARED_FIXTURE}` as a parameter of the test): {wrong[:5]}"
        )


class Turns:
    """This worker's hold on the lock file the session's workers share (none when the suite
    runs in one process): shared while its local Ray instance is up, exclusive through OWN
    and QUIET tests, none otherwise. A wait for it counts in the test's time limit."""

    def __init__(self, path: Path | None) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path is not None else None
        self.held: int | None = None  # fcntl.LOCK_SH or LOCK_EX

    def take(self, turn: Turn, *, shut_shared: Callable[[], None]) -> None:
        """Before a test of `turn` (before its fixtures: a module's own instance among them):
        `shut_shared` shuts this worker's local instance down where it is up."""
        want = {Turn.SHARED: fcntl.LOCK_SH, Turn.OWN: fcntl.LOCK_EX, Turn.QUIET: fcntl.LOCK_EX}.get(turn)
        if want == self.held:
            return
        if want != fcntl.LOCK_SH:
            shut_shared()  # up under a shared hold (or a quiet test's): never beside another worker's own Ray
        if self.fd is not None:
            fcntl.flock(self.fd, want if want is not None else fcntl.LOCK_UN)
        self.held = want


def make_scheduler(config: pytest.Config, log):
    """xdist's load-by-scope scheduler, its units in the collection's order (by turn, not
    by size): one per SHARED module, one for every OWN test, one per FREE test, one for every
    QUIET test."""
    from xdist.scheduler import LoadScopeScheduling

    root = Path(str(config.rootpath))
    config.option.loadscopereorder = False  # xdist's default puts the largest unit first

    class RayApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            turn = turn_of(root, nodeid)
            if turn is Turn.FREE:
                return nodeid
            if turn is Turn.SHARED:
                return f"{turn.name}::{nodeid.partition('::')[0]}"
            return turn.name

    return RayApart(config, log)
