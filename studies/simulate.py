"""Scale simulator: discrete-event chaos model of slices, learners, failures, spares and repairs.

The model, in one place (every time is in seconds):

* **Fleet.** ``chips`` chips in slices of ``slice_chips`` (default 256, one TPU v5e/v6e pod: the
  ICI domain a chip failure breaks, so the whole slice goes down). Each chip is interrupted on
  average once per ``chip_mtbi_s`` (one year), so a healthy slice fails at rate
  ``λ = slice_chips / chip_mtbi_s`` (exponential up times). A failed slice is out of service for an
  exponential repair time of mean ``repair_mean_s`` (memoryless, so the trace starts in the
  stationary state: each slice is down at t = 0 with probability ``p = T_r / (1/λ + T_r)``).
* **Spare pool.** Every system is allocated the same slices and holds the same pool of idle spares,
  ``⌈m + z·√m⌉`` slices (``m = n·p`` slices in repair on average, Little's law; ``z = 3``); it trains
  on the other places. When the slice in a place fails, a healthy spare takes the place
  ``reschedule_s`` later (non-elastic DP swaps it inside its restart, so at once there); the failed
  slice goes to repair and then back to the pool. With no healthy spare the place waits for one (or
  for its own slice). ``pool_position_trace`` plays this on the trace once; the systems then see
  only the vacancies of their places. Repair time, reschedule delay, pool rule and chip MTBI are
  pinned to public figures (``FailureModel``, docs/operations.md#what-the-failure-model-rests-on).
* **Trace.** One seeded list of outages ``(slice, down_s, up_s)`` drives every system, so the
  systems are compared on the same failures (common random numbers).
* **Data-parallel, not elastic** (``dp``): one job on every place. Any vacancy stops everyone: the
  job waits until every place is filled, then pauses ``restart_s``, and the work since the last
  checkpoint (every ``checkpoint_interval_s`` of progress; 0 = every step) is lost. Failures during
  the pause are handled by the same restart.
* **Data-parallel, elastic** (``dp_elastic``): one job on every filled place. A vacancy pauses the
  job for ``reconfig_s`` and it goes on without the place; the spare's arrival pauses it again
  (re-grow). Events during a pause are folded into that reconfiguration; nothing rolls back.
* **Decoupled DiLoCo, M learners** (``diloco_M``): the places are split into M contiguous learners
  (sizes differ by at most one place). Each learner is an elastic job of its own: a vacancy pauses
  only that learner for ``reconfig_s`` (and again on re-grow); the others never wait
  (docs/architecture.md#the-shape). With M = 1 this is exactly ``dp_elastic`` on the same trace.

Goodput is docs/architecture.md#goodput: Σ useful (slice-)time ÷ Σ allocated (slice-)time, where every
system is allocated all ``chips`` (places and spares) for the whole horizon. Only the times no public
report gives for this setting (``Timings``: restart pause, checkpoint interval, elastic
reconfiguration) are calibrated, on the two data-parallel rows of docs/operations.md#scale-simulator;
the DiLoCo rows are then predicted with the same times. ``sensitivity`` moves each assumption and
reports how every DiLoCo cell moves.

Nominal chip counts round to whole slices (150k → 586 × 256). Each simulated run holds about
``failures_per_run`` slice failures (default 20 000, at least 2 days): 49 days at 150k, 3 days at
2.4M; two seeds. Seed-to-seed spread is about 0.3 percentage points at that size. The sequential
steps are the spare pool (``pool_position_trace``, once per trace) and the dead-time walk over
accepted pause starts (``_dead_time_starts``); the rest is numpy, so calibration and prediction
take seconds on two cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import sys
import time
from collections import deque
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
    """The times no public report gives for this setting; ``calibrate`` fits them on the DP rows.

    Attributes:
      restart_s: non-elastic DP pause once it has all its slices again: reload, recompile.
      checkpoint_interval_s: non-elastic DP progress between two checkpoints; a failure loses the
        progress since the last one. 0 means a checkpoint every step (no loss).
      reconfig_s: elastic pause of one shrink or one re-grow (DP elastic and each DiLoCo learner).
    """

    restart_s: float
    checkpoint_interval_s: float
    reconfig_s: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_nonnegative(f.name, getattr(self, f.name))


# Pinned from public reports, not fitted (docs/operations.md#what-the-failure-model-rests-on).
DEFAULT_REPAIR_MEAN_S = 3600.0   # slice rescheduled onto other hosts, "up to a few hours" (GCP TPU docs)
DEFAULT_RESCHEDULE_S = 300.0     # failed node detected and replaced "in under 5 minutes" (Crusoe)


@dataclass(frozen=True)
class FailureModel:
    """How slices fail, how long they are out and how a spare replaces one; pinned, not fitted.

    Attributes:
      chip_mtbi_s: mean time between interruptions of one chip, seconds (the paper's one year).
      repair_mean_s: mean time a failed slice is out of service (exponential), seconds.
      reschedule_s: time from taking a healthy spare from the pool to it training in the failed
        slice's place, seconds.
      spare_z: spare pool = ⌈m + z·√m⌉ slices, m = slices in repair on average (Little's law).
      spare_scale: multiplies that pool size (rounded); 0 means no pool (a place waits for its own
        slice's repair).
    """

    chip_mtbi_s: float = YEAR_S
    repair_mean_s: float = DEFAULT_REPAIR_MEAN_S
    reschedule_s: float = DEFAULT_RESCHEDULE_S
    spare_z: float = DEFAULT_SPARE_Z
    spare_scale: float = 1.0

    def __post_init__(self):
        _check_positive("chip_mtbi_s", self.chip_mtbi_s)
        for name in ("repair_mean_s", "reschedule_s", "spare_z", "spare_scale"):
            _check_nonnegative(name, getattr(self, name))

    def pool_slices(self, fleet: "Fleet") -> int:
        """Spare slices held by the job: spare_scale · ⌈m + z·√m⌉, at most slices − 1.

        >>> FailureModel(repair_mean_s=3600.0).pool_slices(Fleet.nominal(150_000))  # m = 16.6
        29
        """
        m = spare_slices(fleet.slices, down_fraction(fleet, self.repair_mean_s), self.spare_z)
        return min(fleet.slices - 1, int(round(self.spare_scale * m)))


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
    """Spare pool size: ⌈m + z·√m⌉, m = n·p slices in repair on average (at most n − 1).

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


_BACK, _FAIL, _ARRIVE = 0, 1, 2  # event kinds of pool_position_trace; a tie plays a repair first


def pool_position_trace(trace: FailureTrace, positions: int, reschedule_s: float) -> FailureTrace:
    """Vacancies of the job's places when failed slices are swapped for spares from a shared pool.

    Slices ``[0, positions)`` start in the job's places (slice k in place k); the other
    ``n_slices − positions`` are the spare pool. When a slice in a place fails it goes to repair (until
    its ``up_s``) and the place is vacant until a healthy spare arrives, ``reschedule_s`` after it is
    taken from the pool: at once if one is idle, else when a slice comes back from repair (vacant
    places are served first come, first served). A spare that fails on its way is replaced the same
    way. A slice back from repair whose own place is still waiting (no spare on its way) returns to it
    at once, with no reschedule, so with no spares this is exactly the trace without a pool.

    Returns:
      A FailureTrace over the ``positions`` places: one outage (place, vacated_s, filled_s) per
      vacancy (filled_s = inf if never filled); member_u is 0. Events before t = 0 (slices already
      down at the start) are played too, from a fleet with every slice healthy before them.
    """
    _check_int("positions", positions, 1, trace.n_slices)
    _check_nonnegative("reschedule_s", reschedule_s)
    horizon = trace.horizon_s
    place = list(range(positions)) + [-1] * (trace.n_slices - positions)  # -1: pool or repair
    idle = deque(range(positions, trace.n_slices))   # healthy spares in the pool
    came_from = [-1] * trace.n_slices                # the place a slice in repair failed out of
    in_transit = {}                                  # spare slice -> place it is on its way to
    coming = [False] * positions                     # a spare is on its way to the place
    waiting = deque()                                # vacant places with no spare on its way
    vacated = [None] * positions
    out_k, out_down, out_up = [], [], []
    events = []                                      # heap of (time, kind, order, slice, place)
    seq = itertools.count()
    for s, d, u in zip(trace.slice_id.tolist(), trace.down_s.tolist(), trace.up_s.tolist()):
        if d < horizon:
            heapq.heappush(events, (d, _FAIL, next(seq), s, -1))
            if u < horizon:
                heapq.heappush(events, (u, _BACK, next(seq), s, -1))

    def fill(k: int, t: float) -> None:
        out_k.append(k)
        out_down.append(vacated[k])
        out_up.append(t)
        vacated[k] = None

    def send(k: int, t: float, first: bool = False) -> None:
        """Takes an idle spare for place k, or queues k (at the head when ``first``)."""
        if idle:
            s = idle.popleft()
            in_transit[s] = k
            coming[k] = True
            if reschedule_s == 0.0:
                arrive(s, k, t)
            else:
                heapq.heappush(events, (t + reschedule_s, _ARRIVE, next(seq), s, k))
        elif first:
            waiting.appendleft(k)
        else:
            waiting.append(k)

    def arrive(s: int, k: int, t: float) -> None:
        del in_transit[s]
        coming[k] = False
        place[s] = k
        fill(k, t)

    while events:
        t, kind, _, s, k = heapq.heappop(events)
        if kind == _FAIL:
            if place[s] >= 0:                        # a slice in a place: the place is vacant
                k = place[s]
                place[s], came_from[s], vacated[k] = -1, k, t
                send(k, t)
            elif s in in_transit:                    # a spare failed on its way: send another
                k = in_transit.pop(s)
                coming[k] = False
                came_from[s] = -1
                send(k, t, first=True)
            else:                                    # an idle spare
                idle.remove(s)
                came_from[s] = -1
        elif kind == _BACK:
            k = came_from[s]
            if k >= 0 and vacated[k] is not None and not coming[k]:
                waiting.remove(k)                    # back to its own place, no reschedule
                place[s] = k
                fill(k, t)
            elif waiting:
                idle.append(s)
                send(waiting.popleft(), t)
            else:
                idle.append(s)
        elif in_transit.get(s) == k:                 # _ARRIVE of a spare still on its way
            arrive(s, k, t)
    for k in range(positions):
        if vacated[k] is not None:
            out_k.append(k)
            out_down.append(vacated[k])
            out_up.append(math.inf)
    order = np.argsort(np.asarray(out_down, dtype=float), kind="stable")
    return FailureTrace(positions, horizon, np.asarray(out_k, dtype=np.int64)[order],
                        np.asarray(out_down, dtype=float)[order],
                        np.asarray(out_up, dtype=float)[order], np.zeros(len(out_k)))


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
    """How much to simulate, and the pinned failure model.

    Attributes:
      failures_per_run: slice failures per simulated run; sets the horizon (horizon_for).
      min_horizon_s: shortest horizon, seconds.
      seeds: one trace per seed and fleet; goodputs are averaged over seeds.
      slice_chips: chips per slice.
      learners: DiLoCo learner counts M to predict.
      failure: chip MTBI, repair time, reschedule delay and spare pool (FailureModel).
    """

    failures_per_run: int = 20_000
    min_horizon_s: float = 2 * DAY_S
    seeds: tuple = (0, 1)
    slice_chips: int = DEFAULT_SLICE_CHIPS
    learners: tuple = DILOCO_LEARNERS
    failure: FailureModel = FailureModel()

    def __post_init__(self):
        _check_int("failures_per_run", self.failures_per_run, 1)
        _check_positive("min_horizon_s", self.min_horizon_s)
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        _check_int("slice_chips", self.slice_chips, 1)
        for m in self.learners:
            _check_int("learners", m, 1)
        if not isinstance(self.failure, FailureModel):
            raise ValueError(f"failure ({self.failure!r}) must be a FailureModel")


QUICK = SimConfig(failures_per_run=6_000, seeds=(0,))


class PreparedFleet(NamedTuple):
    """One fleet's traces, already played through the spare pool; every fitted time reuses them.

    Attributes:
      fleet: the allocated slices (job places + spare pool).
      pool: spare slices held by the job; the job trains on ``fleet.slices − pool`` places.
      places: per seed, the FailureTrace of the job's places (pool_position_trace) when a spare
        takes ``reschedule_s`` to join: the elastic systems, which add it to a running job.
      dp_places: the same traces when a spare joins at once: non-elastic DP swaps it inside its
        restart, whose cost is ``restart_s``.
    """

    fleet: Fleet
    pool: int
    places: list
    dp_places: list

    @property
    def share(self) -> float:
        """Places ÷ allocated slices: goodput on the places times this is goodput on the fleet."""
        return (self.fleet.slices - self.pool) / self.fleet.slices


def prepare_fleet(chips: int, config: SimConfig) -> PreparedFleet:
    """Seeded traces of a nominal chip count, played through the pinned spare pool."""
    fm = config.failure
    fleet = Fleet.nominal(chips, config.slice_chips, fm.chip_mtbi_s)
    horizon = horizon_for(fleet, config.failures_per_run, config.min_horizon_s)
    pool = fm.pool_slices(fleet)
    traces = [generate_trace(fleet, fm.repair_mean_s, horizon, seed) for seed in config.seeds]
    places = [pool_position_trace(t, fleet.slices - pool, fm.reschedule_s) for t in traces]
    dp_places = (places if fm.reschedule_s == 0 else
                 [pool_position_trace(t, fleet.slices - pool, 0.0) for t in traces])
    return PreparedFleet(fleet, pool, places, dp_places)


def prepared_goodput(prepared: PreparedFleet, timings: Timings, learners: Sequence[int]) -> dict:
    """Goodput of every system on one prepared fleet, averaged over its seeds.

    Every system holds the same spare pool, allocated and idle: goodput on the places × share.
    """
    share = prepared.share
    out = {"dp": np.mean([data_parallel_goodput(t, timings.restart_s,
                                                timings.checkpoint_interval_s)
                          for t in prepared.dp_places]),
           "dp_elastic": np.mean([elastic_goodput(t, timings.reconfig_s)
                                  for t in prepared.places])}
    places = prepared.fleet.slices - prepared.pool
    for m in learners:
        _check_int("learners", m, 1, places)
        out[f"diloco_{m}"] = np.mean([elastic_goodput(t, timings.reconfig_s, m)
                                      for t in prepared.places])
    return {k: float(v) * share for k, v in out.items()}


def simulate_fleet(chips: int, timings: Timings, config: SimConfig = SimConfig()) -> dict:
    """Goodput of every system on the same traces of one fleet, averaged over the seeds.

    Returns:
      {"dp": …, "dp_elastic": …, "diloco_2": …, …} for config.learners (M ≤ places).
    """
    return prepared_goodput(prepare_fleet(chips, config), timings, config.learners)


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


def calibrate(config: SimConfig = SimConfig(), chips: Sequence[int] = PAPER_CHIPS,
              targets: Mapping[str, Sequence] = PAPER_TARGETS, iters: int = 10,
              prepared: Optional[Sequence[PreparedFleet]] = None) -> Calibration:
    """Fits the Timings on the data-parallel rows only (least squares per row).

    The failure model (config.failure) is pinned, not fitted. reconfig_s is fitted on the elastic
    row; (restart_s, checkpoint_interval_s) on the non-elastic row; each by a grid, then golden
    section. ``prepared`` (one PreparedFleet per chip count) saves replaying the traces.
    """
    for key in ("dp", "dp_elastic"):
        if key not in targets or len(targets[key]) != len(chips):
            raise ValueError(f"targets[{key!r}] must give one goodput per chip count "
                             f"({len(chips)})")
    if prepared is None:
        prepared = [prepare_fleet(c, config) for c in chips]
    el_target = np.asarray(targets["dp_elastic"])
    dp_target = np.asarray(targets["dp"])
    axes = [[elastic_axis(t) for t in p.places] for p in prepared]
    stops = [[data_parallel_stops(t) for t in p.dp_places] for p in prepared]
    share = np.asarray([p.share for p in prepared])
    best_c = {}

    def elastic_rows(r: float) -> np.ndarray:
        return share * np.asarray([np.mean([elastic_axis_goodput(a, r) for a in per_fleet])
                                   for per_fleet in axes])

    def dp_rows(r: float, c: float, runs=None) -> np.ndarray:
        runs = runs or [[data_parallel_stops_runs(x, r) for x in per_fleet] for per_fleet in stops]
        return share * np.asarray([np.mean([checkpointed_goodput(x, c) for x in rs])
                                   for rs in runs])

    def dp_sse(r: float) -> float:
        runs = [[data_parallel_stops_runs(x, r) for x in per_fleet] for per_fleet in stops]
        sse = {c: float(np.sum((dp_rows(r, c, runs) - dp_target) ** 2))
               for c in CHECKPOINT_GRID_S}
        best_c[r] = min(sse, key=sse.get)
        return sse[best_c[r]]

    reconfig, _ = _minimize_1d(lambda r: float(np.sum((elastic_rows(r) - el_target) ** 2)),
                               RECONFIG_GRID_S, iters)
    restart, _ = _minimize_1d(dp_sse, RESTART_GRID_S, iters)
    timings = Timings(restart_s=restart, checkpoint_interval_s=best_c[restart],
                      reconfig_s=reconfig)
    fitted = {"dp": tuple(dp_rows(restart, best_c[restart]).tolist()),
              "dp_elastic": tuple(elastic_rows(reconfig).tolist())}
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
    prepared = [prepare_fleet(c, config) for c in chips]
    calibration = calibrate(config, chips, iters=iters, prepared=prepared)
    table = {c: prepared_goodput(p, calibration.timings, config.learners)
             for c, p in zip(chips, prepared)}
    return Study(calibration, table, config, time.perf_counter() - t0)


# The assumptions the sensitivity table moves: the pinned failure model (refitted after each move)
# and the fitted times (moved alone, nothing refitted).
PINNED_ASSUMPTIONS = ("repair_mean_s", "reschedule_s", "spare_scale", "chip_mtbi_s")
FITTED_ASSUMPTIONS = ("reconfig_s", "restart_s")
SENSITIVITY_FACTORS = (0.5, 2.0)


class SensitivityRow(NamedTuple):
    """How the Decoupled DiLoCo cells move when one assumption is scaled by ``factor``.

    Attributes:
      assumption: a FailureModel field (refitted) or a Timings field (held, not refitted).
      factor: the multiplier; value: the assumption's moved value.
      rmse_pp: the data-parallel fit error after the move (refitted or not).
      delta_pp: {chips: {"diloco_M": moved − baseline goodput, percentage points}}.
    """

    assumption: str
    factor: float
    value: float
    rmse_pp: float
    delta_pp: Mapping[int, Mapping[str, float]]


def sensitivity(study: Study, factors: Sequence[float] = SENSITIVITY_FACTORS,
                assumptions: Sequence[str] = PINNED_ASSUMPTIONS + FITTED_ASSUMPTIONS,
                iters: int = 10) -> list:
    """Moves each assumption by each factor and reports how every DiLoCo cell moves (SensitivityRow).

    A pinned assumption (PINNED_ASSUMPTIONS) is moved, the fitted times are refitted on the
    data-parallel rows as the method would, and the DiLoCo rows are predicted again on the same
    seeds. A fitted time (FITTED_ASSUMPTIONS) is moved alone: how much the prediction leans on it.
    """
    for f in factors:
        _check_positive("factor", f)
    cfg, chips = study.config, list(study.table)
    diloco = [k for k in next(iter(study.table.values())) if k.startswith("diloco_")]
    prepared_base = None
    rows = []
    for name in assumptions:
        if name not in PINNED_ASSUMPTIONS + FITTED_ASSUMPTIONS:
            raise ValueError(f"assumption ({name!r}) must be one of "
                             f"{PINNED_ASSUMPTIONS + FITTED_ASSUMPTIONS}")
        for f in factors:
            if name in PINNED_ASSUMPTIONS:
                value = getattr(cfg.failure, name) * f
                moved = dataclasses.replace(cfg, failure=dataclasses.replace(
                    cfg.failure, **{name: value}))
                prepared = [prepare_fleet(c, moved) for c in chips]
                cal = calibrate(moved, chips, iters=iters, prepared=prepared)
                timings, rmse = cal.timings, cal.rmse_pp
            else:
                if prepared_base is None:
                    prepared_base = [prepare_fleet(c, cfg) for c in chips]
                prepared = prepared_base
                value = getattr(study.calibration.timings, name) * f
                timings = dataclasses.replace(study.calibration.timings, **{name: value})
                rows_dp = [prepared_goodput(p, timings, ()) for p in prepared]
                errs = [100.0 * (row[k] - PAPER_TARGETS[k][i]) for k in ("dp", "dp_elastic")
                        for i, row in enumerate(rows_dp)]
                rmse = float(np.sqrt(np.mean(np.square(errs))))
            delta = {}
            for c, p in zip(chips, prepared):
                g = prepared_goodput(p, timings, [int(k.split("_")[1]) for k in diloco])
                delta[c] = {k: 100.0 * (g[k] - study.table[c][k]) for k in diloco}
            rows.append(SensitivityRow(name, float(f), float(value), rmse, delta))
    return rows


def sensitivity_json(rows: Sequence[SensitivityRow]) -> list:
    """The sensitivity rows as JSON: deltas in percentage points, two decimals."""
    return [{"assumption": r.assumption, "factor": r.factor, "value": r.value,
             "rmse_pp": round(r.rmse_pp, 3),
             "delta_pp": {str(c): {k: round(v, 2) for k, v in row.items()}
                          for c, row in r.delta_pp.items()}} for r in rows]


def _chips_label(c: int) -> str:
    return f"{c / 1e6:g}M" if c >= 1e6 else f"{c // 1000}k"


def format_sensitivity(rows: Sequence[SensitivityRow]) -> str:
    """One line per (assumption, factor): DP fit error, then per chip count the moves of M = 2/4/8/16."""
    if not rows:
        return ""
    chips = list(rows[0].delta_pp)
    systems = list(rows[0].delta_pp[chips[0]])
    width = 6 * len(systems)
    head = (f"{'assumption':<15} {'x':>4} {'value':>10} {'fit pp':>6} "
            + " ".join(_chips_label(c).rjust(width) for c in chips))
    lines = [f"DiLoCo moves, pp, M = {'/'.join(s.split('_')[1] for s in systems)} per cell", head]
    for r in rows:
        cells = ["/".join(f"{r.delta_pp[c][s]:+.1f}" for s in systems).rjust(width)
                 for c in chips]
        lines.append(f"{r.assumption:<15} {r.factor:>4g} {r.value:>10.4g} {r.rmse_pp:>6.2f} "
                     + " ".join(cells))
    return "\n".join(lines)


def study_json(study: Study) -> dict:
    """The published record: fitted and pinned parameters, predicted table, fit error, seconds."""
    cal, cfg = study.calibration, study.config
    tm, fm = cal.timings, cfg.failure
    fleets = {c: Fleet.nominal(c, cfg.slice_chips, fm.chip_mtbi_s) for c in study.table}
    return {
        "calibrated": dataclasses.asdict(tm),
        "pinned": {**dataclasses.asdict(fm), "repair_mean_h": fm.repair_mean_s / 3600.0},
        "model": {
            "slice_chips": cfg.slice_chips, "repair": "exponential",
            "failures_per_run": cfg.failures_per_run, "seeds": list(cfg.seeds),
            "slices": {str(c): f.slices for c, f in fleets.items()},
            "spares": {str(c): fm.pool_slices(f) for c, f in fleets.items()},
            "slice_down_fraction": down_fraction(fleets[min(fleets)], fm.repair_mean_s),
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
    head = ["system".ljust(12)] + [_chips_label(c).rjust(11) for c in chips]
    lines = [" ".join(head)]
    for s in systems:
        cells = []
        for i, c in enumerate(chips):
            cell = f"{100 * study.table[c][s]:.1f}"
            if s in PAPER_TARGETS and len(PAPER_TARGETS[s]) == len(chips):
                cell += f" ({100 * PAPER_TARGETS[s][i]:.0f})"
            cells.append(cell.rjust(11))
        lines.append(" ".join([s.ljust(12)] + cells))
    tm, fm = study.calibration.timings, study.config.failure
    lines.append(f"pinned: repair {fm.repair_mean_s / 3600:.2f} h, reschedule {fm.reschedule_s:.0f} s, "
                 f"spare pool x{fm.spare_scale:g}, chip MTBI {fm.chip_mtbi_s / YEAR_S:.3g} y; "
                 f"calibrated: restart {tm.restart_s:.1f} s, checkpoint every "
                 f"{tm.checkpoint_interval_s:.0f} s, reconfig {tm.reconfig_s:.1f} s; fit rmse "
                 f"{study.calibration.rmse_pp:.2f} pp, max {study.calibration.max_abs_pp:.2f} pp; "
                 f"{study.elapsed_s:.1f} s")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's options, shared by ``islands simulate`` and benchmarks/scale.py."""
    fm = FailureModel()
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.failures_per_run} failures per run, one seed")
    parser.add_argument("--failures-per-run", type=int, default=None,
                        help="slice failures per simulated run (sets the horizon)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (traces per size)")
    parser.add_argument("--slice-chips", type=int, default=DEFAULT_SLICE_CHIPS)
    parser.add_argument("--repair-mean-s", type=float, default=fm.repair_mean_s,
                        help="mean time a failed slice is out of service, seconds (pinned, "
                             "not fitted; default %(default)g)")
    parser.add_argument("--reschedule-s", type=float, default=fm.reschedule_s,
                        help="time for a spare slice to take a failed one's place in an elastic "
                             "job, seconds (default %(default)g)")
    parser.add_argument("--spare-scale", type=float, default=fm.spare_scale,
                        help="multiplies the spare pool (ceil(m + 3 sqrt m), m = slices in "
                             "repair on average); 0 = no pool: a place waits for its own slice "
                             "(default %(default)g)")
    parser.add_argument("--chip-mtbi-s", type=float, default=fm.chip_mtbi_s,
                        help="mean time between interruptions of one chip, seconds "
                             "(default one year, %(default)g)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also move each assumption x0.5 and x2 and print how every "
                             "Decoupled DiLoCo cell moves")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    base = QUICK if args.quick else SimConfig()
    failure = FailureModel(chip_mtbi_s=args.chip_mtbi_s, repair_mean_s=args.repair_mean_s,
                           reschedule_s=args.reschedule_s, spare_scale=args.spare_scale)
    changes = {"slice_chips": args.slice_chips, "failure": failure}
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
    record = study_json(study)
    print(format_table(study))
    if args.sensitivity:
        rows = sensitivity(study)
        record["sensitivity"] = sensitivity_json(rows)
        print(format_sensitivity(rows))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
