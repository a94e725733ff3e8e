"""The fleet as a pure state machine: every lifecycle decision of the job's learner slots.

One function, ``step(fleet, observations, now_s) -> Step(fleet, actions, transitions)``, holds
what the controller decides: failure classification (death, hang, straggler; crash vs preemption
budgets through ``health.RestartPolicy``), restart with backoff, the peer a restarted learner
copies its inner state from, scale up/down/drain, following cluster membership, the quorum-floor
pause and chaos faults. No Ray, no clock, no threads: the caller passes what it saw
(``observations``) and the time, and executes the ``actions`` it gets back. The Ray controller
(``controller.py``, wall clock) and the in-process driver (``inprocess.py``, virtual clock) are
two bodies around this one brain; tests step it with hand-made observations and backdated clocks.

A slot is one learner id (``us-east:0``) over its incarnations::

    PENDING ─launch─▶ STARTING ─ready─▶ TRAINING ⇄ PAUSED        (quorum floor)
                         │                 │
                         └──── failed ─────┴─▶ RESTARTING ─relaunch─▶ STARTING
                                               │ budget spent ─▶ FAILED
    TRAINING/STARTING/PAUSED ─drain─▶ DRAINING ─drained─▶ RETIRED
                 node draining (planned preemption) ─▶ DRAINING ─drained─▶ RESTARTING (at once)
                  ─relaunch─▶ AWAITING_PLACEMENT ─placed─▶ STARTING

A warm spare (``RegionPlan.spares``) is a learner process that did everything a restart does before
its first step and holds no learner identity: ``STARTING ─ready─▶ READY``. A slot that launches
(a restart, a scale-up) while its region has a READY spare takes the spare instead of a new
process (``Launch.spare``), at once: no backoff, no repair wait (the spare is another process,
on its own devices). A new spare starts behind it once the promotion is done; a slot already
RESTARTING (waiting for its backoff or a repair) takes a spare as soon as one is ready. A restart
that falls due while its region's spare is still preparing waits for that spare (at most
``FleetSettings.spare_wait_s``) instead of starting a second new process beside it, and the
spare is hurried (``HurrySpare``: its preparation leaves its low priority): a promoted spare's
start costs the learner almost no CPU, a new process a whole start's. With
``RegionPlan.prestart`` a failed learner whose restart must wait gets its next process at once,
a spare reserved for it (``Spare.for_learner``), prepared while it waits and promoted when the
restart is due. A region loss takes the region's spares with its learners (they run on the same
nodes), and no spare starts there, nor is any restart prestarted, before its repair is over.

A node Ray reports draining (``Cluster.draining``: ``ray drain-node``, an autoscaler, the
platform's announced preemption) is a planned preemption: each live learner on it is drained
(its in-flight pushes finish) and, once its run returns, restarted at once elsewhere (a ready
spare of its region, else a new process Ray places off the draining node) under the cause
``preempted_planned``, which spends no budget. Two incarnations of one learner never push at
once (the syncer fences the older), so the new one starts when the old one is out. Spares on a
draining node are ended (new ones start elsewhere). A learner still on the node when it goes
dies as any other.

A device check that fails deterministically (learners/devices.py) marks its node for the
learner's region (``FleetState.misconfigured``); the region is blocked (no spare, no prestart,
no scale-up; its next such failure retires as ``config``) only while every alive node of it is
marked (``FleetState.blocked``); a region's spares wait while an alive node of it is marked. A
good start there (anywhere in the region for a mark of ``UNKNOWN_NODE``) or an operator
(``ClearMisconfigured``) clears a mark. A region's spares that fail to start back off
(``SpareBackoff``). A learner whose crashes keep coming with one error at one resume step is
retired as ``crash_loop`` (``health.crash_loop``), whatever budget it has left.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from islands import defaults
from islands.learners.devices import BACKEND_MARK as DEVICE_BACKEND_MARK
from islands.learners.devices import MISMATCH_MARK as DEVICE_MISMATCH_MARK
from islands.learners.devices import is_backend_unavailable, is_device_mismatch, mismatch_node

from .chaos import HOME_TARGET, Fault, FaultKind
from .health import (Cause, RestartDecision, RestartPolicy, crash_loop, death_cause, detect,
                     error_signature, grown_target)

# The node of a device-check failure whose line names none (an in-process learner, an older
# learner): its mark blocks the whole region, as nothing tells its nodes apart.
UNKNOWN_NODE = "unknown"


class SlotState(str, enum.Enum):
    PENDING = "pending"          # created (config or scale command), not launched yet
    STARTING = "starting"        # an incarnation was launched; no training heartbeat yet
    TRAINING = "training"
    PAUSED = "paused"            # alive, held by the quorum floor
    DRAINING = "draining"        # finishing its in-flight pushes, then leaves
    RESTARTING = "restarting"    # its incarnation died; a new one is due at ``restart_at_s``
    FAILED = "failed"            # restart budget spent: gone for good
    # A remote learner that stopped beating while its region agent is silent too: the home
    # cannot restart it, so it shows here until the agent reports it (or a successor) again.
    UNREACHABLE = "unreachable"
    RETIRED = "retired"          # left on purpose (drained, scaled down, job stopped)
    # A handed-over learner's new incarnation, launched while nothing may take it yet (its node
    # drained, no capacity elsewhere): it waits for Ray to place it, as long as that takes. No
    # hang verdict and no budget: nothing failed. Badput ``awaiting_placement``.
    AWAITING_PLACEMENT = "awaiting_placement"


# The books' drop reason of the work a learner held when the fleet ended its overdue drain.
DRAIN_TIMEOUT = "drain_timeout"

LIVE = frozenset({SlotState.STARTING, SlotState.TRAINING, SlotState.PAUSED, SlotState.DRAINING,
                  SlotState.AWAITING_PLACEMENT})
GONE = frozenset({SlotState.FAILED, SlotState.RETIRED})
# A remote incarnation the home found hung: down here whatever its agent's last report said.
HOME_FAILED = frozenset({SlotState.RESTARTING, SlotState.UNREACHABLE})


def restart_counts(text: Optional[str]) -> Optional[tuple]:
    """A region agent's restart counts as its report carries them (JSON ``{cause: n}``), in
    ``Slot.restarts`` form; None when the report has none (an agent of an older version).
    Unknown causes are dropped.

    >>> restart_counts('{"quarantine": 1, "crash": 2, "new": 4}'), restart_counts("")
    (((<Cause.CRASH: 'crash'>, 2), (<Cause.QUARANTINE: 'quarantine'>, 1)), None)
    """
    if not text:
        return None
    import json

    known = {c.value: c for c in Cause}
    return tuple(sorted((known[k], int(n)) for k, n in json.loads(text).items() if k in known))


def agent_reporting(now_s: float, last_report_s: float, heartbeat_timeout_s: float) -> bool:
    """Whether a region agent counts as alive: it reported within a third of the hang timeout
    (it reports every second; a third leaves room for a slow link without waiting a whole
    timeout on a dead agent).

    >>> agent_reporting(100.0, 95.0, 30.0), agent_reporting(100.0, 85.0, 30.0)
    (True, False)
    """
    return now_s - last_report_s <= heartbeat_timeout_s / 3.0


# -- settings and state ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RegionPlan:
    learners: int                       # initial count
    max_learners: int                   # ceiling for scale commands and node joins
    speed_factors: tuple[float, ...] = ()  # of the initial learners (emulated hardware speed)
    names: tuple[str, ...] = ()           # ids of the initial learners (default "<region>:<i>")
    # In its own Ray cluster, joined over the link: its agent launches, checks and restarts its
    # learners; this fleet mirrors their states from the agent's reports (``RemoteReport``).
    remote: bool = False
    spares: int = defaults.SPARES         # warm spare learner processes kept ready
    # A failed learner's next process is started at once and prepared as a spare reserved for
    # it while its restart waits (backoff, repair), then promoted when the restart is due.
    prestart: bool = defaults.PRESTART_RESTARTS


@dataclass(frozen=True)
class FleetSettings:
    """What the fleet decides with; built from JobConfig by ``build.fleet_settings``."""

    regions: Mapping[str, RegionPlan]
    min_learners: int = defaults.MIN_LEARNERS
    policy: RestartPolicy = RestartPolicy()
    heartbeat_timeout_s: float = defaults.HEARTBEAT_TIMEOUT_S
    startup_timeout_s: float = 120.0
    straggler_factor: float = defaults.STRAGGLER_FACTOR
    # slow for this long (one incarnation) before a verdict
    straggler_window_s: float = defaults.STRAGGLER_WINDOW_S
    # and at least this much above its peers' median step
    straggler_min_excess_s: float = defaults.STRAGGLER_MIN_EXCESS_S
    restart_retry_s: float = 0.2        # a launch that failed (name not released yet) retries
    # A restart due while its region's spare is still preparing waits this long for it rather
    # than start a new process beside it (``start_due_restarts``); 0: never waits.
    spare_wait_s: float = defaults.SPARE_WAIT_S
    first_shard: int = 0                # a region agent's fleet: its region's first data shard
    num_shards: Optional[int] = None    # ... and the job's shard count (None: count the slots)
    syncer_shards: int = 1              # syncer shards (members the fleet can kill and restart)
    # A draining learner whose run has not returned this long after its drain began is ended
    # and its unsent work dropped as ``drain_timeout`` (``check_drains``). The learner gives up
    # on unanswered pushes by itself after ``health.timeout_s``; this bounds one that cannot.
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_FACTOR * defaults.HEARTBEAT_TIMEOUT_S


@dataclass(frozen=True)
class Slot:
    learner: str
    region: str
    index: int
    shard: int
    speed_factor: float = 1.0
    state: SlotState = SlotState.PENDING
    incarnation: int = 0
    launched_s: Optional[float] = None   # when the current incarnation was requested
    last_beat_s: Optional[float] = None
    step_time_s: Optional[float] = None
    node_id: Optional[str] = None
    restarts: tuple[tuple[Cause, int], ...] = ()   # every restart of the learner's life
    # The restarts the policy counts (budgets, backoff): those since it last trained healthily
    # for ``RestartPolicy.reset_after_s``.
    counted: tuple[tuple[Cause, int], ...] = ()
    training_since_s: Optional[float] = None   # when this incarnation began to train
    restart_at_s: Optional[float] = None
    repair_until_s: float = 0.0
    killed_at_s: Optional[float] = None  # a chaos kill: the failure time, to the ms
    start_step: int = 0
    recovery: Optional[tuple[tuple[str, float], ...]] = None  # phase timestamps in progress
    restart_postponed: bool = False
    remote: bool = False                 # mirrored from a region agent (never launched here)
    actor: Optional[str] = None          # the spare hosting this incarnation (None: its own actor)
    slow_since_s: Optional[float] = None  # this incarnation has been slow since (None: it is not)
    slow_tolerated: int = 0              # incarnations let train on at their slow pace
    tolerated_incarnation: int = -1      # ... the newest of them (one event per incarnation)
    # Draining because its node is (a planned preemption): restarted elsewhere once drained.
    preempted_s: Optional[float] = None
    draining_since_s: Optional[float] = None   # its drain began (the fleet's deadline counts)
    # This incarnation has adopted a merged global fragment since it started (its beats say so):
    # only then may it donate its inner optimizer state to a restarting peer (peer_for).
    adopted: bool = False
    # Seconds this incarnation spent paused since it began to train, and the start of the pause
    # it is in (None: not paused): paused time is not training time (``trained_seconds``).
    paused_s: float = 0.0
    paused_since_s: Optional[float] = None
    # Its recent crashes with an error of their own (not chaos kills, hangs, start-up
    # timeouts, device mismatches): (resume step of the failed incarnation, error signature),
    # the newest last (``health.crash_loop``).
    failures: tuple[tuple[int, str], ...] = ()
    # Retired as a crash loop: at which resume step, with which error (the console shows it).
    crash_loop: Optional[str] = None
    # This incarnation was wedged on purpose (a chaos hang): its failure is no crash loop's.
    injected: bool = False

    @property
    def restart_counts(self) -> dict[Cause, int]:
        return dict(self.restarts)

    def trained_seconds(self, died_s: float) -> Optional[float]:
        """Seconds the incarnation trained before ``died_s``, its paused time left out (None:
        it never trained)."""
        if self.training_since_s is None:
            return None
        paused = self.paused_s + (died_s - self.paused_since_s
                                  if self.paused_since_s is not None else 0.0)
        return max(0.0, died_s - self.training_since_s - paused)

    def with_restart(self, cause: Cause, fresh: bool = False) -> "Slot":
        """One more restart for ``cause``; ``fresh``: the counted ones start over with it."""
        counts, counted = self.restart_counts, {} if fresh else dict(self.counted)
        counts[cause] = counts.get(cause, 0) + 1
        counted[cause] = counted.get(cause, 0) + 1
        return dataclasses.replace(self, restarts=tuple(sorted(counts.items())),
                                   counted=tuple(sorted(counted.items())))


class SpareState(str, enum.Enum):
    STARTING = "starting"        # launched: imports, the task built, the step compiled, handles
    READY = "ready"              # waits to be promoted into a failed (or new) learner's place


@dataclass(frozen=True)
class Spare:
    name: str                    # "spare:<region>:<n>", also its actor's name suffix
    region: str
    state: SpareState = SpareState.STARTING
    launched_s: float = 0.0
    ready_s: Optional[float] = None
    node_id: Optional[str] = None   # where it waits (from its ready answer)
    # Prestarted for this learner's restart (``RegionPlan.prestart``): only it takes this one,
    # and not before its restart is due. None: one of the region's ``spares``.
    for_learner: Optional[str] = None
    hurried: bool = False        # a due restart waits for it: it prepares at normal priority


@dataclass(frozen=True)
class SpareBackoff:
    """A region's spares that failed to start, in a row (a spare has no budget: without this a
    deterministic failure would start a process after another for the rest of the job). The
    region's next spare starts no earlier than ``not_before_s`` (the restart policy's backoff
    over ``failed``). ``node``: the node the newest failures named as a backend that did not
    start there, ``on_node`` of them in a row; past the crash budget the node is marked."""

    failed: int = 0
    not_before_s: float = 0.0
    node: Optional[str] = None
    on_node: int = 0


class ShardState(str, enum.Enum):
    UP = "up"                    # started (or re-attached) and answering
    RESTARTING = "restarting"    # its actor ended: a new epoch starts from its snapshot


@dataclass(frozen=True)
class SyncerShard:
    """One syncer shard as a member of the fleet: a dead shard restarts alone, at its next
    epoch, from its newest snapshot; the other shards keep merging meanwhile."""

    shard: int
    state: ShardState = ShardState.UP
    epoch: int = 0
    restarts: int = 0


@dataclass(frozen=True)
class FleetState:
    settings: FleetSettings
    slots: Mapping[str, Slot] = field(default_factory=dict)   # insertion order = creation order
    targets: Mapping[str, int] = field(default_factory=dict)
    next_index: Mapping[str, int] = field(default_factory=dict)
    next_shard: int = 0
    capacity: Mapping[str, float] = field(default_factory=dict)
    alive_nodes: Optional[frozenset] = None
    paused_reason: Optional[str] = None
    quorum_seen: bool = False
    stopping: bool = False
    link_faults: tuple[Fault, ...] = ()    # network faults, for learners launched during them
    applied_steps: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # (inc, step)
    spares: Mapping[str, Spare] = field(default_factory=dict)
    next_spare: int = 0
    operator_paused: bool = False         # paused by an operator (PauseJob) until resumed
    home_paused: Optional[str] = None     # a region agent: its home's pause reason (HomePause)
    agents_seen: Mapping[str, float] = field(default_factory=dict)  # remote region -> last report
    syncer_shards: Mapping[int, SyncerShard] = field(default_factory=dict)
    # Nodes where a learner (or spare) of a region failed its device check: node id ->
    # {region: the check's line}. A region is blocked (``blocked``) only while every alive node
    # of it is marked: then its learners that fail the check retire, no spare is kept, nothing
    # is prestarted, and a scale-up is refused with the message. A good start of the region
    # on the node clears its mark, and so does an operator (``ClearMisconfigured``).
    misconfigured: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Region -> the alive nodes carrying its ``region:<name>`` resource (None: not known; then a
    # mark blocks its region).
    region_nodes: Optional[Mapping[str, frozenset]] = None
    # Nodes Ray reports draining: node id -> deadline (seconds on the fleet's clock; None: none).
    draining_nodes: Mapping[str, Optional[float]] = field(default_factory=dict)
    # Regions lost (a region loss) -> the end of their repair: no spare starts there before it.
    lost_regions: Mapping[str, float] = field(default_factory=dict)
    # Region -> its spares' failed starts in a row (``SpareBackoff``); a spare ready clears it.
    spare_backoff: Mapping[str, SpareBackoff] = field(default_factory=dict)

    def live(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.state in LIVE]

    def in_region(self, region: str) -> list[Slot]:
        return [s for s in self.slots.values() if s.region == region]

    def blocked(self, region: str) -> Optional[str]:
        """The device-check line that blocks ``region``, or None: it is blocked while it has a
        mark and no alive node of it is unmarked (Ray places a learner by its region's
        resource, not by node, so only then is there nowhere it could pass). Unknown nodes
        (no membership report, or a mark of ``UNKNOWN_NODE``) block it on any mark."""
        marks = {node: regions[region] for node, regions in self.misconfigured.items()
                 if region in regions}
        if not marks:
            return None
        nodes = None if self.region_nodes is None else self.region_nodes.get(region)
        if nodes is not None and self.alive_nodes is not None:
            nodes = nodes & self.alive_nodes
        if UNKNOWN_NODE not in marks and nodes and set(nodes) - set(marks):
            return None
        return next(iter(marks.values()))

    def marks(self) -> list[dict]:
        """Every mark, for display: node, region, message and whether it blocks its region."""
        return [{"node": node, "region": region, "message": message,
                 "blocked": self.blocked(region) is not None}
                for node, regions in sorted(self.misconfigured.items())
                for region, message in sorted(regions.items())]


def initial(settings: FleetSettings) -> FleetState:
    """The configured slots, all PENDING (the first ``step`` launches them)."""
    fleet = FleetState(settings, targets={r: p.learners for r, p in settings.regions.items()},
                       next_index={r: 0 for r in settings.regions},
                       next_shard=settings.first_shard, syncer_shards=_up_shards(settings))
    slots = dict(fleet.slots)
    for region, plan in settings.regions.items():
        for i in range(plan.learners):
            fleet, slot = _new_slot(fleet, region, plan.speed_factors[i] if i < len(
                plan.speed_factors) else 1.0)
            if i < len(plan.names):
                slot = dataclasses.replace(slot, learner=plan.names[i])
            slot = dataclasses.replace(slot, remote=plan.remote)
            slots[slot.learner] = slot
            fleet = dataclasses.replace(fleet, slots=dict(slots))
    return fleet


def rebuilt(settings: FleetSettings, slots: Sequence[Slot], targets: Mapping[str, int],
            next_index: Mapping[str, int], next_shard: int, next_spare: int = 0,
            operator_paused: bool = False) -> FleetState:
    """The fleet a restarted controller rebuilds from what it saved and what it finds running
    (the quorum was reached before, so the floor applies at once). Spares are not rebuilt: the
    controller ends the unpromoted ones and this fleet starts new ones."""
    return FleetState(settings, slots={s.learner: s for s in slots}, targets=dict(targets),
                      next_index=dict(next_index), next_shard=next_shard, quorum_seen=True,
                      next_spare=next_spare, operator_paused=operator_paused,
                      syncer_shards=_up_shards(settings))


def _up_shards(settings: FleetSettings) -> dict[int, SyncerShard]:
    return {s: SyncerShard(s) for s in range(max(settings.syncer_shards, 1))}


def _new_slot(fleet: FleetState, region: str, speed: float = 1.0) -> tuple[FleetState, Slot]:
    index = fleet.next_index[region]
    slot = Slot(learner=f"{region}:{index}", region=region, index=index, shard=fleet.next_shard,
                speed_factor=speed)
    return dataclasses.replace(fleet, next_index={**fleet.next_index, region: index + 1},
                               next_shard=fleet.next_shard + 1), slot


# -- observations: what a body saw ----------------------------------------------------------------
@dataclass(frozen=True)
class Beat:
    """A learner's heartbeat (from the current incarnation only; older ones are ignored)."""

    learner: str
    incarnation: int
    training: bool                      # its loop is stepping (not starting, not stopped)
    step_time_s: Optional[float] = None
    node_id: Optional[str] = None
    ready_at_s: Optional[float] = None  # when its restore finished
    # It has adopted a merged global fragment since this incarnation started (the heartbeat's
    # ``adopted`` count is above 0). Once true it stays true for the incarnation.
    adopted: bool = False


@dataclass(frozen=True)
class RunEnded:
    """An incarnation's run returned (``error`` None) or died (``error`` says how)."""

    learner: str
    incarnation: int
    error: Optional[str] = None
    preempted: bool = False             # the platform said so (an autoscaler drain)
    crashed: bool = False               # the training loop raised (not a dead process)
    # What a returned run's unit reported last (its counters and books, as a heartbeat carries
    # them); the fleet reads none of it, the owner's books do.
    final: Optional[Mapping] = field(default=None, compare=False)


@dataclass(frozen=True)
class Quarantine:
    """The syncer refused this incarnation's drifts as garbage too many times in a row."""

    learner: str
    incarnation: int
    detail: str = ""


@dataclass(frozen=True)
class LaunchFailed:
    """A launch could not be carried out (e.g. the dead actor's name is not released yet)."""

    learner: str
    incarnation: int
    reason: str


@dataclass(frozen=True)
class Placed:
    """Ray placed this incarnation's process (it answers): a handover waiting for placement
    starts (``SlotState.AWAITING_PLACEMENT``)."""

    learner: str
    incarnation: int
    node_id: Optional[str] = None


@dataclass(frozen=True)
class Cluster:
    """Cluster membership: region capacities (``region:<name>`` resources), live nodes, and the
    nodes being drained (node id -> deadline on the fleet's clock, None for none; None: not
    known, the last report holds)."""

    capacity: Mapping[str, float]
    alive_nodes: Optional[frozenset] = None
    draining: Optional[Mapping[str, Optional[float]]] = None
    # Region -> the alive nodes carrying its resource (None: not known, the last report holds).
    region_nodes: Optional[Mapping[str, frozenset]] = None


@dataclass(frozen=True)
class Applied:
    """The syncer's ledger: per learner (incarnation, applied step, applied tokens of it)."""

    entries: Mapping[str, tuple[int, int, int]]


@dataclass(frozen=True)
class RemoteReport:
    """A learner of a region in its own Ray cluster, as its agent reports it over the link: the
    agent's fleet decided its state; this fleet mirrors it (and settles what ended)."""

    learner: str
    region: str
    incarnation: int
    state: str                          # a SlotState value
    shard: int = 0
    step_time_s: Optional[float] = None
    last_cause: str = ""                # why its previous incarnation ended, if it did
    beat: bool = True                   # a heartbeat of this incarnation came with the report
    agent_alive: bool = True            # the region agent (not only its link) is reporting
    restarts: Optional[tuple] = None    # the agent's restart counts ((Cause, n), ...): mirrored


@dataclass(frozen=True)
class Unhealthy:
    """The home found this incarnation hung (a remote learner's agent is told over the link):
    the same verdict as the fleet's own health check, from outside."""

    learner: str
    incarnation: int
    cause: str = "hang"
    detail: str = ""


@dataclass(frozen=True)
class SpareReady:
    """A spare finished preparing (its ``prepare`` returned)."""

    name: str
    ready_at_s: Optional[float] = None
    node_id: Optional[str] = None


@dataclass(frozen=True)
class SpareEnded:
    """A spare's process died (or its preparation raised) before it was promoted."""

    name: str
    error: str = ""


@dataclass(frozen=True)
class Scale:
    region: str
    n: int
    reason: str = "operator"


@dataclass(frozen=True)
class Drain:
    learner: str


@dataclass(frozen=True)
class Chaos:
    """A fault to apply now (from the job's plan or an operator's chaos command)."""

    fault: Fault
    mode: str = "ray_kill"     # KILL faults: ray_kill or exit


@dataclass(frozen=True)
class HangCommand:
    """Chaos: wedge a learner (no steps, no heartbeats) for ``duration_s``."""

    learner: str
    duration_s: float


@dataclass(frozen=True)
class PauseJob:
    """An operator pauses (``paused``) or resumes the whole job; the learners stay up and hold
    their state. Independent of the quorum floor: a resume while below quorum stays paused."""

    paused: bool
    origin: str = "operator"


@dataclass(frozen=True)
class SyncerEnded:
    """A syncer shard's actor ended (``epoch``: the epoch it last reported)."""

    shard: int
    epoch: int


@dataclass(frozen=True)
class SyncerStarted:
    """A syncer shard answers at ``epoch`` (started, restored or re-attached)."""

    shard: int
    epoch: int


@dataclass(frozen=True)
class HomePause:
    """A region agent hears from its home that training there is paused (``reason``: the
    home's pause reason) or resumed (None): the home's quorum floor or operator pause reaches the
    region's learners (link/)."""

    reason: Optional[str]


@dataclass(frozen=True)
class Stop:
    """The job is ending: clean ends retire, nothing restarts."""


@dataclass(frozen=True)
class ClearMisconfigured:
    """An operator clears a node's misconfigured marks (``node`` None: every node's), e.g. once
    the node's driver or environment is fixed."""

    node: Optional[str] = None
    origin: str = "operator"


Observation = Union[Beat, RunEnded, Quarantine, LaunchFailed, Placed, Cluster, Applied, Scale,
                    Drain,
                    Chaos, HangCommand, Stop, RemoteReport, SpareReady, SpareEnded, PauseJob,
                    Unhealthy, HomePause, SyncerEnded, SyncerStarted, ClearMisconfigured]


# -- actions: what a body must do -----------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    learner: str
    region: str
    incarnation: int
    shard: int
    num_shards: int
    speed_factor: float
    peer: Optional[str]        # a live learner to copy the inner optimizer state from
    start_step: int            # where its data shard resumes
    link_faults: tuple[Fault, ...] = ()
    spare: Optional[str] = None    # promote this READY spare instead of starting a process
    peer_actor: Optional[str] = None  # the spare hosting ``peer``, if one does (None: its own)


@dataclass(frozen=True)
class LaunchSpare:
    name: str
    region: str


@dataclass(frozen=True)
class KillSpare:
    name: str


@dataclass(frozen=True)
class HurrySpare:
    """A restart waits for this spare, still preparing: its preparation is on the restart's
    critical path now, so it leaves its low priority."""

    name: str


@dataclass(frozen=True)
class Kill:
    """End an incarnation: ``ray_kill`` or ``exit`` (chaos), ``bury`` (make sure it is gone).
    ``reason``: why it is buried, for a body that settles the books at the kill (the
    in-process one; empty: a quarantine); the Forget that follows carries it too."""

    learner: str
    incarnation: int
    mode: str = "bury"
    reason: str = ""
    fault: Optional[Fault] = None   # a chaos kill's fault (its kind: how it dies, when seen)


@dataclass(frozen=True)
class Forget:
    """Unregister the learner at the syncer: its unmerged pushes are dropped, and what the
    incarnation still held is dropped in the books for ``reason``."""

    learner: str
    incarnation: int
    reason: str = "ended"


@dataclass(frozen=True)
class DrainLearner:
    learner: str


@dataclass(frozen=True)
class PauseLearner:
    learner: str
    paused: bool


@dataclass(frozen=True)
class Slowdown:
    """Slow ``learners`` (the fault's target, expanded to the learners running now)."""

    learners: tuple[str, ...]
    fault: Fault


@dataclass(frozen=True)
class Hang:
    learner: str
    duration_s: float


@dataclass(frozen=True)
class LinkFault:
    learners: tuple[str, ...]
    fault: Fault


@dataclass(frozen=True)
class PartitionHome:
    """The home's network fails: the link server cuts every remote region's link for a while."""

    fault: Fault


@dataclass(frozen=True)
class RestartRemote:
    """Ask a remote learner's region agent to restart this incarnation (the home found it hung)."""

    learner: str
    region: str
    incarnation: int
    cause: str


@dataclass(frozen=True)
class KillSyncer:
    syncer_shard: int = 0     # which syncer shard (syncer/shards.py); the others keep merging
    fault: Optional[Fault] = None   # the chaos fault that kills it


@dataclass(frozen=True)
class StartSyncer:
    """Start syncer shard ``shard`` at ``epoch`` (fencing: pushes to an earlier epoch are
    refused), restored from its newest snapshot and journal."""

    shard: int
    epoch: int
    restore: bool = True


# Every action type ``step`` can return: each body (controller.py, orchestrator/region_agent.py, inprocess.py)
# has a handler for each (seam.py builds its table at its start; tests/unit/test_seam.py checks
# that every class of this section is here and that every body handles all of them).
ACTIONS: tuple[type, ...] = (Launch, LaunchSpare, KillSpare, HurrySpare, Kill, Forget,
                             DrainLearner,
                             PauseLearner, Slowdown, Hang, LinkFault, PartitionHome,
                             RestartRemote, KillSyncer, StartSyncer)
Action = Union[Launch, LaunchSpare, KillSpare, HurrySpare, Kill, Forget, DrainLearner, PauseLearner, Slowdown,
               Hang, LinkFault, PartitionHome, RestartRemote, KillSyncer, StartSyncer]


@dataclass(frozen=True)
class Transition:
    """A named change, also the job's event (``name`` is the event kind in events.jsonl)."""

    name: str
    learner: Optional[str] = None
    fields: Mapping = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    fleet: FleetState
    actions: tuple
    transitions: tuple


class CommandError(ValueError):
    """An operator command that cannot be carried out; the message says why."""


# -- the step -------------------------------------------------------------------------------------
def step(fleet: FleetState, observations: Sequence[Observation], now_s: float) -> Step:
    """Applies ``observations`` in order, then the timers (health, due restarts, quorum floor).

    Raises:
      CommandError: a Scale, Drain or Chaos observation that is not possible (an unknown region,
        above max_learners, below quorum, a learner that is not running). Nothing is applied then:
        validate commands with ``check_command`` before queueing them next to others.
    """
    m = _Machine(fleet, now_s)
    for obs in observations:
        m.observe(obs)
    m.timers()
    return Step(m.fleet, tuple(m.actions), tuple(m.transitions))


def check_command(fleet: FleetState, command: Observation) -> None:
    """Raises CommandError when ``command`` would be refused by ``step`` (no state changes)."""
    _Machine(fleet, 0.0).observe(command)


class _Machine:
    """One step's working state: the fleet so far, and the actions and transitions produced."""

    def __init__(self, fleet: FleetState, now_s: float):
        self.fleet, self.now = fleet, now_s
        self.settings = fleet.settings
        self.actions: list = []
        self.transitions: list[Transition] = []

    # -- helpers ----------------------------------------------------------------------------------
    def put(self, slot: Slot) -> Slot:
        self.fleet = dataclasses.replace(self.fleet, slots={**self.fleet.slots, slot.learner: slot})
        return slot

    def set(self, **changes) -> None:
        self.fleet = dataclasses.replace(self.fleet, **changes)

    def note(self, name: str, learner: Optional[str] = None, **fields) -> None:
        self.transitions.append(Transition(name, learner, fields))

    def move(self, slot: Slot, state: SlotState, name: str, **fields) -> Slot:
        self.note(name, slot.learner, **{"from": slot.state.value, "to": state.value, **fields})
        return self.put(dataclasses.replace(slot, state=state))

    def num_shards(self) -> int:
        if self.settings.num_shards is not None:
            return self.settings.num_shards
        total = sum(p.learners for p in self.settings.regions.values())
        return max(total, len(self.fleet.slots), 1)

    def peer_for(self, learner: str, region: str) -> Optional[str]:
        """The one peer-choice policy: a training learner of the same region, else any; only
        one that has adopted the global parameters since it (re)started (``Slot.adopted``). A
        learner that has not holds a fresh or borrowed inner state that never stepped against
        the cluster's Θ: copying it would hand a restart nothing better than its own fresh one.
        None: the restart starts a fresh inner state."""
        training = [s for s in self.fleet.slots.values()
                    if s.state == SlotState.TRAINING and s.learner != learner and s.adopted]
        same = [s for s in training if s.region == region]
        chosen = (same or training or [None])[0]
        return chosen.learner if chosen else None

    def current(self, learner: str, incarnation: int) -> Optional[Slot]:
        slot = self.fleet.slots.get(learner)
        return slot if slot is not None and slot.incarnation == incarnation else None

    # -- observations -----------------------------------------------------------------------------
    def observe(self, obs: Observation) -> None:
        handler = getattr(self, "on_" + type(obs).__name__.lower())
        handler(obs)

    def on_beat(self, beat: Beat) -> None:
        slot = self.current(beat.learner, beat.incarnation)
        if slot is None or slot.state in GONE or slot.state == SlotState.RESTARTING:
            return  # a beat from an incarnation already buried
        # Only this incarnation's own pace (launch resets it): a new incarnation is never judged
        # by its predecessor's step time.
        slot = self.put(dataclasses.replace(
            slot, last_beat_s=self.now,
            step_time_s=beat.step_time_s if beat.step_time_s is not None else slot.step_time_s,
            node_id=beat.node_id or slot.node_id, adopted=slot.adopted or beat.adopted))
        if slot.state == SlotState.AWAITING_PLACEMENT and not beat.training:
            self.placed(slot)   # it runs: its start-up is timed from now
            return
        if slot.state in (SlotState.STARTING, SlotState.AWAITING_PLACEMENT) and beat.training:
            recovery = dict(slot.recovery or ())
            if slot.recovery is not None and beat.ready_at_s is not None:
                recovery.setdefault("restore_done_s", beat.ready_at_s)
            paused = self.fleet.paused_reason is not None
            slot = self.put(dataclasses.replace(slot, recovery=tuple(recovery.items())
                                                if slot.recovery is not None else None,
                                                training_since_s=self.now, paused_s=0.0,
                                                paused_since_s=self.now if paused else None))
            self.move(slot, SlotState.PAUSED if paused else SlotState.TRAINING, "learner_ready",
                      incarnation=slot.incarnation)
            self.clear_mark(slot.node_id, slot.region, f"{slot.learner} started there")
            # A mark of no known node (an in-process learner, an older state file) is the
            # region's: a good start anywhere in it is the proof it is fixed.
            self.clear_mark(UNKNOWN_NODE, slot.region, f"{slot.learner} started in its region")
            if paused:  # a learner that came back joins the pause
                self.actions.append(PauseLearner(slot.learner, True))

    def on_runended(self, obs: RunEnded) -> None:
        slot = self.current(obs.learner, obs.incarnation)
        if slot is None or slot.state not in LIVE:
            return
        if self.fleet.stopping:
            self.retire(slot, "stopped")
            return
        if obs.error is None and slot.preempted_s is not None:
            self.hand_over(slot)   # drained off a node announced for preemption
            return
        if obs.error is None and slot.state == SlotState.DRAINING:
            self.retire(slot, "drained")
            return
        if slot.preempted_s is not None:   # its node went before it was out: as any preemption
            self.fail(slot, Cause.PREEMPTION, detail=obs.error[:300])
            return
        if slot.state == SlotState.DRAINING:  # it died on its way out: it leaves all the same
            self.retire(slot, f"drained (ended with: {obs.error or 'clean exit'})"[:300])
            return
        if is_device_mismatch(obs.error):
            self.set_misconfigured(mismatch_node(obs.error) or slot.node_id, slot.region,
                                   obs.error)
            if self.fleet.blocked(slot.region) is None:
                # Another alive node of its region is unmarked: it may pass there. A crash
                # (budget, backoff): Ray may place it on the marked node again.
                # No crash loop's: the node id in its line is hex (alike in every signature), and
                # a mismatch is the node's, not the learner's at its resume step.
                self.fail(slot, Cause.CRASH, detail=("another node of its region is not marked: "
                                                     f"restarted as a crash; {obs.error}")[:300])
                return
            cause = Cause.CONFIG
        elif obs.error is None or obs.crashed:
            cause = Cause.CRASH
        else:
            cause = death_cause(slot.node_id, self.fleet.alive_nodes or frozenset({slot.node_id}),
                                obs.preempted, obs.error)
        # Only the learner's own raised error can show a crash loop: a dead process's line is
        # Ray's (alike for an OOM kill, a segfault and a SIGKILL from outside); the budget ends
        # those.
        self.fail(slot, cause, detail=(obs.error or "run returned")[:300],
                  error=(obs.error if obs.crashed else None))

    def on_quarantine(self, obs: Quarantine) -> None:
        slot = self.current(obs.learner, obs.incarnation)
        if slot is None or slot.state not in LIVE or self.fleet.stopping:
            return
        self.note("learner_quarantined", slot.learner, incarnation=slot.incarnation,
                  detail=obs.detail[:300])
        if slot.remote:
            # Its agent hears of the quarantine over the link and restarts it, counting it in
            # the learner's one budget (mirrored here from its reports): none is spent here.
            self.actions.append(Forget(slot.learner, slot.incarnation, Cause.QUARANTINE.value))
            self.note("learner_failed", slot.learner, cause=Cause.QUARANTINE.value,
                      incarnation=slot.incarnation, detail=obs.detail[:300], remote=True,
                      **{"from": slot.state.value})
            self.move(slot, SlotState.RESTARTING, "learner_restart_scheduled",
                      cause=Cause.QUARANTINE.value, message="its region agent restarts it",
                      delay_s=0.0)
            return
        self.fail(slot, Cause.QUARANTINE, detail=obs.detail[:300])

    def on_launchfailed(self, obs: LaunchFailed) -> None:
        slot = self.current(obs.learner, obs.incarnation)
        if slot is None or slot.state not in (SlotState.STARTING, SlotState.AWAITING_PLACEMENT):
            return
        if not slot.restart_postponed:
            self.note("learner_restart_postponed", slot.learner, reason=obs.reason[:300])
        # The same incarnation number is launched again (nothing of it ever ran).
        self.put(dataclasses.replace(
            slot, state=SlotState.RESTARTING, restart_postponed=True,
            restart_at_s=self.now + self.settings.restart_retry_s))

    def on_placed(self, obs: Placed) -> None:
        slot = self.current(obs.learner, obs.incarnation)
        if slot is not None and slot.state == SlotState.AWAITING_PLACEMENT:
            self.placed(slot, obs.node_id)

    def placed(self, slot: Slot, node_id: Optional[str] = None) -> None:
        """A handed-over incarnation got its place: it starts now, and the start-up timeout
        (a hang) counts from here, not from its launch."""
        self.move(dataclasses.replace(slot, launched_s=self.now, node_id=node_id or slot.node_id),
                  SlotState.STARTING, "learner_placed", incarnation=slot.incarnation,
                  waited_s=round(self.now - _first(slot.launched_s, self.now), 3))

    def on_cluster(self, obs: Cluster) -> None:
        previous = dict(self.fleet.capacity)
        self.set(capacity=dict(obs.capacity),
                 alive_nodes=obs.alive_nodes if obs.alive_nodes is not None
                 else self.fleet.alive_nodes,
                 region_nodes=({r: frozenset(n) for r, n in obs.region_nodes.items()}
                               if obs.region_nodes is not None else self.fleet.region_nodes))
        for region, plan in self.settings.regions.items():
            if plan.remote:  # its nodes are in its own cluster; its agent follows them
                continue
            capacity = obs.capacity.get(region, 0.0)
            target = grown_target(capacity, previous.get(region), self.fleet.targets[region],
                                  plan.max_learners)
            if target is not None:
                self.note("region_grew", None, region=region, capacity=capacity, target=target)
                self.scale_to(region, target, "node joined")
        if obs.draining is not None:
            self.nodes_draining(obs.draining)

    def nodes_draining(self, draining: Mapping[str, Optional[float]]) -> None:
        """A planned preemption: the learners on a draining node drain and restart elsewhere
        (``hand_over``), its spares end. Swept on every report: a learner whose node became
        known after the notice (its first beat) follows."""
        new = {n: d for n, d in draining.items() if n not in self.fleet.draining_nodes}
        self.set(draining_nodes=dict(draining))
        if self.fleet.stopping:
            return
        for node, deadline in draining.items():
            victims = [s for s in self.fleet.slots.values() if not s.remote and s.node_id == node
                       and s.state in (SlotState.STARTING, SlotState.TRAINING, SlotState.PAUSED)]
            spares = [x for x in self.fleet.spares.values() if x.node_id == node]
            left = None if deadline is None else round(deadline - self.now, 1)
            if node in new:
                self.note("node_draining", None, node=node, deadline_in_s=left,
                          learners=[s.learner for s in victims], spares=[x.name for x in spares])
            for slot in victims:
                slot = self.put(dataclasses.replace(slot, preempted_s=self.now,
                                                    draining_since_s=self.now))
                self.move(slot, SlotState.DRAINING, "learner_draining",
                          cause=Cause.PREEMPTED_PLANNED.value, node=node, deadline_in_s=left)
                self.actions.append(DrainLearner(slot.learner))
            for spare in spares:
                self.drop_spare(spare, "its node is draining")

    def on_applied(self, obs: Applied) -> None:
        self.set(applied_steps={k: (inc, step) for k, (inc, step, _) in obs.entries.items()})
        for learner, (incarnation, _, tokens) in obs.entries.items():
            slot = self.fleet.slots.get(learner)
            if (slot is None or slot.recovery is None or slot.incarnation != incarnation
                    or slot.state not in LIVE or tokens <= 0
                    or "restarted_s" not in dict(slot.recovery)):
                continue
            rec = dict(slot.recovery)
            rec["first_contribution_s"] = self.now
            self.put(dataclasses.replace(slot, recovery=None))
            self.note("learner_recovered", learner, **recovery_phases(rec))

    def on_spareready(self, obs: SpareReady) -> None:
        spare = self.fleet.spares.get(obs.name)
        if spare is None or spare.state != SpareState.STARTING:
            return
        spare = dataclasses.replace(spare, state=SpareState.READY, ready_s=self.now,
                                    node_id=obs.node_id)
        self.put_spare(spare)
        self.note("spare_ready", None, spare=spare.name, region=spare.region,
                  prepare_s=self.now - spare.launched_s)
        self.set(spare_backoff={r: b for r, b in self.fleet.spare_backoff.items()
                                if r != spare.region})
        self.clear_mark(spare.node_id, spare.region, f"{spare.name} passed its check there")
        self.clear_mark(UNKNOWN_NODE, spare.region, f"{spare.name} passed its check in its region")
        if spare.node_id is not None and spare.node_id in self.fleet.draining_nodes:
            self.drop_spare(spare, "its node is draining")

    def on_spareended(self, obs: SpareEnded) -> None:
        spare = self.fleet.spares.get(obs.name)
        if spare is None:
            return  # promoted already (its run is a learner's now) or already buried
        if is_device_mismatch(obs.error):   # a new spare there would fail the same way
            self.set_misconfigured(mismatch_node(obs.error) or spare.node_id, spare.region,
                                   obs.error)
        retry_s = self.spare_failed(spare, obs.error)
        self.drop_spare(spare, obs.error or "ended", next_spare_in_s=retry_s)

    def on_scale(self, obs: Scale) -> None:
        plan = self.settings.regions.get(obs.region)
        if plan is None:
            raise CommandError(f"unknown region {obs.region!r}; regions are "
                               f"{sorted(self.settings.regions)}")
        if plan.remote:
            raise CommandError(f"region {obs.region} runs in its own Ray cluster: scale it there "
                               "(islands scale with that cluster's address)")
        if obs.n < 0:
            raise CommandError(f"learner count must be >= 0, got {obs.n}")
        blocked = self.fleet.blocked(obs.region)
        if blocked is not None and obs.n > len(
                [s for s in self.fleet.in_region(obs.region) if s.state not in GONE]):
            raise CommandError(f"region {obs.region}: its learners cannot train there: "
                               f"{blocked} (every alive node of the region is marked; clear a "
                               "fixed node with islands clear-misconfigured)")
        if obs.n > plan.max_learners:
            raise CommandError(f"region {obs.region}: {obs.n} exceeds max_learners "
                               f"({plan.max_learners})")
        other = sum(1 for s in self.fleet.slots.values()
                    if s.region != obs.region and s.state not in GONE)
        if other + obs.n < self.settings.min_learners:
            raise CommandError(f"scaling {obs.region} to {obs.n} leaves {other + obs.n} "
                               f"learners, below quorum {self.settings.min_learners}")
        self.scale_to(obs.region, obs.n, obs.reason)

    def on_drain(self, obs: Drain) -> None:
        slot = self.fleet.slots.get(obs.learner)
        if slot is None or slot.state in GONE or slot.state == SlotState.DRAINING:
            active = sorted(s.learner for s in self.fleet.slots.values()
                            if s.state not in GONE and s.state != SlotState.DRAINING)
            raise CommandError(f"no active learner {obs.learner!r}; active are {active}")
        self.drain(slot)
        targets = dict(self.fleet.targets)
        targets[slot.region] = max(0, targets[slot.region] - 1)
        self.set(targets=targets)

    def on_chaos(self, obs: Chaos) -> None:
        fault, kind = obs.fault, obs.fault.kind
        if kind in (FaultKind.KILL, FaultKind.EXIT):
            slot = self.fleet.slots.get(fault.target)
            if slot is None or slot.state not in LIVE:
                raise CommandError(f"no running learner {fault.target!r}")
            if slot.remote:
                raise CommandError(f"{fault.target} runs in its region's own Ray cluster: kill "
                                   "it there (islands chaos kill with that cluster's address)")
            mode = obs.mode if kind == FaultKind.KILL else "exit"
            self.note("chaos", fault.target, action="kill", target=fault.target, mode=mode,
                      repair_s=fault.duration_s)
            self.kill(slot, mode, fault)
        elif kind == FaultKind.REGION_LOSS:
            self.region_known(fault.target)
            victims = [s for s in self.fleet.in_region(fault.target) if s.state in LIVE]
            # Its warm spares ran on the same nodes: they go with it, and none starts there
            # again before the repair (a spare surviving the loss would flatter goodput).
            spares = [x for x in self.fleet.spares.values() if x.region == fault.target]
            self.note("chaos", None, action="region_loss", target=fault.target,
                      repair_s=fault.duration_s, learners=[s.learner for s in victims],
                      spares=[x.name for x in spares])
            for slot in victims:
                self.kill(slot, "ray_kill", fault)
            for spare in spares:
                self.drop_spare(spare, "its region was lost")
            self.set(lost_regions={**self.fleet.lost_regions,
                                   fault.target: self.now + fault.duration_s})
        elif kind == FaultKind.SLOWDOWN:
            targets = self.running_targets(fault.target)
            self.note("chaos", None, action="slowdown", target=fault.target, factor=fault.factor,
                      duration_s=fault.duration_s)
            self.actions.append(Slowdown(tuple(s.learner for s in targets), fault))
        elif kind == FaultKind.PARTITION and fault.target == HOME_TARGET:
            remote = sorted(name for name, plan in self.settings.regions.items() if plan.remote)
            if not remote:
                raise CommandError("a home partition cuts the link to the remote regions, and "
                                   "this job has none here (run it in the home cluster of a "
                                   "job with remote regions)")
            self.note("chaos", None, action="partition", target=HOME_TARGET,
                      duration_s=fault.duration_s, regions=remote)
            self.actions.append(PartitionHome(fault))
        elif kind in (FaultKind.NETWORK, FaultKind.PARTITION):
            self.region_known(fault.target)
            self.note("chaos", None, action=kind.value, target=fault.target,
                      duration_s=fault.duration_s, extra_latency_ms=fault.extra_latency_ms,
                      bandwidth_gbps=fault.bandwidth_gbps, loss_rate=fault.loss_rate)
            self.set(link_faults=self.fleet.link_faults + (fault,))
            learners = tuple(s.learner for s in self.fleet.in_region(fault.target)
                             if s.state in LIVE)
            self.actions.append(LinkFault(learners, fault))
        elif kind == FaultKind.HANG:
            slot = self.fleet.slots.get(fault.target)
            if slot is None or slot.state not in LIVE:
                raise CommandError(f"no running learner {fault.target!r}")
            self.note("chaos", fault.target, action="hang", target=fault.target,
                      duration_s=fault.duration_s)
            self.put(dataclasses.replace(slot, injected=True))
            self.actions.append(Hang(fault.target, fault.duration_s))
        elif kind == FaultKind.SYNCER_KILL:
            shard = fault.syncer_shard
            if shard >= self.settings.syncer_shards:
                raise CommandError(f"syncer shard {shard} does not exist (syncer.shards = "
                                   f"{self.settings.syncer_shards})")
            self.note("chaos", None, action="kill", target=fault.target, mode="ray_kill")
            self.actions.append(KillSyncer(shard, fault))
        else:  # pragma: no cover - FaultKind is closed
            raise CommandError(f"unknown fault kind {kind!r}")

    def on_remotereport(self, r: RemoteReport) -> None:
        plan = self.settings.regions.get(r.region)
        if plan is None or not plan.remote:
            return  # not a region this job expects over the link (the server refuses those)
        try:
            state = SlotState(r.state)
        except ValueError:
            return
        if r.agent_alive:
            self.set(agents_seen={**self.fleet.agents_seen, r.region: self.now})
        slot = self.fleet.slots.get(r.learner)
        if slot is None:  # scaled up in its own cluster
            index = int(r.learner.rsplit(":", 1)[1]) if r.learner.rsplit(":", 1)[1].isdigit() else 0
            slot = self.put(Slot(learner=r.learner, region=r.region, index=index, shard=r.shard,
                                 remote=True, incarnation=r.incarnation))
            self.set(next_index={**self.fleet.next_index,
                                 r.region: max(self.fleet.next_index[r.region], index + 1)})
        if not slot.remote or slot.state in GONE:
            return
        new_incarnation = r.incarnation != slot.incarnation
        if (slot.state in HOME_FAILED and not new_incarnation and state in LIVE
                and not (r.beat and r.agent_alive)):
            return  # the incarnation this home found hung: only a heartbeat brings it back
        if slot.state in LIVE and (new_incarnation or state not in LIVE):
            # The incarnation this fleet knew ended in the region: settle its books here.
            cause = r.last_cause or ("stopped" if self.fleet.stopping else "crash")
            self.actions.append(Forget(slot.learner, slot.incarnation, cause))
            # (a handover off a draining node of its cluster failed nothing)
            if state not in GONE and cause not in ("drained", DRAIN_TIMEOUT):
                self.note("learner_failed", slot.learner, cause=cause,
                          incarnation=slot.incarnation, detail="reported by its region agent",
                          **{"from": slot.state.value})
        # Its own heartbeats, not its agent's reports, keep it alive here (check_health).
        slot = self.put(dataclasses.replace(
            slot, incarnation=r.incarnation, shard=r.shard,
            adopted=slot.adopted and not new_incarnation,
            last_beat_s=self.now if r.beat else slot.last_beat_s,
            step_time_s=r.step_time_s or slot.step_time_s,
            # One restart budget per learner: its agent's (the home never counts its own).
            restarts=r.restarts if r.restarts is not None else slot.restarts))
        if state in LIVE and (new_incarnation or slot.state not in LIVE):
            first = slot.launched_s is None
            slot = self.put(dataclasses.replace(slot, launched_s=self.now,
                                                last_beat_s=self.now if r.beat else None))
            self.note("learner_launched" if first else "learner_restarted", slot.learner,
                      incarnation=r.incarnation, remote=True)
        if state in GONE:
            self.move(slot, state, "learner_retired", reason=r.last_cause or "left its region")
        elif state != slot.state:
            self.move(slot, state, "learner_state", remote=True)

    def on_unhealthy(self, obs: Unhealthy) -> None:
        slot = self.current(obs.learner, obs.incarnation)
        if slot is None or slot.state not in LIVE or self.fleet.stopping:
            return  # restarted or gone already (its own check may have come first)
        self.note("learner_unhealthy", slot.learner, cause=obs.cause, origin="home")
        self.fail(slot, Cause(obs.cause), detail=obs.detail[:300] or f"{obs.cause} seen at home")

    def on_hangcommand(self, obs: HangCommand) -> None:
        slot = self.fleet.slots.get(obs.learner)
        if slot is None or slot.state not in LIVE:
            raise CommandError(f"no running learner {obs.learner!r}")
        self.note("chaos", obs.learner, action="hang", target=obs.learner,
                  duration_s=obs.duration_s)
        self.put(dataclasses.replace(slot, injected=True))
        self.actions.append(Hang(obs.learner, obs.duration_s))

    def on_pausejob(self, obs: PauseJob) -> None:
        if obs.paused == self.fleet.operator_paused:
            raise CommandError("the job is already " + ("paused" if obs.paused else
                                                        "running (not paused by an operator)"))
        if self.fleet.stopping:
            raise CommandError("the job is stopping")
        self.set(operator_paused=obs.paused)
        self.note("job_pause_requested" if obs.paused else "job_resume_requested", None,
                  origin=obs.origin)

    def on_syncerended(self, obs: SyncerEnded) -> None:
        if self.fleet.stopping:
            return
        shard = self.fleet.syncer_shards.get(obs.shard, SyncerShard(obs.shard))
        if shard.state == ShardState.RESTARTING:
            return
        epoch = max(shard.epoch, obs.epoch)
        self.put_shard(dataclasses.replace(shard, state=ShardState.RESTARTING, epoch=epoch,
                                           restarts=shard.restarts + 1))
        where = {"shard": obs.shard} if len(self.fleet.syncer_shards) > 1 else {}
        self.note("syncer_failed", None, epoch=epoch, **where)
        self.actions.append(StartSyncer(obs.shard, epoch + 1, restore=True))

    def on_syncerstarted(self, obs: SyncerStarted) -> None:
        shard = self.fleet.syncer_shards.get(obs.shard, SyncerShard(obs.shard))
        self.put_shard(dataclasses.replace(shard, state=ShardState.UP, epoch=obs.epoch))

    def put_shard(self, shard: SyncerShard) -> None:
        self.set(syncer_shards={**self.fleet.syncer_shards, shard.shard: shard})

    def on_homepause(self, obs: HomePause) -> None:
        if obs.reason != self.fleet.home_paused:
            self.set(home_paused=obs.reason)

    def on_clearmisconfigured(self, obs: ClearMisconfigured) -> None:
        marked = sorted(self.fleet.misconfigured)
        if obs.node is not None and obs.node not in self.fleet.misconfigured:
            raise CommandError(f"node {obs.node!r} is not marked misconfigured; marked are "
                               f"{marked or 'none'}")
        for node in [obs.node] if obs.node is not None else marked:
            for region in sorted(self.fleet.misconfigured.get(node, {})):
                self.clear_mark(node, region, f"cleared by {obs.origin}", origin=obs.origin)

    def on_stop(self, _obs: Stop) -> None:
        self.set(stopping=True)
        for spare in list(self.fleet.spares.values()):
            self.drop_spare(spare, "stopped")
        for slot in list(self.fleet.slots.values()):
            if slot.state == SlotState.AWAITING_PLACEMENT:   # never placed: called off
                self.actions.append(Kill(slot.learner, slot.incarnation))
            if slot.state in (SlotState.RESTARTING, SlotState.PENDING,
                              SlotState.AWAITING_PLACEMENT):
                self.retire(slot, "stopped")

    def region_known(self, region: str) -> None:
        if region not in self.settings.regions:
            raise CommandError(f"unknown region {region!r}; regions are "
                               f"{sorted(self.settings.regions)}")

    def running_targets(self, target: str) -> list[Slot]:
        slot = self.fleet.slots.get(target)
        if slot is not None:
            if slot.state not in LIVE:
                raise CommandError(f"no running learner {target!r}")
            return [slot]
        if target in self.settings.regions:
            return [s for s in self.fleet.in_region(target) if s.state == SlotState.TRAINING]
        raise CommandError(f"no running learner {target!r}")

    # -- spares -----------------------------------------------------------------------------------
    def put_spare(self, spare: Spare) -> None:
        self.set(spares={**self.fleet.spares, spare.name: spare})

    def spare_failed(self, spare: Spare, error: str) -> float:
        """A spare of its region ended before it was promoted (it died, raised, or never got
        ready): the region's next spare waits the restart policy's backoff over its failures
        in a row. A backend that did not start on one node more times in a row than a
        learner's crash budget allows marks the node (a learner would have been retired by
        then; a spare has no budget). Returns the wait in seconds."""
        policy = self.settings.policy
        before = self.fleet.spare_backoff.get(spare.region, SpareBackoff())
        failed = before.failed + 1
        delay = min(policy.backoff_initial_s * policy.backoff_multiplier ** (failed - 1),
                    policy.backoff_max_s)
        node = mismatch_node(error) if is_backend_unavailable(error) else None
        on_node = (before.on_node + 1 if node is not None and node == before.node
                   else int(node is not None))
        self.set(spare_backoff={**self.fleet.spare_backoff, spare.region: SpareBackoff(
            failed, self.now + delay, node, on_node)})
        budget = policy.max_crash_restarts
        if node is not None and budget is not None and on_node > budget:
            self.set_misconfigured(node, spare.region, error)
        return round(delay, 3)

    def set_misconfigured(self, node: Optional[str], region: str, error: str) -> None:
        """A learner of ``region`` failed its device check on ``node``: the node is marked for
        the region (once; a node may carry several regions, each with its own devices)."""
        node = node or UNKNOWN_NODE
        marks = dict(self.fleet.misconfigured.get(node, {}))
        if region in marks:
            return
        start = error.find(DEVICE_MISMATCH_MARK)
        marks[region] = error[max(0, start if start >= 0
                                  else error.find(DEVICE_BACKEND_MARK)):][:500]
        self.set(misconfigured={**self.fleet.misconfigured, node: marks})
        self.note("node_misconfigured", None, node=node, region=region, message=marks[region],
                  region_blocked=self.fleet.blocked(region) is not None)

    def alive_mark(self, region: str) -> bool:
        """Whether a node that may still run ``region``'s processes is marked for it: an alive
        one (a node gone, e.g. replaced by an autoscaler, holds none), an unknown one, or any
        while the alive nodes are not known."""
        alive = self.fleet.alive_nodes
        return any(region in regions and (alive is None or node == UNKNOWN_NODE or node in alive)
                   for node, regions in self.fleet.misconfigured.items())

    def clear_mark(self, node: Optional[str], region: str, reason: str,
                   origin: str = "fleet") -> None:
        """``node`` is no longer marked for ``region`` (a good start there, or an operator)."""
        marks = dict(self.fleet.misconfigured.get(node, {})) if node is not None else {}
        if region not in marks:
            return
        del marks[region]
        rest = {n: m for n, m in self.fleet.misconfigured.items() if n != node}
        self.set(misconfigured={**rest, **({node: marks} if marks else {})})
        self.note("node_misconfigured_cleared", None, node=node, region=region, reason=reason,
                  origin=origin)
        backoff = self.fleet.spare_backoff.get(region)
        if backoff is not None and backoff.node == node:   # its spares may start there again
            self.set(spare_backoff={r: b for r, b in self.fleet.spare_backoff.items()
                                    if r != region})

    def drop_spare(self, spare: Spare, reason: str, **fields) -> None:
        self.set(spares={k: v for k, v in self.fleet.spares.items() if k != spare.name})
        self.actions.append(KillSpare(spare.name))
        self.note("spare_ended", None, spare=spare.name, region=spare.region, reason=reason[:300],
                  **fields)

    def region_lost(self, region: str) -> bool:
        """``region`` was lost (a region loss) and its repair is not over: nothing of it runs."""
        return self.now < self.fleet.lost_regions.get(region, -math.inf)

    def ready_spare(self, region: str, learner: Optional[str] = None) -> Optional[Spare]:
        """A READY spare of ``region`` for ``learner``: the one prestarted for it first, else
        the region's oldest (never one prestarted for another learner)."""
        ready = [x for x in self.fleet.spares.values()
                 if x.region == region and x.state == SpareState.READY
                 and x.for_learner in (None, learner)
                 and x.node_id not in self.fleet.draining_nodes]
        return (min(ready, key=lambda x: (x.for_learner is None, x.ready_s or 0.0))
                if ready else None)

    def reserved(self, learner: str) -> list[Spare]:
        return [x for x in self.fleet.spares.values() if x.for_learner == learner]

    def prestart(self, slot: Slot) -> None:
        """Starts the process of ``slot``'s restart now, prepared as a spare reserved for it
        (at low priority, as any spare) while the restart waits: when it is due the start
        costs the learner a promotion. Not where a spare of the region already prepares for
        it (``spare_waiters``) or one is prestarted for it."""
        plan = self.settings.regions.get(slot.region)
        if (plan is None or not plan.prestart or slot.remote or self.fleet.stopping
                or self.fleet.blocked(slot.region) is not None or self.reserved(slot.learner)
                or self.region_lost(slot.region)):
            return
        preparing = sum(1 for x in self.fleet.spares.values() if x.region == slot.region
                        and x.for_learner is None and x.state == SpareState.STARTING)
        others = sum(1 for x in self.fleet.slots.values()
                     if x.region == slot.region and x.learner != slot.learner
                     and x.state == SlotState.RESTARTING and not self.reserved(x.learner))
        if self.settings.spare_wait_s > 0 and preparing > others:
            return
        name = f"spare:{slot.region}:{self.fleet.next_spare}"
        self.set(next_spare=self.fleet.next_spare + 1)
        self.put_spare(Spare(name, slot.region, launched_s=self.now, for_learner=slot.learner))
        self.actions.append(LaunchSpare(name, slot.region))
        self.note("spare_launched", slot.learner, spare=name, region=slot.region)

    def release_reserved(self, learner: str) -> None:
        """``learner`` started without the spare prestarted for it (or left): the spare joins
        the region's spares while they are short of ``spares``, else it ends (it holds a
        learner's resources, which a new process of the region may need)."""
        for spare in self.reserved(learner):
            plan = self.settings.regions[spare.region]
            have = sum(1 for x in self.fleet.spares.values()
                       if x.region == spare.region and x.for_learner is None)
            if have < plan.spares and not self.fleet.stopping:
                self.put_spare(dataclasses.replace(spare, for_learner=None))
            else:
                self.drop_spare(spare, f"{learner} started without it")

    def maintain_spares(self) -> None:
        """Keeps each region's spares: one that does not get ready within the start-up timeout
        is replaced; a missing one is started one at a time, and not while a promotion or a new
        learner's start is under way (a spare competes with it for CPU and the cache)."""
        s = self.settings
        for spare in list(self.fleet.spares.values()):
            if (spare.state == SpareState.STARTING
                    and self.now - spare.launched_s > s.startup_timeout_s):
                retry_s = self.spare_failed(spare, "")
                self.drop_spare(spare, f"not ready after {s.startup_timeout_s:g}s",
                                next_spare_in_s=retry_s)
        # Low priority: never while a promotion is under way (a promoted learner not training
        # yet), nor while new learners start (the job's start-up, a scale-up). A restart in a
        # new process does not wait for it: under a burst of failures that is when spares pay.
        if any(x.state == SlotState.STARTING and not x.remote
               and (x.actor is not None or x.incarnation == 0)
               for x in self.fleet.slots.values()):
            return
        for region, plan in self.settings.regions.items():
            # Not while an alive node of it is marked: a spare has no budget, and one placed on
            # the marked node again and again would start processes forever.
            backoff = self.fleet.spare_backoff.get(region)
            if (plan.remote or plan.spares <= 0 or self.alive_mark(region)
                    or self.region_lost(region)
                    or (backoff is not None and self.now < backoff.not_before_s)):
                continue
            have = sum(1 for x in self.fleet.spares.values()
                       if x.region == region and x.for_learner is None)
            if have < plan.spares:  # one at a time: low priority
                name = f"spare:{region}:{self.fleet.next_spare}"
                self.set(next_spare=self.fleet.next_spare + 1)
                self.put_spare(Spare(name, region, launched_s=self.now))
                self.actions.append(LaunchSpare(name, region))
                self.note("spare_launched", None, spare=name, region=region)
                return

    # -- decisions --------------------------------------------------------------------------------
    def kill(self, slot: Slot, mode: str, fault: Fault) -> None:
        """A chaos kill: the failure time is now; it may restart no earlier than the repair."""
        self.put(dataclasses.replace(slot, killed_at_s=self.now,
                                     repair_until_s=self.now + fault.duration_s))
        self.actions.append(Kill(slot.learner, slot.incarnation, mode, fault=fault))

    def fail(self, slot: Slot, cause: Cause, detail: str = "",
             error: Optional[str] = None) -> None:
        """Buries the incarnation, then restarts (after the policy's backoff) or gives up.
        ``error``: what a crashed incarnation died of, its own error, for crash-loop detection;
        None (a hang, a start-up timeout, a device mismatch, a quarantine) never counts there:
        their texts are the fleet's, alike whatever happened."""
        died_s = _first(slot.killed_at_s, slot.last_beat_s, slot.launched_s, self.now)
        self.actions += [Kill(slot.learner, slot.incarnation),
                         Forget(slot.learner, slot.incarnation, cause.value)]
        self.note("learner_failed", slot.learner, cause=cause.value, incarnation=slot.incarnation,
                  detail=detail, resume_step=slot.start_step, **{"from": slot.state.value})
        policy = self.settings.policy
        trained_s = slot.trained_seconds(died_s)   # paused time is not training time
        fresh = policy.healthy(trained_s)   # not a crash loop: earlier restarts count no more
        verdict = policy.decide(slot.learner, cause, {} if fresh else dict(slot.counted))
        chaos = slot.killed_at_s is not None or slot.injected
        slot = dataclasses.replace(slot, killed_at_s=None, training_since_s=None, paused_s=0.0,
                                   paused_since_s=None, injected=False)
        free = reintegration_failed(cause, slot.recovery)
        if not free and not chaos and cause == Cause.CRASH and error is not None:
            # A chaos kill is the job's own doing, not the learner's: never a crash loop.
            failure = (slot.start_step, error_signature(error))
            slot = self.put(dataclasses.replace(slot, failures=(slot.failures + (failure,))[-8:]))
            loop = crash_loop(slot.failures, policy.crash_loop_after,
                              policy.crash_loop_window_steps)
            if loop is not None:
                step, signature = loop
                text = (f"failed {policy.crash_loop_after} times at resume step {step} "
                        f"with: {signature}")
                slot = dataclasses.replace(slot, restart_at_s=None, recovery=None,
                                           crash_loop=text[:300])
                self.move(slot, SlotState.FAILED, "learner_retired",
                          reason=f"retire {slot.learner}: crash loop: {text}"[:300],
                          cause=Cause.CRASH_LOOP.value, step=step, error=signature)
                self.release_reserved(slot.learner)
                return
        if free:
            verdict = dataclasses.replace(
                verdict, decision=RestartDecision.RESTART,
                message=f"restart {slot.learner} ({cause.value}): its restart after a "
                        f"{dict(slot.recovery)['cause']} had not reintegrated; not counted")
        if verdict.decision == RestartDecision.RETIRE:
            self.move(slot, SlotState.FAILED, "learner_retired", reason=verdict.message)
            return
        slot = slot if free else slot.with_restart(cause, fresh)
        # The repair of a lost machine starts when the loss is seen.
        repair_s = max(0.0, slot.repair_until_s - died_s)
        restart_at = self.now + max(verdict.delay_s, repair_s)
        spare = self.ready_spare(slot.region) if not slot.remote else None
        if spare is not None:
            # A warm spare is another process on its own devices: neither the backoff (which
            # slows a crash loop of new processes) nor the repair of the lost one applies.
            restart_at = self.now
            verdict = dataclasses.replace(verdict, message=f"{verdict.message}: spare "
                                          f"{spare.name} takes over now")
        slot = dataclasses.replace(
            slot, restart_at_s=restart_at, restart_postponed=False,
            recovery=(("failed_s", died_s), ("detected_s", self.now), ("cause", cause.value)))
        self.move(slot, SlotState.RESTARTING, "learner_restart_scheduled", cause=cause.value,
                  message=verdict.message, delay_s=restart_at - self.now)
        if spare is None and restart_at > self.now:
            self.prestart(self.fleet.slots[slot.learner])

    def retire(self, slot: Slot, reason: str, forgotten: bool = False) -> None:
        """``forgotten``: its Forget (with the books' reason) is sent already."""
        if slot.state in LIVE and not forgotten:
            self.actions.append(Forget(slot.learner, slot.incarnation, reason.split(" ")[0]))
        slot = dataclasses.replace(slot, restart_at_s=None, recovery=None, draining_since_s=None)
        self.move(slot, SlotState.RETIRED, "learner_retired", reason=reason)
        self.release_reserved(slot.learner)

    def hand_over(self, slot: Slot, forgotten: bool = False) -> None:
        """A learner drained off a node announced for preemption (all its in-flight pushes
        answered) restarts now, elsewhere: a ready spare of its region, else a new process
        (Ray places nothing new on a draining node). Nothing failed: no budget, no backoff.
        ``forgotten``: it was ended at the drain's deadline (its Forget is sent already)."""
        cause = Cause.PREEMPTED_PLANNED
        if not forgotten:
            self.actions.append(Forget(slot.learner, slot.incarnation, "drained"))
        since = slot.preempted_s if slot.preempted_s is not None else self.now
        slot = dataclasses.replace(
            slot.with_restart(cause), preempted_s=None, draining_since_s=None, killed_at_s=None,
            restart_at_s=self.now,
            restart_postponed=False,
            recovery=(("failed_s", since), ("detected_s", since), ("cause", cause.value)))
        self.move(slot, SlotState.RESTARTING, "learner_restart_scheduled", cause=cause.value,
                  message=f"{slot.learner} drained off a node being preempted: restarts "
                          "elsewhere now", delay_s=0.0)

    def drain(self, slot: Slot) -> None:
        if slot.state == SlotState.DRAINING:
            # Draining off a preempted node already: now it leaves for good (scaled down).
            self.put(dataclasses.replace(slot, preempted_s=None))
            return
        if slot.state == SlotState.AWAITING_PLACEMENT:
            # Never placed: nothing trained, nothing in flight; its request is called off.
            self.actions.append(Kill(slot.learner, slot.incarnation))
            self.retire(slot, "drained while awaiting placement")
            return
        if slot.state in (SlotState.RESTARTING, SlotState.PENDING):
            # No live incarnation: nothing is in flight, so it leaves now.
            self.retire(slot, "drained while restarting" if slot.state == SlotState.RESTARTING
                        else "drained before launch")
            return
        slot = self.put(dataclasses.replace(slot, draining_since_s=self.now))
        self.move(slot, SlotState.DRAINING, "learner_draining")
        self.actions.append(DrainLearner(slot.learner))

    def launch(self, slot: Slot, start_step: int, name: str = "learner_launched") -> None:
        # A peer's inner optimizer state reintegrates a learner that was training (its schedule
        # position, the optimizer's step count, is then close to its own resume step). A new
        # learner starts its own: copying a peer's count would run it at the peer's learning
        # rate while its pushes' steps (from 0) say warm-up, and the syncer's outlier bound,
        # which reads the schedule at those steps, refused its drifts until it was quarantined.
        peer = self.peer_for(slot.learner, slot.region) if slot.incarnation > 0 else None
        faults = tuple(f for f in self.fleet.link_faults
                       if f.target == slot.region and f.end_s > self.now)
        spare = self.ready_spare(slot.region, slot.learner) if not slot.remote else None
        if spare is not None:
            self.set(spares={k: v for k, v in self.fleet.spares.items() if k != spare.name})
        self.release_reserved(slot.learner)
        if spare is not None:
            self.note("spare_promoted", slot.learner, spare=spare.name,
                      incarnation=slot.incarnation, waited_s=self.now - (spare.ready_s or
                                                                         self.now))
        recovery = slot.recovery
        if recovery is not None:
            recovery = tuple({**dict(recovery), "restarted_s": self.now,
                              "incarnation": slot.incarnation}.items())
        # Where it runs is known from its first beat (not its predecessor's node).
        slot = dataclasses.replace(slot, launched_s=self.now, last_beat_s=None, step_time_s=None,
                                   slow_since_s=None, start_step=start_step, restart_at_s=None,
                                   recovery=recovery, actor=spare.name if spare else None,
                                   node_id=None, preempted_s=None, draining_since_s=None,
                                   adopted=False, injected=False)
        peer_actor = self.fleet.slots[peer].actor if peer is not None else None
        self.actions.append(Launch(slot.learner, slot.region, slot.incarnation, slot.shard,
                                   self.num_shards(), slot.speed_factor, peer, start_step,
                                   faults, spare.name if spare else None, peer_actor))
        # A handover in a new process may find no place (its node drains, nothing free
        # elsewhere): it waits for one, not timed as a start (a spare is in place already).
        handover = (spare is None and recovery is not None
                    and dict(recovery).get("cause") == Cause.PREEMPTED_PLANNED.value)
        self.move(slot, SlotState.AWAITING_PLACEMENT if handover else SlotState.STARTING, name,
                  incarnation=slot.incarnation, peer=peer, resume_step=start_step,
                  **({"spare": spare.name} if spare else {}))

    def scale_to(self, region: str, n: int, reason: str) -> None:
        # A learner draining off a preempted node comes back: it counts.
        active = sorted((s for s in self.fleet.in_region(region) if s.state not in GONE
                         and (s.state != SlotState.DRAINING or s.preempted_s is not None)),
                        key=lambda s: s.index)
        added, drained = [], []
        while len(active) + len(added) < n:
            fleet, slot = _new_slot(self.fleet, region)
            self.fleet = fleet
            self.put(slot)
            added.append(slot.learner)
        for slot in active[n:]:
            drained.append(slot.learner)
            self.drain(slot)
        self.set(targets={**self.fleet.targets, region: n})
        for learner in added:
            self.launch(self.fleet.slots[learner], 0)
        self.note("scaled", None, region=region, target=n, added=added, drained=drained,
                  reason=reason)

    # -- timers -----------------------------------------------------------------------------------
    def timers(self) -> None:
        self.check_drains()
        if not self.fleet.stopping:
            self.launch_pending()
            self.check_health()
            self.start_due_restarts()
            self.maintain_spares()
        self.quorum_floor()

    def check_drains(self) -> None:
        """Every drain ends: a learner still draining ``drain_timeout_s`` after its drain began
        (wedged, or waiting on an answer that never comes) is ended, and what it still held is
        dropped as ``drain_timeout``. A planned handover then goes on (it restarts elsewhere);
        any other drain retires it."""
        limit = self.settings.drain_timeout_s
        for slot in list(self.fleet.slots.values()):
            if (slot.state != SlotState.DRAINING or slot.remote
                    or slot.draining_since_s is None or self.now - slot.draining_since_s < limit):
                continue
            self.actions += [Kill(slot.learner, slot.incarnation, reason=DRAIN_TIMEOUT),
                             Forget(slot.learner, slot.incarnation, DRAIN_TIMEOUT)]
            self.note("learner_drain_timeout", slot.learner, incarnation=slot.incarnation,
                      draining_s=round(self.now - slot.draining_since_s, 1),
                      handover=slot.preempted_s is not None)
            if slot.preempted_s is not None and not self.fleet.stopping:
                self.hand_over(slot, forgotten=True)
            else:
                # (the cause is the reason's first word: the region agent and the books read it)
                self.retire(slot, f"{DRAIN_TIMEOUT} (still draining after {limit:g}s)",
                            forgotten=True)

    def launch_pending(self) -> None:
        """Launches new slots: at step 0, or where a resumed job's ledger says they were."""
        for slot in list(self.fleet.slots.values()):
            if slot.state == SlotState.PENDING and not slot.remote:
                applied = self.fleet.applied_steps.get(slot.learner)
                self.launch(slot, applied[1] if applied is not None else 0)

    def check_health(self) -> None:
        s = self.settings
        # A remote slot's health is its region agent's to check (the same rules, there); the
        # home checks only that its heartbeats still arrive (``check_remote``).
        self.check_remote()
        running = [x for x in self.fleet.slots.values()
                   if x.state in (SlotState.TRAINING, SlotState.STARTING) and not x.remote]
        step_times = {x.learner: x.step_time_s for x in running
                      if x.state == SlotState.TRAINING and x.step_time_s}
        for slot in running:
            # Only its own region's other learners: a region is one kind of hardware, and a
            # region of two cannot say which of its pair is the slow one (then nobody is).
            peers = [t for name, t in step_times.items()
                     if name != slot.learner and self.fleet.slots[name].region == slot.region]
            cause = detect(self.now, slot.last_beat_s, _first(slot.launched_s, self.now),
                           step_times.get(slot.learner), peers, s.heartbeat_timeout_s,
                           s.straggler_factor, s.startup_timeout_s, s.straggler_min_excess_s)
            if cause == Cause.STRAGGLER and slot.speed_factor < 1.0:
                cause = None  # slow by design (a mixed fleet)
            if cause != Cause.STRAGGLER and slot.slow_since_s is not None:
                slot = self.put(dataclasses.replace(slot, slow_since_s=None))
            if cause == Cause.STRAGGLER:
                if slot.slow_since_s is None:
                    slot = self.put(dataclasses.replace(slot, slow_since_s=self.now))
                if self.now - slot.slow_since_s < s.straggler_window_s:
                    continue  # slow for a moment is timing noise; slow for a window is a pace
                if slot.restart_counts.get(Cause.STRAGGLER, 0) >= 1:
                    # Restarted once for it and as slow again: a restart does not help here.
                    # It trains on at its pace; the grace window and K keep it from holding
                    # anyone back, so it costs only its own tokens.
                    if slot.tolerated_incarnation != slot.incarnation:
                        self.put(dataclasses.replace(slot, slow_tolerated=slot.slow_tolerated + 1,
                                                     tolerated_incarnation=slot.incarnation))
                        self.note("learner_slow_tolerated", slot.learner,
                                  incarnation=slot.incarnation,
                                  step_time_s=step_times.get(slot.learner),
                                  peers_median_s=statistics.median(peers))
                    continue
            if cause is None:
                continue
            self.note("learner_unhealthy", slot.learner, cause=cause.value,
                      step_time_s=step_times.get(slot.learner))
            self.fail(slot, cause, detail=f"{cause.value} detected")

    def check_remote(self) -> None:
        """A remote learner whose heartbeats stop reaching home is hung here as a local one is
        (the same timeouts). The home cannot restart it: its agent, if that still reports, is
        asked to; else it shows ``unreachable`` until its agent reports it again."""
        s = self.settings
        for slot in list(self.fleet.slots.values()):
            if not slot.remote or slot.state not in (SlotState.TRAINING, SlotState.STARTING):
                continue
            cause = detect(self.now, slot.last_beat_s, _first(slot.launched_s, self.now), None,
                           [], s.heartbeat_timeout_s, s.straggler_factor, s.startup_timeout_s)
            if cause is None:
                continue
            since = _first(slot.last_beat_s, slot.launched_s, self.now)
            seen = self.fleet.agents_seen.get(slot.region)
            agent_alive = seen is not None and agent_reporting(self.now, seen,
                                                               s.heartbeat_timeout_s)
            self.note("learner_unhealthy", slot.learner, cause=cause.value, remote=True)
            self.actions.append(Forget(slot.learner, slot.incarnation, cause.value))
            detail = (f"no heartbeat over the link for {self.now - since:.0f}s; "
                      + ("its region agent is asked to restart it" if agent_alive else
                         "its region agent is silent too: unreachable until it reports again"))
            self.note("learner_failed", slot.learner, cause=cause.value,
                      incarnation=slot.incarnation, detail=detail, remote=True,
                      **{"from": slot.state.value})
            if agent_alive:
                self.actions.append(RestartRemote(slot.learner, slot.region, slot.incarnation,
                                                  cause.value))
                self.move(slot, SlotState.RESTARTING, "learner_restart_scheduled",
                          cause=cause.value, message="its region agent restarts it", delay_s=0.0)
            else:
                self.move(slot, SlotState.UNREACHABLE, "learner_unreachable", cause=cause.value,
                          agent_silent_s=None if seen is None else round(self.now - seen, 1))

    def start_due_restarts(self) -> None:
        waiting = self.spare_waiters()
        for slot in list(self.fleet.slots.values()):
            if slot.state != SlotState.RESTARTING or slot.restart_at_s is None or slot.remote:
                continue
            # A spare that got ready while it waits takes its place now: the backoff and the
            # repair time are the failed process's, not the spare's (another process, its own
            # devices).
            # (one prestarted for it waits for the restart to be due, backoff included: the
            # backoff still paces a crash loop)
            if self.now < slot.restart_at_s and not self.region_spare_ready(slot.region):
                continue
            if slot.learner in waiting and self.ready_spare(slot.region, slot.learner) is None:
                self.hurry(self.fleet.spares[waiting[slot.learner]])
                continue
            applied = self.fleet.applied_steps.get(slot.learner)
            start_step = applied[1] if applied is not None else slot.start_step
            incarnation = slot.incarnation + (0 if slot.restart_postponed else 1)
            slot = dataclasses.replace(slot, incarnation=incarnation)
            self.launch(slot, start_step, name="learner_restarted")

    def hurry(self, spare: Spare) -> None:
        """Once: a due restart waits for ``spare``; its preparation leaves its low priority
        (it would otherwise be starved by the learners it is to join)."""
        if not spare.hurried:
            self.put_spare(dataclasses.replace(spare, hurried=True))
            self.actions.append(HurrySpare(spare.name))

    def region_spare_ready(self, region: str) -> bool:
        spare = self.ready_spare(region)
        return spare is not None and spare.for_learner is None

    def spare_waiters(self) -> dict[str, str]:
        """The due restarts that wait for a spare still preparing in their region, one per such
        spare, the earliest due first, each no longer than ``spare_wait_s`` past its due time.
        A new process beside the spare would cost a whole start's CPU on the cores the spare
        and the training learners share, then leave the spare idle."""
        preparing: dict[str, list[Spare]] = {}
        out: dict[str, str] = {}
        for spare in sorted(self.fleet.spares.values(), key=lambda x: (x.launched_s, x.name)):
            if spare.state != SpareState.STARTING:
                continue
            if spare.for_learner is not None:
                # Prestarted for it: the restart waits for its own process (a new one would
                # need the resources it holds); one that never gets ready is dropped at the
                # start-up timeout, and the restart then starts a new process.
                out[spare.for_learner] = spare.name
                continue
            preparing.setdefault(spare.region, []).append(spare)
        due = sorted((s for s in self.fleet.slots.values()
                      if s.state == SlotState.RESTARTING and s.restart_at_s is not None
                      and not s.remote and self.now >= s.restart_at_s
                      and s.learner not in out and preparing.get(s.region)),
                     key=lambda s: (s.restart_at_s, s.learner))
        for slot in due if self.settings.spare_wait_s > 0 else ():
            if (preparing[slot.region]
                    and self.now < slot.restart_at_s + self.settings.spare_wait_s):
                out[slot.learner] = preparing[slot.region].pop(0).name
        return out

    def quorum_floor(self) -> None:
        """Pauses the job below the quorum floor or while an operator paused it; resumes when
        neither holds any more (a pause's reason follows whichever holds)."""
        k = self.settings.min_learners
        live = [s for s in self.fleet.slots.values()
                if s.state in (SlotState.TRAINING, SlotState.PAUSED)]
        if len(live) >= k and not self.fleet.quorum_seen:
            self.set(quorum_seen=True)
        if self.fleet.stopping:
            return
        reason = None
        if self.fleet.operator_paused:
            reason = "paused by an operator: training resumes on a resume command"
        elif self.fleet.home_paused is not None:
            reason = f"paused at home: {self.fleet.home_paused}"
        elif self.fleet.quorum_seen and len(live) < k:  # before the quorum: still starting up
            reason = (f"{len(live)} live learner(s) below quorum {k}: training paused until "
                      "learners return")
        if reason is not None and self.fleet.paused_reason is None:
            self.set(paused_reason=reason)
            self.note("training_paused", None, reason=reason)
            for slot in live:
                if slot.remote:  # counted, but its agent runs it (the pause stays home)
                    continue
                if slot.state == SlotState.TRAINING:
                    self.put(dataclasses.replace(slot, state=SlotState.PAUSED,
                                                 paused_since_s=self.now))
                self.actions.append(PauseLearner(slot.learner, True))
        elif reason is not None and reason != self.fleet.paused_reason:
            self.set(paused_reason=reason)   # still paused, for another reason now
        elif reason is None and self.fleet.paused_reason is not None:
            self.set(paused_reason=None)
            self.note("training_resumed", None, live=len(live))
            for slot in live:
                if slot.remote:
                    continue
                paused_s = slot.paused_s + (self.now - slot.paused_since_s
                                            if slot.paused_since_s is not None else 0.0)
                self.put(dataclasses.replace(slot, state=SlotState.TRAINING, paused_s=paused_s,
                                             paused_since_s=None))
                self.actions.append(PauseLearner(slot.learner, False))


def reintegration_failed(cause: Cause, recovery) -> bool:
    """Whether a quarantine is the failure of a restart rather than of the learner: the
    incarnation was restarted after another cause and none of its pushes was merged yet
    (``Slot.recovery`` is kept until the first merged push). Such a quarantine spends no
    budget; the one after it (the recovery's cause is then quarantine) does, so a learner
    that pushes garbage whatever its state is still retired.

    >>> pending = (("failed_s", 1.0), ("detected_s", 1.0), ("cause", "crash"), ("restarted_s", 2.0))
    >>> reintegration_failed(Cause.QUARANTINE, pending), reintegration_failed(Cause.CRASH, pending)
    (True, False)
    >>> again = (("cause", "quarantine"), ("restarted_s", 5.0))
    >>> reintegration_failed(Cause.QUARANTINE, again), reintegration_failed(Cause.QUARANTINE, None)
    (False, False)
    """
    if cause != Cause.QUARANTINE or recovery is None:
        return False
    rec = dict(recovery)
    return "restarted_s" in rec and rec.get("cause") not in (None, Cause.QUARANTINE.value)


def _first(*values):
    """The first value that is not None (0.0 is a time like any other)."""
    return next(v for v in values if v is not None)


def recovery_phases(rec: Mapping) -> dict:
    """Seconds per recovery phase: detect, restart, restore, first contribution, total."""
    failed = rec["failed_s"]
    detected = rec.get("detected_s", failed)
    restarted = rec.get("restarted_s", detected)
    restored = rec.get("restore_done_s", restarted)
    first = rec.get("first_contribution_s", restored)
    return {"cause": rec.get("cause"), "detect_s": detected - failed,
            "restart_s": restarted - detected, "restore_s": restored - restarted,
            "first_contribution_s": first - restored, "total_s": first - failed}

