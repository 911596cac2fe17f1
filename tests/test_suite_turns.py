"""The suite's own scheduling (`tests/ray_apart.py`): each test's turn read from source as
the collected marks give it, and the lock that keeps a worker's shared Ray instance from
running beside another worker's own Ray."""

from __future__ import annotations

import threading
import time

from tests.ray_apart import Turn, Turns, turn_of, turns_in

SOURCE = """
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.quiet]

def test_quiet(tmp_path):
    pass
"""

MIXED = """
import pytest

@pytest.mark.ray
def test_shared(ray_local, tmp_path):
    pass

@pytest.mark.ray
@pytest.mark.parametrize("x", [1, 2])
def test_own(tmp_path, x):
    pass

@pytest.mark.alone
def test_alone():
    pass

def test_free(ray_local):  # not marked `ray`: the fixture alone does not make it a Ray test
    pass
"""


def test_each_tests_turn_is_read_from_its_marks_and_fixtures(tmp_path):
    (tmp_path / "test_a.py").write_text(SOURCE)
    (tmp_path / "test_b.py").write_text(MIXED)
    assert turns_in(tmp_path / "test_a.py") == {"test_quiet": Turn.QUIET}
    assert turns_in(tmp_path / "test_b.py") == {
        "test_shared": Turn.SHARED,
        "test_own": Turn.OWN,
        "test_alone": Turn.OWN,
        "test_free": Turn.FREE,
    }
    assert turn_of(tmp_path, "test_b.py::test_own[1]") is Turn.OWN


def test_an_own_turn_waits_for_every_shared_hold_and_the_shared_instance_is_shut_first(tmp_path):
    lock = tmp_path / "turns.lock"
    shared, own = Turns(lock), Turns(lock)
    shut: list[str] = []
    shared.take(Turn.SHARED, shut_shared=lambda: shut.append("shared"))
    shared.take(Turn.SHARED, shut_shared=lambda: shut.append("again"))  # held already: nothing to do
    assert shut == []
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: (own.take(Turn.OWN, shut_shared=lambda: None), taken.set()))
    waiter.start()
    time.sleep(0.3)
    assert not taken.is_set()  # the other worker's instance is still up
    shared.take(Turn.FREE, shut_shared=lambda: shut.append("shared"))  # shut before the lock is let go
    waiter.join(timeout=5)
    assert taken.is_set() and shut == ["shared"]
    shared_again = threading.Thread(target=lambda: shared.take(Turn.SHARED, shut_shared=lambda: None))
    shared_again.start()
    time.sleep(0.3)
    assert shared_again.is_alive()  # no instance starts beside an own turn
    own.take(Turn.FREE, shut_shared=lambda: shut.append("own"))
    shared_again.join(timeout=5)
    assert not shared_again.is_alive() and own.held is None and shut == ["shared", "own"]
