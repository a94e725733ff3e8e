"""A virtual fleet for the in-process driver (``inprocess.py``): its learners' speeds, regions
and links, how its processes start (``ProcessStarts``) and the machine they run on
(``VirtualMachine``), the fleet brain's settings (``Fleet.settings``), the owner's launch specs
for it, the fault plans it can play, the syncer and learner cores it starts from, and a task's
run on it (``task_run``). No Ray, no clock: the driver runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from islands import CARRY_OVERLAP
from islands.faults import LEARNER_LOSS_KINDS, FaultKind, Link
from islands.learners.core import LearnerCore
from islands.learners.inner import at_schedule_step
from islands.orchestrator import fleet as fleet_lib
from islands.orchestrator.chaos import FaultPlan
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

    def regions_of(self, ids: Sequence[str]) -> list[str]:
        """The region of each of the learners ``ids`` (one per speed factor).

        Raises:
          ValueError: ids repeat, or the speeds or regions are not one per learner.
        """
        n = len(ids)
        if len(set(ids)) != n:
            raise ValueError(f"learner ids must be unique, got {list(ids)}")
        if len(self.speed_factors) != n:
            raise ValueError(f"fleet.speed_factors has {len(self.speed_factors)} entries for "
                             f"{n} learners")
        if self.regions is not None and len(self.regions) != n:
            raise ValueError(f"fleet.regions has {len(self.regions)} entries for {n} learners")
        return [self.region_of(i, name) for i, name in enumerate(ids)]

    def settings(self, ids: Sequence[str], min_learners: int) -> fleet_lib.FleetSettings:
        """The fleet brain's settings for these learners: learners that cannot hang or
        straggle, restarts after a constant backoff of ``restart_wait_s`` (0: none;
        ``RestartCosts.restart_s`` holds the start), no budget and no crash-loop retirement
        (every failure here is an injected fault). A drain is bounded as the service bounds it
        (``health.drain_timeout_s`` of ``health_timeout_s``), the policy's fields are the
        service's (``health.RestartPolicy``)."""
        by_region: dict[str, list[int]] = {}
        for i, region in enumerate(self.regions_of(ids)):
            by_region.setdefault(region, []).append(i)
        plans = {region: fleet_lib.RegionPlan(len(idx), len(idx),
                                              tuple(float(self.speed_factors[i]) for i in idx),
                                              tuple(ids[i] for i in idx), spares=self.spares)
                 for region, idx in by_region.items()}
        wait = self.restart_wait_s
        return fleet_lib.FleetSettings(
            regions=plans, min_learners=min_learners,
            policy=RestartPolicy(backoff_initial_s=wait, backoff_multiplier=1.0,
                                 backoff_max_s=wait, max_crash_restarts=None,
                                 max_preemption_restarts=None, crash_loop_after=None),
            heartbeat_timeout_s=math.inf, startup_timeout_s=math.inf, straggler_factor=math.inf,
            drain_timeout_s=drain_timeout_s(self.health_timeout_s))


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


class VirtualMachine:
    """The machine the in-process driver's virtual learners and syncer run on: what a cluster
    and its processes keep on Ray, held here for both the driver and its groups
    (``virtual_groups``), so that the driver uses a group through its interface only.

    It holds the process starts (``starts``), which slots are told to drain (``draining``), each
    slot's restart token (``restart_token``: a comeback scheduled before a kill is void) and the
    kind of its last loss (``cause_of``), and what has happened but is not polled yet: runs
    ended, spares ready, shards killed (``report``; the groups' polls ``take`` them).
    ``driver`` is the ``inprocess._Driver`` whose learners and syncer core it reads."""

    def __init__(self, driver: Any):
        self.d = driver
        n = len(driver.ids)
        self.starts = ProcessStarts(driver.restart, driver.schedule)
        self.draining: set[int] = set()  # told to drain: no new step, leaves once answered
        self.restart_token = [0] * n     # invalidates a scheduled comeback that was killed
        self.cause_of = [""] * n         # the fault kind of each learner's last loss
        self.reported: dict[str, list] = {"ended": [], "spares": [], "shards": []}

    def report(self, message, kind: Optional[str] = None) -> None:
        """Its event has come on the virtual clock: the next poll of its kind returns it (a
        ``fleet.RunEnded`` or ``fleet.SpareReady`` by its type; a shard's end as ``shards``)."""
        if kind is None:
            kind = "ended" if isinstance(message, fleet_lib.RunEnded) else "spares"
        self.reported[kind].append(message)

    def take(self, kind: str) -> list:
        """What was reported of ``kind`` since the last take, in order."""
        out, self.reported[kind] = self.reported[kind], []
        return out

    def killed(self) -> bool:
        """A shard was killed and its end is not polled yet (the driver polls it at once)."""
        return bool(self.reported["shards"])

    def applied(self) -> fleet_lib.Applied:
        """Every learner's applied step and tokens as the core's ledger has them now (the
        driver's turns read them at once; the Ray owner's, from the last statuses)."""
        return fleet_lib.Applied({name: (e.incarnation, e.applied_step, e.applied_tokens_done)
                                  for name, e in self.d.syncer.ledger.items()})

    def final(self, i: int) -> dict:
        """Learner i's last stats, as a returned Ray run's: its step and its books."""
        core = self.d.cores[i]
        return {"learner": core.learner, "incarnation": core.incarnation, "state": "stopped",
                "step": core.step, "fates": core.fates.to_json()}

    def finish_drain(self, i: int, now: float) -> bool:
        """Ends learner i's run, which was told to drain, if it is between steps with nothing
        in flight; True when it did (the learner group's ``ended`` reports it)."""
        d = self.d
        core = d.cores[i]
        if not d.up[i] or d.in_step[i] or any(
                t.in_flight_since_step is not None and t.reply is None for t in core.tracks):
            return False   # down (its restart, if any, drains when it is back), or still busy
        self.draining.discard(i)
        d.record.watermarks[(i, core.incarnation)] = d.watermark(i)
        d.up[i] = d.parked[i] = False
        d.recheck_open_rounds(now)
        self.report(fleet_lib.RunEnded(d.ids[i], core.incarnation, final=self.final(i)))
        return True


class VirtualSpecs:
    """What the owner starts a virtual learner from: its ``fleet.Launch`` (start step, peer);
    no devices, no spec for a spare or a syncer (which restarts from its own core)."""

    def learner(self, a: fleet_lib.Launch) -> tuple:
        return None, a, None

    def spare(self, a: fleet_lib.LaunchSpare) -> tuple:
        return None, None

    def syncer(self, s: int) -> tuple:
        return None, {}, math.inf


def check_plan(faults, ids: Sequence[str], regions: Sequence[str], opt_init) -> None:
    """A fault plan a virtual fleet can play: each fault names one of its learners or regions,
    and learner faults come with ``opt_init`` (a restart's fresh inner state).

    Raises:
      ValueError: naming the fault and the fleet's learners and regions, or ``opt_init``.
    """
    known, region_set = set(ids), set(regions)
    for fault in faults.faults:
        if fault.kind in (FaultKind.KILL, FaultKind.EXIT, FaultKind.HANG):
            ok = fault.target in known
        elif fault.kind == FaultKind.SLOWDOWN:
            ok = fault.target in known or fault.target in region_set
        elif fault.kind == FaultKind.SYNCER_KILL:
            ok = True
        else:
            ok = fault.target in region_set
        if not ok:
            raise ValueError(f"faults: {fault.kind.value} target {fault.target!r} is not a "
                             f"learner ({', '.join(ids)}) or region "
                             f"({', '.join(sorted(region_set))}) of this fleet")
    if opt_init is None and any(f.kind in LEARNER_LOSS_KINDS for f in faults.faults):
        raise ValueError("opt_init is required with learner faults: a restarted learner "
                         "starts a fresh inner state when no peer is alive")


def assemble_like(template: Any) -> Callable[[dict], Any]:
    """Returns ``flat {path: array} -> tree`` shaped like ``template``."""
    return fragments_lib.assembler(template)


def restarted_core(old: LearnerCore, frags: list, assemble: Optional[Callable[[dict], Any]],
                   incarnation: int, start_step: int, schedule_step: int,
                   opt_state_for: Callable[[Any], Any]) -> tuple[LearnerCore, int]:
    """A new incarnation of ``old``'s learner from its registration's ``frags`` (fragment,
    version): the same plan, codec and settings, Θ as the syncer holds it, an inner state
    (``opt_state_for(params)``: a peer's or a fresh one) at ``schedule_step``. Returns it and
    the bytes it fetched (fp32)."""
    flat = {}
    for fragment, _ in frags:
        flat.update(fragment)
    assemble = assemble or assemble_like(old.params)
    params = assemble({k: np.array(v, np.float32, copy=True) for k, v in flat.items()})
    opt_state = at_schedule_step(opt_state_for(params), schedule_step)
    core = LearnerCore(old.learner, params, opt_state, old.plan, [v for _, v in frags],
                       old.error_feedback, old.wire_bytes, old.decode,
                       overlap_steps=old.overlap_steps, merge_alpha=old.merge_alpha,
                       incarnation=incarnation, start_step=start_step,
                       carry_overlap=old.carry_overlap)
    return core, sum(int(np.asarray(v).nbytes) for v in flat.values())


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


def task_run(task, *, steps: int, optimizer, num_learners: int = 2, fragments: int = 2,
             sync_every_steps: int = 8, overlap_steps: int = 2, min_learners: int = 1,
             codec: str = "int4", seed: int = 0, fleet: Optional[Fleet] = None,
             eval_every_steps: int = 0, faults: Optional[FaultPlan] = None,
             outer_optimizer=None) -> dict:
    """``inprocess.run_task``'s run, as ``run_inprocess``'s arguments: a
    :class:`~islands.learners.task.Task` trained by ``num_learners`` learners on the virtual
    clock: init from ``PRNGKey(seed)``, shard i of ``num_learners`` through a ``TaskStream``
    (a restarted learner reopens it at its applied step), the task's own eval batches. The
    syncer merges under the service's rules (``islands.defaults``, as a job's default config:
    re-based outer gradients, one step per round, the fleet's schedule clock, round_wait 0.5).

    Args:
      task: what to train.
      steps: inner steps per learner.
      optimizer: the inner optax transformation (``task.optimizer`` wins when it has one).
      num_learners, fragments, sync_every_steps, overlap_steps, min_learners: M, P, H, τ, K.
      codec: outer-gradient codec kind, with error feedback.
      seed: init and step rng seed.
      fleet: speeds and links (default: equal speeds, instant links).
      eval_every_steps: evaluate the global params every this many steps of learner 0.
      faults: a fault plan (restarted learners take a peer's inner state or a fresh one).
      outer_optimizer: default ``syncer.outer.build()`` (Nesterov).
    """
    import jax

    from islands.learners.task import TaskStream, make_eval_fn, make_train_step
    from islands.syncer import codec as codec_lib
    from islands.syncer import outer as outer_lib
    from islands.syncer.core import SyncerSettings

    optimizer = task.optimizer if task.optimizer is not None else optimizer
    params = jax.jit(task.init_params)(jax.random.PRNGKey(seed))
    codec_obj = codec_lib.make_codec(codec)
    syncer, learners = build_syncer_and_learners(
        params=params, opt_init=optimizer.init, plan=fragments_lib.partition(params, fragments),
        settings=SyncerSettings(min_learners=min_learners, overlap_steps=overlap_steps),
        outer_optimizer=outer_optimizer if outer_optimizer is not None else outer_lib.build(),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec_obj),
        decode=lambda c: codec_lib.decode_tree(codec_obj, c),
        wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=[f"local:{i}" for i in range(num_learners)], merge_alpha=0.0,
        is_embedding=task.is_embedding)
    streams = [TaskStream(task, i, num_learners) for i in range(num_learners)]
    evaluate, eval_set = make_eval_fn(task), list(task.eval_batches())
    return dict(
        learners=learners, syncer=syncer, train_step=make_train_step(task, optimizer, seed),
        batch_for=lambda i, k: streams[i].batch_at(k),
        tokens_per_batch=int(task.tokens(streams[0].batch_at(0).batch)),
        fleet=fleet if fleet is not None else Fleet(speed_factors=[1.0] * num_learners),
        num_fragments=fragments, sync_every_steps=sync_every_steps, steps=steps,
        evaluate=lambda p: evaluate(p, eval_set), eval_every_steps=eval_every_steps,
        assemble=assemble_like(params), faults=faults, opt_init=optimizer.init)
