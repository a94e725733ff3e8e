"""Scale simulator: discrete-event chaos model of slices, learners, failures and repairs.

The model, in one place (every time is in seconds):

* **Fleet.** ``chips`` chips in slices of ``slice_chips`` (default 256, one TPU v5e/v6e pod: the
  ICI domain a chip failure breaks, so the whole slice goes down). Each chip is interrupted on
  average once per ``chip_mtbi_s`` (one year), so a healthy slice fails at rate
  ``λ = slice_chips / chip_mtbi_s`` (exponential up times). A failed slice is out for an
  exponential repair time of mean ``repair_mean_s`` (memoryless, so the trace starts in the
  stationary state: each slice is down at t = 0 with probability ``p = T_r / (1/λ + T_r)``).
* **Trace.** One seeded list of outages ``(slice, down_s, up_s)`` drives every system, so the
  systems are compared on the same failures (common random numbers).
* **Data-parallel, not elastic** (``dp``): one job of ``n − spares`` slices. The spares are hot,
  allocated and idle: ``spares = ⌈m + z·√m⌉`` with ``m = n·p`` the mean number of slices in repair
  (Little's law) and ``z = 3``, so the job rarely waits for a repair. Any member failure stops
  everyone: a spare is swapped in (or the job waits for a repair when none is healthy), then a
  ``restart_s`` pause, and the work since the last checkpoint (every ``checkpoint_interval_s`` of
  progress; 0 = every step) is lost. Failures during the pause are handled by the same restart.
* **Data-parallel, elastic** (``dp_elastic``): one job on every healthy slice. A failure pauses the
  job for ``reconfig_s`` and it goes on without the slice; the slice's return pauses it again
  (re-grow). Events during a pause are folded into that reconfiguration; nothing rolls back.
* **Decoupled DiLoCo, M learners** (``diloco_M``): the slices are split into M contiguous learners
  (sizes differ by at most one slice). Each learner is an elastic job of its own: a failure pauses
  only that learner for ``reconfig_s`` (and again on re-grow); the others never wait (docs/architecture.md#the-shape).
  With M = 1 this is exactly ``dp_elastic`` on the same trace.

Goodput is docs/architecture.md#goodput: Σ useful (slice-)time ÷ Σ allocated (slice-)time, where every system is
allocated all ``chips`` for the whole horizon. Only the times the paper does not publish
(``Timings``) are calibrated, on the two data-parallel rows of docs/operations.md#scale-simulator; the DiLoCo rows are then
predicted with the same times.

Nominal chip counts round to whole slices (150k → 586 × 256). Each simulated run holds about
``failures_per_run`` slice failures (default 20 000, at least 2 days): 49 days at 150k, 3 days at
2.4M; two seeds. Seed-to-seed spread is about 0.3 percentage points at that size. The one
sequential step is the dead-time walk over accepted pause starts (``_dead_time_starts``); the rest
is numpy, so calibration and prediction take well under a minute on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

YEAR_S = 365.25 * 24 * 3600.0
DAY_S = 24 * 3600.0
DEFAULT_SLICE_CHIPS = 256
DEFAULT_SPARE_Z = 3.0
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
# Decoupled DiLoCo paper (arXiv 2604.21428), Table 1, goodput; docs/operations.md#scale-simulator.
PAPER_TARGETS = {
    "dp": (0.72, 0.57, 0.38, 0.27, 0.18),
    "dp_elastic": (0.88, 0.80, 0.69, 0.58, 0.40),
}
DILOCO_LEARNERS = (2, 4, 8, 16)


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} ({value}) must be a finite number > 0")


def _check_nonnegative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} ({value}) must be a finite number >= 0")


def _check_int(name: str, value: int, low: int, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} ({value!r}) must be an integer")
    if value < low:
        raise ValueError(f"{name} ({value}) must be >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{name} ({value}) must be <= {high}")


@dataclass(frozen=True)
class Fleet:
    """The chips of one simulated run.

    Attributes:
      chips: number of chips; a whole number of slices.
      slice_chips: chips per slice, the failure domain (one chip down takes the slice down).
      chip_mtbi_s: mean time between interruptions of one chip, seconds (default one year).
    """

    chips: int
    slice_chips: int = DEFAULT_SLICE_CHIPS
    chip_mtbi_s: float = YEAR_S

    def __post_init__(self):
        _check_int("chips", self.chips, 1)
        _check_int("slice_chips", self.slice_chips, 1)
        _check_positive("chip_mtbi_s", self.chip_mtbi_s)
        if self.chips % self.slice_chips:
            raise ValueError(f"chips ({self.chips}) must be a multiple of slice_chips "
                             f"({self.slice_chips}); Fleet.nominal() rounds to whole slices")

    @classmethod
    def nominal(cls, chips: int, slice_chips: int = DEFAULT_SLICE_CHIPS,
                chip_mtbi_s: float = YEAR_S) -> "Fleet":
        """The fleet of whole slices closest to a nominal chip count (150k → 586 × 256 chips)."""
        _check_int("chips", chips, 1)
        _check_int("slice_chips", slice_chips, 1)
        return cls(max(1, round(chips / slice_chips)) * slice_chips, slice_chips, chip_mtbi_s)

    @property
    def slices(self) -> int:
        return self.chips // self.slice_chips

    @property
    def slice_failure_rate_hz(self) -> float:
        """λ = slice_chips / chip_mtbi_s: failures per second of one healthy slice."""
        return self.slice_chips / self.chip_mtbi_s


@dataclass(frozen=True)
class Timings:
    """The times the paper does not publish; ``calibrate`` fits them on the data-parallel rows.

    Attributes:
      restart_s: non-elastic DP pause after a failure: detect, swap a spare in, reload, recompile.
      checkpoint_interval_s: non-elastic DP progress between two checkpoints; a failure loses the
        progress since the last one. 0 means a checkpoint every step (no loss).
      reconfig_s: elastic pause of one shrink or one re-grow (DP elastic and each DiLoCo learner).
      repair_mean_s: mean time a failed slice is out of service (exponential).
    """

    restart_s: float
    checkpoint_interval_s: float
    reconfig_s: float
    repair_mean_s: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_nonnegative(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class FailureTrace:
    """Seeded outages of the slices; the one input every system is simulated on.

    Attributes:
      n_slices: slices in the fleet.
      horizon_s: measured window [0, horizon_s).
      slice_id: int array [K], the slice of each outage.
      down_s: float array [K], when the slice failed; < 0 means it was already down at t = 0.
      up_s: float array [K], when it is healthy again (may lie beyond the horizon).
      member_u: float array [K] in [0, 1): decides whether a failure hits a member of the
        non-elastic job or an idle spare (hit when member_u < members / healthy slices; by
        symmetry every healthy slice is equally likely to fail).
    """

    n_slices: int
    horizon_s: float
    slice_id: np.ndarray
    down_s: np.ndarray
    up_s: np.ndarray
    member_u: np.ndarray

    def __post_init__(self):
        _check_int("n_slices", self.n_slices, 1)
        _check_positive("horizon_s", self.horizon_s)
        k = len(self.slice_id)
        for name in ("down_s", "up_s", "member_u"):
            if len(getattr(self, name)) != k:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, slice_id has {k}")
        if k:
            if np.min(self.slice_id) < 0 or np.max(self.slice_id) >= self.n_slices:
                raise ValueError(f"slice_id must lie in [0, {self.n_slices})")
            if np.any(self.up_s < self.down_s):
                raise ValueError("up_s must be >= down_s for every outage")
            order = np.lexsort((self.down_s, self.slice_id))
            same = self.slice_id[order][1:] == self.slice_id[order][:-1]
            if np.any(same & (self.down_s[order][1:] < self.up_s[order][:-1])):
                raise ValueError("outages of one slice overlap")

    @classmethod
    def scripted(cls, n_slices: int, horizon_s: float,
                 outages: Sequence[tuple]) -> "FailureTrace":
        """A hand-written trace: ``outages`` of ``(slice, down_s, up_s[, member_u])``."""
        rows = [tuple(o) + (0.0,) * (4 - len(o)) for o in outages]
        cols = list(zip(*rows)) if rows else [(), (), (), ()]
        return cls(n_slices, float(horizon_s), np.asarray(cols[0], dtype=np.int64),
                   np.asarray(cols[1], dtype=float), np.asarray(cols[2], dtype=float),
                   np.asarray(cols[3], dtype=float))


def down_fraction(fleet: Fleet, repair_mean_s: float) -> float:
    """Stationary fraction of slices in repair, p = T_r / (1/λ + T_r) (alternating renewal)."""
    _check_nonnegative("repair_mean_s", repair_mean_s)
    return repair_mean_s / (1.0 / fleet.slice_failure_rate_hz + repair_mean_s)


def spare_slices(n_slices: int, down_frac: float, z: float = DEFAULT_SPARE_Z) -> int:
    """Hot spares for the non-elastic job: ⌈m + z·√m⌉, m = n·p slices in repair on average.

    >>> spare_slices(586, 0.05)
    46
    """
    _check_int("n_slices", n_slices, 1)
    if not 0.0 <= down_frac < 1.0:
        raise ValueError(f"down_frac ({down_frac}) must lie in [0, 1)")
    _check_nonnegative("z", z)
    m = n_slices * down_frac
    return min(n_slices - 1, int(math.ceil(m + z * math.sqrt(m) - 1e-9)))


def horizon_for(fleet: Fleet, failures: int, min_horizon_s: float = 2 * DAY_S) -> float:
    """Wall time that holds about ``failures`` slice failures: max(min_horizon_s, failures/Λ)."""
    _check_int("failures", failures, 1)
    _check_positive("min_horizon_s", min_horizon_s)
    return max(min_horizon_s, failures / (fleet.slices * fleet.slice_failure_rate_hz))


def generate_trace(fleet: Fleet, repair_mean_s: float, horizon_s: float, seed: int) -> FailureTrace:
    """Samples the outages of every slice over [0, horizon_s), starting in the stationary state.

    Up times ~ Exp(mean 1/λ), repair times ~ Exp(mean repair_mean_s). The unit draws depend only on
    (seed, slices, horizon), so traces for different repair times share their randomness.
    """
    _check_nonnegative("repair_mean_s", repair_mean_s)
    _check_positive("horizon_s", horizon_s)
    n, lam = fleet.slices, fleet.slice_failure_rate_hz
    rng = np.random.default_rng(seed)
    cycles = int(math.ceil(lam * horizon_s + 6.0 * math.sqrt(lam * horizon_s) + 6.0))
    initial_u = rng.random(n)
    age_e, residual_e = rng.standard_exponential((2, n))
    up_e = rng.standard_exponential((n, cycles))
    repair_e = rng.standard_exponential((n, cycles))
    member_u = rng.random((n, cycles))
    while True:  # almost never loops: `cycles` is six standard deviations above the mean
        up, repair = up_e / lam, repair_e * repair_mean_s
        down0 = initial_u < down_fraction(fleet, repair_mean_s)
        back0_s = np.where(down0, residual_e * repair_mean_s, 0.0)
        # fail_j = back0 + Σ_{i<j}(up_i + repair_i) + up_j
        fail = back0_s[:, None] + np.cumsum(up + repair, axis=1) - repair
        if np.all(fail[:, -1] >= horizon_s):
            break
        up_e = np.concatenate([up_e, rng.standard_exponential((n, cycles))], axis=1)
        repair_e = np.concatenate([repair_e, rng.standard_exponential((n, cycles))], axis=1)
        member_u = np.concatenate([member_u, rng.random((n, cycles))], axis=1)
    inside = fail < horizon_s
    rows = np.nonzero(inside)[0]
    pre = np.nonzero(down0)[0]
    slice_id = np.concatenate([pre, rows])
    down_s = np.concatenate([-age_e[pre] * repair_mean_s - 1e-9, fail[inside]])
    up_s = np.concatenate([back0_s[pre], (fail + repair)[inside]])
    u = np.concatenate([np.zeros(len(pre)), member_u[inside]])
    order = np.argsort(down_s, kind="stable")
    return FailureTrace(n, float(horizon_s), slice_id[order], down_s[order], up_s[order], u[order])


def _dead_time_starts(keys: np.ndarray, dead_s: float) -> np.ndarray:
    """Indices of the events that start a pause; an event within dead_s of the last start joins it.

    ``keys`` is sorted. This is the only sequential step; it walks the accepted events only.
    """
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    nxt = np.maximum(np.searchsorted(keys, keys + dead_s, side="left"),
                     np.arange(1, len(keys) + 1)).tolist()
    starts, i, end = [], 0, len(keys)
    while i < end:
        starts.append(i)
        i = nxt[i]
    return np.asarray(starts, dtype=np.int64)


def learner_of_slice(n_slices: int, learners: int) -> np.ndarray:
    """Contiguous split of slices into learners; sizes differ by at most one slice.

    >>> learner_of_slice(5, 2).tolist()
    [0, 0, 0, 1, 1]
    """
    _check_int("learners", learners, 1, n_slices)
    return (np.arange(n_slices) * learners) // n_slices


class ElasticAxis(NamedTuple):
    """A trace prepared for elastic learners; every reconfig_s reuses it.

    Learner m lives on the axis [m·span, m·span + horizon_s), span = 2·horizon_s + 1, so one sorted
    array holds every learner and a pause (clipped to horizon_s) never reaches the next learner.

    Attributes:
      event_key: sorted axis positions of the failures and repairs (they start pauses).
      event_end: for each event, the end of its learner's window on the axis (m·span + horizon_s).
      x, area: breakpoints of the healthy-slice count and its integral F(x) = ∫ h; F is piecewise
        linear, so np.interp evaluates it exactly.
      span: axis length per learner; horizon_s: window; n_slices: allocated slices.
    """

    event_key: np.ndarray
    event_end: np.ndarray
    x: np.ndarray
    area: np.ndarray
    span: float
    horizon_s: float
    n_slices: int


def elastic_axis(trace: FailureTrace, learners: int = 1) -> ElasticAxis:
    """Lays out the healthy slices of each of ``learners`` contiguous learners (see ElasticAxis)."""
    _check_int("learners", learners, 1, trace.n_slices)
    n, horizon = trace.n_slices, trace.horizon_s
    group = learner_of_slice(n, learners)
    size = np.bincount(group, minlength=learners)
    g = group[trace.slice_id]
    down_at_0 = (trace.down_s < 0) & (trace.up_s > 0)
    h0 = size - np.bincount(g[down_at_0], minlength=learners)
    fail_in = (trace.down_s >= 0) & (trace.down_s < horizon)
    back_in = (trace.up_s < horizon) & (fail_in | down_at_0)
    span = 2.0 * horizon + 1.0
    ev_key = np.concatenate([g[fail_in] * span + trace.down_s[fail_in],
                             g[back_in] * span + trace.up_s[back_in]])
    ev_jump = np.concatenate([-np.ones(fail_in.sum()), np.ones(back_in.sum())])
    ev_group = np.concatenate([g[fail_in], g[back_in]])
    # Healthy slices as a step function: +h0 at each learner's start, the events, 0 at its end.
    base = np.arange(learners) * span
    end_jump = -(h0 + np.bincount(ev_group, weights=ev_jump, minlength=learners))
    x = np.concatenate([base, ev_key, base + horizon])
    jump = np.concatenate([h0.astype(float), ev_jump, end_jump])
    order = np.argsort(x, kind="stable")
    x, h = x[order], np.cumsum(jump[order])
    area = np.concatenate([[0.0], np.cumsum(h[:-1] * np.diff(x))])
    order = np.argsort(ev_key, kind="stable")
    return ElasticAxis(ev_key[order], base[ev_group[order]] + horizon, x, area, span, horizon, n)


def elastic_axis_goodput(axis: ElasticAxis, reconfig_s: float) -> float:
    """Goodput on a prepared axis: (∫ h − ∫ h over the pauses) ÷ (n_slices · horizon_s)."""
    _check_nonnegative("reconfig_s", reconfig_s)
    # A pause longer than the window covers the rest of it either way.
    dead_s = min(reconfig_s, axis.horizon_s)
    first = _dead_time_starts(axis.event_key, dead_s)
    starts = axis.event_key[first]
    ends = np.minimum(starts + dead_s, axis.event_end[first])
    paused = np.sum(np.interp(ends, axis.x, axis.area) - np.interp(starts, axis.x, axis.area))
    return float((axis.area[-1] - paused) / (axis.n_slices * axis.horizon_s))


def elastic_goodput(trace: FailureTrace, reconfig_s: float, learners: int = 1) -> float:
    """Goodput of independent elastic learners: ``dp_elastic`` (learners=1) or ``diloco_M``.

    Learner m trains on its h_m(t) healthy slices except during its own reconfiguration pauses, each
    ``reconfig_s`` long, started by a failure or a repair of one of its slices (events inside a
    pause join that pause). goodput = Σ_m ∫ h_m(t)·running_m(t) dt ÷ (n_slices · horizon_s).
    """
    _check_nonnegative("reconfig_s", reconfig_s)
    return elastic_axis_goodput(elastic_axis(trace, learners), reconfig_s)


@dataclass(frozen=True)
class DataParallelRuns:
    """Run segments of the non-elastic job (before checkpoint loss).

    Attributes:
      length_s: float array, wall time of each uninterrupted run.
      truncated: bool array, the run was cut by the horizon, not by a failure (nothing lost).
      job_slices: slices the job trains on (n_slices − spares).
      n_slices: slices allocated in all.
      horizon_s: the measured window.
    """

    length_s: np.ndarray
    truncated: np.ndarray
    job_slices: int
    n_slices: int
    horizon_s: float


class DataParallelStops(NamedTuple):
    """A trace prepared for the non-elastic job; every restart_s reuses it.

    Attributes:
      stop_s: sorted failures that hit a job member (a healthy spare, if any, replaces it).
      step_s: sorted times the healthy-slice count changes; full_after: the job has all its
        slices after that step; next_full: index of the first step ≥ i after which it has them
        (len(step_s) for never), with one extra entry; full_at_0: it has them at t = 0.
      job_slices, n_slices, horizon_s: as in DataParallelRuns.
    """

    stop_s: np.ndarray
    step_s: np.ndarray
    full_after: np.ndarray
    next_full: np.ndarray
    full_at_0: bool
    job_slices: int
    n_slices: int
    horizon_s: float


def data_parallel_stops(trace: FailureTrace, spares: int = 0) -> DataParallelStops:
    """Which failures stop a job of ``n − spares`` slices, and when it has its slices."""
    _check_int("spares", spares, 0, trace.n_slices - 1)
    n, horizon = trace.n_slices, trace.horizon_s
    job = n - spares
    down_at_0 = (trace.down_s < 0) & (trace.up_s > 0)
    h0 = n - int(down_at_0.sum())
    fail_in = (trace.down_s >= 0) & (trace.down_s < horizon)
    back_in = (trace.up_s < horizon) & (fail_in | down_at_0)
    t = np.concatenate([trace.down_s[fail_in], trace.up_s[back_in]])
    jump = np.concatenate([-np.ones(fail_in.sum(), dtype=np.int64),
                           np.ones(back_in.sum(), dtype=np.int64)])
    u = np.concatenate([trace.member_u[fail_in], np.ones(back_in.sum())])
    order = np.argsort(t, kind="stable")
    t, jump, u = t[order], jump[order], u[order]
    h_after = h0 + np.cumsum(jump)
    h_before = h_after - jump
    # A failure hits a member with probability members / healthy (all healthy slices alike).
    hit = (jump < 0) & (u * np.maximum(h_before, 1) < np.minimum(job, h_before))
    full_after = h_after >= job
    idx = np.where(full_after, np.arange(len(t)), len(t))
    next_full = np.append(np.minimum.accumulate(idx[::-1])[::-1], len(t))
    return DataParallelStops(t[hit], t, full_after, next_full, bool(h0 >= job), job, n, horizon)


def _first_full(stops: DataParallelStops, at_s: np.ndarray) -> np.ndarray:
    """Earliest time ≥ at_s at which the job has all its slices (inf when never)."""
    i = np.searchsorted(stops.step_s, at_s, side="right") - 1
    full = np.concatenate([[stops.full_at_0], stops.full_after])[i + 1]
    step_ext = np.append(stops.step_s, np.inf)
    return np.where(full, at_s, step_ext[stops.next_full[i + 1]])


def data_parallel_stops_runs(stops: DataParallelStops, restart_s: float) -> DataParallelRuns:
    """Runs of the non-elastic job between its stops, for one restart pause."""
    _check_nonnegative("restart_s", restart_s)
    horizon, stop_s = stops.horizon_s, stops.stop_s
    # After a stop at s: wait for a full set of slices, pause restart_s; if the pause left the job
    # short (spares ran out meanwhile), wait and pause again.
    resume = _first_full(stops, stop_s) + restart_s
    while True:
        again = (resume < horizon) & (_first_full(stops, resume) > resume)
        if not again.any():
            break
        resume[again] = _first_full(stops, resume[again]) + restart_s
    nxt = np.searchsorted(stop_s, resume, side="right").tolist()
    first_start = float(_first_full(stops, np.asarray([0.0]))[0])
    starts, ends = [], []
    if first_start < horizon:
        k = int(np.searchsorted(stop_s, first_start, side="right"))
        starts.append(first_start)
        resume_l, stop_l = resume.tolist(), stop_s.tolist()
        while k < len(stop_l):
            ends.append(stop_l[k])
            if resume_l[k] >= horizon:
                break
            starts.append(resume_l[k])
            k = nxt[k]
        if len(ends) < len(starts):
            ends.append(horizon)
    starts_a, ends_a = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    truncated = np.zeros(len(starts_a), dtype=bool)
    if len(truncated) and ends_a[-1] >= horizon:
        truncated[-1] = True
    return DataParallelRuns(ends_a - starts_a, truncated, stops.job_slices, stops.n_slices, horizon)


def data_parallel_runs(trace: FailureTrace, restart_s: float, spares: int = 0) -> DataParallelRuns:
    """Runs of the non-elastic job on ``n − spares`` slices; any member failure stops everyone.

    After a stop at t the job waits until it has ``n − spares`` healthy slices (at once when a spare
    is healthy), then pauses ``restart_s``; failures in that pause are swapped in the same restart,
    and if the pause leaves the job short it waits and pauses again.
    """
    _check_nonnegative("restart_s", restart_s)
    return data_parallel_stops_runs(data_parallel_stops(trace, spares), restart_s)


def checkpointed_goodput(runs: DataParallelRuns, checkpoint_interval_s: float) -> float:
    """Goodput of the runs when a failure loses the progress since the last checkpoint.

    A run of length L stopped by a failure keeps ⌊L/C⌋·C (C = checkpoint_interval_s; C = 0 keeps
    L); a run cut by the horizon keeps L. goodput = job_slices · Σ kept ÷ (n_slices · horizon_s).
    """
    _check_nonnegative("checkpoint_interval_s", checkpoint_interval_s)
    length = runs.length_s
    if checkpoint_interval_s > 0:
        kept = np.where(runs.truncated, length,
                        np.floor(length / checkpoint_interval_s) * checkpoint_interval_s)
    else:
        kept = length
    return float(runs.job_slices * kept.sum() / (runs.n_slices * runs.horizon_s))


def data_parallel_goodput(trace: FailureTrace, restart_s: float, checkpoint_interval_s: float,
                          spares: int = 0) -> float:
    """Goodput of non-elastic data parallelism (``dp``) on one trace; see data_parallel_runs."""
    return checkpointed_goodput(data_parallel_runs(trace, restart_s, spares), checkpoint_interval_s)


@dataclass(frozen=True)
class SimConfig:
    """How much to simulate.

    Attributes:
      failures_per_run: slice failures per simulated run; sets the horizon (horizon_for).
      min_horizon_s: shortest horizon, seconds.
      seeds: one trace per seed and fleet; goodputs are averaged over seeds.
      slice_chips: chips per slice.
      spare_z: standard deviations of hot spares above the mean slices in repair (non-elastic DP).
      learners: DiLoCo learner counts M to predict.
    """

    failures_per_run: int = 20_000
    min_horizon_s: float = 2 * DAY_S
    seeds: tuple = (0, 1)
    slice_chips: int = DEFAULT_SLICE_CHIPS
    spare_z: float = DEFAULT_SPARE_Z
    learners: tuple = DILOCO_LEARNERS

    def __post_init__(self):
        _check_int("failures_per_run", self.failures_per_run, 1)
        _check_positive("min_horizon_s", self.min_horizon_s)
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        _check_int("slice_chips", self.slice_chips, 1)
        _check_nonnegative("spare_z", self.spare_z)
        for m in self.learners:
            _check_int("learners", m, 1)


QUICK = SimConfig(failures_per_run=6_000, seeds=(0,))


def _traces(chips: Sequence[int], repair_mean_s: float, config: SimConfig) -> list:
    """[(fleet, [trace per seed])] for each nominal chip count."""
    out = []
    for c in chips:
        fleet = Fleet.nominal(c, config.slice_chips)
        horizon = horizon_for(fleet, config.failures_per_run, config.min_horizon_s)
        out.append((fleet, [generate_trace(fleet, repair_mean_s, horizon, seed)
                            for seed in config.seeds]))
    return out


def simulate_fleet(chips: int, timings: Timings, config: SimConfig = SimConfig()) -> dict:
    """Goodput of every system on the same traces of one fleet, averaged over the seeds.

    Returns:
      {"dp": …, "dp_elastic": …, "diloco_2": …, …} for config.learners (M ≤ slices).
    """
    ((fleet, traces),) = _traces([chips], timings.repair_mean_s, config)
    spares = spare_slices(fleet.slices, down_fraction(fleet, timings.repair_mean_s), config.spare_z)
    out = {"dp": np.mean([data_parallel_goodput(t, timings.restart_s,
                                                timings.checkpoint_interval_s, spares)
                          for t in traces]),
           "dp_elastic": np.mean([elastic_goodput(t, timings.reconfig_s) for t in traces])}
    for m in config.learners:
        _check_int("learners", m, 1, fleet.slices)
        out[f"diloco_{m}"] = np.mean([elastic_goodput(t, timings.reconfig_s, m) for t in traces])
    return {k: float(v) for k, v in out.items()}


def _minimize_1d(f: Callable[[float], float], grid: Sequence[float], iters: int) -> tuple:
    """Best point of a grid, then golden-section search between its neighbours; (x, f(x))."""
    values = [f(x) for x in grid]
    k = int(np.argmin(values))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    best = (grid[k], values[k])
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(iters):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = f(b)
    for x, fx in ((a, fa), (b, fb)):
        if fx < best[1]:
            best = (x, fx)
    return best


@dataclass(frozen=True)
class Calibration:
    """Fitted times and how well the data-parallel rows match the paper.

    Attributes:
      timings: the calibrated Timings.
      fitted: {"dp": (goodput per chip count), "dp_elastic": (…)} at those timings.
      errors_pp: same shape, fitted − target in percentage points.
      rmse_pp: root mean square of all errors_pp; max_abs_pp: the largest |error|.
    """

    timings: Timings
    fitted: Mapping[str, tuple]
    errors_pp: Mapping[str, tuple]
    rmse_pp: float
    max_abs_pp: float


# Search ranges of the calibration (seconds).
RECONFIG_GRID_S = (0.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
RESTART_GRID_S = (0.0, 15.0, 30.0, 60.0, 90.0, 120.0, 240.0)
CHECKPOINT_GRID_S = (0.0, 5.0, 10.0, 20.0, 30.0, 60.0)
REPAIR_GRID_S = tuple(3600.0 * h for h in (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0))


def _fit_given_repair(repair_mean_s: float, chips: Sequence[int], targets: Mapping[str, Sequence],
                      config: SimConfig, iters: int) -> tuple:
    """Best (reconfig_s, restart_s, checkpoint_interval_s, SSE) for one repair time."""
    runs = _traces(chips, repair_mean_s, config)
    el_target = np.asarray(targets["dp_elastic"])
    dp_target = np.asarray(targets["dp"])

    axes = [[elastic_axis(t) for t in traces] for _, traces in runs]
    spares = [spare_slices(f.slices, down_fraction(f, repair_mean_s), config.spare_z)
              for f, _ in runs]
    stops = [[data_parallel_stops(t, s) for t in traces] for (_, traces), s in zip(runs, spares)]
    best_c = {}

    def elastic_sse(r: float) -> float:
        g = [np.mean([elastic_axis_goodput(a, r) for a in per_fleet]) for per_fleet in axes]
        return float(np.sum((np.asarray(g) - el_target) ** 2))

    def dp_sse(r: float) -> float:
        per_run = [[data_parallel_stops_runs(x, r) for x in per_fleet] for per_fleet in stops]
        sse = {c: float(np.sum((np.asarray([np.mean([checkpointed_goodput(x, c) for x in rs])
                                            for rs in per_run]) - dp_target) ** 2))
               for c in CHECKPOINT_GRID_S}
        c = min(sse, key=sse.get)
        best_c[r] = c
        return sse[c]

    reconfig, el_sse = _minimize_1d(elastic_sse, RECONFIG_GRID_S, iters)
    restart, dp_err = _minimize_1d(dp_sse, RESTART_GRID_S, iters)
    return reconfig, restart, best_c[restart], el_sse + dp_err


def calibrate(config: SimConfig = SimConfig(), chips: Sequence[int] = PAPER_CHIPS,
              targets: Mapping[str, Sequence] = PAPER_TARGETS, iters: int = 10) -> Calibration:
    """Fits the Timings on the data-parallel rows only (least squares over both rows).

    repair_mean_s: log grid then golden search in log time; for each repair time, reconfig_s is
    fitted on the elastic row and (restart_s, checkpoint_interval_s) on the non-elastic row.
    """
    for key in ("dp", "dp_elastic"):
        if key not in targets or len(targets[key]) != len(chips):
            raise ValueError(f"targets[{key!r}] must give one goodput per chip count "
                             f"({len(chips)})")
    cache = {}

    def total_sse(log_repair: float) -> float:
        cache[log_repair] = _fit_given_repair(math.exp(log_repair), chips, targets, config, iters)
        return cache[log_repair][3]

    log_repair, _ = _minimize_1d(total_sse, [math.log(r) for r in REPAIR_GRID_S],
                                 max(iters // 2, 1))
    reconfig, restart, checkpoint, _ = cache[log_repair]
    timings = Timings(restart_s=restart, checkpoint_interval_s=checkpoint, reconfig_s=reconfig,
                      repair_mean_s=math.exp(log_repair))
    rows = [simulate_fleet(c, timings, dataclasses.replace(config, learners=())) for c in chips]
    fitted = {k: tuple(r[k] for r in rows) for k in ("dp", "dp_elastic")}
    errors = {k: tuple(100.0 * (f - t) for f, t in zip(fitted[k], targets[k])) for k in fitted}
    flat = np.asarray(errors["dp"] + errors["dp_elastic"])
    return Calibration(timings, fitted, errors, float(np.sqrt(np.mean(flat ** 2))),
                       float(np.max(np.abs(flat))))


@dataclass(frozen=True)
class Study:
    """Calibration plus the predicted table {chips: {system: goodput}} and the time it took."""

    calibration: Calibration
    table: Mapping[int, Mapping[str, float]]
    config: SimConfig
    elapsed_s: float


def run_study(config: SimConfig = SimConfig(), chips: Sequence[int] = PAPER_CHIPS,
              iters: int = 10) -> Study:
    """Calibrates on the data-parallel rows, then predicts every system at every chip count."""
    t0 = time.perf_counter()
    calibration = calibrate(config, chips, iters=iters)
    table = {c: simulate_fleet(c, calibration.timings, config) for c in chips}
    return Study(calibration, table, config, time.perf_counter() - t0)


def study_json(study: Study) -> dict:
    """The published record: calibrated parameters, predicted table, fit error, elapsed seconds."""
    cal, cfg = study.calibration, study.config
    tm = cal.timings
    fleets = {c: Fleet.nominal(c, cfg.slice_chips) for c in study.table}
    return {
        "calibrated": {**dataclasses.asdict(tm), "repair_mean_h": tm.repair_mean_s / 3600.0},
        "model": {
            "slice_chips": cfg.slice_chips, "chip_mtbi_s": YEAR_S, "spare_z": cfg.spare_z,
            "repair": "exponential", "failures_per_run": cfg.failures_per_run,
            "seeds": list(cfg.seeds),
            "slices": {str(c): f.slices for c, f in fleets.items()},
            "spares": {str(c): spare_slices(f.slices, down_fraction(f, tm.repair_mean_s),
                                            cfg.spare_z) for c, f in fleets.items()},
            "slice_down_fraction": down_fraction(fleets[min(fleets)], tm.repair_mean_s),
            "horizon_days": {str(c): horizon_for(f, cfg.failures_per_run, cfg.min_horizon_s) / DAY_S
                             for c, f in fleets.items()},
        },
        "table": {str(c): {k: round(v, 4) for k, v in row.items()}
                  for c, row in study.table.items()},
        "targets": {k: list(v) for k, v in PAPER_TARGETS.items()},
        "fit": {"rmse_pp": round(cal.rmse_pp, 3), "max_abs_pp": round(cal.max_abs_pp, 3),
                "errors_pp": {k: [round(e, 2) for e in v] for k, v in cal.errors_pp.items()}},
        "elapsed_s": round(study.elapsed_s, 2),
    }


def format_table(study: Study) -> str:
    """Goodput table in percent, one row per system, paper targets in brackets."""
    chips = list(study.table)
    systems = list(next(iter(study.table.values())))
    head = ["system".ljust(12)] + [f"{c / 1e6:g}M".rjust(11) if c >= 1e6 else
                                   f"{c // 1000}k".rjust(11) for c in chips]
    lines = [" ".join(head)]
    for s in systems:
        cells = []
        for i, c in enumerate(chips):
            cell = f"{100 * study.table[c][s]:.1f}"
            if s in PAPER_TARGETS and len(PAPER_TARGETS[s]) == len(chips):
                cell += f" ({100 * PAPER_TARGETS[s][i]:.0f})"
            cells.append(cell.rjust(11))
        lines.append(" ".join([s.ljust(12)] + cells))
    tm = study.calibration.timings
    lines.append(f"calibrated: restart {tm.restart_s:.1f} s, checkpoint every "
                 f"{tm.checkpoint_interval_s:.0f} s, reconfig {tm.reconfig_s:.1f} s, repair "
                 f"{tm.repair_mean_s / 3600:.2f} h; fit rmse {study.calibration.rmse_pp:.2f} pp, "
                 f"max {study.calibration.max_abs_pp:.2f} pp; {study.elapsed_s:.1f} s")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's options, shared by ``islands simulate`` and benchmarks/scale.py."""
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.failures_per_run} failures per run, one seed")
    parser.add_argument("--failures-per-run", type=int, default=None,
                        help="slice failures per simulated run (sets the horizon)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (traces per size)")
    parser.add_argument("--slice-chips", type=int, default=DEFAULT_SLICE_CHIPS)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    base = QUICK if args.quick else SimConfig()
    changes = {"slice_chips": args.slice_chips}
    if args.failures_per_run is not None:
        changes["failures_per_run"] = args.failures_per_run
    if args.seeds is not None:
        _check_int("seeds", args.seeds, 1)
        changes["seeds"] = tuple(range(args.seeds))
    return dataclasses.replace(base, **changes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``islands simulate``: calibrate, predict, print the table and one JSON object last."""
    parser = argparse.ArgumentParser(prog="islands simulate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    study = run_study(config)
    print(format_table(study))
    print(json.dumps(study_json(study)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
