"""Health: how a learner failure is classified and what the restart policy decides (docs/architecture.md#failures-and-reintegration)."""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional

from islands import defaults


class Cause(str, enum.Enum):
    """Why a learner stopped training; the ``reason`` label of islands_learner_restarts_total."""

    CRASH = "crash"             # the actor process died on a live node
    PREEMPTION = "preemption"   # the node under it is gone
    HANG = "hang"               # alive but no heartbeat for timeout_s
    STRAGGLER = "straggler"     # step time far above its region's median, for a whole window
    QUARANTINE = "quarantine"   # its drifts kept being refused as garbage: restart from a peer
    CONFIG = "config"           # its devices are not what its region asked for: never restarted
    # Its node was announced for preemption (a Ray node drain with a deadline): it finished its
    # in-flight pushes and left; its place was taken elsewhere. No budget is spent.
    PREEMPTED_PLANNED = "preempted_planned"
    # Only a retirement's cause, never a restart's: it crashed again and again with the same
    # error at the same resume step (or within a few steps of it): restarting cannot help.
    CRASH_LOOP = "crash_loop"


class RestartDecision(str, enum.Enum):
    RESTART = "restart"
    RETIRE = "retire"


@dataclass(frozen=True)
class Verdict:
    decision: RestartDecision
    delay_s: float
    attempt: int            # 1-based restart number within the cause's budget
    budget: Optional[int]   # None = unlimited
    message: str


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff; separate budgets for preemptions and for everything else.

    A preemption is the platform's doing, not the learner's, so it does not use up the crash budget.
    ``None`` means unlimited.

    ``reset_after_s``: a learner that trained this long since its last (re)start (its paused
    time left out) was healthy; its next failure is not part of a crash loop, so the restarts
    counted before it no longer count, neither in the budgets nor in the backoff
    (``Slot.counted``; as Kubernetes resets a container's crash-loop backoff once it has run
    fine for 10 minutes). Without it a long job under ordinary failures loses each learner for
    good at its sixth, and every restart waits the longest backoff; too short, and a learner
    that fails deterministically that long after each start restarts forever. ``None``: counts
    are for the learner's lifetime.

    ``crash_loop_after``: a learner whose crashes with an error of its own (not chaos kills,
    hangs, start-up timeouts or device mismatches) came this many times with one error at one
    resume step, or within ``crash_loop_window_steps`` steps of it, is retired as a
    ``crash_loop`` whatever its budget (``crash_loop``); None: never.
    """

    backoff_initial_s: float = defaults.BACKOFF_INITIAL_S
    backoff_multiplier: float = defaults.BACKOFF_MULTIPLIER
    backoff_max_s: float = defaults.BACKOFF_MAX_S
    max_crash_restarts: Optional[int] = defaults.MAX_CRASH_RESTARTS
    max_preemption_restarts: Optional[int] = defaults.MAX_PREEMPTION_RESTARTS
    reset_after_s: Optional[float] = defaults.RESET_AFTER_S
    crash_loop_after: Optional[int] = defaults.CRASH_LOOP_AFTER
    crash_loop_window_steps: int = defaults.CRASH_LOOP_WINDOW_STEPS

    def budget_kind(self, cause: Cause) -> str:
        """The budget a restart for ``cause`` is counted in (crash, preemption, straggler,
        planned)."""
        return _budget_kind(cause)

    def healthy(self, trained_s: Optional[float]) -> bool:
        """The incarnation that just failed had trained ``trained_s`` seconds (None: it never
        trained): long enough that the restarts before it no longer count."""
        return (self.reset_after_s is not None and trained_s is not None
                and trained_s >= self.reset_after_s)

    def budget_for(self, cause: Cause) -> Optional[int]:
        if cause == Cause.STRAGGLER:
            return None  # the fleet restarts a straggler once at most (then it trains on, slow)
        if cause == Cause.PREEMPTED_PLANNED:
            return None  # a handover the platform announced: nothing failed
        return self.max_preemption_restarts if cause == Cause.PREEMPTION else self.max_crash_restarts

    def decide(self, learner: str, cause: Cause, restarts: Mapping[Cause, int]) -> Verdict:
        """Restart (after a backoff) or retire a learner that just failed for ``cause``.

        Args:
          learner: id, for the message.
          cause: why it failed now.
          restarts: restarts so far by cause (before this failure).

        The backoff grows with the learner's counted crash-budget restarts (crash, hang,
        quarantine): delay = min(initial·mult^n, max). Planned handovers, straggler restarts
        and preemptions never lengthen it (a crash after a few handovers is a first crash).
        Being slow never spends a budget: a straggler restart is neither limited by the crash
        budget nor counted in it (in an asynchronous job a slow learner costs only its own
        tokens, and retiring it would lose a learner for good).
        """
        if cause == Cause.CONFIG:   # it would fail the same way on every restart
            return Verdict(RestartDecision.RETIRE, 0.0, 1, 0,
                           f"retire {learner}: a configuration failure is not restarted")
        same_budget = sum(n for c, n in restarts.items() if _budget_kind(c) == _budget_kind(cause))
        budget = self.budget_for(cause)
        attempt = same_budget + 1
        kind = _budget_kind(cause)
        if budget is not None and attempt > budget:
            return Verdict(RestartDecision.RETIRE, 0.0, attempt, budget,
                           f"retire {learner}: {kind} budget of {budget} spent ({cause.value})")
        crashes = sum(n for c, n in restarts.items() if _budget_kind(c) == "crash")
        delay = min(self.backoff_initial_s * self.backoff_multiplier ** crashes,
                    self.backoff_max_s)
        of = "unlimited" if budget is None else str(budget)
        return Verdict(RestartDecision.RESTART, delay, attempt, budget,
                       f"restart {attempt} of {of} ({cause.value}) {learner} in {delay:.2f}s")


def _budget_kind(cause: Cause) -> str:
    """The budget a restart for ``cause`` is counted in."""
    return {Cause.PREEMPTION: "preemption", Cause.STRAGGLER: "straggler",
            Cause.PREEMPTED_PLANNED: "planned"}.get(cause, "crash")


def error_signature(text: str) -> str:
    """What makes two failures "the same error": the last line of the text (a traceback's is the
    exception itself) with its numbers and hex ids made alike (a pid, an address, an actor id
    differ between incarnations), whitespace collapsed.

    >>> error_signature("RayTaskError(ValueError)(ValueError('bad record 17 at 0x7f3a9c'))")
    "RayTaskError(ValueError)(ValueError('bad record # at #'))"
    >>> error_signature("Traceback (most recent call last):\\n  File 'x.py', line 3\\nKeyError: 'w'\\n")
    "KeyError: 'w'"
    """
    import re

    lines = [line for line in (text or "").splitlines() if line.strip()]
    text = re.sub(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{12,}\b|\d+", "#", lines[-1] if lines else "")
    return " ".join(text.split())[:200]


def crash_loop(failures: "tuple[tuple[int, str], ...]", after: Optional[int],
               window_steps: int) -> "Optional[tuple[int, str]]":
    """(resume step, error) when the newest of ``failures`` ((resume step, error signature),
    oldest first) makes ``after`` failures with its error at its resume step or within
    ``window_steps`` steps of it; None otherwise (or ``after`` None). Other errors at the same
    step are no loop: a learner that fails in several ways where it resumes is not shown to
    fail there deterministically (the budget ends it if it keeps failing).

    >>> crash_loop(((40, "a"), (48, "b"), (48, "c")), 3, 0), crash_loop(((40, "a"), (48, "b")), 3, 16)
    (None, None)
    >>> crash_loop(((0, "x"), (48, "b"), (48, "c"), (48, "d")), 3, 0)
    >>> crash_loop(((0, "x"), (48, "d"), (48, "c"), (48, "d"), (48, "d")), 3, 0)
    (48, 'd')
    >>> crash_loop(((40, "x"), (48, "x"), (50, "x")), 3, 16), crash_loop(((10, "x"), (48, "x"), (50, "x")), 3, 16)
    ((50, 'x'), None)
    """
    if not after or not failures:
        return None
    step, signature = failures[-1]
    same = sum(1 for s, e in failures if e == signature and abs(s - step) <= max(window_steps, 0))
    return (step, signature) if same >= after else None


def detect(now_s: float, last_beat_s: Optional[float], started_s: float, step_time_s: Optional[float],
           region_step_times_s: list[float], timeout_s: float, straggler_factor: float,
           startup_timeout_s: float = 120.0, min_excess_s: float = 0.0) -> Optional[Cause]:
    """HANG when no heartbeat for ``timeout_s`` (or, before the first one, ``startup_timeout_s``
    after the start: importing JAX and compiling the step takes a while on a loaded machine);
    STRAGGLER when it is slow now (``is_slow``). A caller decides how long slow must last.
    """
    if last_beat_s is None:
        return Cause.HANG if now_s - started_s > startup_timeout_s else None
    if now_s - last_beat_s > timeout_s:
        return Cause.HANG
    if step_time_s is not None and is_slow(step_time_s, region_step_times_s, straggler_factor,
                                           min_excess_s):
        return Cause.STRAGGLER
    return None


def is_slow(step_time_s: float, peer_step_times_s: list[float], factor: float,
            min_excess_s: float = 0.0) -> bool:
    """Whether a step time is above ``factor`` × the median of its peers' AND at least
    ``min_excess_s`` above that median: 4× of a 2 ms step is scheduling noise, not a slow machine.
    Needs at least two peers (a pair cannot say which of them is the slow one); when the peers
    are slow too, the median is, and nobody is a straggler (the machine is starved, not the
    learner).

    >>> is_slow(0.45, [0.1, 0.1], 4.0), is_slow(0.008, [0.002, 0.002], 4.0, 0.05)
    (True, False)
    >>> is_slow(0.45, [0.1], 4.0), is_slow(0.45, [0.4, 0.5, 0.1], 4.0)
    (False, False)
    """
    if len(peer_step_times_s) < 2:
        return False
    median = statistics.median(peer_step_times_s)
    return median > 0 and step_time_s > factor * median and step_time_s - median >= min_excess_s


def death_cause(node_id: Optional[str], alive_node_ids: "set[str] | frozenset[str]",
                preempted: bool = False, error_text: str = "") -> Cause:
    """PREEMPTION when the learner's node is gone, CRASH when the process died on a live node.

    Ray may report the actor's death before the node's; then its own word counts: the error's
    ``preempted`` flag (an autoscaler drain) or its message "its node has died".

    >>> death_cause("n1", {"n1"}), death_cause("n1", {"n2"}), death_cause(None, set())
    (<Cause.CRASH: 'crash'>, <Cause.PREEMPTION: 'preemption'>, <Cause.CRASH: 'crash'>)
    """
    if preempted or "its node has died" in error_text.lower():
        return Cause.PREEMPTION
    if node_id is not None and node_id not in alive_node_ids:
        return Cause.PREEMPTION
    return Cause.CRASH


def grown_target(capacity: float, previous_capacity: Optional[float], current_target: int,
                 max_learners: int) -> Optional[int]:
    """The learner count a region should grow to when its ``region:<name>`` capacity rose (a node
    joined, by hand or the autoscaler), up to ``max_learners``; None when nothing is to be done.

    >>> grown_target(3, 2, 2, 4), grown_target(6, 2, 2, 4), grown_target(2, 2, 2, 4)
    (3, 4, None)
    """
    if previous_capacity is None or capacity <= previous_capacity:
        return None
    target = min(int(capacity), max_learners)
    return target if target > current_target else None


def drain_timeout_s(health_timeout_s: float) -> float:
    """The fleet's bound on a drain, the Ray body's and the in-process driver's alike: the
    learner gives up on its unanswered pushes after ``health.timeout_s``; one still draining a
    timeout later cannot leave by itself.

    >>> drain_timeout_s(10.0)
    20.0
    """
    return defaults.DRAIN_TIMEOUT_FACTOR * health_timeout_s
