"""What a learner unit tells the controller, typed: its state and its heartbeat.

A heartbeat crosses Ray (learner → controller) and, for a region in its own cluster, the link
(region agent → home, as JSON): ``Heartbeat.as_dict`` and ``Heartbeat.from_dict`` are that
boundary, and a beat that does not parse is refused there, naming the field, instead of being
half-read by the health rules.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional


class LearnerState(str, enum.Enum):
    """A learner unit's own view of itself (the fleet's slot states are the controller's)."""

    STARTING = "starting"
    TRAINING = "training"
    PAUSED = "paused"
    DRAINING = "draining"
    STOPPED = "stopped"

    def __str__(self) -> str:   # f-strings, logs and metric labels read the value
        return self.value


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """One heartbeat: who, when, in what state, and the incarnation's counters so far.

    The counters are cumulative for the incarnation (a restart starts them again; the
    controller folds closed incarnations into the slot's totals).
    """

    learner: str
    incarnation: int
    t: float                      # wall clock when sent
    state: LearnerState
    node_id: Optional[str] = None
    step: int = 0
    tokens_done: int = 0
    compute_s: float = 0.0
    loss: Optional[float] = None
    step_time_s: Optional[float] = None   # the incarnation's step time (EMA, first step left out)
    wire_bytes_up: int = 0
    wire_bytes_down: int = 0
    in_flight: int = 0
    epoch: Optional[int] = None
    compression_relative_error: Optional[float] = None
    pushes: int = 0
    refused: int = 0
    adopted: int = 0
    reregistered: int = 0
    ready_at: Optional[float] = None
    timings: dict = dataclasses.field(default_factory=dict)
    fates: dict = dataclasses.field(default_factory=dict)   # the training thread's token books
    profiler: Optional[str] = None
    # What JAX gave the learner at start (learners/devices.py ``DeviceReport.as_dict``).
    devices: Optional[dict] = None

    def __post_init__(self):
        object.__setattr__(self, "state", LearnerState(self.state))

    @property
    def training(self) -> bool:
        return self.state == LearnerState.TRAINING

    def as_dict(self) -> dict:
        """Plain values (the state as its string): what the books keep and the link sends."""
        out = dataclasses.asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_dict(cls, beat: dict) -> "Heartbeat":
        """A beat from its dict (the link's JSON); unknown keys are ignored (a newer agent may
        send more), a missing or wrong field raises ValueError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in beat.items() if k in names})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"heartbeat from {beat.get('learner')!r} refused: {exc}") from None

    @classmethod
    def of(cls, beat: "Heartbeat | dict") -> "Heartbeat":
        return beat if isinstance(beat, Heartbeat) else cls.from_dict(beat)


def beat_dict(beat: "Heartbeat | dict") -> dict:
    return beat.as_dict() if isinstance(beat, Heartbeat) else dict(beat)


def known_stats(stats: dict) -> dict[str, Any]:
    """The learner's stats that a Heartbeat carries."""
    names = {f.name for f in dataclasses.fields(Heartbeat)}
    return {k: v for k, v in stats.items() if k in names}
