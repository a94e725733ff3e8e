"""The controller actor: a thin single-writer shell around the pure fleet state machine.

One thread (the owner) holds the fleet. Everything else it hears about — learners' heartbeats,
their ``run`` futures resolving, cluster membership, the syncer's ledger, the chaos plan coming
due, operator commands — becomes an observation; the owner hands them to ``fleet.step`` with the
wall clock and carries out the actions it returns (launch, kill, forget, drain, pause, chaos).
Decisions live in ``fleet.py``, books in ``books.py``, the snapshot in ``snapshot.py``; this file
only talks to Ray. Control plane only: tensors flow learner <-> syncer directly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Optional

from . import fleet as fleet_lib
from . import seam
from .books import Books
from islands.learners.fates import newest
from .chaos import HOME_TARGET, Fault, FaultKind
from islands.learners.messages import Heartbeat, known_stats
from islands.syncer import timing

from .fleet import SlotState
from . import groups_api
from .groups_api import SyncerStatus, combined
from .groups import (LearnerGroups, SyncerShards, cluster_view, drain_node, draining_nodes,
                     restarted_actor, share)
from .metrics import window_to_save
from .snapshot import finite
from .runtime import (CONTROLLER_NAME, NAMESPACE, SYNCER_NAME, controller_options,  # noqa: F401
                      enable_compile_cache, learner_actor_name,
                      syncer_options)

log = logging.getLogger("islands.controller")

EVENT_LOG_LIMIT = 100_000


@dataclasses.dataclass
class Incarnation:
    """What the controller knows of a slot's running incarnation (its Ray side is in
    ``LearnerGroups``)."""

    number: int
    start_step: int = 0
    beat: Optional[Heartbeat] = None   # its last heartbeat (none yet: it is starting)
    remote: bool = False   # in a region's own cluster: known from its agent's reports (link/)

    def counters(self) -> dict:
        """Its newest counters as plain values (the books, the saved state and the snapshot
        read these): its last heartbeat's, or its start step before the first."""
        return self.beat.as_dict() if self.beat is not None else {"step": self.start_step}

    def ended_with(self, final: dict) -> None:
        """Its run returned ``final`` (the unit's last stats): they update its last beat."""
        stats = {k: v for k, v in known_stats(final).items() if k not in ("learner",
                                                                           "incarnation")}
        if self.beat is not None:
            self.beat = dataclasses.replace(self.beat, **stats)
            return
        self.beat = Heartbeat.from_dict({"step": self.start_step, "t": time.time(), **stats,
                                         "learner": final.get("learner", ""),
                                         "incarnation": self.number})


def missed_restarts(saved_started: Optional[list], shard: int, live_epoch: int) -> int:
    """Syncer restarts a restarted controller's saved state does not know of: each restart starts
    the shard at the epoch after the dead one's, so the live shard's epoch less the one it was
    last started with (as saved) counts them. No saved epoch (an older state file): none.

    >>> missed_restarts([3, 5], 1, 6), missed_restarts([3], 0, 3), missed_restarts(None, 0, 9)
    (1, 0, 0)
    """
    if not saved_started or shard >= len(saved_started):
        return 0
    return max(0, live_epoch - int(saved_started[shard]))


class OwnerRole:
    """Where an owner runs, as the points of its loop that differ: this base is the home's
    controller (its own syncer shards, its own evaluation, nothing more on a step); a region's
    agent is the same owner with ``region_agent.RegionRole``, whose one syncer is its link.

    The owner calls these at fixed points; a role holds no fleet state of its own beyond what
    it reports elsewhere (a region's last failure causes), so the owner stays the one writer.
    """

    owns_syncers = True   # False: its one syncer shard is a link it attaches (attach_link)
    evaluates = True      # False: the home evaluates Θ; a region fetches nothing for it

    def bind(self, owner: "Controller") -> None:
        """The owner it serves, told before the owner builds or recovers anything."""

    def fleet_settings(self, settings: fleet_lib.FleetSettings) -> fleet_lib.FleetSettings:
        return settings

    def attach_link(self) -> None:
        """Attaches the syncer shard that is a link (a role that ``owns_syncers`` has none)."""
        raise NotImplementedError("the home starts its own syncer shards")

    def recovery_observations(self) -> list:
        """What a restarted owner's first step hears besides its rebuilt fleet."""
        return []

    def heard(self, beat: Heartbeat) -> None:
        """A heartbeat the owner took."""

    def recorded(self, transition: fleet_lib.Transition) -> None:
        """A transition the owner recorded (its event is emitted)."""

    def stepped(self) -> None:
        """The owner's step is done (its new fleet adopted, its actions carried out)."""

    def handlers(self) -> seam.Table:
        """Handlers that replace the owner's for some action types (none: the home's)."""
        return {}


HOME = OwnerRole()   # holds no state: every home controller shares it


class Controller:
    """Create with ``ray.remote(Controller).options(**controller_options(run_dir))``.

    Args:
      config: a JobConfig (validated before any actor starts).
      run_dir: the job's run directory (snapshots, compile cache).
      resume: start the syncer from the newest snapshot in the job's snapshot directory.
      role: where it runs (``OwnerRole``): the home (default) or a region's agent.
    """

    role: OwnerRole = HOME

    def __init__(self, config, run_dir: str, resume: bool = False,
                 role: Optional[OwnerRole] = None):
        from . import build

        self.config, self.run_dir, self.resume = config, run_dir, resume
        if role is not None:
            self.role = role
        self.role.bind(self)
        self.fleet = fleet_lib.initial(self._fleet_settings())
        self.books = Books(config.syncer.fragments)
        self.inbox: "queue.Queue[tuple[Any, Optional[Future]]]" = queue.Queue()
        self.running: dict[str, Incarnation] = {}
        self.groups = LearnerGroups()   # every Ray call for learners and spares
        self.closed: dict[str, dict] = {}    # per learner: counters of ended incarnations
        self.lock = threading.Lock()         # guards events and the syncer status for readers
        self.events: list[dict] = []
        self.started_s = time.time()
        self.job_started_s: Optional[float] = None
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.syncer_status = SyncerStatus()  # every shard's status as one (syncer/shards.py)
        # Syncer shards (syncer.shards = S): their Ray side, and per shard its status.
        self.shards = SyncerShards(0)
        self.shard_status: list[Optional[SyncerStatus]] = []   # None: not answered yet
        self.shard_refusals_seen: list = []
        self.syncer_restarts = 0
        self.refusals_seen = 0               # the current syncer's refusals already emitted
        self.syncer_closed: dict = {"rejected": {}, "staleness_counts": {},
                                    "participation_counts": {}}
        self.eval_history: list[tuple[float, int, float]] = []
        self.initial_eval_loss: Optional[float] = None
        self.recoveries: list[dict] = []
        self.chaos_fired: list[dict] = []
        self.goodput_history: list = []
        self.step_seconds: dict = {}         # per region: histogram of heartbeats' step times
        self.badput_high: dict = {}          # per cause: the highest exported (never goes back)
        self.metrics_server = None
        self.console = None                  # console.ConsoleServer, once served
        self.ray_metrics = None
        self.link_regions: dict[str, dict] = {}   # per remote region: its link's last report
        self.remote_beats: dict[tuple, Heartbeat] = {}  # (learner, incarnation) -> newest
        self.remote_restarts: dict[str, list] = {}  # per remote region: restarts for its agent
        self.settings = build.controller_settings(config)
        self.chaos_plan = build.chaos_plan(config)
        self.state_path = os.path.join(run_dir, "controller_state.json")
        # Every fleet action's handler, found now: a body missing one does not start.
        self.handlers = {**seam.handler_table(self, "_do_"), **self.role.handlers()}
        if restarted_actor():
            self._recover()

    def _fleet_settings(self) -> fleet_lib.FleetSettings:
        from . import build

        return self.role.fleet_settings(build.fleet_settings(self.config))

    # -- events ---------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        now = time.time()
        event = {"t": now, "elapsed_s": round(now - self.started_s, 3), "event": kind, **fields}
        with self.lock:
            if len(self.events) < EVENT_LOG_LIMIT:
                self.events.append(event)
        log.info("%s %s", kind, fields)

    def events_since(self, index: int) -> tuple[list[dict], int]:
        """Events after the first ``index``; all of them when ``index`` is past the end (the
        caller's count is from before this controller restarted)."""
        with self.lock:
            if index > len(self.events):
                index = 0
            return self.events[index:], len(self.events)

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> dict:
        """Builds the model once, starts the syncer, launches the learners and the owner thread."""
        from islands.learners.unit import warm_compile_cache

        from . import build

        t0 = time.time()
        self._build_task()
        t_task = time.time()
        self.jax_cache_dir = os.path.join(self.run_dir, "jax_cache")
        enable_compile_cache(self.jax_cache_dir)
        # Restarts load it instead of compiling. This process compiles for its CPU, whose
        # programs only CPU learners can load (the cache is per platform): where every learner
        # of this cluster runs on an accelerator it would cost the job's start a CPU compile and
        # step of the model (minutes for 124M on single-threaded XLA) for nothing.
        if any(not r.remote and r.devices().accelerator == "cpu"
               for r in self.config.regions.values()):
            warm_compile_cache(self.training, self.template, self.task)
        t_cache = time.time()
        self.syncer_spec = build.syncer_spec(self.config, self.template, self.run_dir,
                                             self.task.is_embedding)
        self._init_shards()
        for s in range(self.shards.count):
            self._start_syncer(epoch=0, restore=self.resume, syncer_shard=s)
        self._refresh_syncer_status()
        t_syncer = time.time()
        self._step([self._applied()])  # launches the configured learners (resumed: at their step)
        # Seconds of the job's start before its learners were launched (benchmarks/startup.py).
        self.start_phases = {"build_task_s": t_task - t0, "warm_cache_s": t_cache - t_task,
                             "syncer_s": t_syncer - t_cache, "launch_s": time.time() - t_syncer}
        for target in (self._owner_loop, self._eval_loop):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self.threads.append(thread)
        self.job_started_s = time.time()  # the chaos plan's clock: faults hit a running job
        self.emit("job_started", learners=list(self.fleet.slots), regions=list(self.config.regions),
                  num_params=_num_params(self.template),
                  start_phases={k: round(v, 3) for k, v in self.start_phases.items()})
        return {"learners": list(self.fleet.slots)}

    def _build_task(self) -> None:
        """Builds the job's task once here: the initial params (the syncer's Θ) and, for the
        built-in byte LM, its corpus, put in the object store so every learner maps the same
        train bytes instead of reading them."""
        from islands.learners.unit import build_task, build_training, is_builtin, load_corpus

        from . import build

        self.training = build.training_spec(self.config)
        self.corpus_ref = None
        train_bytes = None
        if is_builtin(self.training):
            train_bytes = load_corpus(self.training).train
            self.corpus_ref = share(train_bytes)
        self.task = build_task(self.training, train_bytes)
        _, self.template, _, _ = build_training(self.training, task=self.task)

    def _init_shards(self) -> None:
        """The syncer shards' specs (one: the single syncer) and their empty slots. A region's
        agent has one, its link, whatever ``syncer.shards`` the job has: the home's shards are
        behind it (the region's learners reach shards s > 0 through the ``LinkShard`` actors
        ``join`` starts; their forgets and statuses are the link's)."""
        from islands.syncer.shards import shard_specs

        self.shard_specs = shard_specs(self.syncer_spec, self.config.syncer.shards)
        n = len(self.shard_specs) if self.role.owns_syncers else 1
        self.shards = SyncerShards(n)
        self.shard_status, self.shard_refusals_seen = [None] * n, [0] * n
        self.started_epochs = [0] * n     # the epoch each shard was last started with, here

    def _start_syncer(self, epoch: int, restore: bool, syncer_shard: int = 0) -> None:
        """Starts one syncer shard (shard 0 keeps the name ``islands:syncer``); a region's agent
        attaches its link instead."""
        from islands.syncer.shards import syncer_shard_name

        if not self.role.owns_syncers:
            self.role.attach_link()
            return
        s = syncer_shard
        options = dict(syncer_options(self.jax_cache_dir), name=syncer_shard_name(s))
        ready = self.shards.start(s, self.shard_specs[s], epoch, restore, options,
                                  self.settings.placement_timeout_s)
        self.started_epochs[s] = int(ready["epoch"])
        self.inbox.put((fleet_lib.SyncerStarted(s, int(ready["epoch"])), None))
        shard = {"shard": s} if self.shards.count > 1 else {}
        self.emit("syncer_started", epoch=ready["epoch"], versions=ready["versions"],
                  restored_from=ready["restored_from"], journaled=ready.get("journaled", []),
                  **shard)

    # -- surviving a restart of this actor -------------------------------------------------------
    def _save_state(self) -> None:
        """What a restarted controller cannot ask anyone else for: the books, the slots' states and
        restart counts, the chaos plan's progress (written atomically, about once a second)."""
        fleet = self.fleet
        state = {
            "books": self.books.to_json(), "closed": self.closed,
            "slots": [{"learner": x.learner, "region": x.region, "index": x.index,
                       "shard": x.shard, "speed_factor": x.speed_factor, "state": x.state.value,
                       "incarnation": x.incarnation, "start_step": x.start_step,
                       "restarts": {c.value: n for c, n in x.restarts}, "actor": x.actor,
                       "slow_tolerated": x.slow_tolerated}
                      for x in fleet.slots.values()],
            "targets": dict(fleet.targets), "next_index": dict(fleet.next_index),
            "next_shard": fleet.next_shard, "next_spare": fleet.next_spare,
            "operator_paused": fleet.operator_paused,
            "recoveries": self.recoveries[-1000:],
            "eval_history": self.eval_history[-1000:], "initial_eval_loss": self.initial_eval_loss,
            "syncer_restarts": self.syncer_restarts, "syncer_closed": self.syncer_closed,
            "chaos_fired": self.chaos_fired, "job_started_s": self.job_started_s,
            "started_s": self.started_s, "restarts": getattr(self, "restarts", 0),
            "syncer_epoch": int(self.syncer_status.epoch),
            "syncer_epochs": [int(st.epoch) if st is not None else 0 for st in self.shard_status],
            "started_epochs": list(self.started_epochs),
            "goodput_history": window_to_save(self.goodput_history, time.time(),
                                              self.settings.goodput_window_s),
            "step_seconds": self.step_seconds}
        os.makedirs(self.run_dir, exist_ok=True)
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(finite(state), f, default=str, allow_nan=False)
        os.replace(tmp, self.state_path)

    def _recover(self) -> None:
        """Rebuilds the controller after Ray restarted it: its saved books and slots, the live
        syncer (or a restored one), and the learners that kept training meanwhile — none of them
        is stopped. Learners that died while it was away are relaunched by the first step."""
        from . import build
        from .health import Cause

        with open(self.state_path) as f:
            saved = json.load(f)
        self.books = Books.from_json(saved["books"])
        self.closed = saved["closed"]
        self.recoveries, self.chaos_fired = saved["recoveries"], saved["chaos_fired"]
        self.eval_history = [tuple(e) for e in saved["eval_history"]]
        self.initial_eval_loss = saved["initial_eval_loss"]
        self.syncer_restarts, self.syncer_closed = saved["syncer_restarts"], saved["syncer_closed"]
        self.started_s, self.job_started_s = saved["started_s"], saved["job_started_s"]
        self.restarts = saved["restarts"] + 1
        # The sliding goodput window goes on from the samples it held (not from 1.0 at zero).
        self.goodput_history = [tuple(x) for x in saved.get("goodput_history") or []]
        self.step_seconds = saved.get("step_seconds") or {}
        if self.chaos_plan is not None and self.job_started_s is not None:
            self.chaos_plan.due(time.time() - self.job_started_s)  # fired before: not again
        self._build_task()
        self.jax_cache_dir = os.path.join(self.run_dir, "jax_cache")
        enable_compile_cache(self.jax_cache_dir)
        self.syncer_spec = build.syncer_spec(self.config, self.template, self.run_dir,
                                             self.task.is_embedding)
        self._init_shards()
        epochs = saved.get("syncer_epochs") or [saved["syncer_epoch"]]
        for s in range(self.shards.count):
            from islands.syncer.shards import syncer_shard_name

            try:
                live_epoch = int(self.shards.attach(s, syncer_shard_name(s), 30)["epoch"])
                # A restart between the last save and this controller's death (the state is
                # up to a second old) left the shard at a newer epoch than saved: count it.
                self.syncer_restarts += missed_restarts(saved.get("started_epochs"), s,
                                                        live_epoch)
                self.started_epochs[s] = live_epoch
            except Exception:  # it died too: the usual syncer restart
                self.syncer_restarts += 1
                epoch = epochs[s] if s < len(epochs) else max(epochs)
                self._start_syncer(epoch=epoch + 1, restore=True, syncer_shard=s)
        self._refresh_syncer_status()
        ledger = self.syncer_status.ledger
        now = time.time()
        slots, paused = [], []
        for row in saved["slots"]:
            slot = fleet_lib.Slot(
                learner=row["learner"], region=row["region"], index=row["index"],
                shard=row["shard"], speed_factor=row["speed_factor"],
                state=fleet_lib.SlotState(row["state"]), incarnation=row["incarnation"],
                start_step=row["start_step"], actor=row.get("actor"),
                slow_tolerated=int(row.get("slow_tolerated", 0)),
                restarts=tuple(sorted((Cause(c), n) for c, n in row["restarts"].items())))
            if slot.state in fleet_lib.GONE:
                slots.append(slot)
                continue
            if self.config.regions[slot.region].remote:
                # Its agent runs it in the region's own cluster: nothing here to re-attach or
                # relaunch. It is kept as saved; the agent's next report (every second) says
                # how it is, and its beats time from now.
                slots.append(dataclasses.replace(slot, last_beat_s=now))
                self.running[slot.learner] = Incarnation(slot.incarnation, remote=True)
                continue
            # Still running? then it keeps training under the new controller.
            info = self.groups.reattach(slot.learner, slot.actor or slot.learner,
                                        self.config.regions[slot.region].devices().hosts)
            if info is not None and info["state"] in ("training", "paused", "draining",
                                                      "starting"):
                running_state = {"training": fleet_lib.SlotState.TRAINING,
                                 "paused": fleet_lib.SlotState.TRAINING,  # the floor decides again
                                 "draining": fleet_lib.SlotState.DRAINING,
                                 "starting": fleet_lib.SlotState.STARTING}[info["state"]]
                if slot.state == fleet_lib.SlotState.DRAINING:
                    running_state = fleet_lib.SlotState.DRAINING
                if info["state"] == "paused":
                    paused.append(slot.learner)
                slots.append(dataclasses.replace(
                    slot, state=running_state, incarnation=info["incarnation"],
                    start_step=info["start_step"], launched_s=now, last_beat_s=now))
                self.running[slot.learner] = Incarnation(info["incarnation"],
                                                         info["start_step"])
                continue
            # Gone while the controller was away: relaunched, as a newer incarnation.
            known = int(ledger.get(slot.learner, {}).get("incarnation", slot.incarnation))
            slots.append(dataclasses.replace(slot, state=fleet_lib.SlotState.RESTARTING,
                                             incarnation=max(slot.incarnation, known),
                                             restart_at_s=now))
        self.fleet = fleet_lib.rebuilt(self.fleet.settings, slots, saved["targets"],
                                       saved["next_index"], saved["next_shard"],
                                       saved.get("next_spare", 0),
                                       bool(saved.get("operator_paused", False)))
        # Spares waiting for promotion are not worth a recovery: end them; the fleet starts
        # new ones once nobody is starting.
        self.groups.end_stray_spares({x.actor for x in slots if x.actor})
        self.emit("controller_restarted", restarts=self.restarts,
                  learners_kept=sorted(self.running),
                  relaunched=sorted(s.learner for s in slots
                                    if s.state == fleet_lib.SlotState.RESTARTING))
        # The rebuilt fleet is not paused: its first step pauses the learners again if a reason
        # still holds; else those found paused resume (nothing else would ever resume them).
        self._step(self.role.recovery_observations())
        if self.fleet.paused_reason is None:
            for learner in paused:
                self.groups.call(learner, "pause", False, time.time_ns())
        for target in (self._owner_loop, self._eval_loop):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self.threads.append(thread)

    # -- the owner thread -----------------------------------------------------------------------
    def _owner_loop(self) -> None:
        last = {"cluster": 0.0, "syncer": 0.0}
        while not self.stop_event.is_set():
            try:
                observations = self._drain_inbox()
                observations += self._ended_runs()
                observations += self._spare_observations()
                observations += self._ended_syncers()
                now = time.time()
                if now - last["cluster"] >= 2.0:
                    observations.append(self._cluster())
                    last["cluster"] = now
                # Faster while a restarted learner's first merged contribution is awaited.
                awaiting = any(s.recovery is not None and "restarted_s" in dict(s.recovery)
                               for s in self.fleet.slots.values())
                if now - last["syncer"] >= (0.2 if awaiting else 1.0):
                    self._refresh_syncer_status()
                    observations.append(self._applied())
                    observations += self._refusals()
                    gp = self.goodput()
                    self.goodput_history.append((now, gp["useful_s"], gp["allocated_s"]))
                    del self.goodput_history[:-100_000]
                    self._mirror_ray_metrics()
                    last["syncer"] = now
                observations += self._due_faults()
                self._step(observations)
                if now - last.get("saved", 0.0) >= 1.0:
                    self._save_state()
                    last["saved"] = now
            except Exception as exc:  # keep owning the fleet; say what broke, once per error
                log.exception("controller iteration failed")
                if repr(exc) != getattr(self, "_last_error", None):
                    self._last_error = repr(exc)
                    self.emit("monitor_error", error=repr(exc)[:300],
                              where=traceback.format_exc(limit=3)[-600:])
            # Wake on a run ending (a real event) or after a short tick.
            if not self.groups.wait(self.shards.closed_refs, 0.2):
                self.stop_event.wait(0.2)

    def _drain_inbox(self) -> list:
        """Queued observations; a command is stepped on its own so its error is its caller's."""
        observations = []
        while True:
            try:
                obs, reply = self.inbox.get_nowait()
            except queue.Empty:
                return observations
            if reply is None:
                observations.append(obs)
                continue
            try:
                self._step(observations + [obs])
                observations = []
                reply.set_result(None)
            except fleet_lib.CommandError as exc:
                self._step(observations)
                observations = []
                reply.set_exception(exc)

    def _step(self, observations: list) -> None:
        seam.turn(self.fleet, observations, time.time(), adopt=self._adopt_fleet,
                  record=self._record, recorded=self._track_slots, table=self.handlers,
                  on_error=self._action_failed)
        self.role.stepped()

    def _adopt_fleet(self, fleet: fleet_lib.FleetState) -> None:
        self.fleet = fleet

    def _track_slots(self) -> None:
        self.books.track({n: x.state.value for n, x in self.fleet.slots.items()}, time.time())

    def _action_failed(self, action, exc: Exception) -> None:
        self.emit("action_failed", action=type(action).__name__, error=repr(exc)[:300])

    def _record(self, t: fleet_lib.Transition) -> None:
        fields = dict(t.fields)
        if t.learner is not None:
            fields.setdefault("learner", t.learner)
        now = time.time()
        if t.name in ("learner_launched", "learner_restarted"):
            self.books.allocate(t.learner, now)
            if t.fields.get("remote"):  # its agent launched it: home keeps its books
                self._close(t.learner)  # the previous incarnation's newest beat stays in closed
                number = int(t.fields["incarnation"])
                self.running[t.learner] = Incarnation(
                    number, beat=self.remote_beats.pop((t.learner, number), None), remote=True)
        elif t.name == "learner_retired":
            self.books.release(t.learner, now)
        elif t.name == "learner_recovered":
            self.recoveries.append(dict(t.fields))
        self.emit(t.name, **fields)
        self.role.recorded(t)

    def _command(self, obs) -> None:
        """Queues an operator command for the owner thread and waits for its verdict."""
        fleet_lib.check_command(self.fleet, obs)  # fail fast with the reason
        reply: Future = Future()
        self.inbox.put((obs, reply))
        reply.result(timeout=60)

    # -- observations from Ray ------------------------------------------------------------------
    def heartbeat(self, beat: "Heartbeat | dict") -> None:
        """Called by learners (fire and forget); a region agent's beats arrive as dicts."""
        from .metrics import observe_step

        beat = Heartbeat.of(beat)
        run = self.running.get(beat.learner)
        if run is not None and run.number == beat.incarnation:
            if beat.devices is not None and (run.beat is None or run.beat.devices is None):
                # Its first beat: the devices it proved at start, once per incarnation.
                devices = beat.devices
                self.emit("learner_devices", learner=beat.learner, incarnation=beat.incarnation,
                          backend=devices.get("backend"), platform=devices.get("platform"),
                          device_kind=devices.get("kind"), count=devices.get("count"))
            run.beat = beat
            slot = self.fleet.slots.get(beat.learner)
            if slot is not None and beat.step_time_s and beat.training:
                with self.lock:
                    observe_step(self.step_seconds, slot.region, float(beat.step_time_s))
        self.inbox.put((fleet_lib.Beat(beat.learner, beat.incarnation, beat.training,
                                       beat.step_time_s, beat.node_id, beat.ready_at,
                                       adopted=beat.adopted > 0), None))
        self.role.heard(beat)

    def _ended_runs(self) -> list:
        out = []
        for ended in self.groups.ended():
            inc = self.running.get(ended.learner)
            if inc is not None and ended.final:
                inc.ended_with(ended.final)
            if ended.crashed:
                self.emit("learner_error", learner=ended.learner, error=ended.error)
            out.append(fleet_lib.RunEnded(ended.learner, ended.incarnation, ended.error,
                                          ended.preempted, ended.crashed))
            if inc is not None and not inc.remote and inc.number == ended.incarnation:
                self._close(ended.learner)
        return out

    def _cluster(self) -> fleet_lib.Cluster:
        total, alive = cluster_view(self.config.regions)
        # Whole units: a unit of H hosts takes H of its region's resource.
        return fleet_lib.Cluster({r: float(int(total.get(f"region:{r}", 0.0)
                                               / self.config.regions[r].devices().hosts + 1e-9))
                                  for r in self.config.regions}, alive, draining_nodes())

    def _applied(self) -> fleet_lib.Applied:
        ledger = self.syncer_status.ledger
        return fleet_lib.Applied({name: (int(e["incarnation"]), int(e["applied_step"]),
                                         int(e["applied_tokens_incarnation"]))
                                  for name, e in ledger.items()})

    def _refusals(self) -> list:
        """Every refused push becomes a ``push_refused`` event; a learner the syncer quarantined
        (its drifts kept being refused as garbage) becomes an observation."""
        refusals = self.shards.refusals_since(self.shard_refusals_seen)
        self.refusals_seen = sum(self.shard_refusals_seen)
        for refusal in refusals:
            self.emit("push_refused", **refusal)
        return [fleet_lib.Quarantine(name, incarnation, "drifts refused as garbage")
                for name, incarnation in self.syncer_status.quarantined.items()]

    def _due_faults(self) -> list:
        if self.chaos_plan is None or self.job_started_s is None:
            return []
        out = []
        for fault in self.chaos_plan.due(time.time() - self.job_started_s):
            # Wall-clock times from here on: each learner checks link windows on its own clock.
            fired = dataclasses.replace(fault, at_s=time.time())
            try:
                fleet_lib.check_command(self.fleet, fleet_lib.Chaos(fired))
                out.append(fleet_lib.Chaos(fired))
                message = "fired"
            except fleet_lib.CommandError as exc:  # e.g. the target is down already: moot
                message = f"not fired: {exc}"
            self.chaos_fired.append({"at_s": fault.at_s, "kind": fault.kind.value,
                                     "target": fault.target, "message": message})
        return out

    # -- actions --------------------------------------------------------------------------------
    def _do_launch(self, a: fleet_lib.Launch) -> None:
        from . import build

        spec = build.learner_spec(self.config, self.training, a, self.corpus_ref,
                                  self.jax_cache_dir)
        error = self.groups.launch(a.learner, a.incarnation, a.region,
                                   build.learner_devices(self.config, a.region), spec,
                                   a.link_faults, spare=a.spare,
                                   identity=build.identity(spec) if a.spare else None)
        if error is not None:   # the dead actor's name is not released yet: retry soon
            self.inbox.put((fleet_lib.LaunchFailed(a.learner, a.incarnation, error), None))
            return
        self.running[a.learner] = Incarnation(a.incarnation, a.start_step)

    def _do_launchspare(self, a: fleet_lib.LaunchSpare) -> None:
        from . import build

        spec = build.spare_spec(self.config, self.training, a.name, a.region, self.corpus_ref,
                                self.jax_cache_dir)
        error = self.groups.launch_spare(a.name, a.region,
                                         build.learner_devices(self.config, a.region), spec)
        if error is not None:   # an earlier spare's name is not released yet
            self.inbox.put((fleet_lib.SpareEnded(a.name, error), None))

    def _do_killspare(self, a: fleet_lib.KillSpare) -> None:
        self.groups.end_spare(a.name)

    def _spare_observations(self) -> list:
        """A spare whose ``prepare`` returned is ready; one whose call failed has ended."""
        return [fleet_lib.SpareReady(r.name, r.prepare_s, r.node_id) if isinstance(r, groups_api.SpareReady)
                else fleet_lib.SpareEnded(r.name, r.error) for r in self.groups.spare_results()]

    def _do_kill(self, a: fleet_lib.Kill) -> None:
        # Buried (decided dead): its run future is no longer an observation.
        if self.groups.kill(a.learner, a.incarnation, a.mode):
            self._close(a.learner)

    def _do_forget(self, a: fleet_lib.Forget) -> None:
        """Unregisters it at the syncer and settles the incarnation's tokens."""
        # Only this incarnation: a newer one may have registered meanwhile (a remote region).
        self.shards.forget(a.learner, a.incarnation, a.reason)
        self._refresh_syncer_status()
        closed = self.closed.setdefault(a.learner, {"steps": 0, "up": 0, "down": 0})
        if closed.get("settled") == a.incarnation:
            return
        # The newest of its books: its last heartbeat (the incarnation may still be in `running`
        # when its death was seen before its run ended), or what its newest push carried.
        inc = self.running.get(a.learner)
        beat = inc.counters() if inc is not None and inc.number == a.incarnation else closed.get(
            "beat", {})
        entry = self.syncer_status.ledger.get(a.learner) or {}
        same = int(entry.get("incarnation", -1)) == a.incarnation
        fates = newest(beat.get("fates") if int(beat.get("incarnation", a.incarnation))
                       == a.incarnation else None, entry.get("fates") if same else None)
        merged_steps = {int(p): int(v) for p, v in (entry.get("merged_steps") or {}).items()
                        } if same else {}
        self.books.close_incarnation(a.learner, fates, merged_steps, a.reason)
        closed["settled"] = a.incarnation
        if inc is not None and inc.remote and inc.number == a.incarnation:
            self._close(a.learner)

    def _close(self, learner: str) -> None:
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

    def _do_drainlearner(self, a) -> None:
        self.groups.call(a.learner, "drain")

    def _do_pauselearner(self, a) -> None:
        # Ordered: the learner applies the newest call only (LearnerUnit.pause).
        self.groups.call(a.learner, "pause", a.paused, time.time_ns())

    def _do_slowdown(self, a) -> None:
        for learner in a.learners:
            self.groups.call(learner, "slowdown", a.fault.factor, a.fault.duration_s)

    def _do_hang(self, a) -> None:
        self.groups.call(a.learner, "hang", a.duration_s)

    def _do_linkfault(self, a) -> None:
        for learner in a.learners:
            self.groups.call(learner, "link_fault", a.fault)

    def _do_partitionhome(self, a) -> None:
        """The link server (the home's side of every region's link) goes down for the window."""
        import ray
        from islands.link.server import LINK_SERVER_NAME

        ray.get_actor(LINK_SERVER_NAME, namespace=NAMESPACE).partition.remote(a.fault.duration_s)

    def _do_restartremote(self, a) -> None:
        """Goes to the region's agent with the reply to its next report (the home has no handle
        on a learner in another cluster)."""
        with self.lock:
            self.remote_restarts.setdefault(a.region, []).append(
                {"learner": a.learner, "incarnation": a.incarnation, "cause": a.cause})

    def _do_killsyncer(self, a) -> None:
        self.shards.kill(a.syncer_shard)

    # -- regions in their own clusters (link/) --------------------------------------------------
    def link_report(self, report: dict) -> dict:
        """A remote region's report, relayed by the home's link server: its learners' states
        become ``RemoteReport`` observations and their heartbeats (books included) are kept as
        a local learner's are. Returns the home syncer's view of the region's learners."""
        region, now = report["region"], time.time()
        beats = remote_heartbeats(report.get("beats", []))
        with self.lock:
            self.link_regions[region] = {"bytes": dict(report.get("link_bytes") or {}),
                                         "reconnects": int(report.get("reconnects") or 0),
                                         "last_report_s": now}
        for learner, beat in beats.items():
            inc = self.running.get(learner)
            number = beat.incarnation
            if inc is not None and inc.remote and inc.number == number:
                inc.beat = beat
            else:  # its incarnation is not known here yet: kept for when it is
                self.remote_beats[(learner, number)] = beat
        # The agent is alive when it updated its slots lately (the link client outlives it).
        age = float(report.get("agent_age_s") or 0.0)
        agent_alive = fleet_lib.agent_reporting(now, now - age,
                                                self.fleet.settings.heartbeat_timeout_s)
        for s in report.get("slots", []):
            beat = beats.get(s["learner"])
            self.inbox.put((fleet_lib.RemoteReport(
                s["learner"], region, int(s["incarnation"]), s["state"], int(s.get("shard", 0)),
                beat.step_time_s if beat is not None else None, s.get("last_cause") or "",
                beat=beat is not None and beat.incarnation == int(s["incarnation"]),
                agent_alive=agent_alive, restarts=fleet_lib.restart_counts(s.get("restarts_json"))),
                None))
        with self.lock:
            status = self.syncer_status
            restarts = self.remote_restarts.pop(region, [])
        mine = lambda table: {k: v for k, v in (table or {}).items()  # noqa: E731
                              if k.rsplit(":", 1)[0] == region}
        return {"epoch": status.epoch, "versions": list(status.versions),
                "merges": status.merges, "ledger": mine(status.ledger),
                "registered": mine(status.registered),
                "quarantined": mine(status.quarantined), "restart": restarts,
                "paused": self.fleet.paused_reason,   # the region's learners pause with home
                **({"ended": f"the home job {self.config.name!r} is stopping"}
                   if self.fleet.stopping else {})}

    # -- the syncer -----------------------------------------------------------------------------
    def _ended_syncers(self) -> list:
        """Shards whose actor ended, with the epoch each last reported: the fleet restarts
        them (``StartSyncer``)."""
        if self.stop_event.is_set():
            return []
        return [fleet_lib.SyncerEnded(e.shard, self._shard_epoch(e.shard))
                for e in self.shards.ended()]

    def _shard_epoch(self, s: int) -> int:
        status = self.shard_status[s]
        return int(status.epoch) if status is not None else 0

    def _do_startsyncer(self, a: fleet_lib.StartSyncer) -> None:
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
        self._start_syncer(epoch=a.epoch, restore=a.restore, syncer_shard=s)
        self._refresh_syncer_status()

    def _refresh_syncer_status(self) -> None:
        # ξ_step and the pause rule as the in-process driver computes them (syncer/timing.py),
        # from the step times the TRAINING slots' heartbeats carried.
        slowest = timing.slowest_step_s(s.step_time_s for s in self.fleet.slots.values()
                                        if s.state == SlotState.TRAINING)
        # A shard that cannot answer keeps its last status.
        statuses = self.shards.statuses(slowest, timing.merges_held(self.fleet.paused_reason))
        if not statuses:
            return
        with self.lock:
            for s, status in statuses.items():
                self.shard_status[s] = status
            self.syncer_status = combined(self.shard_status)

    # -- evaluation -----------------------------------------------------------------------------
    def _eval_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.evaluate_now()
            except Exception as exc:
                log.info("eval skipped: %s", exc)
            self.stop_event.wait(self.settings.eval_every_s)

    def evaluate_now(self) -> Optional[float]:
        """The eval loss of the syncer's global parameters now (also recorded); None where the
        home evaluates (a region's agent)."""
        from islands.learners.unit import eval_loss_fn

        if not self.role.evaluates:
            return None
        if not hasattr(self, "_evaluate"):
            self._evaluate = eval_loss_fn(self.training, self.template, self.task)
        flat = self.shards.global_params()
        loss = self._evaluate(flat)
        with self.lock:
            if self.initial_eval_loss is None:
                self.initial_eval_loss = loss
            self.eval_history.append((time.time() - self.started_s, self.tokens()["applied"],
                                      loss))
        return loss

    # -- the books and the snapshot -------------------------------------------------------------
    def _live_fates(self) -> dict:
        """Each running incarnation's own books, from its newest heartbeat."""
        return {name: inc.beat.fates if inc.beat is not None else None
                for name, inc in list(self.running.items())}

    def tokens(self) -> dict:
        """Tokens by fate, each counted where it happens (``books.py``): applied, dropped (by
        reason) and in flight, which account for every processed token."""
        return self.books.tokens(self._live_fates()).as_dict(self.books.num_fragments)

    def goodput(self) -> dict:
        from .metrics import window_label, windowed_ratio
        from .books import goodput

        now = time.time()
        useful = self.books.useful_s(self._live_fates())
        allocated = self.books.allocated_s(now)
        window_s = self.settings.goodput_window_s
        history = list(self.goodput_history) + [(now, useful, allocated)]
        split = self.books.badput(self._live_fates(), now)
        # Counters never go back: the training phase's remainder wiggles by a step as beats land.
        for cause, x in split["badput_s"].items():
            self.badput_high[cause] = max(self.badput_high.get(cause, 0.0), x)
        return {"useful_s": useful, "allocated_s": allocated, "goodput": goodput(useful, allocated),
                "window": {"label": window_label(window_s), "seconds": window_s,
                           "ratio": windowed_ratio(history, now, window_s)},
                "goodput_s": split["goodput_s"], "badput_s": dict(self.badput_high),
                "unsettled_s": split["unsettled_s"]}

    def learner_goodput(self, learner: str) -> float:
        """One learner slot's goodput: its applied inner-step seconds (every incarnation) over
        the seconds its slot was allocated (restarts included)."""
        from .books import goodput

        live = self._live_fates().get(learner)
        useful = self.books.learner_tokens(learner, live).applied_s / self.books.num_fragments
        return goodput(useful, self.books.allocated_s(time.time(), learner))

    def snapshot(self) -> dict:
        """One row of metrics.jsonl and the source of every exported metric."""
        from .snapshot import job_snapshot

        return job_snapshot(self).as_dict()

    def summary(self) -> dict:
        from .snapshot import job_snapshot

        return job_snapshot(self).summary(self)

    def status_table(self) -> dict:
        snap = self.snapshot()
        return {"learners": snap["learners"],
                "syncer": {k: snap["syncer"].get(k)
                           for k in ("epoch", "versions", "merges", "shards")},
                "paused_reason": snap["paused_reason"], "spares": snap.get("spares") or {},
                "misconfigured": dict(self.fleet.misconfigured)}

    # -- operator commands ----------------------------------------------------------------------
    def scale(self, region: str, n: int) -> str:
        self._command(fleet_lib.Scale(region, n))
        return f"{region}: {n} learners"

    def drain(self, learner: str) -> str:
        self._command(fleet_lib.Drain(learner))
        return f"draining {learner}"

    def drain_node(self, node_id: str, deadline_s: Optional[float] = None,
                   origin: str = "operator") -> str:
        """A planned preemption of a node, as a platform announces one: Ray drains it (nothing new
        is placed there) and the fleet hands its learners over to other nodes before
        ``deadline_s`` (None: no deadline). Nothing kills the node: that is the platform's part."""
        if deadline_s is not None and not deadline_s >= 0:
            raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
        drain_node(node_id, deadline_s, f"islands drain-node ({origin})")
        self.emit("node_drain_requested", node=node_id, deadline_s=deadline_s, origin=origin)
        self.inbox.put((self._cluster(), None))   # seen now, not at the next poll
        return f"draining node {node_id}" + ("" if deadline_s is None else
                                             f" (deadline in {deadline_s:g}s)")

    def pause(self, paused: bool = True, origin: str = "operator") -> str:
        """Pauses (or resumes) every learner; they stay up and keep their state."""
        self._command(fleet_lib.PauseJob(bool(paused), origin))
        return "paused" if paused else "resumed"

    def chaos_kill(self, target: str, mode: str = "ray_kill") -> str:
        """Kills a learner (``ray.kill`` or a hard exit inside it) or the syncer, on purpose."""
        if target.split(":")[0] == "syncer":  # "syncer" (shard 0) or "syncer:<shard>"
            self._command(fleet_lib.Chaos(Fault(time.time(), FaultKind.SYNCER_KILL, target)))
            return f"killed {target}"
        if mode not in ("ray_kill", "exit"):
            raise ValueError(f"unknown kill mode {mode!r}; choose ray_kill or exit")
        kind = FaultKind.KILL if mode == "ray_kill" else FaultKind.EXIT
        self._command(fleet_lib.Chaos(Fault(time.time(), kind, target), mode))
        return f"killed {target} ({mode})"

    def chaos_slowdown(self, target: str, factor: float, duration_s: float) -> str:
        self._command(fleet_lib.Chaos(Fault(time.time(), FaultKind.SLOWDOWN, target,
                                            duration_s=duration_s, factor=factor)))
        return f"slowed {target} x{factor} for {duration_s}s"

    def chaos_hang(self, target: str, duration_s: float) -> str:
        if not duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        self._command(fleet_lib.HangCommand(target, duration_s))
        return f"hung {target} for {duration_s}s"

    def chaos_region_loss(self, region: str, repair_s: float = 0.0) -> str:
        """Kills every running learner of ``region`` at once (a lost slice or node)."""
        self._command(fleet_lib.Chaos(Fault(time.time(), FaultKind.REGION_LOSS, region,
                                            duration_s=repair_s)))
        return f"lost region {region}"

    def chaos_network(self, region: str, duration_s: float, extra_latency_ms: float = 0.0,
                      bandwidth_gbps: Optional[float] = None, partition: bool = False,
                      loss_rate: float = 0.0) -> str:
        """Degrades (or, with ``partition``, silences) a region's link for ``duration_s``;
        ``region`` ``HOME_TARGET`` ("@home", a partition only) cuts every remote region's link."""
        kind = FaultKind.PARTITION if partition else FaultKind.NETWORK
        if region == HOME_TARGET and not partition:
            raise ValueError("a network fault targets one region; the home can be partitioned "
                             "(islands chaos partition --home), not degraded")
        self._command(fleet_lib.Chaos(Fault(time.time(), kind, region, duration_s=duration_s,
                                            extra_latency_ms=extra_latency_ms,
                                            bandwidth_gbps=bandwidth_gbps, loss_rate=loss_rate)))
        if region == HOME_TARGET:
            return f"partition of the home (every remote region's link) for {duration_s}s"
        return f"{kind.value} on {region} for {duration_s}s"

    # -- the end --------------------------------------------------------------------------------
    def shutdown(self) -> dict:
        """Stops the learners, takes a final eval, and returns the summary."""
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=30)
        self._step(self._drain_inbox() + [fleet_lib.Stop()])
        self.groups.stop_all(timeout_s=30)
        self._step(self._ended_runs())
        self._refresh_syncer_status()
        try:  # the newest state on disk: `islands run --resume` continues from exactly here
            self.shards.snapshot_now()
        except Exception as exc:
            log.warning("final snapshot failed: %s", exc)
        try:
            self.evaluate_now()
        except Exception as exc:
            log.warning("final eval failed: %s", exc)
        summary = self.summary()
        now = time.time()
        for learner in list(self.fleet.slots):
            self.books.release(learner, now)
        self.emit("job_stopped", goodput=summary["goodput"])
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        if self.console is not None:
            self.console.stop()
            self.console = None
        return summary

    def ping(self) -> str:
        return "ok"

    # -- metrics ----------------------------------------------------------------------------------
    def serve_metrics(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves Prometheus ``/metrics`` on ``host:port`` from this actor and mirrors the same
        values into ``ray.util.metrics`` for the Ray dashboard. Returns the bound port."""
        from . import metrics

        if self.metrics_server is None:
            self.metrics_server, self.metrics_port = metrics.serve(self.snapshot, port, host)
            try:
                self.ray_metrics = metrics.RayMetricsMirror()
            except Exception as exc:  # the Ray mirror is a convenience; Prometheus is the contract
                log.warning("ray.util.metrics mirror not started: %s", exc)
        return self.metrics_port

    def console_view(self) -> dict:
        """What the console shows, read once under the lock: the snapshot and what only the
        fleet and the beats know (the console reads this view, never the controller's fields)."""
        snap = self.snapshot()
        with self.lock:
            events = list(self.events[-2000:])
            profilers = {name: run.beat.profiler if run.beat is not None else None
                         for name, run in self.running.items()}
        return {"snapshot": snap, "events": events, "profilers": profilers,
                "job": self.config.name, "goodput_window_s": self.settings.goodput_window_s,
                "goodput_history": list(self.goodput_history),
                "misconfigured": dict(self.fleet.misconfigured),
                "operator_paused": self.fleet.operator_paused,
                "regions": {name: {"target": self.fleet.targets.get(name, 0),
                                   "max_learners": region.max_learners, "remote": region.remote}
                            for name, region in self.config.regions.items()}}

    def serve_console(self, port: int, host: str, token: str, allow_chaos: bool = False) -> int:
        """Serves the operator console (``console.py``) on ``host:port`` from this actor; every
        action must carry ``token``. Returns the bound port."""
        from .console import ConsoleServer

        if self.console is None:
            server = ConsoleServer(self, token, allow_chaos)
            server.start(host, port)
            self.console, self.console_host = server, host
        return self.console.port

    def console_url(self) -> Optional[str]:
        if self.console is None:
            return None
        host = self.console_host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.console.port}/"

    def _mirror_ray_metrics(self) -> None:
        """The Ray dashboard's copy of the metrics: a failure here must never stop the owner."""
        if self.ray_metrics is None:
            return
        try:
            self.ray_metrics.update(self.snapshot())
        except Exception as exc:
            self.ray_metrics = None
            self.emit("metrics_mirror_stopped", error=repr(exc)[:300])


recovery_phases = fleet_lib.recovery_phases


def remote_heartbeats(beats: list) -> dict[str, Heartbeat]:
    """A region report's beats (the link's JSON), parsed: per learner its newest. A beat that
    does not parse is left out, and said once in the log."""
    out = {}
    for beat in beats:
        if not isinstance(beat, dict):
            continue
        try:
            parsed = Heartbeat.from_dict(beat)
        except ValueError as exc:
            log.warning("%s", exc)
            continue
        out[parsed.learner] = parsed
    return out


def _num_params(tree) -> int:
    import jax

    return sum(int(v.size) for v in jax.tree_util.tree_leaves(tree))
