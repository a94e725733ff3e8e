"""SIGTERM (a pod's stop) reaches ``islands run`` and a region agent as Ctrl+C does: they stop
cleanly (their exit codes on SIGTERM: tests/integration/test_link.py)."""

import os
import signal
import threading

import pytest

from islands.orchestrator.runtime import (NOT_INSTALLED, Terminated, hold_sigterm,
                                          restore_sigterm, sigterm_interrupts)


def test_sigterm_raises_terminated_once_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    previous = sigterm_interrupts()
    try:
        assert previous is before
        with pytest.raises(KeyboardInterrupt) as raised:   # the driver's Ctrl+C path
            os.kill(os.getpid(), signal.SIGTERM)
        assert isinstance(raised.value, Terminated)
        # A second SIGTERM during the clean stop is ignored rather than cutting it short.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        restore_sigterm(previous)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_first_arriving_during_the_clean_stop_is_ignored():
    before = signal.getsignal(signal.SIGTERM)
    previous = sigterm_interrupts()
    try:
        hold_sigterm(previous)   # the top of the driver's `finally`
        os.kill(os.getpid(), signal.SIGTERM)   # nothing raised, the process lives on
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        restore_sigterm(previous)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_handler_set_from_c_is_restored_as_the_default():
    before = signal.getsignal(signal.SIGTERM)
    try:
        restore_sigterm(None)   # what signal.signal returns for a handler Python cannot name
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_off_the_main_thread_nothing_changes():
    before = signal.getsignal(signal.SIGTERM)
    got = []
    thread = threading.Thread(target=lambda: got.append(sigterm_interrupts()))
    thread.start()
    thread.join()
    assert got == [NOT_INSTALLED] and signal.getsignal(signal.SIGTERM) is before
    hold_sigterm(NOT_INSTALLED)
    restore_sigterm(NOT_INSTALLED)
    assert signal.getsignal(signal.SIGTERM) is before
