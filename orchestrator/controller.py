"""The controller actor: places the syncer and the learners, runs the health monitor, applies scale,
drain and chaos commands, and keeps the job's books (events, goodput, token ledger).

Control plane only: tensors flow learner <-> syncer directly. The monitor thread reacts to real
events (a learner's ``run`` future resolving or failing, heartbeats going quiet), never to guesses.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .health import Cause, RestartDecision, RestartPolicy, death_cause, detect, grown_target

log = logging.getLogger("islands.controller")

NAMESPACE = "islands"
CONTROLLER_NAME = "islands:controller"
SYNCER_NAME = "islands:syncer"
EVENT_LOG_LIMIT = 100_000


def controller_options(run_dir: str) -> dict:
    """Ray options for the controller. It shares the learners' XLA flags and compilation cache, so
    the train step it compiles before launching them is a cache hit in every learner."""
    return dict(name=CONTROLLER_NAME, namespace=NAMESPACE, num_cpus=0.1, max_concurrency=16,
                max_restarts=0,
                runtime_env={"env_vars": _single_thread_env(os.path.join(run_dir, "jax_cache"))})


def learner_actor_name(learner_id: str) -> str:
    """"us-east:0" -> "islands:us-east:0" (DESIGN §2)."""
    return f"islands:{learner_id}"


@dataclass
class Slot:
    """One learner id over its incarnations."""

    learner: str
    region: str
    shard_index: int
    speed_factor: float = 1.0
    state: str = "starting"          # starting|training|restarting|draining|retired|paused
    incarnation: int = 0
    handle: Any = None
    run_ref: Any = None
    # When the current incarnation was requested; "now" from creation, so a slot the monitor sees
    # between its creation and its launch is not taken for a learner that never started.
    started_s: float = field(default_factory=time.time)
    allocated_since_s: Optional[float] = None
    allocated_total_s: float = 0.0   # closed allocation intervals
    restarts: collections.Counter = field(default_factory=collections.Counter)
    last_beat: Optional[dict] = None
    last_beat_s: Optional[float] = None
    restart_at_s: Optional[float] = None
    cause: Optional[Cause] = None
    recovery: Optional[dict] = None  # phase timestamps of the recovery in progress
    processed_tokens_closed: int = 0  # tokens of finished incarnations
    dropped_tokens: int = 0
    applied_tokens_closed: int = 0
    drain_requested: bool = False
    killed_at_s: Optional[float] = None  # when chaos killed it: the failure time, to the ms
    node_id: Optional[str] = None         # where the current incarnation runs (preemption test)
    death_detail: str = ""
    start_step: int = 0                   # the step the current incarnation resumed at
    # Counters of finished incarnations, so the exported totals never go backwards.
    steps_closed: int = 0
    wire_up_closed: int = 0
    wire_down_closed: int = 0
    counters_closed: bool = False         # the current incarnation's counters are folded in
    repair_until_s: float = 0.0           # a chaos repair delay: no restart before this

    def beat_value(self, key: str, default=0):
        return (self.last_beat or {}).get(key, default) or default

    def steps_total(self) -> int:
        """Inner steps over every incarnation (a restart resumes at ``start_step``)."""
        if self.counters_closed:
            return self.steps_closed
        return self.steps_closed + max(0, int(self.beat_value("step", self.start_step))
                                       - self.start_step)

    def wire_bytes(self, direction: str) -> int:
        closed = self.wire_up_closed if direction == "up" else self.wire_down_closed
        if self.counters_closed:
            return closed
        return closed + int(self.beat_value(f"wire_bytes_{direction}"))

    def close_counters(self) -> None:
        """Folds the ended incarnation's counters into the closed totals (once)."""
        if self.counters_closed:
            return
        self.steps_closed = self.steps_total()
        self.wire_up_closed = self.wire_bytes("up")
        self.wire_down_closed = self.wire_bytes("down")
        self.counters_closed = True

    def allocated_s(self, now_s: float) -> float:
        open_s = now_s - self.allocated_since_s if self.allocated_since_s is not None else 0.0
        return self.allocated_total_s + open_s


class Controller:
    """Create with ``ray.remote(Controller).options(name=CONTROLLER_NAME, max_concurrency=16)``.

    Args:
      config: a JobConfig (validated before any actor starts).
      run_dir: where the syncer's snapshots go when the config names no checkpoint_dir.
    """

    def __init__(self, config, run_dir: str):
        self.config = config
        self.run_dir = run_dir
        self.policy = RestartPolicy(**config.health.restart.model_dump())
        self.slots: dict[str, Slot] = {}
        self.lock = threading.RLock()
        self.events: list[dict] = []
        self.started_s = time.time()
        self.job_started_s: Optional[float] = None
        self.stop_event = threading.Event()
        self.syncer = None
        self.syncer_ref = None
        self.syncer_status: dict = {}
        self.syncer_restarts = 0
        self.paused_reason: Optional[str] = None
        self.eval_history: list[tuple[float, int, float]] = []
        self.initial_eval_loss: Optional[float] = None
        self.recoveries: list[dict] = []
        self.chaos_fired: list[dict] = []
        self.region_capacity: dict[str, float] = {}
        self.targets = {name: region.learners for name, region in config.regions.items()}
        self.next_index = dict(self.targets)
        self.next_shard = 0
        self.threads: list[threading.Thread] = []
        # Syncer counters of earlier epochs (a restarted syncer counts from zero again).
        self.rejected_closed: collections.Counter = collections.Counter()
        self.staleness_closed: collections.Counter = collections.Counter()
        # (t, useful_s, allocated_s) samples for the sliding goodput window.
        self.goodput_history: collections.deque = collections.deque(maxlen=100_000)
        self.metrics_server = None
        self.ray_metrics = None
        self.link_faults: list = []       # network faults in force, for learners started later
        self.chaos_plan = (config.chaos.plan(
            {name: [f"{name}:{i}" for i in range(region.learners)]
             for name, region in config.regions.items()}, config.run.duration_s)
            if config.chaos is not None else None)

    # -- events ---------------------------------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        event = {"t": time.time(), "elapsed_s": round(time.time() - self.started_s, 3),
                 "event": kind, **fields}
        with self.lock:
            if len(self.events) < EVENT_LOG_LIMIT:
                self.events.append(event)
        log.info("%s %s", kind, fields)

    def events_since(self, index: int) -> tuple[list[dict], int]:
        with self.lock:
            return self.events[index:], len(self.events)

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> dict:
        """Creates the syncer and the configured learners, then starts the monitor threads."""
        import ray

        from islands.learners.unit import build_training, warm_compile_cache

        from . import build

        from islands.learners.unit import load_corpus

        self.training = build.training_spec(self.config)
        _, self.template, _, _ = build_training(self.training)
        self.corpus = load_corpus(self.training)
        self.corpus_ref = ray.put(self.corpus.train)  # every learner maps the same bytes
        self.jax_cache_dir = os.path.join(self.run_dir, "jax_cache")
        _enable_compile_cache(self.jax_cache_dir)
        warm_compile_cache(self.training, self.template)  # restarts load it instead of compiling
        self.syncer_spec = build.syncer_spec(self.config, self.template, self.run_dir)
        self._start_syncer(epoch=0)
        for region, n in self.targets.items():
            for i in range(n):
                self._add_slot(region, i)
        for slot in list(self.slots.values()):
            self._launch(slot)
        for target in (self._monitor_loop, self._eval_loop):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self.threads.append(thread)
        self.job_started_s = time.time()  # the chaos plan's clock: faults hit a running job
        self.emit("job_started", learners=list(self.slots), regions=list(self.targets),
                  num_params=sum(int(v.size) for v in _leaves(self.template)))
        return {"learners": list(self.slots)}

    def _start_syncer(self, epoch: int) -> None:
        import ray

        from islands.syncer.actor import Syncer

        options = dict(name=SYNCER_NAME, namespace=NAMESPACE, num_cpus=self.config_cpus("syncer"),
                       max_restarts=0, max_concurrency=1000,
                       runtime_env={"env_vars": _single_thread_env(self.jax_cache_dir)})
        self.syncer = ray.remote(Syncer).options(**options).remote(self.syncer_spec, epoch,
                                                                   restore=epoch > 0)
        ready = ray.get(self.syncer.ready.remote(), timeout=self.config.health.placement_timeout_s)
        self.syncer_ref = self.syncer.wait_closed.remote()
        self.emit("syncer_started", epoch=ready["epoch"], versions=ready["versions"],
                  restored_from=ready["restored_from"])

    def config_cpus(self, role: str) -> float:
        return {"syncer": 0.2, "learner": 0.25}[role]

    def _add_slot(self, region: str, index: int) -> Slot:
        learner = f"{region}:{index}"
        spec_speed = self.config.speed_factor(learner) if index < self.config.regions[
            region].learners else 1.0
        slot = Slot(learner=learner, region=region, shard_index=self.next_shard,
                    speed_factor=spec_speed)
        self.next_shard += 1
        self.slots[learner] = slot
        return slot

    def _num_shards(self) -> int:
        return max(self.config.total_learners, len(self.slots), 1)

    def _launch(self, slot: Slot, peer: Optional[str] = None, start_step: int = 0) -> None:
        """Starts an incarnation of ``slot`` (a fresh actor process; never a reused worker)."""
        import ray

        from islands.learners.unit import LearnerSpec, LearnerUnit

        region = self.config.regions[slot.region]
        spec = LearnerSpec(
            learner=slot.learner, shard_index=slot.shard_index % self._num_shards(),
            num_shards=self._num_shards(), training=self.training, incarnation=slot.incarnation,
            start_step=start_step, speed_factor=slot.speed_factor,
            min_step_time_s=self.config.learner.min_step_time_s, latency_ms=region.latency_ms,
            bandwidth_gbps=region.bandwidth_gbps, heartbeat_s=self.config.health.heartbeat_s,
            peer=learner_actor_name(peer) if peer else None, corpus_ref=self.corpus_ref,
            env=_single_thread_env(self.jax_cache_dir))
        options = dict(name=learner_actor_name(slot.learner), namespace=NAMESPACE,
                       num_cpus=self.config_cpus("learner"), max_restarts=0, max_concurrency=8,
                       resources={f"region:{slot.region}": 1})
        slot.handle = ray.remote(LearnerUnit).options(**options).remote(spec)
        for fault in self.link_faults:
            if fault.target == slot.region and fault.end_s > time.time():
                slot.handle.link_fault.remote(fault)
        slot.run_ref = slot.handle.run.remote()
        slot.start_step = start_step
        slot.counters_closed = False
        slot.started_s = time.time()
        if slot.allocated_since_s is None:
            slot.allocated_since_s = slot.started_s
        slot.last_beat, slot.last_beat_s = None, None
        slot.state = "starting"

    # -- heartbeats -----------------------------------------------------------------------------
    def heartbeat(self, beat: dict) -> None:
        with self.lock:
            slot = self.slots.get(beat["learner"])
            if slot is None or beat["incarnation"] != slot.incarnation:
                return  # a beat from an incarnation we already buried
            slot.last_beat, slot.last_beat_s = beat, time.time()
            slot.node_id = beat.get("node_id") or slot.node_id
            if slot.state == "starting" and beat["state"] == "training":
                slot.state = "training"
                if slot.recovery is not None and beat.get("ready_at"):
                    slot.recovery.setdefault("restore_done_s", beat["ready_at"])
            if slot.state in ("training", "paused") and beat["state"] in ("training", "paused"):
                slot.state = beat["state"]

    # -- the monitor ----------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        import ray

        last_fleet = 0.0
        while not self.stop_event.is_set():
            try:
                self._check_runs()
                self._check_syncer()
                self._check_health()
                self._start_due_restarts()
                self._check_nodes()
                self._apply_quorum_floor()
                # Faster while a restarted learner's first merged contribution is awaited: the
                # refresh is what sees it (the recovery's last phase).
                awaiting = any(s.recovery is not None and "restarted_s" in s.recovery
                               for s in self.slots.values())
                if time.time() - last_fleet > (0.2 if awaiting else 1.0):
                    self._refresh_syncer_status()
                    gp = self.goodput()
                    self.goodput_history.append((time.time(), gp["useful_s"], gp["allocated_s"]))
                    self._mirror_ray_metrics()
                    last_fleet = time.time()
                self._fire_chaos()
            except Exception as exc:  # keep monitoring; say what broke, once per distinct error
                log.exception("monitor iteration failed")
                if repr(exc) != getattr(self, "_last_monitor_error", None):
                    self._last_monitor_error = repr(exc)
                    import traceback

                    self.emit("monitor_error", error=repr(exc)[:300],
                              where=traceback.format_exc(limit=3)[-600:])
            refs = [s.run_ref for s in self.slots.values() if s.run_ref is not None]
            if self.syncer_ref is not None:
                refs.append(self.syncer_ref)
            if refs:
                ray.wait(refs, num_returns=1, timeout=0.2)
            else:
                time.sleep(0.2)

    def _mirror_ray_metrics(self) -> None:
        """The Ray dashboard's copy of the metrics: a failure here must never stop monitoring."""
        if self.ray_metrics is None:
            return
        try:
            self.ray_metrics.update(self.snapshot())
        except Exception as exc:
            self.ray_metrics = None
            self.emit("metrics_mirror_stopped", error=repr(exc)[:300])

    def _check_runs(self) -> None:
        import ray

        with self.lock:
            slots = [s for s in self.slots.values() if s.run_ref is not None]
        if not slots:
            return
        ready, _ = ray.wait([s.run_ref for s in slots], num_returns=len(slots), timeout=0)
        ready = set(ready)
        for slot in slots:
            if slot.run_ref not in ready:
                continue
            try:
                ray.get(slot.run_ref)
                ended_cleanly = True
            except ray.exceptions.RayActorError as exc:
                ended_cleanly = False
                cause = self._death_cause(slot, exc)
                slot.death_detail = str(exc)[:300]
            except Exception as exc:  # the training loop raised: a crash of the learner
                ended_cleanly = False
                cause = Cause.CRASH
                self.emit("learner_error", learner=slot.learner, error=repr(exc)[:500])
            slot.run_ref = None
            if ended_cleanly and (slot.drain_requested or self.stop_event.is_set()):
                self._retire(slot, "drained" if slot.drain_requested else "stopped")
            elif ended_cleanly:
                self._on_failure(slot, Cause.CRASH, time.time())
            else:
                self._on_failure(slot, cause, time.time())

    def _death_cause(self, slot: Slot, exc: Exception) -> Cause:
        """PREEMPTION when the node the learner ran on is gone, CRASH otherwise."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return death_cause(slot.node_id, alive, bool(getattr(exc, "preempted", False)), str(exc))

    def _check_health(self) -> None:
        import ray

        now = time.time()
        with self.lock:
            # Only launched incarnations: a slot being created by a scale command has no run yet.
            training = [s for s in self.slots.values()
                        if s.state in ("training", "starting") and s.run_ref is not None]
            step_times = {s.learner: s.last_beat["step_time_s"] for s in training
                          if s.last_beat and s.last_beat.get("step_time_s")}
        for slot in training:
            step_s = step_times.get(slot.learner)
            # Its region's other learners; the whole fleet's when the region has fewer than two
            # others (a region of two cannot say which of its pair is the slow one).
            peers = [t for name, t in step_times.items()
                     if name != slot.learner and self.slots[name].region == slot.region]
            if len(peers) < 2:
                peers = [t for name, t in step_times.items() if name != slot.learner]
            cause = detect(now, slot.last_beat_s, slot.started_s, step_s, peers,
                           self.config.health.timeout_s, self.config.health.straggler_factor)
            if cause is None:
                continue
            if cause == Cause.STRAGGLER and slot.speed_factor < 1.0:
                continue  # slow by design (a mixed fleet), not a sick learner
            self.emit("learner_unhealthy", learner=slot.learner, cause=cause.value,
                      step_time_s=step_s)
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:
                pass
            slot.run_ref = None
            self._on_failure(slot, cause, now)

    def _on_failure(self, slot: Slot, cause: Cause, detected_s: float) -> None:
        """Buries the current incarnation, settles its tokens, and restarts or retires the slot."""
        import ray

        died_s = slot.killed_at_s or slot.last_beat_s or slot.started_s
        slot.killed_at_s = None
        try:  # make sure Ray buries it too, so its name is free for the next incarnation
            ray.kill(slot.handle, no_restart=True)
        except Exception:
            pass
        dropped_pushes = 0
        try:
            dropped_pushes = ray.get(self.syncer.forget.remote(slot.learner), timeout=10)
        except Exception:
            pass
        self._settle_tokens(slot)
        self.emit("learner_failed", learner=slot.learner, cause=cause.value,
                  incarnation=slot.incarnation, dropped_pushes=dropped_pushes,
                  detail=getattr(slot, "death_detail", ""))
        slot.death_detail = ""
        verdict = self.policy.decide(slot.learner, cause, slot.restarts)
        slot.cause = cause
        if verdict.decision == RestartDecision.RETIRE:
            self.emit("learner_retired", learner=slot.learner, reason=verdict.message)
            self._close_allocation(slot)
            slot.state = "retired"
            return
        slot.restarts[cause] += 1
        slot.state = "restarting"
        # Not before its repair is done (a chaos fault with a repair delay).
        slot.restart_at_s = max(detected_s + verdict.delay_s, slot.repair_until_s)
        slot.recovery = {"learner": slot.learner, "cause": cause.value, "failed_s": died_s,
                         "detected_s": detected_s}
        self.emit("learner_restart_scheduled", learner=slot.learner, cause=cause.value,
                  message=verdict.message, delay_s=verdict.delay_s)

    def _settle_tokens(self, slot: Slot) -> None:
        """A dead incarnation's tokens are final: applied ones stay, the rest are dropped."""
        processed = int(slot.last_beat["tokens_done"]) if slot.last_beat else 0
        entry = self.syncer_status.get("ledger", {}).get(slot.learner)
        applied = 0
        if entry and entry["incarnation"] == slot.incarnation:
            applied = self._fresh_applied(slot)
        applied = min(applied, processed) if processed else applied
        slot.close_counters()
        slot.processed_tokens_closed += max(processed, applied)
        slot.applied_tokens_closed += applied
        slot.dropped_tokens += max(processed - applied, 0)

    def _fresh_applied(self, slot: Slot) -> int:
        import ray

        try:
            status = ray.get(self.syncer.status.remote(), timeout=10)
            self.syncer_status = status
        except Exception:
            status = self.syncer_status
        entry = status.get("ledger", {}).get(slot.learner)
        if entry and entry["incarnation"] == slot.incarnation:
            return int(entry["applied_tokens_incarnation"])
        return 0

    def _start_due_restarts(self) -> None:
        now = time.time()
        for slot in list(self.slots.values()):
            if slot.state != "restarting" or slot.restart_at_s is None or now < slot.restart_at_s:
                continue
            peer = next((s.learner for s in self.slots.values()
                         if s.state == "training" and s.learner != slot.learner), None)
            entry = self.syncer_status.get("ledger", {}).get(slot.learner)
            start_step = int(entry["applied_step"]) if entry else 0
            slot.incarnation += 1
            try:
                self._launch(slot, peer=peer, start_step=start_step)
            except ValueError as exc:  # the dead actor's name is not released yet: next tick
                slot.incarnation -= 1
                if slot.recovery is not None and not slot.recovery.get("postponed"):
                    slot.recovery["postponed"] = True
                    self.emit("learner_restart_postponed", learner=slot.learner,
                              reason=str(exc)[:300])
                continue
            slot.restart_at_s = None
            if slot.recovery is not None:
                slot.recovery["restarted_s"] = time.time()
                slot.recovery["incarnation"] = slot.incarnation
            self.emit("learner_restarted", learner=slot.learner, incarnation=slot.incarnation,
                      peer=peer, resume_step=start_step)

    def _check_first_contributions(self) -> None:
        ledger = self.syncer_status.get("ledger", {})
        for slot in self.slots.values():
            rec = slot.recovery
            if rec is None or "restarted_s" not in rec:
                continue
            entry = ledger.get(slot.learner)
            if (entry and entry["incarnation"] == slot.incarnation
                    and entry["applied_tokens_incarnation"] > 0):
                rec["first_contribution_s"] = time.time()
                phases = recovery_phases(rec)
                self.recoveries.append(phases)
                self.emit("learner_recovered", learner=slot.learner, **phases)
                slot.recovery = None

    def _retire(self, slot: Slot, reason: str) -> None:
        import ray

        try:
            ray.get(self.syncer.forget.remote(slot.learner), timeout=10)
        except Exception:
            pass
        self._settle_tokens(slot)
        self._close_allocation(slot)
        slot.state = "retired"
        self.emit("learner_retired", learner=slot.learner, reason=reason)

    def _close_allocation(self, slot: Slot) -> None:
        if slot.allocated_since_s is not None:
            slot.allocated_total_s += time.time() - slot.allocated_since_s
            slot.allocated_since_s = None

    # -- syncer ---------------------------------------------------------------------------------
    def _check_syncer(self) -> None:
        import ray

        if self.syncer_ref is None:
            return
        ready, _ = ray.wait([self.syncer_ref], timeout=0)
        if not ready or self.stop_event.is_set():
            return
        old_epoch = self.syncer_status.get("epoch", 0)
        # Its counters die with it: keep what it last reported so the totals never go backwards.
        self.rejected_closed.update(self.syncer_status.get("rejected") or {})
        self.staleness_closed.update(self.syncer_status.get("staleness_counts") or {})
        self.syncer_status = {**self.syncer_status, "rejected": {}, "staleness_counts": {}}
        self.emit("syncer_failed", epoch=old_epoch)
        self.syncer_restarts += 1
        self._start_syncer(epoch=old_epoch + 1)
        self._refresh_syncer_status()

    def _refresh_syncer_status(self) -> None:
        import ray

        slowest = max((s.last_beat.get("step_time_s") or 0.0 for s in self.slots.values()
                       if s.state == "training" and s.last_beat), default=1.0)
        try:
            self.syncer.set_fleet.remote(slowest, self.paused_reason is not None)
            status = ray.get(self.syncer.status.remote(), timeout=10)
        except Exception:
            return
        with self.lock:
            self.syncer_status = status
        self._check_first_contributions()

    # -- quorum floor ---------------------------------------------------------------------------
    def _apply_quorum_floor(self) -> None:
        k = self.config.quorum.min_learners
        live = [s for s in self.slots.values() if s.state in ("training", "paused")]
        if len(live) >= k:
            self.quorum_seen = True
        if not getattr(self, "quorum_seen", False):
            return  # still starting up: nothing to pause yet
        if len(live) < k and self.paused_reason is None:
            self.paused_reason = (f"{len(live)} live learner(s) below quorum {k}: training "
                                  "paused until learners return")
            self.emit("training_paused", reason=self.paused_reason)
            for s in live:
                s.handle.pause.remote(True)
        elif len(live) >= k and self.paused_reason is not None:
            self.paused_reason = None
            self.emit("training_resumed", live=len(live))
            for s in live:
                s.handle.pause.remote(False)
        elif self.paused_reason is not None:
            for s in live:
                if s.last_beat and s.last_beat.get("state") == "training":
                    s.handle.pause.remote(True)  # a learner that came back joins the pause

    # -- cluster membership ---------------------------------------------------------------------
    def _check_nodes(self) -> None:
        """Follows the cluster: more region capacity -> more learners (up to max_learners)."""
        import ray

        now = time.time()
        if now - getattr(self, "_last_node_check", 0.0) < 2.0:
            return
        self._last_node_check = now
        total = ray.cluster_resources()
        for region, cfg in self.config.regions.items():
            capacity = total.get(f"region:{region}", 0.0)
            previous = self.region_capacity.get(region)
            self.region_capacity[region] = capacity
            ceiling = cfg.max_learners if cfg.max_learners is not None else cfg.learners
            target = grown_target(capacity, previous, self.targets[region], ceiling)
            if target is not None:
                self.emit("region_grew", region=region, capacity=capacity, target=target)
                self._scale_to(region, target)

    # -- operator commands ----------------------------------------------------------------------
    def scale(self, region: str, n: int) -> str:
        if region not in self.config.regions:
            raise ValueError(f"unknown region {region!r}; regions are {sorted(self.config.regions)}")
        if n < 0:
            raise ValueError(f"learner count must be >= 0, got {n}")
        cfg = self.config.regions[region]
        if cfg.max_learners is not None and n > cfg.max_learners:
            raise ValueError(f"region {region}: {n} exceeds max_learners ({cfg.max_learners})")
        other = sum(1 for s in self.slots.values() if s.region != region and s.state != "retired")
        if other + n < self.config.quorum.min_learners:
            raise ValueError(f"scaling {region} to {n} leaves {other + n} learners, below quorum "
                             f"{self.config.quorum.min_learners}")
        return self._scale_to(region, n)

    def _scale_to(self, region: str, n: int) -> str:
        with self.lock:
            active = sorted((s for s in self.slots.values()
                             if s.region == region and s.state != "retired" and not s.drain_requested),
                            key=lambda s: int(s.learner.split(":")[1]))
            added, drained = [], []
            while len(active) + len(added) < n:
                index = self.next_index[region]
                self.next_index[region] += 1
                slot = self._add_slot(region, index)
                added.append(slot)
            for slot in active[n:]:
                drained.append(slot.learner)
                self._drain(slot)
            self.targets[region] = n
        for slot in added:
            self._launch(slot, peer=self._healthy_peer(slot.learner))
        self.emit("scaled", region=region, target=n, added=[s.learner for s in added],
                  drained=drained)
        return f"{region}: {n} learners (added {[s.learner for s in added]}, draining {drained})"

    def _healthy_peer(self, exclude: str) -> Optional[str]:
        return next((s.learner for s in self.slots.values()
                     if s.state == "training" and s.learner != exclude), None)

    def drain(self, learner: str) -> str:
        slot = self.slots.get(learner)
        if slot is None or slot.state == "retired":
            raise ValueError(f"no active learner {learner!r}; active are "
                             f"{sorted(s.learner for s in self.slots.values() if s.state != 'retired')}")
        self._drain(slot)
        self.targets[slot.region] = max(0, self.targets[slot.region] - 1)
        return f"draining {learner}"

    def _drain(self, slot: Slot) -> None:
        slot.drain_requested = True
        if slot.run_ref is None:
            # Waiting for a restart (no live incarnation): nothing is in flight, so it leaves now
            # rather than sit in "draining" with no run to finish.
            slot.restart_at_s = None
            slot.recovery = None
            self._close_allocation(slot)
            slot.state = "retired"
            self.emit("learner_retired", learner=slot.learner, reason="drained while restarting")
            return
        slot.state = "draining"
        self.emit("learner_draining", learner=slot.learner)
        if slot.handle is not None:
            slot.handle.drain.remote()

    def chaos_kill(self, target: str, mode: str = "ray_kill") -> str:
        """Kills a learner (``ray.kill`` or a hard exit inside it) or the syncer, on purpose."""
        import ray

        if target == "syncer":
            self.emit("chaos", action="kill", target="syncer", mode="ray_kill")
            ray.kill(self.syncer, no_restart=True)
            return "killed syncer"
        slot = self.slots.get(target)
        if slot is None or slot.handle is None or slot.state in ("retired", "restarting"):
            raise ValueError(f"no running learner {target!r}")
        if mode not in ("ray_kill", "exit"):
            raise ValueError(f"unknown kill mode {mode!r}; choose ray_kill or exit")
        self.emit("chaos", action="kill", target=target, mode=mode)
        return self._kill_learner(slot, mode)

    def _kill_learner(self, slot: Slot, mode: str, repair_s: float = 0.0) -> str:
        """Kills the running incarnation; it may restart no earlier than ``repair_s`` from now."""
        import ray

        slot.killed_at_s = time.time()
        slot.repair_until_s = slot.killed_at_s + repair_s
        if mode == "exit":
            slot.handle.crash.remote()
        else:
            ray.kill(slot.handle, no_restart=True)
        return f"killed {slot.learner} ({mode})"

    def chaos_slowdown(self, target: str, factor: float, duration_s: float) -> str:
        slot = self.slots.get(target)
        if slot is None or slot.handle is None:
            raise ValueError(f"no running learner {target!r}")
        self.emit("chaos", action="slowdown", target=target, factor=factor, duration_s=duration_s)
        slot.handle.slowdown.remote(factor, duration_s)
        return f"slowed {target} x{factor} for {duration_s}s"

    def chaos_hang(self, target: str, duration_s: float) -> str:
        slot = self.slots.get(target)
        if slot is None or slot.handle is None:
            raise ValueError(f"no running learner {target!r}")
        self.emit("chaos", action="hang", target=target, duration_s=duration_s)
        slot.handle.hang.remote(duration_s)
        return f"hung {target} for {duration_s}s"

    def chaos_region_loss(self, region: str, repair_s: float = 0.0) -> str:
        """Kills every running learner of ``region`` at once (a lost slice or node)."""
        if region not in self.config.regions:
            raise ValueError(f"unknown region {region!r}; regions are {sorted(self.config.regions)}")
        victims = [s.learner for s in self.slots.values() if s.region == region
                   and s.handle is not None and s.state not in ("retired", "restarting")]
        self.emit("chaos", action="region_loss", target=region, repair_s=repair_s,
                  learners=victims)
        for learner in victims:
            self._kill_learner(self.slots[learner], "ray_kill", repair_s)
        return f"lost region {region}: killed {victims}"

    def chaos_network(self, region: str, duration_s: float, extra_latency_ms: float = 0.0,
                      bandwidth_gbps: Optional[float] = None, partition: bool = False) -> str:
        """Degrades (or, with ``partition``, silences) a region's link for ``duration_s``."""
        from .chaos import Fault, FaultKind

        if region not in self.config.regions:
            raise ValueError(f"unknown region {region!r}; regions are {sorted(self.config.regions)}")
        # Absolute times: each learner checks the window against its own clock.
        fault = Fault(time.time(), FaultKind.PARTITION if partition else FaultKind.NETWORK,
                      region, duration_s=duration_s, extra_latency_ms=extra_latency_ms,
                      bandwidth_gbps=bandwidth_gbps)
        self.emit("chaos", action=fault.kind.value, target=region, duration_s=duration_s,
                  extra_latency_ms=extra_latency_ms, bandwidth_gbps=bandwidth_gbps)
        self.link_faults.append(fault)
        for slot in self.slots.values():
            if slot.region == region and slot.handle is not None and slot.state != "retired":
                slot.handle.link_fault.remote(fault)
        return f"{fault.kind.value} on {region} for {duration_s}s"

    def _fire_chaos(self) -> None:
        """Applies the faults of the job's chaos plan that are due (times from the job start)."""
        from .chaos import FaultKind

        if self.chaos_plan is None:
            return
        if self.job_started_s is None:
            return
        for fault in self.chaos_plan.due(time.time() - self.job_started_s):
            try:
                if fault.kind in (FaultKind.KILL, FaultKind.EXIT):
                    slot = self.slots.get(fault.target)
                    if slot is None or slot.handle is None or slot.state in ("retired",
                                                                             "restarting"):
                        raise ValueError(f"{fault.target} is not running")
                    mode = "ray_kill" if fault.kind == FaultKind.KILL else "exit"
                    self.emit("chaos", action="kill", target=fault.target, mode=mode,
                              repair_s=fault.duration_s)
                    message = self._kill_learner(slot, mode, fault.duration_s)
                elif fault.kind == FaultKind.REGION_LOSS:
                    message = self.chaos_region_loss(fault.target, fault.duration_s)
                elif fault.kind == FaultKind.SLOWDOWN:
                    targets = ([fault.target] if fault.target in self.slots else
                               [s.learner for s in self.slots.values()
                                if s.region == fault.target and s.state == "training"])
                    message = "; ".join(self.chaos_slowdown(t, fault.factor, fault.duration_s)
                                        for t in targets)
                elif fault.kind in (FaultKind.NETWORK, FaultKind.PARTITION):
                    message = self.chaos_network(fault.target, fault.duration_s,
                                                 fault.extra_latency_ms, fault.bandwidth_gbps,
                                                 partition=fault.kind == FaultKind.PARTITION)
                else:
                    message = self.chaos_kill("syncer")
            except ValueError as exc:  # e.g. the target is down already: that fault is moot
                message = f"not fired: {exc}"
            self.chaos_fired.append({"at_s": fault.at_s, "kind": fault.kind.value,
                                     "target": fault.target, "message": message})

    # -- evaluation -----------------------------------------------------------------------------
    def _eval_loop(self) -> None:
        import ray

        from islands.learners import data, inner, model
        from islands.learners.unit import _assembler

        cfg = model.ModelConfig(**self.training.model)
        batches = data.eval_batches(self.corpus.eval, self.training.batch_size, cfg.seq_len,
                                    self.config.data.eval_batches)
        evaluate = inner.make_eval_fn(cfg)
        assemble = _assembler(self.template)
        every = self.config.learner.eval_every_s
        while not self.stop_event.is_set():
            try:
                flat, _ = ray.get(self.syncer.global_params.remote(), timeout=30)
                loss = float(evaluate(assemble(flat), batches))
                with self.lock:
                    if self.initial_eval_loss is None:
                        self.initial_eval_loss = loss
                    self.eval_history.append((time.time() - self.started_s, self.tokens()["applied"],
                                              loss))
            except Exception as exc:
                log.info("eval skipped: %s", exc)
            self.stop_event.wait(every)

    def evaluate_now(self) -> Optional[float]:
        import ray

        from islands.learners import data, inner, model
        from islands.learners.unit import _assembler

        cfg = model.ModelConfig(**self.training.model)
        batches = data.eval_batches(self.corpus.eval, self.training.batch_size, cfg.seq_len,
                                    self.config.data.eval_batches)
        flat, _ = ray.get(self.syncer.global_params.remote(), timeout=30)
        loss = float(inner.make_eval_fn(cfg)(_assembler(self.template)(flat), batches))
        with self.lock:
            self.eval_history.append((time.time() - self.started_s, self.tokens()["applied"], loss))
        return loss

    # -- the books ------------------------------------------------------------------------------
    def tokens(self) -> dict:
        """Token ledger: applied + dropped + in flight == processed (DESIGN §5)."""
        ledger = self.syncer_status.get("ledger", {})
        applied = dropped = processed = 0
        for slot in self.slots.values():
            applied += slot.applied_tokens_closed
            dropped += slot.dropped_tokens
            processed += slot.processed_tokens_closed
            if slot.state in ("retired", "restarting"):
                continue
            entry = ledger.get(slot.learner)
            live_applied = (int(entry["applied_tokens_incarnation"])
                            if entry and entry["incarnation"] == slot.incarnation else 0)
            live_processed = int(slot.last_beat["tokens_done"]) if slot.last_beat else 0
            applied += live_applied
            processed += max(live_processed, live_applied)
        return {"applied": applied, "dropped": dropped, "processed": processed,
                "in_flight": processed - applied - dropped}

    def goodput(self) -> dict:
        """Σ applied inner-step seconds ÷ Σ allocated learner seconds (DESIGN §6), over the run
        and over the sliding window of ``metrics.goodput_window_s``."""
        from .metrics import window_label, windowed_ratio

        now = time.time()
        ledger = self.syncer_status.get("ledger", {})
        useful = sum(float(e["applied_compute_s"]) for e in ledger.values())
        allocated = sum(s.allocated_s(now) for s in self.slots.values())
        window_s = self.config.metrics.goodput_window_s
        history = list(self.goodput_history) + [(now, useful, allocated)]
        return {"useful_s": useful, "allocated_s": allocated,
                "goodput": min(1.0, useful / allocated) if allocated > 0 else 0.0,
                "window": {"label": window_label(window_s), "seconds": window_s,
                           "ratio": windowed_ratio(history, now, window_s)}}

    def snapshot(self) -> dict:
        """One row of metrics.jsonl and the source of every exported metric."""
        with self.lock:
            states = collections.Counter(s.state for s in self.slots.values())
            learners = {s.learner: {"region": s.region, "state": s.state,
                                    "incarnation": s.incarnation,
                                    "step": (s.last_beat or {}).get("step", 0),
                                    "tokens_done": (s.last_beat or {}).get("tokens_done", 0),
                                    "loss": (s.last_beat or {}).get("loss"),
                                    "step_time_s": (s.last_beat or {}).get("step_time_s"),
                                    "restarts": dict((c.value, n) for c, n in s.restarts.items()),
                                    "last_heartbeat_s": (time.time() - s.last_beat_s
                                                         if s.last_beat_s else None),
                                    "wire_bytes_up": (s.last_beat or {}).get("wire_bytes_up", 0),
                                    "wire_bytes_down": (s.last_beat or {}).get("wire_bytes_down", 0),
                                    "compression_relative_error": (s.last_beat or {}).get(
                                        "compression_relative_error"),
                                    "timings": (s.last_beat or {}).get("timings"),
                                    "steps_total": s.steps_total(),
                                    "wire_bytes_up_total": s.wire_bytes("up"),
                                    "wire_bytes_down_total": s.wire_bytes("down")}
                        for s in self.slots.values()}
            wire_bytes = {region: {"up": 0, "down": 0} for region in self.config.regions}
            for s in self.slots.values():
                wire_bytes[s.region]["up"] += s.wire_bytes("up")
                wire_bytes[s.region]["down"] += s.wire_bytes("down")
            rejected_total = collections.Counter(self.rejected_closed)
            rejected_total.update(self.syncer_status.get("rejected") or {})
            staleness_total = collections.Counter(self.staleness_closed)
            staleness_total.update(self.syncer_status.get("staleness_counts") or {})
            losses = [l["loss"] for l in learners.values()
                      if l["loss"] is not None and l["state"] == "training"]
            restarts = collections.Counter()
            for s in self.slots.values():
                restarts.update({c.value: n for c, n in s.restarts.items()})
            eval_loss = self.eval_history[-1][2] if self.eval_history else None
            return {
                "t": time.time(), "elapsed_s": time.time() - self.started_s,
                "goodput": self.goodput(), "tokens": self.tokens(),
                "learner_states": dict(states), "learners": learners,
                "alive": states.get("training", 0) + states.get("paused", 0),
                "total": sum(1 for s in self.slots.values() if s.state != "retired"),
                "train_loss": statistics.fmean(losses) if losses else None,
                "eval_loss": eval_loss, "initial_eval_loss": self.initial_eval_loss,
                "syncer": {k: self.syncer_status.get(k) for k in (
                    "epoch", "versions", "merges", "merges_by_fragment", "quorum_size",
                    "grace_window_s", "staleness_counts", "rejected", "wire_bytes_up",
                    "wire_bytes_down")},
                "syncer_restarts": self.syncer_restarts,
                "learner_restarts": dict(restarts), "recoveries": list(self.recoveries),
                "paused_reason": self.paused_reason, "wire_bytes": wire_bytes,
                "rejected_total": dict(rejected_total), "staleness_counts": dict(staleness_total),
            }

    def summary(self) -> dict:
        snap = self.snapshot()
        regions = {name: {"learners": self.targets[name],
                          "wire_bytes_up": snap["wire_bytes"][name]["up"],
                          "wire_bytes_down": snap["wire_bytes"][name]["down"]}
                   for name in self.config.regions}
        return {
            "goodput": snap["goodput"]["goodput"],
            "tokens_applied": snap["tokens"]["applied"],
            "tokens_dropped": snap["tokens"]["dropped"],
            "tokens_in_flight": snap["tokens"]["in_flight"],
            "tokens_processed": snap["tokens"]["processed"],
            "merges": snap["syncer"]["merges"] or 0,
            "learner_restarts": sum(snap["learner_restarts"].values()),
            "learner_restarts_by_reason": snap["learner_restarts"],
            "syncer_restarts": self.syncer_restarts,
            "syncer_epoch": snap["syncer"]["epoch"],
            "wire_bytes": sum(r["wire_bytes_up"] + r["wire_bytes_down"] for r in regions.values()),
            "initial_eval_loss": self.initial_eval_loss,
            "final_eval_loss": snap["eval_loss"],
            "duration_s": snap["elapsed_s"],
            "learners": snap["learners"],
            "regions": regions,
            "recoveries": snap["recoveries"],
            "rejected_pushes": snap["rejected_total"],
            "goodput_window": snap["goodput"]["window"],
            "chaos_fired": list(self.chaos_fired),
        }

    def status_table(self) -> dict:
        return {"learners": self.snapshot()["learners"],
                "syncer": {"epoch": self.syncer_status.get("epoch"),
                           "versions": self.syncer_status.get("versions"),
                           "merges": self.syncer_status.get("merges")},
                "paused_reason": self.paused_reason}

    def shutdown(self) -> dict:
        """Stops learners, takes a final eval, and returns the summary."""
        import ray

        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=30)
        live = [s for s in self.slots.values() if s.handle is not None and s.state != "retired"]
        for s in live:
            try:
                s.handle.stop.remote()
            except Exception:
                pass
        refs = [s.run_ref for s in live if s.run_ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=30)
        self._refresh_syncer_status()
        for s in live:
            try:
                final = ray.get(s.handle.status.remote(), timeout=5)
                s.last_beat = {**(s.last_beat or {}), **final}
            except Exception:
                pass
        try:
            self.evaluate_now()
        except Exception as exc:
            log.warning("final eval failed: %s", exc)
        summary = self.summary()
        for s in live:
            self._close_allocation(s)
        self.emit("job_stopped", goodput=summary["goodput"])
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        return summary

    def ping(self) -> str:
        return "ok"

    # -- metrics ----------------------------------------------------------------------------------
    def serve_metrics(self, port: int) -> int:
        """Serves Prometheus ``/metrics`` from this actor (DESIGN §7) and mirrors the same values
        into ``ray.util.metrics`` for the Ray dashboard. Returns the bound port (0 picks one)."""
        from . import metrics

        if self.metrics_server is None:
            self.metrics_server, self.metrics_port = metrics.serve(self.snapshot, port)
            try:
                self.ray_metrics = metrics.RayMetricsMirror()
            except Exception as exc:  # the Ray mirror is a convenience; Prometheus is the contract
                log.warning("ray.util.metrics mirror not started: %s", exc)
        return self.metrics_port


def recovery_phases(rec: dict) -> dict:
    """Seconds per recovery phase: detect, restart, restore, first contribution, total."""
    failed = rec["failed_s"]
    detected = rec.get("detected_s", failed)
    restarted = rec.get("restarted_s", detected)
    restored = rec.get("restore_done_s", restarted)
    first = rec.get("first_contribution_s", restored)
    return {"cause": rec.get("cause"), "detect_s": detected - failed,
            "restart_s": restarted - detected, "restore_s": restored - restarted,
            "first_contribution_s": first - restored, "total_s": first - failed}


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def _single_thread_env(jax_cache_dir: str) -> dict:
    """Small CPU thread pools (several learners share a few cores, DESIGN §10) and the shared
    persistent compilation cache (a restarted learner loads its step instead of compiling it)."""
    return {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "OMP_NUM_THREADS": "1",
            "JAX_PLATFORMS": os.environ.get("ISLANDS_JAX_PLATFORMS", "cpu"),
            "JAX_COMPILATION_CACHE_DIR": jax_cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _enable_compile_cache(path: str) -> None:
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
