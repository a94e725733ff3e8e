"""The in-process driver's learners and syncer behind the seam's interfaces (groups_api.py), on
its virtual clock. No Ray here.

The third body of the seam: ``VirtualLearnerGroup`` and ``VirtualSyncerGroup`` implement
``groups_api.LearnerGroup`` and ``groups_api.SyncerGroup`` on the state of an
``inprocess._Driver`` (its arrays of learners, its ``SyncerCore``, its event queue), so that the
driver's action handlers are one call on a group each, as the Ray controller's are on
``groups.LearnerGroups`` and ``groups.SyncerShards``. What takes time on a cluster takes virtual
time here: a process start (``chaos.RestartCosts``; with ``start_cpu_s`` the starts share
``start_cores``), a death's detection, a spare's preparation, a syncer's restart.

The machine they run on (``virtual_fleet.VirtualMachine``: the process starts, the drains,
restart tokens, causes of loss and what is reported but not polled yet) is held by the driver
and by both groups, so the driver uses a group through its interface only. The driver is
event-driven: what the Ray owner polls (``ended``, ``spare_results``) becomes due at an event of
the virtual clock (a death at its detection time, a drained run once its pushes are answered, a
spare at the end of its preparation); the driver ``report``s it to the machine and polls at
once, so each poll returns that one message, in the order the events came.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional, Sequence

from . import fleet
from .groups_api import ShardEnded, SyncerStatus
from .virtual_fleet import RESTART

# Event priorities at equal times: pushes leave before the syncer decides, the syncer answers
# before learners start their next step (so zero latency means "answered at this boundary").
# A fault at the time a step ends hits after that step's pushes left (they are then refused), and
# before the learner starts another step; a restarted learner starts after everything else.
STEP_DONE, FAULT, ARRIVE, CHECK, REPLY, STEP_START, FLEET = range(7)
assert RESTART == FLEET + 1   # a restarted learner starts after everything else


class VirtualLearnerGroup:
    """The in-process body of ``groups_api.LearnerGroup``: the driver's learner slots, each one
    virtual learner whose incarnations come and go on the virtual clock.

    ``driver`` is the ``inprocess._Driver`` whose state this carries the fleet's actions out
    on (``now``, ``cores``, ``up``, ``restart``, ``schedule`` ...). There are no devices here
    (``devices`` is None), and ``launch``'s ``spec`` is the ``fleet.Launch`` itself (the new
    incarnation's start step and peer). Its new processes start on the driver's machine
    (``driver.machine``, a ``virtual_fleet.VirtualMachine``), which also keeps the drains,
    restart tokens and causes of loss, and what is reported until it is polled."""

    def __init__(self, driver: Any):
        self.d, self.m = driver, driver.machine

    # -- start ----------------------------------------------------------------------------------
    def launch(self, learner: str, incarnation: int, region: str, devices, spec,
               link_faults: Iterable = (), spare: Optional[str] = None,
               identity: Optional[dict] = None) -> Optional[str]:
        """A new incarnation, back after its start (``driver.on_restart``): a new process's
        (``begin_start``), or a promoted spare's, whose process is there (a flat cost). Link
        faults need no passing on: they are windows on the region's link (``driver.windows``)."""
        d, m, i = self.d, self.m, self.d.index_of[learner]
        if incarnation == 0 and d.cores[i].incarnation == 0:
            return None  # the initial learners exist already
        m.restart_token[i] += 1
        payload = (i, spec, m.restart_token[i])
        if spare is not None:
            d.schedule(d.now + d.restart_cost(True), RESTART, "restart", payload)
        else:
            m.starts.begin(d.now, ("restart", i, m.restart_token[i]), "restart", payload,
                           d.restart_cost(False))
        return None

    def launch_spare(self, name: str, region: str, devices, spec) -> Optional[str]:
        """Starts preparing a spare. One that could not be ready before the run ends
        (``until_s``) is not started: the fleet waits for it to the end, as it would for a spare
        still preparing then."""
        d = self.d
        if d.until_s is None or d.now + d.restart.spare_ready_s < d.until_s:
            self.m.starts.begin(d.now, ("spare", name), "spare", name, d.restart.spare_ready_s)
        return None

    def hurry_spare(self, name: str) -> None:
        """A virtual spare's preparation has one fixed length: no priority to change."""

    def end_spare(self, name: str) -> None:
        self.m.starts.cancel(self.d.now, ("spare", name))   # one still preparing stops taking CPU

    # -- control --------------------------------------------------------------------------------
    # A drain, a pause or a hang is its slot's and holds across a restart (one told to drain
    # while down drains when it is back); each says whether a running incarnation took it.
    def drain(self, learner: str) -> bool:
        """As the Ray learner's ``drain``: it finishes the step it is in (its pushes leave),
        takes no new one, and its run returns once every push it has in flight is answered
        (``VirtualMachine.finish_drain``)."""
        i = self.d.index_of[learner]
        self.m.draining.add(i)
        return self.d.up[i]

    def pause(self, learner: str, paused: bool) -> bool:
        """Paused, it parks at its next step boundary; resumed, a parked one steps again now."""
        d, i = self.d, self.d.index_of[learner]
        d.paused[i] = paused
        if not paused and d.parked[i]:
            d.parked[i] = False
            d.schedule(d.now, STEP_START, "start", (i, d.cores[i].incarnation))
        return d.up[i]

    def hang(self, learner: str, duration_s: float) -> bool:
        """A wedged learner does nothing from now on; the health timeout finds it and it is
        restarted like a dead one (its unmerged work is lost). One down already (its death not
        seen yet) is not killed again, but its end is seen as a hang too."""
        d, i = self.d, self.d.index_of[learner]
        incarnation, running = d.cores[i].incarnation, d.up[i]
        if running:
            d.kill(i, d.now, "hang")
        self.m.cause_of[i] = "hang"
        self._seen_after(d.restart.detect_hang_s,
                         fleet.RunEnded(d.ids[i], incarnation, "hang"))
        return running

    # Slowdowns and link faults are windows on the fault's target, a learner or a region
    # (FaultWindows), not calls on the learners running now as on Ray: a window also holds for
    # an incarnation that starts within it (as a Ray restart is launched with the region's link
    # faults), and the driver's step and transfer times read them.
    def apply_fault(self, learners: Sequence[str], fault) -> None:
        self.d.windows.add(fault)

    def partition_home(self, fault) -> None:
        """The home's network fails: every region's link is cut for the fault's window (the fleet
        asks for this only in a job with remote regions, so a virtual fleet does not meet it
        from a fault plan, whose home partitions the driver refuses)."""
        for region in sorted(set(self.d.regions)):
            self.d.windows.add(dataclasses.replace(fault, target=region))

    def kill(self, learner: str, incarnation: int, mode: str, fault=None,
             reason: str = "") -> bool:
        """``bury``: a running incarnation (a quarantined one, or one the fleet ended at its
        drain's deadline: ``reason``) stops now, and no end of its run is reported (True); its
        books are settled for ``reason``. Otherwise a chaos kill by ``fault``: the incarnation
        ends now, or its start is called off when it was coming back; its end is seen after the
        fault's detection time (False)."""
        d, i = self.d, self.d.index_of[learner]
        if mode == "bury":
            if d.up[i] and d.cores[i].incarnation == incarnation:
                self.m.draining.discard(i)   # ended: its drain is over (a successor trains)
                d.kill(i, d.now, reason or "quarantine")
                self.m.cause_of[i] = reason or "quarantine"
                return True
            return False
        if fault is None:
            raise ValueError(f"Kill({learner}, {incarnation}, {mode!r}) without its fault: the "
                             "in-process driver times a chaos kill's detection by its kind")
        if d.up[i]:
            d.kill(i, d.now, fault.kind.value)
        else:  # killed during its restart: that comeback is off, its process is gone
            self.m.starts.cancel(d.now, ("restart", i, self.m.restart_token[i]))
            self.m.restart_token[i] += 1
        self.m.cause_of[i] = fault.kind.value
        self._seen_after(d.restart.detect_s(fault.kind),
                         fleet.RunEnded(learner, incarnation, fault.kind.value))
        return False

    # -- poll: what the machine reported ------------------------------------------------------
    def ended(self) -> "list[fleet.RunEnded]":
        """The runs reported ended since the last poll."""
        return self.m.take("ended")

    def placed(self) -> list:
        """Nothing waits for placement here: a restart's first beat starts it."""
        return []

    def spare_results(self) -> "list[fleet.SpareReady]":
        """The spares reported ready since the last poll (a virtual spare never fails)."""
        return self.m.take("spares")

    def stop_all(self, timeout_s: float) -> None:
        """The job's end: every running incarnation's run returns now (reported by ``ended``).
        The virtual learners keep their state: the run's record has read it already."""
        d = self.d
        for i, name in enumerate(d.ids):
            if d.up[i]:
                self.m.report(fleet.RunEnded(name, d.cores[i].incarnation, final=self.m.final(i)))

    def wait(self, other_refs: list, timeout_s: float) -> bool:
        """False at once: on the virtual clock nothing happens between events (the event loop
        moves the clock to the next one), so there is nothing to block on."""
        return False

    # -- what only an owner that restarts needs: the driver never does ------------------------
    def reattach(self, learner: str, actor: str, hosts: int = 1,
                 timeout_s: float = 10) -> Optional[dict]:
        """None: nothing runs outside the driver. Its learners live and end with it, and no
        owner restarts under a running fleet here."""
        return None

    def end_stray_spares(self, keep: set) -> None:
        """Nothing to end: a virtual spare is the driver's own state, and no owner restarts
        here to leave one waiting."""

    def _seen_after(self, delay_s: float, ended: "fleet.RunEnded") -> None:
        """Its end is seen (``driver.on_seen``) ``delay_s`` from now."""
        self.d.schedule(self.d.now + delay_s, FLEET, "seen", ended)


class VirtualSyncerGroup:
    """The in-process body of ``groups_api.SyncerGroup``: one shard, the driver's
    ``SyncerCore``, which lives in memory (its restart keeps Θ, versions and ledger,
    ``SyncerCore.restart``). It answers at once: the driver hands it ξ_step and the pause at
    each decision itself (``on_check``)."""

    def __init__(self, driver: Any):
        self.d, self.m = driver, driver.machine

    @property
    def count(self) -> int:
        return 1

    def _ready(self) -> dict:
        core = self.d.syncer
        return {"epoch": core.epoch, "versions": list(core.versions), "syncer_shard": 0}

    def _check_shard(self, s: int) -> None:
        if s != 0:
            raise ValueError(f"syncer shard {s}: the in-process driver has one syncer (shard 0)")

    def start(self, s: int, spec, epoch: int, restore: bool, options: dict,
              timeout_s: float) -> dict:
        """Restarts the syncer at ``epoch`` (fencing), restored as the Ray syncer restores from
        its snapshot and merge journal (``SyncerCore.restart``: as of the last merge; the open
        rounds are dropped, their learners told so). It answers ``syncer_restart_s`` later, when
        every live learner registers again (``driver.on_syncer_back``); its ``ready`` answer
        says when (``back_at_s``)."""
        self._check_shard(s)
        if not restore:
            raise ValueError(f"StartSyncer(shard {s}, restore=False): the in-process driver's "
                             "syncer restarts from its own state")
        d = self.d
        for push in d.syncer.restart(epoch):
            i = d.index_of[push.learner]
            d.record.dropped_pushes += 1
            if d.current(i, push.incarnation):
                d.cores[i].push_refused(push.fragment)
        d.syncer_down_until = d.now + d.restart.syncer_restart_s
        d.schedule(d.syncer_down_until, FAULT, "syncer_back", None)
        return {**self._ready(), "back_at_s": d.syncer_down_until}

    def attach(self, s: int, name: str, timeout_s: float) -> dict:
        """The one shard is the driver's own core: its ``ready`` answer, unless it is down."""
        self._check_shard(s)
        if self.d.now < self.d.syncer_down_until:
            raise RuntimeError("the in-process syncer is down")
        return self._ready()

    def ended(self) -> list[ShardEnded]:
        """The shard if it was killed since the last poll."""
        return self.m.take("shards")

    def kill(self, s: int, fault=None) -> None:
        """Its process dies now: pushes that reach it are refused until a restarted one
        answers. One that is down already is not killed again (``fault`` is recorded as
        skipped)."""
        self._check_shard(s)
        d = self.d
        if d.now < d.syncer_down_until:
            d.record.faults_skipped.append((fault, "syncer is already down"))
            return
        d.syncer_down_until = math.inf   # until a restarted syncer answers
        self.m.report(ShardEnded(s), "shards")

    def refusals_since(self, seen: list[int], timeout_s: float = 10) -> list:
        """The refusals after the ``seen[0]`` already reported (``seen`` is advanced)."""
        core = self.d.syncer
        new = core.refusals_total - seen[0]
        seen[0] = core.refusals_total
        return list(core.refusals)[-new:] if new > 0 else []

    def forget(self, learner: str, incarnation: int, reason: str,
               timeout_s: float = 10) -> None:
        """Unregisters ``learner`` and drops its unmerged pushes. ``SyncerCore.forget`` knows
        learners, not incarnations: the one registered is forgotten."""
        self.d.record.dropped_pushes += len(self.d.syncer.forget(learner))

    def statuses(self, slowest_step_s: float, paused: bool,
                 timeout_s: float = 10) -> dict[int, SyncerStatus]:
        """The core's status (what the Ray syncer's ``status`` reads off its core); the pace and
        the pause are not kept: the driver passes them to each decision."""
        core = self.d.syncer
        ledger = {name: {"incarnation": e.incarnation, "applied_step": e.applied_step,
                         "applied_tokens": e.applied_tokens,
                         "merged_steps": dict(e.merged_steps),
                         "merged_tokens_total": e.merged_tokens_total, "fates": e.fates}
                  for name, e in core.ledger.items()}
        return {0: SyncerStatus(
            epoch=core.epoch, versions=list(core.versions), merges=int(sum(core.versions)),
            merges_by_fragment=dict(enumerate(core.versions)),
            live_learners=dict(core.last_live),
            participation_counts=dict(core.participation_counts),
            staleness_counts=dict(core.staleness_counts),
            rejected={r.value: n for r, n in core.rejected.items()},
            registered=dict(core.learners), refusals_total=core.refusals_total,
            quarantined=dict(core.quarantined), ledger=ledger, syncer_shard=0)}

    def global_params(self, timeout_s: float = 30) -> dict:
        """The global parameters, flat."""
        return self.d.syncer.params_flat()

    def snapshot_now(self, timeout_s: float = 60) -> None:
        """Nothing to write: the virtual syncer's state is its core, in memory, and a restart
        (``start``) restores from it."""

    def closed_refs(self) -> list:
        """None to wait on: a virtual shard's end is an event of the virtual clock."""
        return []

    def shard(self, s: int) -> Any:
        """The driver's ``SyncerCore``, its one shard."""
        self._check_shard(s)
        return self.d.syncer
