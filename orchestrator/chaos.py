"""Chaos: a seeded fault schedule (kills, lost regions, slowdowns, network faults, syncer kills).

Pure (no Ray, no clock): a ``FaultPlan`` is a list of ``Fault`` records with their times. The Ray
controller and the in-process drivers (``orchestrator/inprocess.py``, ``studies/baseline.py``)
replay the same plan, so two systems can run under identical faults. ``poisson_plan`` draws one
from per-learner and per-region Poisson processes; every (seed, target, kind) has its own numpy
Generator, so adding a learner never reshuffles the faults of the others.

>>> plan = FaultPlan().crash("us-east:0", at_s=5.0, repair_s=2.0).slow("us-east:1", 1.0, 3.0, 4.0)
>>> [(f.at_s, f.kind.value, f.target) for f in plan.sorted()]
[(1.0, 'slowdown', 'us-east:1'), (5.0, 'kill', 'us-east:0')]
>>> [f.kind.value for f in plan.due(2.0)], len(plan.fired), [f.kind.value for f in plan.due(2.0)]
(['slowdown'], 1, [])
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np

from islands.faults import (HOME_TARGET, LEARNER_LOSS_KINDS, SYNCER_TARGET, Fault,  # noqa: F401
                            FaultKind, FaultWindows, Link, check_time)

KILL_MODES: tuple[str, ...] = ("kill", "exit")


@dataclass
class FaultPlan:
    """A list of faults, built by hand (builder methods return the plan) or by ``poisson_plan``.

    ``due(now_s)`` hands out each fault once, in time order, and records it in ``fired``; a run
    that starts from the beginning calls ``reset()`` first, so one plan object can drive two
    systems in turn. Iterating a plan yields its faults in time order.
    """

    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self):
        self.faults = list(self.faults)
        self._fired_ids: set[int] = set()
        self._sorted_ids: Optional[list[int]] = None   # fault indices in time order
        self._cursor = 0   # every fault before it in _sorted_ids has been due
        self.fired: list[Fault] = []

    # -- builders -------------------------------------------------------------------------------
    def add(self, fault: Fault) -> "FaultPlan":
        self.faults.append(fault)
        return self

    def crash(self, target: str, at_s: float, repair_s: float = 0.0,
              mode: str = "kill") -> "FaultPlan":
        """A learner dies at ``at_s`` and may restart ``repair_s`` later (``mode`` kill or exit)."""
        return self.add(Fault(at_s, _kill_kind(mode), target, duration_s=repair_s))

    def hang(self, target: str, at_s: float, duration_s: float) -> "FaultPlan":
        """A learner wedges at ``at_s`` (no steps, no heartbeats) for ``duration_s``: the health
        timeout finds it, and it is restarted like a dead one."""
        return self.add(Fault(at_s, FaultKind.HANG, target, duration_s=duration_s))

    def lose_region(self, region: str, at_s: float, repair_s: float) -> "FaultPlan":
        """Every learner of ``region`` dies at ``at_s`` (a lost slice or node)."""
        return self.add(Fault(at_s, FaultKind.REGION_LOSS, region, duration_s=repair_s))

    def slow(self, target: str, at_s: float, duration_s: float, factor: float) -> "FaultPlan":
        """Step time of ``target`` (a learner or a region) × ``factor`` for ``duration_s``."""
        return self.add(Fault(at_s, FaultKind.SLOWDOWN, target, duration_s=duration_s,
                              factor=factor))

    def degrade(self, region: str, at_s: float, duration_s: float, extra_latency_ms: float = 0.0,
                bandwidth_gbps: Optional[float] = None, loss_rate: float = 0.0) -> "FaultPlan":
        """``region``'s link gets ``extra_latency_ms``, a ``bandwidth_gbps`` cap and a segment
        ``loss_rate`` (played on a remote region's relay only) for a while."""
        return self.add(Fault(at_s, FaultKind.NETWORK, region, duration_s=duration_s,
                              extra_latency_ms=extra_latency_ms, bandwidth_gbps=bandwidth_gbps,
                              loss_rate=loss_rate))

    def partition(self, region: str, at_s: float, duration_s: float) -> "FaultPlan":
        """No traffic in or out of ``region`` for ``duration_s``."""
        return self.add(Fault(at_s, FaultKind.PARTITION, region, duration_s=duration_s))

    def kill_syncer(self, at_s: float, target: str = SYNCER_TARGET) -> "FaultPlan":
        """``target``: "syncer" (shard 0) or "syncer:<s>", a syncer shard."""
        return self.add(Fault(at_s, FaultKind.SYNCER_KILL, target))

    # -- replay ---------------------------------------------------------------------------------
    def sorted(self) -> "FaultPlan":
        """A new plan with the same faults in time order (ties: kind, then target), none fired."""
        return FaultPlan(sorted(self.faults, key=Fault.order_key))

    def due(self, now_s: float) -> list[Fault]:
        """Faults with ``at_s <= now_s`` not handed out before, in time order; marks them fired.

        Cheap to call on every tick: a cursor walks the time-ordered faults (a fault added later
        re-sorts them once).
        """
        if self._sorted_ids is None or len(self._sorted_ids) != len(self.faults):
            self._sorted_ids = sorted(range(len(self.faults)),
                                      key=lambda i: self.faults[i].order_key())
            self._cursor = 0
        ready = []
        k = self._cursor
        while k < len(self._sorted_ids) and self.faults[self._sorted_ids[k]].at_s <= now_s:
            i = self._sorted_ids[k]
            if i not in self._fired_ids:
                ready.append(i)
            k += 1
        self._cursor = k
        self._fired_ids.update(ready)
        out = [self.faults[i] for i in ready]
        self.fired.extend(out)
        return out

    def reset(self) -> "FaultPlan":
        """Forgets what fired, so the plan replays from the start."""
        self._fired_ids.clear()
        self.fired = []
        self._sorted_ids = None
        return self

    def count(self, kind: Optional[FaultKind | str] = None) -> int:
        """Planned faults (of ``kind``, or all)."""
        if kind is None:
            return len(self.faults)
        kind = FaultKind(kind)
        return sum(f.kind == kind for f in self.faults)

    def times(self) -> list[float]:
        """Distinct fault times, ascending (a driver wakes up at each)."""
        return sorted({f.at_s for f in self.faults})

    def __iter__(self) -> Iterator[Fault]:
        return iter(sorted(self.faults, key=Fault.order_key))

    def __len__(self) -> int:
        return len(self.faults)


def _kill_kind(mode: str) -> FaultKind:
    if mode not in KILL_MODES:
        raise ValueError(f"mode must be one of {', '.join(KILL_MODES)}, got {mode!r}")
    return FaultKind.KILL if mode == "kill" else FaultKind.EXIT


def stream_rng(seed: int, target: str, kind: FaultKind | str) -> np.random.Generator:
    """The Generator of one (seed, target, kind) fault stream.

    The target and kind enter through a stable hash (sha256, not Python's salted ``hash``), so the
    stream is the same in every process and does not depend on which other streams exist.
    """
    digest = hashlib.sha256(f"{target}\x00{FaultKind(kind).value}".encode("utf-8")).digest()
    return np.random.default_rng([int(seed), int.from_bytes(digest[:8], "little")])


def renewal_times(rng: np.random.Generator, mean_gap_s: float, busy_s: float,
                  horizon_s: float) -> list[float]:
    """Start times of an alternating renewal process on ``[0, horizon_s)``.

    Gaps are exponential with mean ``mean_gap_s`` and each event keeps its target busy for
    ``busy_s`` (repair, or the slowdown itself) before the next gap starts, so a target that is
    down cannot fail again. Long-run rate: ``1 / (mean_gap_s + busy_s)``.
    """
    times, t = [], 0.0
    while True:
        t += float(rng.exponential(mean_gap_s))
        if t >= horizon_s:
            return times
        times.append(t)
        t += busy_s


def poisson_plan(learners_by_region: Mapping[str, Sequence[str]], horizon_s: float, *, seed: int,
                 mtbf_s: float, repair_s: float, kill_mode: str = "kill",
                 region_mtbf_s: Optional[float] = None, slowdown_mtbf_s: Optional[float] = None,
                 slowdown_factor: float = 4.0, slowdown_s: float = 10.0,
                 network_mtbf_s: Optional[float] = None, network_s: float = 10.0,
                 syncer_mtbf_s: Optional[float] = None, network_extra_latency_ms: float = 200.0,
                 network_bandwidth_gbps: Optional[float] = 0.1,
                 network_kind: str = "network") -> FaultPlan:
    """Faults from independent Poisson processes, one per (target, kind).

    Learner failures: per learner, exponential inter-arrival times with mean ``mtbf_s``, counted
    from when the learner is back: after a failure the learner is down for ``repair_s`` and its
    next time-to-failure starts only then (a learner waiting for repair cannot fail again). The
    restart cost a driver adds on top of ``repair_s`` is not known here; a driver ignores a fault
    for a learner that is still down then (``inprocess`` and ``baseline`` both do). Long-run
    failure rate per learner: ``1 / (mtbf_s + repair_s)``. Region losses, slowdowns, network faults
    and syncer kills follow the same rule with their own means and busy times.

    Args:
      learners_by_region: ``{region: [learner ids]}``.
      horizon_s: faults are drawn on ``[0, horizon_s)``.
      seed: non-negative int; the same seed gives the same plan.
      mtbf_s: mean time between failures of one learner (seconds of up time).
      repair_s: repair delay after a learner or region failure (``Fault.duration_s``).
      kill_mode: "kill" (ray.kill) or "exit" (hard process exit).
      region_mtbf_s: per-region MTBF of whole-region losses (None: none).
      slowdown_mtbf_s: per-learner mean time between slowdowns (None: none).
      slowdown_factor, slowdown_s: how much slower and for how long.
      network_mtbf_s: per-region mean time between network faults (None: none).
      network_s: how long a network fault lasts.
      syncer_mtbf_s: mean time between syncer kills (None: none).
      network_extra_latency_ms, network_bandwidth_gbps: what a "network" fault does.
      network_kind: "network" (degraded link) or "partition" (no traffic).

    Returns:
      The plan, faults in time order.

    Raises:
      ValueError: naming the argument, for empty or duplicate learners, a negative or non-finite
        time, a non-positive MTBF, an unknown kill mode or network kind.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    horizon_s = check_time("horizon_s", horizon_s)
    check_time("mtbf_s", mtbf_s, positive=True)
    repair_s = check_time("repair_s", repair_s)
    kill = _kill_kind(kill_mode)
    for name, value in (("region_mtbf_s", region_mtbf_s), ("slowdown_mtbf_s", slowdown_mtbf_s),
                        ("network_mtbf_s", network_mtbf_s), ("syncer_mtbf_s", syncer_mtbf_s)):
        if value is not None:
            check_time(name, value, positive=True)
    check_time("slowdown_s", slowdown_s, positive=slowdown_mtbf_s is not None)
    check_time("network_s", network_s, positive=network_mtbf_s is not None)
    if network_kind not in ("network", "partition"):
        raise ValueError(f"network_kind must be 'network' or 'partition', got {network_kind!r}")
    if not learners_by_region:
        raise ValueError("learners_by_region must name at least one region")
    seen: set[str] = set()
    for region, learners in learners_by_region.items():
        if not isinstance(region, str) or not region:
            raise ValueError(f"learners_by_region: region names must be non-empty strings, "
                             f"got {region!r}")
        if isinstance(learners, str):
            raise ValueError(f"learners_by_region[{region!r}] must be a sequence of learner ids, "
                             f"got the string {learners!r}")
        for learner in learners:
            if learner in seen:
                raise ValueError(f"learners_by_region: learner {learner!r} is listed twice")
            seen.add(learner)

    plan = FaultPlan()
    for region, learners in learners_by_region.items():
        for learner in learners:
            for t in renewal_times(stream_rng(seed, learner, kill), mtbf_s, repair_s, horizon_s):
                plan.add(Fault(t, kill, learner, duration_s=repair_s))
            if slowdown_mtbf_s is not None:
                rng = stream_rng(seed, learner, FaultKind.SLOWDOWN)
                for t in renewal_times(rng, slowdown_mtbf_s, slowdown_s, horizon_s):
                    plan.slow(learner, t, slowdown_s, slowdown_factor)
        if region_mtbf_s is not None:
            rng = stream_rng(seed, region, FaultKind.REGION_LOSS)
            for t in renewal_times(rng, region_mtbf_s, repair_s, horizon_s):
                plan.lose_region(region, t, repair_s)
        if network_mtbf_s is not None:
            kind = FaultKind(network_kind)
            rng = stream_rng(seed, region, kind)
            for t in renewal_times(rng, network_mtbf_s, network_s, horizon_s):
                if kind == FaultKind.PARTITION:
                    plan.partition(region, t, network_s)
                else:
                    plan.degrade(region, t, network_s, network_extra_latency_ms,
                                 network_bandwidth_gbps)
    if syncer_mtbf_s is not None:
        rng = stream_rng(seed, SYNCER_TARGET, FaultKind.SYNCER_KILL)
        for t in renewal_times(rng, syncer_mtbf_s, 0.0, horizon_s):
            plan.kill_syncer(t)
    return plan.sorted()


# -- reading a plan on a virtual clock (the in-process drivers) ----------------------------------
# Defaults mirror the Ray service: Ray reports a killed actor or a dead worker process at once;
# a lost node only shows as missing heartbeats (health.timeout_s, 10 s by default); a restart is
# the policy's first backoff (0.5 s) plus a fresh actor process loading the corpus and the
# compiled step from the persistent cache (a few seconds on 2 CPU cores).
DEFAULT_DETECT_KILL_S = 0.0
DEFAULT_DETECT_EXIT_S = 0.0
DEFAULT_DETECT_LOST_S = 10.0
DEFAULT_RESTART_S = 3.0
DEFAULT_SYNCER_RESTART_S = 5.0
# A warm spare's promotion: register, pull every fragment and a peer's inner state, build the
# core (the process, the task and the compiled step are ready). Its preparation is a restart's.
DEFAULT_PROMOTE_S = 0.3
DEFAULT_SPARE_READY_S = DEFAULT_RESTART_S


@dataclass(frozen=True)
class RestartCosts:
    """Seconds from a learner loss to the new incarnation's first step: detect + repair + restart.

    Attributes:
      detect_kill_s: detection of a ``kill`` (Ray reports the dead actor).
      detect_exit_s: detection of an ``exit`` (the worker process dies; Ray reports it).
      detect_lost_s: detection of a ``region_loss`` (no heartbeat for the health timeout).
      restart_s: backoff + new process + restore, after detection and repair.
      syncer_restart_s: the syncer is unreachable this long after a ``syncer_kill``.
      promote_s: a warm spare taking a failed learner's place (instead of ``restart_s``).
      spare_ready_s: a new spare's preparation, from its launch to ready.
      detect_hang_s: detection of a ``hang`` (no heartbeat for the health timeout).
      restart_samples_s, promote_samples_s: measured restart (promotion) seconds; when given,
        each restart (promotion) draws one of them (seeded) instead of the flat figure.
      survivor_slowdown_per_start: on shared cores, each process starting (a restart or a spare
        preparing) makes every running learner's step this fraction slower.
      start_cpu_s: CPU seconds a new process needs to start (0: starts take their wall time,
        ``restart_s`` / ``spare_ready_s``, however many there are at once).
      start_cores: the cores all starts share when ``start_cpu_s`` is set (one at most each).
      seed: of the draws.
    """

    detect_kill_s: float = DEFAULT_DETECT_KILL_S
    detect_exit_s: float = DEFAULT_DETECT_EXIT_S
    detect_lost_s: float = DEFAULT_DETECT_LOST_S
    restart_s: float = DEFAULT_RESTART_S
    syncer_restart_s: float = DEFAULT_SYNCER_RESTART_S
    promote_s: float = DEFAULT_PROMOTE_S
    spare_ready_s: float = DEFAULT_SPARE_READY_S
    detect_hang_s: float = DEFAULT_DETECT_LOST_S
    restart_samples_s: tuple = ()
    promote_samples_s: tuple = ()
    survivor_slowdown_per_start: float = 0.0
    start_cpu_s: float = 0.0
    start_cores: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("detect_kill_s", "detect_exit_s", "detect_lost_s", "restart_s",
                     "syncer_restart_s", "promote_s", "spare_ready_s", "detect_hang_s",
                     "survivor_slowdown_per_start", "start_cpu_s"):
            check_time(name, getattr(self, name))
        if self.start_cores <= 0:
            raise ValueError(f"start_cores must be > 0, got {self.start_cores}")
        for name in ("restart_samples_s", "promote_samples_s"):
            for value in getattr(self, name):
                check_time(name, value)

    def detect_s(self, kind: FaultKind) -> float:
        return {FaultKind.KILL: self.detect_kill_s, FaultKind.EXIT: self.detect_exit_s,
                FaultKind.REGION_LOSS: self.detect_lost_s,
                FaultKind.HANG: self.detect_hang_s}[FaultKind(kind)]

    def sampler(self):
        """``draw(promotion: bool) -> seconds``: a measured sample when there are any (seeded,
        with replacement), else the flat ``promote_s`` / ``restart_s``."""
        import numpy as np

        rng = np.random.default_rng(self.seed)

        def draw(promotion: bool) -> float:
            samples = self.promote_samples_s if promotion else self.restart_samples_s
            if samples:
                return float(samples[int(rng.integers(len(samples)))])
            return self.promote_s if promotion else self.restart_s
        return draw

    def down_s(self, fault: Fault) -> float:
        """How long the learners a fault kills stay down: detect + repair (duration_s) + restart."""
        if fault.kind not in LEARNER_LOSS_KINDS:
            raise ValueError(f"a {fault.kind.value} fault does not take a learner down")
        repair_s = 0.0 if fault.kind == FaultKind.HANG else fault.duration_s  # a hang's is its length
        return self.detect_s(fault.kind) + repair_s + self.restart_s
