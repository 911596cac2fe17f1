"""SIGTERM/SIGINT inside `stop_on_signals` become a stop request instead of a dead driver."""

from __future__ import annotations

import os
import signal
import time

import pytest

from archipelago.orchestrator.runtime.signals import stop_on_signals


def test_sigterm_is_turned_into_a_stop_request_and_handlers_restored():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.event.wait(2) and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_interrupts():
    with pytest.raises(KeyboardInterrupt), stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.event.wait(2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)  # the handler raises before this returns
