"""A virtual fleet for the in-process driver (``inprocess.py``): its learners' speeds, regions
and links, the fleet brain's settings for it, and the syncer and learner cores it starts from.
No Ray, no clock: the driver runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from islands import CARRY_OVERLAP
from islands.faults import Link
from islands.learners.core import LearnerCore
from islands.orchestrator import fleet as fleet_lib
from islands.orchestrator.config import HealthSection
from islands.orchestrator.health import RestartPolicy, drain_timeout_s
from islands.syncer import downlink as downlink_lib
from islands.syncer import fragments as fragments_lib
from islands.syncer.core import SyncerCore
from islands.syncer.fragments import FragmentPlan


@dataclass(frozen=True)
class Fleet:
    """Speeds, regions and links of the simulated learners.

    Attributes:
      speed_factors: one per learner; step time = step_time_s / speed.
      step_time_s: nominal seconds per inner step.
      step_noise: relative step-time noise, uniform in [−noise, +noise], seeded per learner.
      latency_s: one-way latency of every message.
      bandwidth_bytes_per_s: link bandwidth (inf = instantaneous transfer).
      seed: seed of the noise.
      regions: the region of each learner (network faults and region losses act per region);
        None: the learner id up to its last ":" ("us-east:0" is in "us-east").
      spares: warm spares kept per region by the same fleet state machine as the service.
      restart_wait_s: how long a failed learner waits, restarting, before its start begins
        (the fleet's backoff; a kill meanwhile finds no running learner, as on the service,
        whose restart waits there for the process prestarted for it). A ready warm spare
        takes over at once, as on the service.
      health_timeout_s: the job's ``health.timeout_s``: the fleet's bound on a drain follows
        from it by the service's own rule (``health.drain_timeout_s``).
    """

    speed_factors: Sequence[float]
    step_time_s: float = 1.0
    step_noise: float = 0.0
    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = math.inf
    seed: int = 0
    regions: Optional[Sequence[str]] = None
    spares: int = 0              # warm spares per region (RestartCosts.promote_s to take over)
    restart_wait_s: float = 0.0
    health_timeout_s: float = HealthSection.model_fields["timeout_s"].default

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @property
    def link(self) -> Link:
        return Link(self.latency_s, self.bandwidth_bytes_per_s)

    def region_of(self, index: int, learner_id: str) -> str:
        if self.regions is not None:
            return self.regions[index]
        return learner_id.rsplit(":", 1)[0] if ":" in learner_id else learner_id

    def noise_rng(self, index: int) -> np.random.Generator:
        """Learner ``index``'s own noise stream: a fault elsewhere never changes its step times."""
        return np.random.default_rng((self.seed, index))

    def nominal_step_s(self, index: int) -> float:
        return self.step_time_s / self.speed_factors[index]


RESTART = 7   # the event priority of a start's end: after everything else at its time (inprocess)


class ProcessStarts:
    """New processes starting on the virtual clock (a restart's or a spare's): each is done
    after its wall time, or, with ``RestartCosts.start_cpu_s``, once it had that much CPU out
    of ``start_cores`` shared by every start (processor sharing), so a burst of failures makes
    every start slower, as on a machine whose cores they share.

    ``schedule(time_s, priority, kind, payload)`` is the driver's event queue: a
    ``start_done`` event comes at each end, and ``finished`` says which starts it finishes."""

    def __init__(self, restart, schedule: Callable[..., None]):
        self.restart, self.schedule = restart, schedule
        self.starting = 0          # processes starting now (they take CPU from the learners)
        self.starts: dict = {}     # key -> (what, payload, CPU seconds left or None)
        self.at = 0.0
        self.version = 0

    def begin(self, now: float, key, what: str, payload, wall_s: float) -> None:
        self.starting += 1
        cpu_s = self.restart.start_cpu_s
        if cpu_s <= 0:
            self.starts[key] = (what, payload, None)
            self.schedule(now + wall_s, RESTART, "start_done", (key, None))
            return
        self.advance(now)
        self.starts[key] = (what, payload, cpu_s)
        self.reschedule(now)

    def cancel(self, now: float, key) -> None:
        """The starting process was killed: it needs no more CPU and never comes back."""
        if key not in self.starts:
            return
        self.advance(now)
        del self.starts[key]
        self.starting -= 1
        self.reschedule(now)

    def rate(self) -> float:
        """CPU seconds per second each start gets (one core at most: a process is one thread)."""
        n = sum(1 for _, _, left in self.starts.values() if left is not None)
        return min(1.0, self.restart.start_cores / n) if n else 0.0

    def advance(self, now: float) -> None:
        done = (now - self.at) * self.rate()
        for key, (what, payload, left) in list(self.starts.items()):
            if left is not None:
                self.starts[key] = (what, payload, left - done)
        self.at = now

    def reschedule(self, now: float) -> None:
        self.version += 1
        left = [x for _, _, x in self.starts.values() if x is not None]
        if left:
            self.schedule(now + max(min(left), 0.0) / self.rate(), RESTART, "start_done",
                          (None, self.version))

    def finished(self, now: float, payload) -> list[tuple[str, Any]]:
        """The starts a ``start_done`` event finishes, in order: (what, payload) as begun."""
        key, version = payload
        if key is not None:          # a flat start: this one is done, unless it was cancelled
            finished = [key] if key in self.starts else []
        else:                        # the CPU pool: whichever starts ran out of work
            if version != self.version:
                return []
            self.advance(now)
            finished = [k for k, (_, _, left) in self.starts.items()
                        if left is not None and left <= 1e-9]
        done = [self.starts.pop(k) for k in finished]
        self.starting -= len(done)
        if key is None:
            self.reschedule(now)
        return [(what, item) for what, item, _ in done]


def fleet_settings(ids: Sequence[str], regions: Sequence[str], speed_factors: Sequence[float],
                   min_learners: int, spares: int = 0,
                   restart_wait_s: float = 0.0,
                   health_timeout_s: float = HealthSection.model_fields["timeout_s"].default
                   ) -> fleet_lib.FleetSettings:
    """The fleet brain's settings for a virtual fleet: learners that cannot hang or straggle,
    restarts after a constant backoff of ``restart_wait_s`` (0: none; ``RestartCosts.restart_s``
    holds the start), no budget and no crash-loop retirement (every failure here is an
    injected fault). A drain is bounded as the service bounds it (``health.drain_timeout_s``
    of ``health_timeout_s``)."""
    by_region: dict[str, list[int]] = {}
    for i, region in enumerate(regions):
        by_region.setdefault(region, []).append(i)
    plans = {region: fleet_lib.RegionPlan(len(idx), len(idx),
                                          tuple(float(speed_factors[i]) for i in idx),
                                          tuple(ids[i] for i in idx), spares=spares)
             for region, idx in by_region.items()}
    return fleet_lib.FleetSettings(
        regions=plans, min_learners=min_learners,
        policy=RestartPolicy(backoff_initial_s=restart_wait_s, backoff_multiplier=1.0,
                             backoff_max_s=restart_wait_s,
                             max_crash_restarts=None, max_preemption_restarts=None,
                             crash_loop_after=None),
        heartbeat_timeout_s=math.inf, startup_timeout_s=math.inf, straggler_factor=math.inf,
        drain_timeout_s=drain_timeout_s(health_timeout_s))


def assemble_like(template: Any) -> Callable[[dict], Any]:
    """Returns ``flat {path: array} -> tree`` shaped like ``template``."""
    return fragments_lib.assembler(template)


def build_syncer_and_learners(*, params: Any, opt_init: Callable[[Any], Any], plan: FragmentPlan,
                              settings, outer_optimizer, error_feedback_factory: Callable[[], Any],
                              decode, wire_bytes, learner_ids: Sequence[str], merge_alpha: float,
                              is_embedding=lambda path: False, carry_overlap: bool = CARRY_OVERLAP,
                              downlink: Optional[downlink_lib.DownlinkSettings] = None,
                              ) -> tuple[SyncerCore, list[LearnerCore]]:
    """A syncer holding ``params`` and learners registered with it, all starting from ``params``.
    ``downlink``: how the syncer answers merged pushes (None: the full fragment, fp32)."""
    fragments = [fragments_lib.extract(params, plan, p) for p in range(plan.num_fragments)]
    syncer = SyncerCore(fragments, settings, outer_optimizer, decode, is_embedding,
                        downlink=downlink)
    cores = []
    for learner_id in learner_ids:
        _, frags = syncer.register(learner_id, 0)
        cores.append(LearnerCore(learner_id, params, opt_init(params), plan,
                                 [v for _, v in frags], error_feedback_factory(), wire_bytes,
                                 decode, overlap_steps=settings.overlap_steps,
                                 merge_alpha=merge_alpha, carry_overlap=carry_overlap))
    return syncer, cores
