"""The owner of a fleet: its state, its books and its 15 action handlers, written once for every
body. No Ray here, no clock of its own.

The Ray controller (``controller.py``, a region agent's too) and the in-process driver
(``inprocess.py``) each hold one ``Owner``. It owns the fleet state, the token books, the
running and closed incarnations and the syncer shards' last statuses; it carries out every
action ``fleet.step`` returns through the body's ``groups_api.LearnerGroup`` and
``groups_api.SyncerGroup`` and a ``LaunchSpecs`` (what a new learner, spare or syncer shard is
started from). A body differs only in what it hands the owner: its groups, its clock, where an
observation a handler produces goes (``tell``), what it records of a transition (``hooks``).

>>> from islands.orchestrator.health import RestartPolicy
>>> class Learners:                     # a body's groups, reduced to what this run uses
...     launched = []
...     def launch(self, learner, incarnation, region, devices, spec, link_faults=(),
...                spare=None, identity=None):
...         self.launched.append((learner, incarnation, spec))
>>> class Specs:
...     def learner(self, a):
...         return None, f"spec of {a.learner}", None
>>> settings = fleet.FleetSettings({"a": fleet.RegionPlan(1, 1)}, 1, RestartPolicy())
>>> owner = Owner(settings, 1, Learners(), None, Specs(), clock=lambda: 0.0)
>>> _ = owner.step([], 0.0)
>>> Learners.launched, owner.running["a:0"].number, owner.fleet.slots["a:0"].state.value
([('a:0', 0, 'spec of a:0')], 0, 'starting')
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

from islands.learners.fates import newest
from islands.syncer import timing

from . import fleet
from . import seam
from .books import Books
from .groups_api import Incarnation, SyncerStatus, combined
from .logs import RecoveryLog

# A saved spare back-off's fields this version knows (a newer state file may carry more).
BACKOFF_FIELDS = frozenset(f.name for f in dataclasses.fields(fleet.SpareBackoff))
# A re-attached learner's state (its actor's answer) -> its slot's ("paused": the floor decides
# again at the first step).
RUNNING_STATES = {"training": fleet.SlotState.TRAINING, "paused": fleet.SlotState.TRAINING,
                  "draining": fleet.SlotState.DRAINING, "starting": fleet.SlotState.STARTING}


class LaunchSpecs(Protocol):
    """What a body starts a learner, a warm spare or a syncer shard from."""

    def learner(self, a: fleet.Launch) -> tuple[Any, Any, Optional[dict]]:
        """(devices, spec, identity) of the incarnation ``a`` launches (identity: a promoted
        spare's check that it is the process the spec describes)."""

    def spare(self, a: fleet.LaunchSpare) -> tuple[Any, Any]:
        """(devices, spec) of a warm spare."""

    def syncer(self, s: int) -> tuple[Any, dict, float]:
        """(spec, options, timeout_s) of syncer shard ``s``."""


class Hooks:
    """What a body does at the owner's fixed points besides the owner's own work (the base
    does nothing): the Ray controller emits events and tells its role; the in-process driver
    records the run and schedules its virtual events."""

    def adopted(self, state: fleet.FleetState) -> None:
        """The owner adopted a new fleet state, before any transition or action."""

    def recorded(self, t: fleet.Transition, now: float) -> None:
        """A transition the owner recorded (books, recoveries and its event done)."""

    def attach_link(self) -> Optional[Callable[[], None]]:
        """A body whose one syncer shard is a link it attaches: the call that attaches it."""
        return None


def no_events(kind: str, **fields) -> None:
    """The events of a body that keeps none (the in-process driver records its run instead)."""


class Owner:
    """A fleet's one writer.

    Args:
      settings: the fleet's settings (``build.fleet_settings`` of the job's config, a region's
        own through its role).
      num_fragments: P, for the books.
      learners, syncers: the body's groups (``groups_api``).
      specs: the body's ``LaunchSpecs``.
      clock: the body's time (the wall clock, or the driver's virtual one).
      tell: where an observation a handler produces goes (a launch that failed, a syncer shard
        that answered): the body's next turn hears it.
      emit: the body's event log (``no_events``: none).
      hooks: the body's ``Hooks``.
      overrides: handlers that replace the owner's for some action types (a region's role).
      contain_errors: an action whose handler raised is reported (``action_failed``) and the
        next one goes on (the Ray owner loop); False: the error propagates (the driver).
    """

    def __init__(self, settings: fleet.FleetSettings, num_fragments: int, learners: Any,
                 syncers: Any, specs: LaunchSpecs, *, clock: Callable[[], float],
                 tell: Callable[[Any], None] = lambda obs: None,
                 emit: Callable[..., None] = no_events, hooks: Optional[Hooks] = None,
                 overrides: Optional[seam.Table] = None, contain_errors: bool = False,
                 lock: Optional[threading.Lock] = None):
        self.fleet = fleet.initial(settings)
        self.books = Books(num_fragments)
        self.learners, self.specs = learners, specs
        self.clock, self.tell, self.emit = clock, tell, emit
        self.hooks = hooks if hooks is not None else Hooks()
        self.contain_errors = contain_errors
        self.lock = lock if lock is not None else threading.Lock()  # readers of the statuses
        self.running: dict[str, Incarnation] = {}
        self.closed: dict[str, dict] = {}     # per learner: counters of ended incarnations
        self.recoveries = RecoveryLog()      # a histogram of all, the newest as rows
        self.remote_beats: dict[tuple, Any] = {}   # (learner, incarnation) -> newest beat
        self.remote_restarts: dict[str, list] = {}  # per remote region: restarts for its agent
        self.syncer_restarts = 0
        self.syncer_closed: dict = {"rejected": {}, "staleness_counts": {},
                                    "participation_counts": {}}
        self.syncer_status = SyncerStatus()   # every shard's status as one (syncer/shards.py)
        self.use_syncers(syncers)
        # Every fleet action's handler, found now: an owner missing one does not start.
        self.handlers = {**seam.handler_table(self, "do_"), **(overrides or {})}

    def use_syncers(self, syncers: Any) -> None:
        """The body's syncer shards (a controller knows how many only once its spec is built)."""
        self.syncers = syncers
        n = syncers.count if syncers is not None else 0
        self.shard_status: list[Optional[SyncerStatus]] = [None] * n   # None: not answered
        self.shard_refusals_seen = [0] * n
        self.refusals_seen = 0          # the refusals already reported, every shard's
        self.started_epochs = [0] * n   # the epoch each shard was last started with, here

    # -- the turn -------------------------------------------------------------------------------
    def step(self, observations: Iterable, now: Optional[float] = None) -> fleet.Step:
        """One turn of the owner loop (``seam.turn``) at ``now`` (default: the clock's)."""
        now = self.clock() if now is None else now
        return seam.turn(self.fleet, list(observations), now, adopt=self.adopt,
                         record=lambda t: self.record(t, now), recorded=self.track,
                         table=self.handlers,
                         on_error=self.action_failed if self.contain_errors else None)

    def adopt(self, state: fleet.FleetState) -> None:
        self.fleet = state
        self.hooks.adopted(state)

    def track(self) -> None:
        self.books.track({n: x.state.value for n, x in self.fleet.slots.items()}, self.clock())

    def action_failed(self, action, exc: Exception) -> None:
        self.emit("action_failed", action=type(action).__name__, error=repr(exc)[:300])

    def record(self, t: fleet.Transition, now: float) -> None:
        """A transition's books (a slot allocated or released, a recovery), then its event."""
        if t.name in ("learner_launched", "learner_restarted"):
            self.books.allocate(t.learner, now)
            if t.fields.get("remote"):  # its agent launched it: home keeps its books
                self.close(t.learner)   # the previous incarnation's newest beat stays in closed
                number = int(t.fields["incarnation"])
                with self.lock:   # a report's thread stores beats that come before the launch
                    beat = self.remote_beats.pop((t.learner, number), None)
                    for key in [k for k in self.remote_beats if k[0] == t.learner and k[1] < number]:
                        del self.remote_beats[key]   # older incarnations' beats: never taken
                    self.running[t.learner] = Incarnation(number, beat=beat, remote=True)
        elif t.name == "learner_retired":
            self.books.release(t.learner, now)
        elif t.name == "learner_recovered":
            with self.lock:   # snapshots read the histogram and rows under it
                self.recoveries.append({**t.fields, "learner": t.learner})
        fields = dict(t.fields)
        if t.learner is not None:
            fields.setdefault("learner", t.learner)
        self.emit(t.name, **fields)
        self.hooks.recorded(t, now)

    # -- what the groups report -----------------------------------------------------------------
    def observe(self, syncers: bool = True) -> list:
        """What the groups report since the last poll, as fleet observations: ended runs (their
        incarnations closed), placements, spares, and (``syncers``) ended syncer shards."""
        out = self.ended_runs()
        out += self.learners.placed()
        out += self.learners.spare_results()
        if syncers:
            out += [fleet.SyncerEnded(e.shard, self.shard_epoch(e.shard))
                    for e in self.syncers.ended()]
        return out

    def ended_runs(self) -> list:
        """The runs that ended: a returned run's final stats update its incarnation's last
        beat, and a local one is closed."""
        out = []
        for ended in self.learners.ended():
            inc = self.running.get(ended.learner)
            if inc is not None and ended.final:
                inc.ended_with(ended.final)
            if ended.crashed:
                self.emit("learner_error", learner=ended.learner, error=ended.error)
            out.append(ended)
            if inc is not None and not inc.remote and inc.number == ended.incarnation:
                self.close(ended.learner)
        return out

    def heard(self, beat) -> Optional[str]:
        """A heartbeat: the current incarnation's last beat is now ``beat``. Returns None for
        another incarnation's, "first" for the first that names its devices, else "beat"."""
        run = self.running.get(beat.learner)
        if run is None or run.number != beat.incarnation:
            return None
        first = beat.devices is not None and (run.beat is None or run.beat.devices is None)
        run.beat = beat
        return "first" if first else "beat"

    def refusals(self) -> list:
        """Every push the syncers refused since the last poll becomes a ``push_refused`` event;
        a learner a syncer quarantined (its drifts kept being refused as garbage) becomes an
        observation."""
        for refusal in self.syncers.refusals_since(self.shard_refusals_seen):
            self.emit("push_refused", **refusal)
        self.refusals_seen = sum(self.shard_refusals_seen)
        return [fleet.Quarantine(name, incarnation, "drifts refused as garbage")
                for name, incarnation in self.syncer_status.quarantined.items()]

    def chaos_due(self, plan, elapsed_s: float, now: float, fired: list) -> list:
        """The faults of the chaos ``plan`` due ``elapsed_s`` into the job, at ``now`` (wall
        clock from here on: each learner checks link windows on its own clock), as
        observations; each is noted in ``fired`` with what became of it (one the fleet refuses,
        its target down already, is moot)."""
        out = []
        for fault in plan.due(elapsed_s):
            chaos = fleet.Chaos(dataclasses.replace(fault, at_s=now))
            try:
                fleet.check_command(self.fleet, chaos)
                out.append(chaos)
                message = "fired"
            except fleet.CommandError as exc:
                message = f"not fired: {exc}"
            fired.append({"at_s": fault.at_s, "kind": fault.kind.value, "target": fault.target,
                          "message": message})
        return out

    def applied(self) -> fleet.Applied:
        """Every learner's applied step and tokens, as the syncers' ledgers last said."""
        return fleet.Applied({name: (int(e["incarnation"]), int(e["applied_step"]),
                                     int(e["applied_tokens_incarnation"]))
                              for name, e in self.syncer_status.ledger.items()})

    def shard_epoch(self, s: int) -> int:
        status = self.shard_status[s]
        return int(status.epoch) if status is not None else 0

    def refresh_syncer_status(self) -> None:
        """Tells every shard ξ_step (the TRAINING slots' paces, ``timing.slowest_step_s``) and
        the pause rule; keeps what they answer (a shard that cannot answer keeps its last)."""
        slowest = timing.slowest_step_s(s.step_time_s for s in self.fleet.slots.values()
                                        if s.state == fleet.SlotState.TRAINING)
        statuses = self.syncers.statuses(slowest, timing.merges_held(self.fleet.paused_reason))
        if not statuses:
            return
        with self.lock:
            for s, status in statuses.items():
                self.shard_status[s] = status
            self.syncer_status = combined(self.shard_status)

    # -- the books of an incarnation ------------------------------------------------------------
    def settle(self, learner: str, incarnation: int, reason: str) -> None:
        """Closes the books of an ended incarnation (once): its pushes the syncer merged are
        applied, everything else it held is dropped for ``reason``. Its books are the newest of
        its last heartbeat (or final stats) and what its newest push carried (the syncer's
        ledger, as last refreshed)."""
        closed = self.closed.setdefault(learner, {"steps": 0, "up": 0, "down": 0})
        if closed.get("settled") == incarnation:
            return
        inc = self.running.get(learner)
        beat = inc.counters() if inc is not None and inc.number == incarnation else closed.get(
            "beat", {})
        entry = self.syncer_status.ledger.get(learner) or {}
        same = int(entry.get("incarnation", -1)) == incarnation
        fates = newest(beat.get("fates") if int(beat.get("incarnation", incarnation))
                       == incarnation else None, entry.get("fates") if same else None)
        merged_steps = {int(p): int(v) for p, v in (entry.get("merged_steps") or {}).items()
                        } if same else {}
        self.books.close_incarnation(learner, fates, merged_steps, reason)
        closed["settled"] = incarnation

    def close(self, learner: str) -> None:
        """Folds an ended incarnation's counters into the slot's totals (they never go back)."""
        inc = self.running.pop(learner, None)
        if inc is None:
            return
        closed = self.closed.setdefault(learner, {"steps": 0, "up": 0, "down": 0})
        beat = inc.counters()
        start = int(self.fleet.slots[learner].start_step) if learner in self.fleet.slots else 0
        closed["steps"] += max(0, int(beat.get("step", start) or start) - start)
        closed["up"] += int(beat.get("wire_bytes_up", 0) or 0)
        closed["down"] += int(beat.get("wire_bytes_down", 0) or 0)
        closed["beat"] = beat

    def release_all(self, now: float) -> None:
        """The job's end: every slot's allocation ends ``now``."""
        for learner in list(self.fleet.slots):
            self.books.release(learner, now)

    # -- syncer shards --------------------------------------------------------------------------
    def start_syncer(self, s: int, epoch: int, restore: bool) -> None:
        """Starts shard ``s`` (a body whose one shard is a link attaches it instead). A shard that
        answers at once is observed next turn (``tell``); one that answers later (the driver's,
        after its restart time) is its body's to report."""
        attach = self.hooks.attach_link()
        if attach is not None:
            attach()
            return
        spec, options, timeout_s = self.specs.syncer(s)
        ready = self.syncers.start(s, spec, epoch, restore, options, timeout_s)
        self.started_epochs[s] = int(ready["epoch"])
        if ready.get("back_at_s") is None:
            self.tell(fleet.SyncerStarted(s, int(ready["epoch"])))
        shard = {"shard": s} if self.syncers.count > 1 else {}
        self.emit("syncer_started", epoch=ready["epoch"], versions=ready["versions"],
                  restored_from=ready.get("restored_from"),
                  journaled=ready.get("journaled", []), **shard)

    # -- its saved state (what a restarted controller cannot ask anyone else for) --------------
    def save(self, now: float) -> dict:
        """The books, the slots' states and restart counts, the shards' epochs: the owner's
        part of the state a restarted controller reads back (``restore``)."""
        fleet_state = self.fleet
        return {
            "books": self.books.to_json(), "closed": self.closed,
            "slots": [slot_row(x, now) for x in fleet_state.slots.values()],
            "targets": dict(fleet_state.targets), "next_index": dict(fleet_state.next_index),
            "next_shard": fleet_state.next_shard, "next_spare": fleet_state.next_spare,
            "lost_regions": dict(fleet_state.lost_regions),
            "misconfigured": {node: dict(regions)
                              for node, regions in fleet_state.misconfigured.items()},
            "operator_paused": fleet_state.operator_paused,
            "recoveries": self.recoveries.to_json(),
            "syncer_restarts": self.syncer_restarts, "syncer_closed": self.syncer_closed,
            "syncer_epoch": int(self.syncer_status.epoch),
            "syncer_epochs": [int(st.epoch) if st is not None else 0
                              for st in self.shard_status],
            "started_epochs": list(self.started_epochs),
            "refusals_seen": list(self.shard_refusals_seen),
            # Restarts decided for a remote region's agent, not yet taken by its report, and
            # each region's spare back-off: both would be lost with the owner's memory.
            "remote_restarts": self.pending_remote_restarts(),
            "spare_backoff": {r: dataclasses.asdict(b)
                              for r, b in fleet_state.spare_backoff.items()}}

    def restore(self, saved: Mapping, observed: Mapping[str, Optional[dict]], now: float,
                syncer_restarts_missed: int = 0) -> list[str]:
        """Rebuilds the owner from ``saved`` (``save``'s) and what its body ``observed`` since:
        per local learner not gone, what its running actor said (``groups.reattach``; None:
        none answers). One still running keeps training under this owner; one gone is
        relaunched as a newer incarnation (after the newest the syncers' ledger knows, as last
        refreshed); a remote region's stays mirrored from its agent. Returns the learners found
        paused (the first step pauses them again if a reason still holds)."""
        self.books = Books.from_json(saved["books"])
        self.closed = dict(saved["closed"])
        self.recoveries = RecoveryLog.from_json(saved["recoveries"])
        self.syncer_restarts = int(saved["syncer_restarts"]) + syncer_restarts_missed
        self.syncer_closed = saved["syncer_closed"]
        # The refusals already reported, per shard still in the epoch it was saved at (a
        # restarted one counts from 0 again): a restarted owner emits none of them twice.
        for s, (seen, epoch) in enumerate(zip(saved.get("refusals_seen", []),
                                              saved.get("syncer_epochs", []))):
            status = self.shard_status[s] if s < len(self.shard_status) else None
            if status is not None and int(status.epoch) == int(epoch):
                self.shard_refusals_seen[s] = int(seen)
        self.refusals_seen = sum(self.shard_refusals_seen)
        ledger = self.syncer_status.ledger
        regions = self.fleet.settings.regions
        slots, paused = [], []
        for row in saved["slots"]:
            remote = regions[row["region"]].remote
            slot = saved_slot(row, remote)
            if slot.state in fleet.GONE:
                slots.append(slot)
                continue
            if remote:
                # Its agent runs it in the region's own cluster: nothing here to re-attach or
                # relaunch. It is kept as saved; the agent's next report (every second) says
                # how it is, and its beats time from now.
                slots.append(dataclasses.replace(slot, last_beat_s=now))
                self.running[slot.learner] = Incarnation(slot.incarnation, remote=True)
                continue
            info = observed.get(slot.learner)
            if info is not None and info["state"] in RUNNING_STATES:
                running_state = RUNNING_STATES[info["state"]]
                if slot.state == fleet.SlotState.DRAINING:
                    running_state = fleet.SlotState.DRAINING
                if info["state"] == "paused":
                    paused.append(slot.learner)
                since = slot.draining_since_s
                if running_state == fleet.SlotState.DRAINING and since is None:
                    since = now   # (a state file from before the drain's deadline was saved)
                slots.append(dataclasses.replace(
                    slot, state=running_state, incarnation=info["incarnation"],
                    start_step=info["start_step"], launched_s=now, last_beat_s=now,
                    draining_since_s=since if running_state == fleet.SlotState.DRAINING
                    else None))
                self.running[slot.learner] = Incarnation(info["incarnation"],
                                                         info["start_step"])
                continue
            # Gone while the owner was away: relaunched, as a newer incarnation.
            known = int(ledger.get(slot.learner, {}).get("incarnation", slot.incarnation))
            slots.append(relaunched(slot, known, now))
        rebuilt = fleet.rebuilt(self.fleet.settings, slots, saved["targets"],
                                saved["next_index"], saved["next_shard"],
                                saved.get("next_spare", 0),
                                bool(saved.get("operator_paused", False)))
        # A region still in its repair after a region loss starts no spare before it is over.
        self.fleet = dataclasses.replace(rebuilt, lost_regions={
            region: float(until) for region, until in saved.get("lost_regions", {}).items()},
            misconfigured=saved_marks(saved.get("misconfigured")),
            spare_backoff={region: fleet.SpareBackoff(**{k: v for k, v in b.items()
                                                         if k in BACKOFF_FIELDS})
                           for region, b in saved.get("spare_backoff", {}).items()})
        with self.lock:
            self.remote_restarts = {r: list(rows)
                                    for r, rows in saved.get("remote_restarts", {}).items()}
        return paused

    # -- the handlers: one per action type (fleet.ACTIONS) ------------------------------------
    def do_launch(self, a: fleet.Launch) -> None:
        devices, spec, identity = self.specs.learner(a)
        error = self.learners.launch(a.learner, a.incarnation, a.region, devices, spec,
                                     a.link_faults, spare=a.spare, identity=identity)
        if error is not None:   # the dead actor's name is not released yet: retry soon
            self.tell(fleet.LaunchFailed(a.learner, a.incarnation, error))
            return
        self.running[a.learner] = Incarnation(a.incarnation, a.start_step)

    def do_launchspare(self, a: fleet.LaunchSpare) -> None:
        devices, spec = self.specs.spare(a)
        error = self.learners.launch_spare(a.name, a.region, devices, spec)
        if error is not None:   # an earlier spare's name is not released yet
            self.tell(fleet.SpareEnded(a.name, error))

    def do_hurryspare(self, a: fleet.HurrySpare) -> None:
        self.learners.hurry_spare(a.name)

    def do_killspare(self, a: fleet.KillSpare) -> None:
        self.learners.end_spare(a.name)

    def do_kill(self, a: fleet.Kill) -> None:
        # Buried (decided dead): its run's end is no longer an observation.
        if self.learners.kill(a.learner, a.incarnation, a.mode, a.fault, a.reason):
            self.close(a.learner)

    def do_forget(self, a: fleet.Forget) -> None:
        """Unregisters it at the syncer and settles the incarnation's tokens."""
        # Only this incarnation: a newer one may have registered meanwhile (a remote region).
        self.syncers.forget(a.learner, a.incarnation, a.reason)
        self.refresh_syncer_status()
        self.settle(a.learner, a.incarnation, a.reason)
        inc = self.running.get(a.learner)
        if inc is not None and inc.remote and inc.number == a.incarnation:
            self.close(a.learner)

    def do_drainlearner(self, a: fleet.DrainLearner) -> None:
        self.learners.drain(a.learner)

    def do_pauselearner(self, a: fleet.PauseLearner) -> None:
        self.learners.pause(a.learner, a.paused)

    def do_hang(self, a: fleet.Hang) -> None:
        self.learners.hang(a.learner, a.duration_s)

    def do_slowdown(self, a: fleet.Slowdown) -> None:
        self.learners.apply_fault(a.learners, a.fault)

    def do_linkfault(self, a: fleet.LinkFault) -> None:
        self.learners.apply_fault(a.learners, a.fault)

    def do_partitionhome(self, a: fleet.PartitionHome) -> None:
        self.learners.partition_home(a.fault)

    def pending_remote_restarts(self) -> dict:
        """The restarts not yet taken by their region's report (its thread pops them)."""
        with self.lock:
            return {r: list(rows) for r, rows in self.remote_restarts.items()}

    def do_restartremote(self, a: fleet.RestartRemote) -> None:
        """Goes to the region's agent with the reply to its next report (the home has no handle
        on a learner in another cluster)."""
        plan = self.fleet.settings.regions.get(a.region)
        if plan is None or not plan.remote:
            raise RuntimeError(f"RestartRemote({a.learner}, incarnation {a.incarnation}): "
                               f"{a.region!r} is not a remote region of this fleet, so no "
                               "region agent can restart it")
        with self.lock:
            self.remote_restarts.setdefault(a.region, []).append(
                {"learner": a.learner, "incarnation": a.incarnation, "cause": a.cause})

    def do_killsyncer(self, a: fleet.KillSyncer) -> None:
        self.syncers.kill(a.syncer_shard, a.fault)

    def do_startsyncer(self, a: fleet.StartSyncer) -> None:
        """A dead shard restarts alone, from its newest snapshot at its next epoch (fencing);
        the other shards keep merging meanwhile. Its counters died with it: keep what it last
        reported."""
        s, last = a.shard, self.shard_status[a.shard] or SyncerStatus()
        with self.lock:
            for key in ("rejected", "staleness_counts", "participation_counts"):
                closed = self.syncer_closed.setdefault(key, {})
                for k, n in getattr(last, key).items():
                    closed[k] = closed.get(k, 0) + n
            self.shard_status[s] = dataclasses.replace(last, rejected={}, staleness_counts={},
                                                       participation_counts={})
            self.syncer_status = combined(self.shard_status)
        self.syncer_restarts += 1
        self.shard_refusals_seen[s] = 0
        self.refusals_seen = sum(self.shard_refusals_seen)
        self.start_syncer(s, a.epoch, a.restore)
        self.refresh_syncer_status()


# -- the saved state's rows ----------------------------------------------------------------------
def saved_slot(row: dict, remote: bool) -> "fleet.Slot":
    """A slot as ``Owner.save`` wrote it. ``remote``: its region runs in its own cluster, and its
    learner stays mirrored from the region's agent (lost, the home took the learner for its own:
    found it hung, restarted it at home, even prestarted it on resources only the region has).
    """
    from .health import Cause

    return fleet.Slot(
        learner=row["learner"], region=row["region"], index=row["index"],
        shard=row["shard"], speed_factor=row["speed_factor"],
        state=fleet.SlotState(row["state"]), incarnation=row["incarnation"],
        start_step=row["start_step"], actor=row.get("actor"), remote=remote,
        slow_tolerated=int(row.get("slow_tolerated", 0)),
        restarts=tuple(sorted((Cause(c), n) for c, n in row["restarts"].items())),
        # A state file from before ``counted``: every restart counts (the old rule).
        counted=tuple(sorted((Cause(c), n) for c, n in row.get("counted",
                                                                 row["restarts"]).items())),
        training_since_s=row.get("training_since_s"),
        # Its paused time so far, an open pause folded in at the save (a state file from before
        # it was saved: none). The restarted fleet pauses it again from its first step if a
        # reason still holds.
        paused_s=float(row.get("paused_s") or 0.0),
        failures=tuple((int(step), str(error)) for step, error in row.get("failures", [])),
        crash_loop=row.get("crash_loop"),
        # A handover in progress (its node is draining): it restarts elsewhere once out, not
        # retired as a plain drain would be. Its drain's deadline goes on from when it began.
        preempted_s=row.get("preempted_s"), draining_since_s=row.get("draining_since_s"))


def slot_row(x: "fleet.Slot", now_s: Optional[float] = None) -> dict:
    """A slot as ``Owner.save`` writes it at ``now_s`` (the fleet's clock; ``saved_slot`` reads
    it back). Paused time is saved with the pause it is in counted up to ``now_s``: paused time
    is not training time (``Slot.trained_seconds``), across a controller restart too.

    >>> slot = fleet.Slot("a:0", "a", 0, 0, training_since_s=100.0, paused_s=20.0,
    ...                       paused_since_s=150.0)
    >>> slot_row(slot, 200.0)["paused_s"], slot_row(slot)["paused_s"]
    (70.0, 20.0)
    """
    paused_s = x.paused_s + (now_s - x.paused_since_s
                             if now_s is not None and x.paused_since_s is not None else 0.0)
    return {"learner": x.learner, "region": x.region, "index": x.index,
            "shard": x.shard, "speed_factor": x.speed_factor, "state": x.state.value,
            "incarnation": x.incarnation, "start_step": x.start_step,
            "restarts": {c.value: n for c, n in x.restarts},
            "counted": {c.value: n for c, n in x.counted},
            "training_since_s": x.training_since_s, "paused_s": paused_s, "actor": x.actor,
            "slow_tolerated": x.slow_tolerated, "preempted_s": x.preempted_s,
            "draining_since_s": x.draining_since_s,
            "failures": [list(f) for f in x.failures], "crash_loop": x.crash_loop}


def relaunched(slot: "fleet.Slot", known: int, now: float) -> "fleet.Slot":
    """A saved slot whose learner a restarted controller did not find running: restarted now,
    after the newest incarnation the syncer's ledger knows (``known``). A handover stays one
    (its relaunch waits for placement, not timed as a start, spending no crash budget): one that
    was awaiting placement, and one saved draining off a preempted node (``preempted_s``): the
    fleet launches the handover in the step its drain ends, and the state file may be a second
    older than that launch.

    >>> row = {"learner": "a:0", "region": "a", "index": 0, "shard": 0, "speed_factor": 1.0,
    ...        "state": "awaiting_placement", "incarnation": 2, "start_step": 9, "restarts": {}}
    >>> slot = relaunched(saved_slot(row, remote=False), known=1, now=5.0)
    >>> slot.state.value, slot.incarnation, slot.restart_at_s, dict(slot.recovery)["cause"]
    ('restarting', 2, 5.0, 'preempted_planned')
    >>> row.update(state="draining", preempted_s=3.0, draining_since_s=3.0)
    >>> slot = relaunched(saved_slot(row, remote=False), known=2, now=5.0)
    >>> dict(slot.recovery)["cause"], slot.preempted_s, slot.restart_counts
    ('preempted_planned', None, {<Cause.PREEMPTED_PLANNED: 'preempted_planned'>: 1})
    """
    from .health import Cause

    recovery = slot.recovery
    if slot.state == fleet.SlotState.AWAITING_PLACEMENT:
        recovery = (("failed_s", now), ("detected_s", now),
                    ("cause", Cause.PREEMPTED_PLANNED.value))
    elif slot.state == fleet.SlotState.DRAINING and slot.preempted_s is not None:
        # As ``hand_over`` does (its step was not saved): one planned restart, timed from the
        # preemption's notice, which no failure budget counts.
        since = slot.preempted_s
        slot = slot.with_restart(Cause.PREEMPTED_PLANNED)
        recovery = (("failed_s", since), ("detected_s", since),
                    ("cause", Cause.PREEMPTED_PLANNED.value))
    return dataclasses.replace(slot, state=fleet.SlotState.RESTARTING,
                               incarnation=max(slot.incarnation, known), restart_at_s=now,
                               recovery=recovery, preempted_s=None, draining_since_s=None)


def saved_marks(saved) -> dict:
    """The fleet's misconfigured marks as ``Owner.save`` wrote them ({node: {region: line}});
    the older shape {region: line} (a region's mark, its node not known) becomes the marks of
    ``fleet.UNKNOWN_NODE``, which block their regions as before; none saved: none.

    >>> saved_marks({"n1": {"gpu": "device check failed: x"}}), saved_marks({"gpu": "device check failed: x"})
    ({'n1': {'gpu': 'device check failed: x'}}, {'unknown': {'gpu': 'device check failed: x'}})
    """
    out: dict = {}
    for key, value in (saved or {}).items():
        if isinstance(value, str):
            out.setdefault(fleet.UNKNOWN_NODE, {})[key] = value
        else:
            out.setdefault(key, {}).update({r: str(m) for r, m in value.items()})
    return out
