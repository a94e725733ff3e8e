"""What an in-process run produced (``inprocess.run_inprocess``): its parameters, merges, evals,
every inner step, restarts and faults, and goodput on the virtual clock, whole and over time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from islands.faults import Fault
from islands.learners.core import LearnerCore
from islands.orchestrator import fleet as fleet_lib
from islands.syncer.core import MergeResult


@dataclass(frozen=True)
class StepRecord:
    """One inner step: learner index, incarnation, the step count after it, start and duration."""

    learner: int
    incarnation: int
    step: int
    start_s: float
    step_s: float


@dataclass
class RunRecord:
    """What an in-process run produced."""

    global_params: Any
    learner_params: list[Any]
    merges: list[MergeResult] = field(default_factory=list)
    evals: list[tuple[float, int, float]] = field(default_factory=list)  # (time_s, tokens, loss)
    train_losses: list[list[float]] = field(default_factory=list)
    rejected: dict = field(default_factory=dict)
    wire_bytes_up: int = 0
    wire_bytes_down: int = 0
    tokens_processed: int = 0
    end_time_s: float = 0.0
    steps: list[int] = field(default_factory=list)
    # -- failures and goodput (docs/architecture.md#failures-and-reintegration, §6) ----------------------------------------------------
    learner_ids: list[str] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    step_log: list[StepRecord] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)   # one per new incarnation
    faults_fired: list[Fault] = field(default_factory=list)
    faults_skipped: list[tuple[Fault, str]] = field(default_factory=list)  # (fault, why)
    down_intervals: list[list[tuple[float, float]]] = field(default_factory=list)
    allocated_s: list[float] = field(default_factory=list)     # per learner slot
    useful_s: list[float] = field(default_factory=list)        # applied inner-step seconds
    ledger: dict[str, dict] = field(default_factory=dict)      # tokens by fate, per learner
    dropped_pushes: int = 0
    wire_bytes_restore: int = 0    # fragments fetched by restarted learners (fp32)
    watermarks: dict[tuple[int, int], int] = field(default_factory=dict)  # (i, inc) -> step
    learners: list[LearnerCore] = field(default_factory=list)  # final cores (restarts included)
    transitions: list[tuple[float, fleet_lib.Transition]] = field(default_factory=list)
    refusals: list[dict] = field(default_factory=list)   # every refused push, with its reason
    commands_refused: list[tuple] = field(default_factory=list)  # (time_s, command, why)

    def close_slot(self, books, name: str, end_s: float, live, num_fragments: int) -> None:
        """Learner ``name``'s slot at the run's end (``end_s``): its allocated seconds, its
        useful ones and its tokens by fate from the owner's ``books`` (``live``: the running
        incarnation's own books, None when none runs)."""
        books.release(name, end_s)
        self.allocated_s.append(books.allocated_s(end_s, name))
        fates = books.learner_tokens(name, live)
        self.useful_s.append(fates.applied_s / num_fragments)
        self.ledger[name] = {**fates.as_dict(num_fragments),
                             "restarts": sum(r["learner"] == name for r in self.restarts)}

    @property
    def goodput(self) -> float:
        """Σ applied inner-step seconds ÷ Σ allocated seconds (docs/architecture.md#goodput); 0 for an empty run."""
        allocated = sum(self.allocated_s)
        return sum(self.useful_s) / allocated if allocated > 0 else 0.0

    def applied(self, s: StepRecord) -> bool:
        """Whether a step's update reached a merge (its incarnation's watermark covers it)."""
        return s.step <= self.watermarks.get((s.learner, s.incarnation), -1)

    def goodput_series(self, bin_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Goodput over virtual time: ``(bin_end_s, windowed, cumulative)``.

        A step counts as useful in hindsight (its update was applied by the end of the run),
        spread over the bins it overlaps; allocated time is each slot's ``[0, allocated_s]``.
        """
        return series_from_intervals(
            [(s.start_s, s.start_s + s.step_s) for s in self.step_log if self.applied(s)],
            self.allocated_s, bin_s)


def series_from_intervals(useful: Sequence[tuple[float, float]], allocated_s: Sequence[float],
                          bin_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Windowed and cumulative goodput from useful intervals and per-slot allocation ends.

    Args:
      useful: ``(start_s, end_s)`` of each useful piece of work (any slot).
      allocated_s: per slot, the slot exists on ``[0, allocated_s]``.
      bin_s: window width (seconds).

    Returns:
      ``(bin_end_s, windowed, cumulative)``; windowed = useful ÷ allocated within the bin.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    horizon = max(list(allocated_s) + [end for _, end in useful] + [0.0])
    edges = np.arange(0.0, horizon + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    useful_bins = np.zeros(len(edges) - 1)
    for start, end in useful:
        first = int(start // bin_s)
        last = min(int(math.ceil(end / bin_s)), len(useful_bins))
        for b in range(first, last):
            useful_bins[b] += max(0.0, min(end, edges[b + 1]) - max(start, edges[b]))
    alloc_bins = np.zeros_like(useful_bins)
    for end in allocated_s:
        alloc_bins += np.clip(end - edges[:-1], 0.0, bin_s)
    with np.errstate(invalid="ignore", divide="ignore"):
        windowed = np.where(alloc_bins > 0, useful_bins / alloc_bins, np.nan)
        cumulative = np.where(np.cumsum(alloc_bins) > 0,
                              np.cumsum(useful_bins) / np.cumsum(alloc_bins), np.nan)
    return edges[1:], windowed, cumulative
