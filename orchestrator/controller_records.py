"""What the controller records of its job beside the owner's books: the evaluations, the chaos
plan's fired faults, the goodput window's samples, the step-time histograms and the highest
badput it exported. Saved with the owner's state about once a second (``recovery.save_state``)
and read back by a restarted controller (``from_json``), so the window and the curves go on.

>>> r = ControllerRecords()
>>> r.record_eval(1.0, 0, 5.5); r.record_eval(9.0, 640, 4.0)
>>> r.sample_goodput(10.0, 4.0, 8.0, window_s=60.0)
>>> back = ControllerRecords.from_json(r.to_json(10.0, window_s=60.0))
>>> back.initial_eval_loss, back.eval_history[-1], list(back.goodput_history)
(5.5, (9.0, 640, 4.0), [(10.0, 4.0, 8.0)])
"""

from __future__ import annotations

import collections
import copy
import threading
from dataclasses import dataclass, field
from typing import Optional

from .logs import keep_span_s, trim_before
from .metrics import observe_step, window_to_save

EVALS_SAVED = 1000   # the newest evaluations a restarted controller gets back


@dataclass
class ControllerRecords:
    eval_history: list = field(default_factory=list)   # (elapsed_s, tokens applied, eval loss)
    initial_eval_loss: Optional[float] = None
    chaos_fired: list = field(default_factory=list)    # the chaos plan's faults, as fired
    # (t, useful_s, allocated_s): the sliding goodput window's samples
    goodput_history: collections.deque = field(default_factory=collections.deque)
    step_seconds: dict = field(default_factory=dict)   # per region: heartbeats' step times
    badput_high: dict = field(default_factory=dict)    # per cause: the highest exported
    # Scrapes, the console and the owner loop read and raise these on their own threads.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_eval(self, elapsed_s: float, applied: float, loss: float) -> None:
        if self.initial_eval_loss is None:
            self.initial_eval_loss = loss
        self.eval_history.append((elapsed_s, applied, loss))

    def sample_goodput(self, now: float, useful_s: float, allocated_s: float,
                       window_s: float) -> None:
        """One sample of the sliding goodput window; those too old for it are dropped."""
        self.goodput_history.append((now, useful_s, allocated_s))
        trim_before(self.goodput_history, now - keep_span_s(window_s))

    def observe_step(self, region: str, seconds: float) -> None:
        with self.lock:
            observe_step(self.step_seconds, region, seconds)

    def ratchet_badput(self, badput_s: dict) -> dict:
        """Raises each cause's exported badput to ``badput_s``'s where that is higher, and
        returns them all: a counter never goes back (the training phase's remainder wiggles by
        a step as beats land), also when two threads export at once.

        >>> r = ControllerRecords()
        >>> r.ratchet_badput({"restart": 3.0}), r.ratchet_badput({"restart": 2.5})
        ({'restart': 3.0}, {'restart': 3.0})
        """
        with self.lock:
            for cause, x in badput_s.items():
                self.badput_high[cause] = max(self.badput_high.get(cause, 0.0), x)
            return dict(self.badput_high)

    def to_json(self, now: float, window_s: float) -> dict:
        with self.lock:   # a region's first beat adds a histogram while this is written
            step_seconds = copy.deepcopy(self.step_seconds)
        return {"eval_history": self.eval_history[-EVALS_SAVED:],
                "initial_eval_loss": self.initial_eval_loss, "chaos_fired": self.chaos_fired,
                "goodput_history": window_to_save(self.goodput_history, now, window_s),
                "step_seconds": step_seconds}

    @classmethod
    def from_json(cls, saved: dict) -> "ControllerRecords":
        """A saved state's records (older state files lack the window and the histograms)."""
        return cls(eval_history=[tuple(e) for e in saved["eval_history"]],
                   initial_eval_loss=saved["initial_eval_loss"],
                   chaos_fired=saved["chaos_fired"],
                   goodput_history=collections.deque(
                       tuple(x) for x in saved.get("goodput_history") or []),
                   step_seconds=saved.get("step_seconds") or {})
