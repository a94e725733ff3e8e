"""A learner's pause and resume apply in the order the controller sent them, whatever order its
control threads run them in (the CI failure: a learner that came back into a pause got the pause
and the resume of one fleet step the other way round, and stayed paused while the fleet had it
training)."""

import threading

from islands.learners.unit import LearnerUnit


def control_only() -> LearnerUnit:
    """The actor's pause state alone (no spec, no JAX): what ``pause`` reads and writes."""
    unit = object.__new__(LearnerUnit)
    unit.pause_event, unit.pause_order, unit.pause_lock = threading.Event(), -1, threading.Lock()
    return unit


def test_a_pause_that_runs_after_the_newer_resume_is_ignored():
    unit = control_only()
    unit.pause(False, order=20)          # the resume, sent second, runs first
    unit.pause(True, order=10)           # the pause, sent first, runs second: too old
    assert not unit.pause_event.is_set()
    unit.pause(True, order=30)
    assert unit.pause_event.is_set()
    unit.pause(False, order=30)          # the same order again is not newer
    assert unit.pause_event.is_set()


def test_an_unordered_call_always_applies():
    unit = control_only()
    unit.pause(True, order=50)
    unit.pause(False)                    # an operator's direct call, no order: applied
    assert not unit.pause_event.is_set()
