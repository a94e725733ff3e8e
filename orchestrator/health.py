"""Health: how a learner failure is classified and what the restart policy decides (docs/architecture.md#failures-and-reintegration)."""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional


class Cause(str, enum.Enum):
    """Why a learner stopped training; the ``reason`` label of islands_learner_restarts_total."""

    CRASH = "crash"             # the actor process died on a live node
    PREEMPTION = "preemption"   # the node under it is gone
    HANG = "hang"               # alive but no heartbeat for timeout_s
    STRAGGLER = "straggler"     # step time far above its region's median
    QUARANTINE = "quarantine"   # its drifts kept being refused as garbage: restart from a peer


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
    """

    backoff_initial_s: float = 0.5
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 30.0
    max_crash_restarts: Optional[int] = 5
    max_preemption_restarts: Optional[int] = None

    def budget_for(self, cause: Cause) -> Optional[int]:
        return self.max_preemption_restarts if cause == Cause.PREEMPTION else self.max_crash_restarts

    def decide(self, learner: str, cause: Cause, restarts: Mapping[Cause, int]) -> Verdict:
        """Restart (after a backoff) or retire a learner that just failed for ``cause``.

        Args:
          learner: id, for the message.
          cause: why it failed now.
          restarts: restarts so far by cause (before this failure).

        The backoff grows with the learner's total restarts: delay = min(initial·mult^n, max).
        """
        same_budget = sum(n for c, n in restarts.items()
                          if (c == Cause.PREEMPTION) == (cause == Cause.PREEMPTION))
        budget = self.budget_for(cause)
        attempt = same_budget + 1
        kind = "preemption" if cause == Cause.PREEMPTION else "crash"
        if budget is not None and attempt > budget:
            return Verdict(RestartDecision.RETIRE, 0.0, attempt, budget,
                           f"retire {learner}: {kind} budget of {budget} spent ({cause.value})")
        total = sum(restarts.values())
        delay = min(self.backoff_initial_s * self.backoff_multiplier ** total, self.backoff_max_s)
        of = "unlimited" if budget is None else str(budget)
        return Verdict(RestartDecision.RESTART, delay, attempt, budget,
                       f"restart {attempt} of {of} ({cause.value}) {learner} in {delay:.2f}s")


def detect(now_s: float, last_beat_s: Optional[float], started_s: float, step_time_s: Optional[float],
           region_step_times_s: list[float], timeout_s: float, straggler_factor: float,
           startup_timeout_s: float = 120.0) -> Optional[Cause]:
    """HANG when no heartbeat for ``timeout_s`` (or, before the first one, ``startup_timeout_s``
    after the start: importing JAX and compiling the step takes a while on a loaded machine);
    STRAGGLER when its step time exceeds ``straggler_factor`` × the median of its region's peers
    (needs at least two peers: a region of one has no median to be slow against).
    """
    if last_beat_s is None:
        return Cause.HANG if now_s - started_s > startup_timeout_s else None
    if now_s - last_beat_s > timeout_s:
        return Cause.HANG
    if step_time_s is not None and len(region_step_times_s) >= 2:
        median = statistics.median(region_step_times_s)
        if median > 0 and step_time_s > straggler_factor * median:
            return Cause.STRAGGLER
    return None


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
