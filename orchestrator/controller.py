"""The controller actor: the Ray shell (threads, inbox, wall clock, public methods, serving)
around the fleet's one owner.

One thread holds the ``owner.Owner`` (the fleet state, the books, every action's handler, as the
in-process driver holds one). Everything else it hears about (learners' heartbeats, their runs
ending, cluster membership, the syncer's ledger, the chaos plan coming due, operator commands)
becomes an observation for the owner's next turn on the wall clock. Decisions live in
``fleet.py``, the snapshot in ``snapshot.py``, operator commands are built in ``commands.py``,
what it records beside the books in ``controller_records.py``, and what it serves in
``serving.py``. Control plane only: tensors flow learner <-> syncer directly.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Optional

from . import fleet as fleet_lib
from islands.learners.messages import Heartbeat

from . import commands, recovery
from .owner import Owner
from .owner_role import HOME, OwnerRole
from .groups import (DrainQuery, LearnerGroups, SyncerShards, cluster_observation,
                     guarded_drain, restarted_actor, share)
from .logs import EventLog, events_kept
from .controller_records import ControllerRecords
from .memory import release_free_memory
from .safety import DrainGuard
from .serving import Serving
from . import remote_regions
from .snapshot import console_view, goodput_view, learner_goodput, live_fates
from .runtime import (CONTROLLER_NAME, NAMESPACE, SYNCER_NAME, controller_options,  # noqa: F401
                      enable_compile_cache, learner_actor_name,
                      syncer_options)

log = logging.getLogger("islands.controller")

RELEASE_MEMORY_EVERY_S = 30.0   # malloc_trim takes milliseconds; RSS is sampled by the second


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
        self.inbox: "queue.Queue[tuple[Any, Optional[Future]]]" = queue.Queue()
        self.groups = LearnerGroups()   # every Ray call for learners and spares
        self.lock = threading.Lock()         # guards events and the syncer status for readers
        # The newest events (events.jsonl has all); indexes from this process's start, so a
        # reader's index from before a restart of this actor is below every new one.
        slots = sum(max(r.learners, r.max_learners or 0) for r in config.regions.values())
        self.events = EventLog(events_kept(slots), first_index=time.time_ns() // 1000)
        self.started_s = time.time()
        self.job_started_s: Optional[float] = None
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.drain_query = DrainQuery()      # the draining-node query's failures
        self.drain_guard = DrainGuard()      # drain-node's check and drain, as one step
        self.shards = SyncerShards(0)        # the syncer shards' Ray side (syncer.shards = S)
        # The fleet, its books and every action's handler (owner.py); the role's replace some.
        body = build.ControllerBody(self)
        settings = self.role.fleet_settings(build.fleet_settings(config))
        self.owner = Owner(settings, config.syncer.fragments, self.groups,
                           self.shards, body, clock=time.time,
                           tell=lambda obs: self.inbox.put((obs, None)), emit=self.emit,
                           hooks=body, overrides=self.role.handlers(), contain_errors=True,
                           lock=self.lock)
        self.records = ControllerRecords()   # evals, chaos fired, goodput window, step times
        self.serving = Serving(self.snapshot, self.emit)   # /metrics, Ray's mirror, the console
        self.link_regions: dict[str, dict] = {}   # per remote region: its link's last report
        self.settings = build.controller_settings(config)
        self.chaos_plan = build.chaos_plan(config)
        self.state_path = os.path.join(run_dir, "controller_state.json")
        if restarted_actor():
            recovery.recover(self)

    # -- events ---------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        now = time.time()
        event = {"t": now, "elapsed_s": round(now - self.started_s, 3), "event": kind, **fields}
        with self.lock:
            self.events.append(event)
        log.info("%s %s", kind, fields)

    def events_since(self, index: int) -> tuple[list[dict], int]:
        """Events after the first ``index`` (absolute: it never goes back), and the next index;
        the oldest kept when ``index`` is past the end (the caller's count is from before this
        controller restarted). The newest ``logs.EVENTS_KEPT`` are kept here."""
        with self.lock:
            return self.events.since(index)

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> dict:
        """Builds the model once, starts the syncer, launches the learners and the owner thread."""
        from islands.learners.unit import warm_compile_cache

        from . import build

        t0 = time.time()
        self.build_task()
        t_task = time.time()
        self.jax_cache_dir = os.path.join(self.run_dir, "jax_cache")
        enable_compile_cache(self.jax_cache_dir)
        if build.warms_compile_cache(self.config):   # restarts load it instead of compiling
            warm_compile_cache(self.training, self.template, self.task)
        t_cache = time.time()
        self.syncer_spec = build.syncer_spec(self.config, self.template, self.run_dir,
                                             self.task.is_embedding)
        self.init_shards()
        for s in range(self.shards.count):
            self.owner.start_syncer(s, epoch=0, restore=self.resume)
        self.owner.refresh_syncer_status()
        t_syncer = time.time()
        self.step([self.owner.applied()])  # launches the learners (resumed: at their step)
        # Seconds of the job's start before its learners were launched (benchmarks/startup.py).
        self.start_phases = {"build_task_s": t_task - t0, "warm_cache_s": t_cache - t_task,
                             "syncer_s": t_syncer - t_cache, "launch_s": time.time() - t_syncer}
        self.start_threads()
        self.job_started_s = time.time()  # the chaos plan's clock: faults hit a running job
        self.emit("job_started", learners=list(self.owner.fleet.slots),
                  regions=list(self.config.regions),
                  num_params=build.num_params(self.template),
                  start_phases={k: round(v, 3) for k, v in self.start_phases.items()})
        return {"learners": list(self.owner.fleet.slots)}

    def build_task(self) -> None:
        """Builds the job's task once here: the initial params (the syncer's Θ) and, for the
        built-in byte LM, its corpus, put in the object store so every learner maps the same
        train bytes instead of reading them."""
        from . import build

        self.training, self.corpus_ref, self.task, self.template = build.job_task(self.config,
                                                                                  share)

    def init_shards(self) -> None:
        """The syncer shards' specs (one: the single syncer) and their empty slots. A region's
        agent has one, its link, whatever ``syncer.shards`` the job has: the home's shards are
        behind it (the region's learners reach shards s > 0 through the ``LinkShard`` actors
        ``join`` starts; their forgets and statuses are the link's)."""
        from islands.syncer.shards import shard_specs

        self.shard_specs = shard_specs(self.syncer_spec, self.config.syncer.shards)
        n = len(self.shard_specs) if self.role.owns_syncers else 1
        self.shards = SyncerShards(n)
        self.owner.use_syncers(self.shards)

    # -- surviving a restart of this actor (recovery.py re-attaches; these are its steps) -------
    def start_threads(self) -> None:
        for target in (self._owner_loop, self._eval_loop):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self.threads.append(thread)

    # -- the owner thread -----------------------------------------------------------------------
    def _owner_loop(self) -> None:
        last = {"cluster": 0.0, "syncer": 0.0, "trimmed": time.time()}
        while not self.stop_event.is_set():
            try:
                observations = self._drain_inbox()
                observations += self.owner.observe(syncers=not self.stop_event.is_set())
                now = time.time()
                if now - last["cluster"] >= 2.0:
                    observations.append(cluster_observation(self.config.regions,
                                                            self.drain_query))
                    last["cluster"] = now
                # Faster while a restarted learner's first merged contribution is awaited.
                awaiting = any(s.recovery is not None and "restarted_s" in dict(s.recovery)
                               for s in self.owner.fleet.slots.values())
                if now - last["syncer"] >= (0.2 if awaiting else 1.0):
                    self.owner.refresh_syncer_status()
                    observations.append(self.owner.applied())
                    observations += self.owner.refusals()
                    gp = self.goodput()
                    self.records.sample_goodput(now, gp["useful_s"], gp["allocated_s"],
                                                self.settings.goodput_window_s)
                    self.serving.mirror_ray_metrics()
                    last["syncer"] = now
                if now - last["trimmed"] >= RELEASE_MEMORY_EVERY_S:
                    release_free_memory()   # what glibc keeps of freed snapshots (memory.py)
                    last["trimmed"] = now
                observations += self._due_faults()
                self.step(observations)
                if now - last.get("saved", 0.0) >= 1.0:
                    recovery.save_state(self)
                    last["saved"] = now
            except Exception as exc:  # keep owning the fleet; say what broke, once per error
                log.exception("controller iteration failed")
                if repr(exc) != getattr(self, "_last_error", None):
                    self._last_error = repr(exc)
                    self.emit("monitor_error", error=repr(exc)[:300],
                              where=traceback.format_exc(limit=3)[-600:])
            # Wake on a run ending (a real event) or after a short tick.
            if not self.groups.wait(self.shards.closed_refs(), 0.2):
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
                self.step(observations + [obs])
                observations = []
                reply.set_result(None)
            except fleet_lib.CommandError as exc:
                self.step(observations)
                observations = []
                reply.set_exception(exc)

    def step(self, observations: list) -> None:
        """One turn of the owner (owner thread only: the actor's one writer)."""
        self.owner.step(observations, time.time())
        self.role.stepped()

    # -- observations from Ray ------------------------------------------------------------------
    def heartbeat(self, beat: "Heartbeat | dict") -> None:
        """Called by learners (fire and forget); a region agent's beats arrive as dicts."""
        beat = Heartbeat.of(beat)
        current = self.owner.heard(beat)
        if current == "first":   # the devices it proved at start, once per incarnation
            devices = beat.devices
            self.emit("learner_devices", learner=beat.learner, incarnation=beat.incarnation,
                      backend=devices.get("backend"), platform=devices.get("platform"),
                      device_kind=devices.get("kind"), count=devices.get("count"))
        slot = self.owner.fleet.slots.get(beat.learner)
        if current and slot is not None and beat.step_time_s and beat.training:
            with self.lock:
                self.records.observe_step(slot.region, float(beat.step_time_s))
        self.inbox.put((fleet_lib.Beat(beat.learner, beat.incarnation, beat.training,
                                       beat.step_time_s, beat.node_id, beat.ready_at,
                                       adopted=beat.adopted > 0), None))
        self.role.heard(beat)

    def _due_faults(self) -> list:
        if self.chaos_plan is None or self.job_started_s is None:
            return []
        now = time.time()
        return self.owner.chaos_due(self.chaos_plan, now - self.job_started_s, now,
                                    self.records.chaos_fired)

    # -- regions in their own clusters (link/) --------------------------------------------------
    def link_report(self, report: dict) -> dict:
        """A remote region's report, relayed by the home's link server
        (``remote_regions.take_report``); the home syncer's view of the region's learners."""
        return remote_regions.take_report(self, report)

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
            self.records.record_eval(time.time() - self.started_s, self.tokens()["applied"], loss)
        return loss

    # -- the books and the snapshot -------------------------------------------------------------
    def tokens(self) -> dict:
        """Tokens by fate, each counted where it happens (``books.py``): applied, dropped (by
        reason) and in flight, which account for every processed token."""
        return self.owner.books.tokens(live_fates(self)).as_dict(self.owner.books.num_fragments)

    def goodput(self) -> dict:
        return goodput_view(self)

    def learner_goodput(self, learner: str) -> float:
        """One learner slot's goodput (``snapshot.learner_goodput``)."""
        return learner_goodput(self, learner)

    def snapshot(self) -> dict:
        """One row of metrics.jsonl and the source of every exported metric."""
        from .snapshot import job_snapshot

        return job_snapshot(self).as_dict()

    def summary(self) -> dict:
        from .snapshot import job_snapshot

        return job_snapshot(self).summary(self)

    def status_table(self) -> dict:
        from .snapshot import status_table

        return status_table(self.snapshot(), self.owner.fleet)

    # -- operator commands (commands.py builds them; the owner thread decides) -----------------
    def _command(self, obs, reply: str) -> str:
        """Queues an operator command for the owner thread, waits for its verdict: ``reply``."""
        fleet_lib.check_command(self.owner.fleet, obs)  # fail fast with the reason
        verdict: Future = Future()
        self.inbox.put((obs, verdict))
        verdict.result(timeout=60)
        return reply

    def scale(self, region: str, n: int) -> str:
        return self._command(*commands.scale(region, n))

    def drain(self, learner: str) -> str:
        return self._command(*commands.drain(learner))

    def drain_node(self, node_id: str, deadline_s: Optional[float] = None,
                   origin: str = "operator", force: bool = False) -> str:
        """A planned preemption of a node, as a platform announces one: Ray drains it (nothing new
        is placed there) and the fleet hands its learners over to other nodes before
        ``deadline_s`` (None: no deadline). Nothing kills the node: that is the platform's part.

        Raises:
          safety.DrainRefused: the head node, or the last nodes a region of the job can run a
            whole learner on, or any node of a region while Ray cannot say which nodes are
            draining (``safety.drain_refusal``), without ``force``: Ray cannot undo a drain, so
            nothing is asked of it.
        """
        reply = commands.drain_node_reply(node_id, deadline_s)
        guarded_drain(self.drain_guard, self.drain_query, self.config.regions, node_id,
                      deadline_s, f"islands drain-node ({origin})", force)
        self.emit("node_drain_requested", node=node_id, deadline_s=deadline_s, origin=origin,
                  force=bool(force))
        # seen now, not at the next poll
        self.inbox.put((cluster_observation(self.config.regions, self.drain_query), None))
        return reply

    def pause(self, paused: bool = True, origin: str = "operator") -> str:
        """Pauses (or resumes) every learner; they stay up and keep their state."""
        return self._command(*commands.pause(paused, origin))

    def clear_misconfigured(self, node_id: Optional[str] = None, origin: str = "operator") -> str:
        """Clears a node's misconfigured marks (None: every node's): the regions it carries may
        place learners, spares and scale-ups there again."""
        return self._command(*commands.clear_misconfigured(node_id, origin))

    def chaos_kill(self, target: str, mode: str = "ray_kill") -> str:
        """Kills a learner (``ray.kill`` or a hard exit inside it) or the syncer, on purpose."""
        return self._command(*commands.chaos_kill(target, mode, time.time()))

    def chaos_slowdown(self, target: str, factor: float, duration_s: float) -> str:
        return self._command(*commands.chaos_slowdown(target, factor, duration_s, time.time()))

    def chaos_hang(self, target: str, duration_s: float) -> str:
        return self._command(*commands.chaos_hang(target, duration_s))

    def chaos_region_loss(self, region: str, repair_s: float = 0.0) -> str:
        """Kills every running learner of ``region`` at once (a lost slice or node)."""
        return self._command(*commands.chaos_region_loss(region, repair_s, time.time()))

    def chaos_network(self, region: str, duration_s: float, extra_latency_ms: float = 0.0,
                      bandwidth_gbps: Optional[float] = None, partition: bool = False,
                      loss_rate: float = 0.0) -> str:
        """Degrades (or, with ``partition``, silences) a region's link for ``duration_s``;
        ``region`` ``HOME_TARGET`` ("@home", a partition only) cuts every remote region's link."""
        return self._command(*commands.chaos_network(region, duration_s, extra_latency_ms,
                                                     bandwidth_gbps, partition, loss_rate,
                                                     time.time()))

    # -- the end --------------------------------------------------------------------------------
    def shutdown(self) -> dict:
        """Stops the learners, takes a final eval, and returns the summary."""
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=30)
        self.step(self._drain_inbox() + [fleet_lib.Stop()])
        self.groups.stop_all(timeout_s=30)
        self.step(self.owner.ended_runs())
        self.owner.refresh_syncer_status()
        try:  # the newest state on disk: `islands run --resume` continues from exactly here
            self.shards.snapshot_now()
        except Exception as exc:
            log.warning("final snapshot failed: %s", exc)
        try:
            self.evaluate_now()
        except Exception as exc:
            log.warning("final eval failed: %s", exc)
        summary = self.summary()
        self.owner.release_all(time.time())
        self.emit("job_stopped", goodput=summary["goodput"])
        self.serving.stop()
        return summary

    def ping(self) -> str:
        return "ok"

    def identity(self) -> dict:
        """Whose this controller is, for a region command that must end only a region join's
        leftovers (orchestrator/safety.py): the home job's, or a region agent's."""
        region = getattr(self.role, "region", None)
        if region is None:
            return {"kind": "home", "job": self.config.name}
        return {"kind": "region", "job": self.config.name, "region": region}

    # -- serving (serving.py) -------------------------------------------------------------------
    def serve_metrics(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves Prometheus ``/metrics`` on ``host:port`` from this actor and mirrors the same
        values into ``ray.util.metrics`` for the Ray dashboard. Returns the bound port."""
        return self.serving.serve_metrics(port, host)

    def console_view(self) -> dict:
        """What the console shows (``snapshot.console_view``)."""
        return console_view(self)

    def serve_console(self, port: int, host: str, token: str, allow_chaos: bool = False) -> int:
        """Serves the operator console (``console.py``) on ``host:port`` from this actor; every
        action must carry ``token``. Returns the bound port."""
        return self.serving.serve_console(self, port, host, token, allow_chaos)

    def console_url(self) -> Optional[str]:
        return self.serving.console_url()
