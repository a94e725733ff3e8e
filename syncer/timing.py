"""One model of time and pause for the grace window (docs/architecture.md#one-model-of-time-and-pause).

The syncer's merge decision (``SyncerCore.timed_decision``, paper Eq. 3) reads four things: ξ_step,
ξ_sync, the live set and whether the fleet is paused. Both bodies of the service compute them
here, the same way, from what their machine gives them: the Ray service from wall-clock step and
merge times and its configured region latencies, the in-process driver from its virtual clock.
So the in-process prediction and the real service differ only by what the machine does (how long
a step or a merge really takes, when a heartbeat carries the news), never by the definitions.

- ξ_step: ``slowest_step_s`` over the step times (``StepPace``) of the learners the fleet holds
  TRAINING; ``DEFAULT_STEP_S`` while none is known.
- ξ_sync: ``SyncTime``, the round trip of a push and its reply (``round_trip_s``: twice the
  largest configured one-way latency) plus an EMA of the merge's own time (merge and outer step).
- the live set: ``live_set``, the learners registered at the syncer now.
- the pause: ``merges_held``, no merge while the fleet is paused, for whatever reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

EMA_WEIGHT = 0.2       # the newest sample's weight: ξ ← 0.8·ξ + 0.2·last
DEFAULT_STEP_S = 1.0   # ξ_step while no training learner has a step time yet
MIN_STEP_S = 1e-3      # ξ_step is never taken below this


def ema(previous: Optional[float], sample: float, weight: float = EMA_WEIGHT) -> float:
    """The running average of step and merge times: the first sample when there is no
    previous value, else ``(1 − weight)·previous + weight·sample``.

    >>> ema(None, 2.0)
    2.0
    >>> round(ema(1.0, 2.0), 6)
    1.2
    """
    sample = float(sample)
    return sample if previous is None else (1.0 - weight) * previous + weight * sample


class StepPace:
    """One learner incarnation's step time, as its heartbeat reports it and ξ_step reads it:
    the EMA of its inner steps' seconds, the first step left out (on the service it loads or
    compiles the program: not a pace). None until the second step ends.

    >>> pace = StepPace()
    >>> pace.observe(30.0), pace.observe(1.0), round(pace.observe(2.0), 6)
    (None, 1.0, 1.2)
    """

    def __init__(self) -> None:
        self.steps = 0
        self.step_s: Optional[float] = None

    def observe(self, seconds: float) -> Optional[float]:
        """Counts one finished step of ``seconds`` (its whole iteration); returns the pace."""
        self.steps += 1
        if self.steps > 1:
            self.step_s = ema(self.step_s, seconds)
        return self.step_s


def slowest_step_s(step_times: Iterable[Optional[float]]) -> float:
    """ξ_step: the largest known step time of the training learners (None or 0: not known yet),
    ``DEFAULT_STEP_S`` when none is known, never below ``MIN_STEP_S``.

    >>> slowest_step_s([0.5, None, 2.0]), slowest_step_s([None, 0.0]), slowest_step_s([])
    (2.0, 1.0, 1.0)
    >>> slowest_step_s([1e-6])
    0.001
    """
    known = [float(s) for s in step_times if s]
    return max(max(known), MIN_STEP_S) if known else DEFAULT_STEP_S


def round_trip_s(one_way_latencies_s: Iterable[float]) -> float:
    """The transfer part of ξ_sync: a push's way to the syncer and its reply's way back over the
    slowest configured link, ``2 × max(one-way latency)``; 0 with none. Bandwidth is left out
    (a fragment's bytes are the learners' to send while they step).

    >>> round_trip_s([0.05, 0.2]), round_trip_s([])
    (0.4, 0.0)
    """
    return 2.0 * max((float(x) for x in one_way_latencies_s), default=0.0)


@dataclass
class SyncTime:
    """ξ_sync = transfer + merge + outer step time: ``round_trip_s`` (fixed, from the configured
    latencies) plus ``merge_s``, the EMA of the merges' own seconds, starting from 0 s (a merge
    costs nothing until one is measured). The Ray syncer observes each merge's wall time; the
    in-process driver merges in no virtual time and observes 0.

    >>> t = SyncTime(round_trip_s=0.4)
    >>> t.sync_s
    0.4
    >>> t.observe_merge(0.5); round(t.merge_s, 6), round(t.sync_s, 6)
    (0.1, 0.5)
    """

    round_trip_s: float = 0.0
    merge_s: float = 0.0

    def observe_merge(self, seconds: float) -> None:
        self.merge_s = ema(self.merge_s, seconds)

    @property
    def sync_s(self) -> float:
        return self.round_trip_s + self.merge_s


def live_set(registered: Mapping[str, int]) -> frozenset:
    """The learners a round waits for (``merge_decision``'s ``live``): those registered at the
    syncer now (``SyncerCore.learners``, learner -> incarnation). A learner that died or left is
    forgotten there, so it is not waited for; one that registered again is.

    >>> sorted(live_set({"a:0": 1, "b:0": 0}))
    ['a:0', 'b:0']
    """
    return frozenset(registered)


def merges_held(paused_reason: Optional[str]) -> bool:
    """The pause rule: while the fleet is paused (``FleetState.paused_reason``: an operator's
    pause, the quorum floor, a paused home) the syncer merges nothing; its open rounds keep their
    pushes and are decided again when training resumes.

    >>> merges_held(None), merges_held("paused by an operator")
    (False, True)
    """
    return paused_reason is not None
