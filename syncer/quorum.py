"""Quorum and the adaptive grace window: when may the syncer merge a fragment (docs/architecture.md#quorum-and-the-grace-window)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional


class MergeReason(str, enum.Enum):
    ALL_LIVE_IN = "all_live_in"        # every live learner has pushed: no reason to wait
    GRACE_EXPIRED = "grace_expired"    # quorum reached and the grace window is over
    BELOW_QUORUM = "below_quorum"      # fewer than K distinct learners have pushed
    IN_GRACE = "in_grace"              # quorum reached, waiting for stragglers until the deadline


@dataclass(frozen=True)
class Decision:
    """``merge`` now, or wait (until ``wait_until_s``, or for more pushes when it is None)."""

    merge: bool
    reason: MergeReason
    wait_until_s: Optional[float] = None


def grace_window(tau_steps: float, step_s: float, quorum_s: float, sync_s: float,
                 gamma: float, cap_s: float) -> float:
    """Grace = clamp(γ·slack, 0, cap) with slack = τ·ξ_step − (ξ_quorum + ξ_sync), paper Eq. 3.

    Args:
      tau_steps: τ, the overlap in inner steps a reply may take without anyone waiting.
      step_s: ξ_step, recent step time of the slowest live learner (seconds).
      quorum_s: ξ_quorum, how long the quorum took to assemble (seconds).
      sync_s: ξ_sync, transfer + merge + outer step time (seconds).
      gamma: γ in [0, 1), the share of the slack given to stragglers.
      cap_s: upper bound (seconds).

    >>> grace_window(2, 1.0, 0.2, 0.3, 0.5, 5.0)  # slack 1.5 s -> 0.75 s
    0.75
    """
    slack = tau_steps * step_s - (quorum_s + sync_s)
    return min(max(gamma * slack, 0.0), cap_s)


def merge_decision(arrived: AbstractSet[str], live: AbstractSet[str], now_s: float,
                   quorum_reached_at_s: Optional[float], min_learners: int,
                   grace_s: float, hold_until_s: Optional[float] = None) -> Decision:
    """Decides whether a fragment's open round may merge.

    Args:
      arrived: distinct learners whose push for this round is in.
      live: learners currently alive (a learner that left is not waited for).
      now_s: the current time (seconds, any clock).
      quorum_reached_at_s: when the K-th distinct push arrived (None if not yet).
      min_learners: K.
      grace_s: the grace window to wait after the quorum.
      hold_until_s: a later deadline than the grace window's, or None (``round_hold``: the
        round's missing learners are due to push before it).

    >>> merge_decision({"a"}, {"a", "b"}, 1.5, 1.0, 1, 1.0)
    Decision(merge=False, reason=<MergeReason.IN_GRACE: 'in_grace'>, wait_until_s=2.0)
    >>> merge_decision({"a"}, {"a", "b"}, 2.5, 1.0, 1, 1.0, hold_until_s=4.0).wait_until_s
    4.0
    >>> merge_decision({"a"}, {"a", "b"}, 4.0, 1.0, 1, 1.0, hold_until_s=4.0).merge
    True
    """
    if len(arrived) < min_learners or quorum_reached_at_s is None:
        return Decision(False, MergeReason.BELOW_QUORUM)
    if live <= arrived:
        return Decision(True, MergeReason.ALL_LIVE_IN)
    deadline = quorum_reached_at_s + grace_s
    if hold_until_s is not None:
        deadline = max(deadline, hold_until_s)
    if now_s >= deadline:
        return Decision(True, MergeReason.GRACE_EXPIRED)
    return Decision(False, MergeReason.IN_GRACE, wait_until_s=deadline)


def round_hold(missing: Mapping[str, tuple[Optional[float], Optional[float]]], now_s: float,
               quorum_reached_at_s: float, bound_s: float, margin_s: float) -> Optional[float]:
    """The round-completion wait (``syncer.round_wait``): until when to hold a partial merge
    for the round's missing live learners that are due to push soon.

    Each learner pushes a fragment once per sync period, so its next push is predicted at its
    last push of the fragment's arrival plus a whole number of its periods (the first that is
    not overdue by more than ``margin_s``: a push it skipped is not waited for). A learner is
    waited for when that is no later than ``quorum_reached_at_s + bound_s``; the hold lasts
    until the latest such prediction plus ``margin_s`` (the prediction's noise). None: nobody
    is due, the grace window decides.

    Args:
      missing: per live learner not yet in the round, ``(period_s, last_arrival_s)``: its
        period (None: not measured yet) and when its last push of this fragment arrived
        (None: none yet). Neither known: not predicted.
      now_s: the current time.
      quorum_reached_at_s: when the quorum came in.
      bound_s: how long after the quorum a due learner may be waited for.
      margin_s: slack around each prediction (the grace window).

    >>> round_hold({"b": (24.0, 10.0), "c": (24.0, 3.0)}, 30.0, 30.0, 6.0, 1.0)  # b at 34
    35.0
    >>> round_hold({"b": (24.0, 10.0)}, 30.0, 30.0, 3.0, 1.0) is None  # b beyond the bound
    True
    >>> round_hold({"b": (None, 10.0), "c": (24.0, None)}, 30.0, 30.0, 6.0, 1.0) is None
    True
    >>> round_hold({"b": (10.0, 1.0)}, 30.0, 30.0, 6.0, 1.0)  # skipped at 11 and 21: 31
    32.0
    """
    due = []
    for period, last in missing.values():
        if period is None or period <= 0 or last is None:
            continue
        periods = max(1, math.ceil((now_s - margin_s - last) / period))
        if last + periods * period <= quorum_reached_at_s + bound_s:
            due.append(last + periods * period)
    return max(due) + margin_s if due else None
