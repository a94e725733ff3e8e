"""Waiting on real state in the integration tests: poll what the service reports until it says
what the test waits for, or fail naming it (never a sleep that hopes)."""

import time


def wait_for(predicate, timeout_s, what, every_s=0.2, describe=None):
    """Polls real state until ``predicate()`` is truthy and returns it; fails naming ``what`` on
    timeout (and showing ``describe()``, the state that did not come about)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    state = f"; state: {describe()}" if describe is not None else ""
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{state}")
