"""LearnerUnit: the learner actor. A training thread around ``LearnerCore`` that never blocks on
the network: pushes leave through a sender thread (which emulates the region's WAN link), replies
are picked up at step boundaries, heartbeats are fire-and-forget.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from typing import Any, Optional

# This process's CPU-seconds before this module loaded: a Ray worker's boot (the interpreter,
# Ray, its connection), reported as the start's ``cpu_boot_s``.
_CPU_AT_LOAD = time.process_time()

import numpy as np  # noqa: E402
import ray  # noqa: E402

from islands.syncer import downlink as downlink_lib

from .devices import apply_env, check_devices
from .factories import (BUILTIN_TASK, learner_core, push_codec, build_task,  # noqa: F401
                        build_training, eval_loss_fn, is_builtin, learner_layout, load_corpus,
                        make_error_feedback, meshed_steps, place_learner_state,
                        warm_compile_cache)
from .gang import replay
from .messages import Heartbeat, LearnerState, known_stats
from .spec import LearnerSpec, TrainingSpec  # noqa: F401 (the actor's spec; re-exported)

log = logging.getLogger("islands.learner")


class LearnerUnit:
    """One learner. Create with ``ray.remote(LearnerUnit).options(name=..., max_concurrency=8)``."""

    def __init__(self, spec: LearnerSpec):
        cpu_init = time.process_time()
        apply_env(spec.env)  # before anything imports JAX in this process
        self.spec = spec
        self.state = LearnerState.STARTING
        self.stop_event = threading.Event()
        self.done = threading.Event()        # run() has returned
        self.run_error: Optional[str] = None
        self.drain_event = threading.Event()
        self.pause_event = threading.Event()
        self.pause_order = -1   # the newest pause/resume call applied (see ``pause``)
        self.pause_lock = threading.Lock()
        self.lock = threading.Lock()
        self.slowdown_factor = 1.0
        self.slowdown_until = 0.0
        self.hang_until = 0.0
        self.stats: dict[str, Any] = {"step": spec.start_step, "tokens_done": 0, "compute_s": 0.0,
                                      "loss": None, "step_time_s": None, "wire_bytes_up": 0,
                                      "wire_bytes_down": 0, "in_flight": 0, "epoch": None,
                                      "compression_relative_error": None, "pushes": 0,
                                      "refused": 0, "adopted": 0, "reregistered": 0,
                                      "ready_at": None,
                                      # This clock's time when ``step`` was reached (its
                                      # iteration's end): step rates on the learner's own clock.
                                      "step_at": None}
        self.core = None
        self.settled_opt_state = None   # the inner state of the newest finished step (a peer's)
        self.gang = None            # the other hosts of a multi-host unit (learners/gang.py)
        self.gang_calls: list = []  # core calls since the last step, for them to replay
        # Sharded syncer: re-registrations with a restarting shard run on their own threads
        # (the training loop never waits on one); their answers wait here for the loop.
        self.registering: set[int] = set()
        self.registered: list[tuple[int, dict, Any]] = []   # (shard, answer, its handle)
        self.prepared: Optional[dict] = None     # what ``prepare`` built (no learner identity)
        self.prepare_lock = threading.Lock()
        self.promoted = threading.Event()
        self.created_s = time.time()
        self.node_id = _node_id()
        self.timings: dict[str, float] = {}
        # Process CPU-seconds per start phase (``cpu_<phase>``, all threads, benchmarks/
        # start_cost.py): on shared cores a start's cost is CPU taken from the training learners.
        self.timings.update(cpu_boot_s=_CPU_AT_LOAD, cpu_load_s=cpu_init - _CPU_AT_LOAD)
        self._cpu_mark = cpu_init
        # The niceness Ray gave this worker (its ``worker_niceness``): a spare's preparation
        # runs above it and comes back to it when hurried or promoted (``normal_priority``).
        self.base_niceness = _niceness()
        from islands.faults import FaultWindows, Link, emulated_bytes_per_s

        self.region = spec.learner.rsplit(":", 1)[0]
        self.link_faults = FaultWindows()   # chaos on this region's link, in wall-clock times
        self.base_link = Link(spec.latency_ms / 1e3, emulated_bytes_per_s(spec.bandwidth_gbps))

    # -- control methods (called concurrently with run) -----------------------------------------
    def ping(self) -> dict:
        spec = self.spec
        return {"learner": spec.learner, "incarnation": spec.incarnation, "state": self.state,
                "pid": os.getpid(), "node_id": _node_id(), "shard_index": spec.shard_index,
                "start_step": spec.start_step, "speed_factor": spec.speed_factor}

    def environment(self) -> dict:
        """This process's JAX/XLA and visible-device variables as it runs with them (what
        ``runtime.process_env`` set, and what Ray set for its devices)."""
        from .devices import ENVIRONMENT_SHOWN

        return {k: os.environ.get(k) for k in ENVIRONMENT_SHOWN}

    def wait_done(self) -> dict:
        """Returns when ``run`` has returned (with its stats) or raises what it raised: the
        liveness probe a restarted controller watches (the first one's ``run`` future died with
        it)."""
        self.done.wait()
        if self.run_error is not None:
            raise RuntimeError(f"{self.spec.learner}: training loop failed: {self.run_error}")
        return self.status()

    def status(self) -> dict:
        with self.lock:
            return {"learner": self.spec.learner, "incarnation": self.spec.incarnation,
                    "state": self.state, **self.stats, "timings": dict(self.timings)}

    def stop(self) -> None:
        self.stop_event.set()

    def drain(self) -> None:
        """Finish the in-flight pushes, stop stepping and return from ``run``."""
        self.drain_event.set()

    def pause(self, paused: bool, order: Optional[int] = None) -> None:
        """Holds or resumes training. ``order``: when the caller sent it (its clock, ns); a call
        older than one already applied is ignored. This actor runs control calls on several
        threads, so a pause and the resume sent right after it (a learner that came back into
        a pause the same fleet step ends) could run the other way round and leave it paused
        while the fleet has it training."""
        with self.pause_lock:
            if order is not None:
                if order <= self.pause_order:
                    return
                self.pause_order = order
            (self.pause_event.set if paused else self.pause_event.clear)()

    def slowdown(self, factor: float, duration_s: float) -> None:
        self.slowdown_factor, self.slowdown_until = factor, time.time() + duration_s

    def hang(self, duration_s: float) -> None:
        """Chaos: stop stepping and heartbeating, as a wedged process would."""
        self.hang_until = time.time() + duration_s

    def link_fault(self, fault) -> None:
        """Chaos: a network fault or partition of this learner's region (absolute wall times)."""
        self.link_faults.add(fault)

    def arrival_s(self, sent_s: float, nbytes: int) -> float:
        """WAN emulation: when ``nbytes`` handed to the link at ``sent_s`` arrive (latency +
        bytes / bandwidth, after any partition, with any degradation in force)."""
        return self.link_faults.arrival_s(self.region, sent_s, nbytes, self.base_link)

    def crash(self) -> None:
        """Chaos: a hard process exit inside the actor (no cleanup, like a segfault)."""
        os._exit(1)

    def fragment_bases(self) -> dict:
        """{p: (version, base fragment)}: what this learner last adopted of each fragment."""
        with self.lock:
            if self.core is None:
                return {}
            return {p: (t.base_version, {k: np.asarray(v) for k, v in t.base.items()})
                    for p, t in enumerate(self.core.tracks)}

    def fragment_base_ids(self) -> dict:
        """{p: (version, base id)}: the syncer's name for each base (syncer/downlink.py; 0: the
        exact global fragment of that version)."""
        with self.lock:
            if self.core is None:
                return {}
            return {p: (t.base_version, t.base_id) for p, t in enumerate(self.core.tracks)}

    def inner_state(self) -> Any:
        """A numpy copy of the inner optimizer state, for a restarting peer (docs/architecture.md#failures-and-reintegration)."""
        import jax

        # The state of the newest finished step (the one in flight's inputs, held by it anyway):
        # its copy never waits for a step, and the training thread never waits on the lock.
        with self.lock:
            if self.core is None:
                return None
            opt_state = (self.settled_opt_state if self.settled_opt_state is not None
                         else self.core.opt_state)
        return jax.tree_util.tree_map(np.asarray, opt_state)

    # -- a warm spare ---------------------------------------------------------------------------
    def prepare(self) -> dict:
        """Everything a start does before it needs a learner identity: JAX imported, the task
        built, the train step and every push encoder compiled (or loaded from the cache), the
        controller and syncer shards found. A spare returns here and waits for ``promote``."""
        with self.prepare_lock:
            if self.prepared is None:
                self.prepared = self._prepare()
        return {"name": self.spec.learner, "prepare_s": self.timings.get("prepare_s"),
                "node_id": self.node_id}

    def promote(self, identity: dict) -> None:
        """Takes a learner's identity (id, shard, incarnation, resume step, peer, speed): the
        next ``run`` trains as that learner. Called once, on a prepared spare."""
        import dataclasses

        if not self.spec.spare or self.promoted.is_set():
            raise RuntimeError(f"{self.spec.learner} is not a spare waiting for promotion")
        # The threads its preparation started (JAX's) are still low: the learner's are not.
        normal_priority(self.base_niceness)
        self.spec = dataclasses.replace(self.spec, spare=False, **identity)
        self.region = self.spec.learner.rsplit(":", 1)[0]
        self.stats["step"] = self.spec.start_step
        self.timings["promoted_at"] = time.time()
        self.promoted.set()

    def hurry(self) -> None:
        """A restart waits for this spare: every thread of its process, the one preparing
        included, goes back to normal priority (its preparation is on the critical path)."""
        normal_priority(self.base_niceness)

    def _prepare(self) -> dict:
        if not self.spec.spare:
            return self._prepare_now()
        # A spare prepares at low priority: it must not take CPU from the learners training or
        # from a restart under way on the same cores (its threads, JAX's included, inherit it).
        with low_priority():
            return self._prepare_now()

    def cpu_lap(self, name: str) -> None:
        """Records the process CPU-seconds since the previous lap as ``timings[cpu_<name>]``."""
        now = time.process_time()
        self.timings["cpu_" + name], self._cpu_mark = now - self._cpu_mark, now

    def _prepare_now(self) -> dict:
        self.cpu_lap("init_s")
        import jax

        from .task import TaskStream

        self.cpu_lap("import_s")   # JAX, optax and the learner's modules
        spec, tspec = self.spec, self.spec.training
        t_start = time.time()
        # Before anything else: a learner on the wrong devices must not train at all.
        self.stats["devices"] = check_devices(spec.device_request).as_dict()
        self.timings["devices_s"] = time.time() - t_start
        self.cpu_lap("devices_s")
        if spec.profiler and self.stats.get("profiler") is None:
            self.stats["profiler"] = start_profiler()
        # Zero-copy from the object store when the controller shared the built-in corpus.
        train_bytes = ray.get(spec.corpus_ref) if spec.corpus_ref is not None else None
        self.timings["corpus_s"] = time.time() - t_start
        self.cpu_lap("corpus_s")
        task = build_task(tspec, train_bytes)
        task, template, optimizer, train_step = build_training(tspec, abstract=True, task=task)
        self.timings["model_s"] = time.time() - t_start
        self.cpu_lap("model_s")
        controller = (ray.get_actor(spec.controller_name, namespace=spec.namespace)
                      if spec.controller_name else None)
        if spec.spare:
            # Compile what a learner runs, on placeholder values of the right shapes (the values
            # are thrown away; the compiled programs stay in this process and the cache).
            params = jax.tree_util.tree_map(lambda x: jax.numpy.zeros(x.shape, x.dtype), template)
            opt_state = optimizer.init(params)
            _, _, loss = train_step(params, opt_state, TaskStream(task, 0, 1).batch_at(0))
            float(loss)
            self.cpu_lap("warm_step_s")
            learner_core(tspec, spec.learner, params, opt_state,
                          [0] * tspec.fragments).compile_pushes()
            self.cpu_lap("warm_pushes_s")
            for s in range(spec.syncer_shards):   # found now, registered at promotion
                ray.get_actor(self._shard_name(s), namespace=spec.namespace)
        self.timings["prepare_s"] = time.time() - t_start
        return {"task": task, "template": template, "optimizer": optimizer,
                "train_step": train_step, "controller": controller,
                "pushes_compiled": spec.spare}

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> dict:
        """Trains until stopped or drained; returns the final stats. Its future is the liveness probe."""
        try:
            self._run()
        except Exception as exc:
            log.exception("%s failed", self.spec.learner)
            self.run_error = repr(exc)[:500]
            raise
        finally:
            self.done.set()
        return self.status()

    def _run(self) -> None:
        # A threaded actor may start ``run`` before the ``promote`` sent just ahead of it.
        if self.spec.spare and not self.promoted.wait(timeout=60.0):
            raise RuntimeError(f"{self.spec.learner} is a spare: promote it before run")
        t_start = time.time()
        cpu_from = 0.0
        if self.prepared is not None:   # a prepared process: its start's CPU counts from here
            self._cpu_mark = cpu_from = time.process_time()
        if self.spec.hosts > 1 and self.gang is None:
            from .gang import Gang

            self.gang = Gang(self.spec)
            self.gang.join()   # jax.distributed over the unit, before JAX runs anything here
        if self.prepared is None:
            self.prepare()
        import jax   # (imported by prepare: its CPU is prepare's ``import`` phase)

        from .task import TaskStream

        prepared = self.prepared
        spec, tspec = self.spec, self.spec.training
        # The restore's phases, each in seconds (``timings``; a promoted spare's takeover).
        lap = [t_start]

        def phase(name: str) -> None:
            now = time.time()
            self.timings[name], lap[0] = now - lap[0], now
            if name != "prepare_wait_s":   # (prepare's own laps cover it)
                self.cpu_lap(name)

        phase("prepare_wait_s")   # ~0 for a prepared spare; a fresh process's whole prepare
        # The peer's inner state is asked for first: its copy (the peer's step in flight, then
        # Adam's two moments through the object store) runs while this one registers.
        peer_ref = None
        if spec.peer:
            try:
                peer_ref = ray.get_actor(spec.peer, namespace=spec.namespace
                                         ).inner_state.remote()
            except Exception as exc:  # a peer that died meanwhile: start a fresh inner state
                log.warning("%s: no inner state from %s (%s)", spec.learner, spec.peer, exc)
        task, template = prepared["task"], prepared["template"]
        optimizer, train_step = prepared["optimizer"], prepared["train_step"]
        stream = TaskStream(task, spec.shard_index, spec.num_shards)
        # Exact resume: the first batch is the one at start_step (the stream opens there).
        first_batch = stream.batch_at(spec.start_step).batch
        tokens_per_batch = int(task.tokens(first_batch))
        layout = learner_layout(tspec, task, template, optimizer, first_batch,
                                jax.devices() if self.gang is not None else None)
        train_step, batch_at = meshed_steps(layout, train_step, stream.batch_at)
        self.controller = prepared["controller"]
        phase("data_s")
        reg = self._register_all()
        flat = {}
        for frag in reg["fragments"]:
            flat.update(frag)
        from islands.syncer.fragments import assembler

        assemble = assembler(template)
        params = jax.tree_util.tree_map(lambda x: x, assemble(flat))
        phase("register_s")
        # (a promoted spare: from its promotion, not from its start as a spare)
        self.timings["restart_s"] = t_start - self.timings.get("promoted_at", self.created_s)
        opt_state = None
        if peer_ref is not None:
            try:
                opt_state = ray.get(peer_ref, timeout=10)
            except Exception as exc:  # a peer that died meanwhile: start a fresh inner state
                log.warning("%s: no inner state from %s (%s)", spec.learner, spec.peer, exc)
        phase("peer_state_s")
        # Its schedule resumes where the syncer says under the fleet clock (the fleet's count,
        # for a fresh state and a peer's alike), else where its data does.
        schedule = reg["schedule_step"] if reg["schedule_step"] is not None else spec.start_step
        if self.gang is not None:
            from .gang import StartState

            self.gang.start(StartState(spec.learner, spec.incarnation, spec.shard_index,
                                       spec.num_shards, spec.start_step, flat,
                                       tuple(reg["versions"]), reg["session"], opt_state,
                                       schedule))
        params, opt_state = place_learner_state(layout, optimizer, params, opt_state, schedule)
        with self.lock:
            self.core = learner_core(tspec, spec.learner, params, opt_state, reg["versions"],
                                      spec.incarnation, spec.start_step, reg["session"], layout)
        core = self.core
        phase("place_s")
        from .loop import LearnerLoop

        loop = LearnerLoop(core, train_step, batch_at, tokens_per_batch, tspec.fragments,
                           tspec.sync_every_steps)
        t_compile = time.time()
        # A prepared spare compiled exactly these encoders (same shapes, one device, the same
        # jitted function: ``push_codec``); a layout or a gang places them differently.
        if not (prepared.get("pushes_compiled") and layout is None and self.gang is None):
            core.compile_pushes()
        self.timings["compile_pushes_s"] = time.time() - t_compile
        self.cpu_lap("compile_pushes_s")
        self.timings["restore_s"] = time.time() - t_start
        self.timings["ready_at"] = time.time()
        self.stats["ready_at"] = self.timings["ready_at"]
        sender = _Sender(self, spec)
        sender.start()
        self.state = LearnerState.TRAINING
        last_beat = 0.0
        step_time_ema = None
        arrived: list = []  # (usable_at, p, fragment, version, epoch of its push)
        drain_since: Optional[float] = None
        try:
            while not self.stop_event.is_set():
                now = time.time()
                if now < self.hang_until:
                    time.sleep(0.05)
                    continue
                if self.drain_event.is_set():
                    if sender.idle() and not sender.pending and not sender.failed:
                        break
                    drain_since = drain_since if drain_since is not None else now
                    if now - drain_since > spec.drain_timeout_s:
                        # A push never answered (seen once, across a syncer restart) must not
                        # hold the drain forever: it is given up, as a dead learner's would be.
                        log.warning("%s drained with %d push(es) unanswered after %.0fs",
                                    spec.learner, sender.in_flight(),
                                    spec.drain_timeout_s)
                        with self.lock:
                            self.stats["drain_unanswered"] = sender.in_flight()
                        break
                    self.state = LearnerState.DRAINING
                    self._collect_replies(sender, arrived)
                    time.sleep(0.02)
                    continue
                if self.pause_event.is_set():
                    self.state = LearnerState.PAUSED
                    self._collect_replies(sender, arrived)
                    if time.time() - last_beat >= spec.heartbeat_s:
                        self._beat(core, step_time_ema)
                        last_beat = time.time()
                    time.sleep(0.05)
                    continue
                self.state = LearnerState.TRAINING
                # Collecting replies may re-register with a restarted syncer (seconds): that is
                # not step time, which the straggler check reads.
                self._collect_replies(sender, arrived)
                t0 = time.time()
                self._offer_arrived(arrived, t0)
                if self.gang is not None:
                    self._gang_step()
                with self.lock:
                    adopted = loop.adopt()
                    self.stats["adopted"] += len(adopted)
                self.settled_opt_state = core.opt_state   # this step's inputs (finished)
                loss = loop.train(loop.batch())
                loop.prefetch(core.step + 1)  # the next batch while this step runs
                loss = float(loss)  # waits for the step
                self.settled_opt_state = core.opt_state
                # Emulated slower hardware (speed factor, chaos slowdown): the whole iteration,
                # pushes and bookkeeping included, is padded to the target at its end.
                factor = self.slowdown_factor if time.time() < self.slowdown_until else 1.0
                target = max(spec.min_step_time_s, 0.0) / spec.speed_factor * factor
                if factor > 1.0 and spec.min_step_time_s == 0.0:
                    target = (time.time() - t0) * factor
                dt = max(time.time() - t0, target)
                first_step = "first_step_s" not in self.timings
                if first_step:
                    self.timings["first_step_s"] = dt
                    self.cpu_lap("first_step_s")
                    # The start's CPU: from the process's birth, or a prepared one's ``run``.
                    self.timings["cpu_start_s"] = time.process_time() - cpu_from
                    self.stats["timings"] = dict(self.timings)
                with self.lock:
                    loop.record(dt)
                # The encodes are dispatched; the sender thread waits for the codes and sends them
                # while the next inner step runs.
                for push_plan in loop.pushes(self.fragment_epochs()):
                    sender.send(self.arrival_s(time.time(), push_plan.wire_bytes), push_plan)
                    with self.lock:
                        self.stats["pushes"] += 1
                        self.stats["wire_bytes_up"] += push_plan.wire_bytes
                # The iteration's time includes handing over its pushes (as padding covers them);
                # that part is counted once the pushes are out, with the next push's seconds.
                extra = max(time.time() - t0, target) - dt
                with self.lock:
                    if extra > 0:
                        core.add_step_seconds(extra)
                        dt += extra
                    # The pace (syncer/timing.py StepPace: EMA, the first step, which loads or
                    # compiles the program, left out), as the in-process driver keeps it.
                    loop.paced(dt)
                    step_time_ema = loop.step_time_s
                    self.stats.update(step=core.step, tokens_done=core.tokens_done,
                                      compute_s=core.compute_s, loss=loss,
                                      step_time_s=step_time_ema, in_flight=sender.in_flight(),
                                      epoch=self.epoch, step_at=t0 + dt)
                if time.time() - last_beat >= spec.heartbeat_s:
                    self._beat(core, step_time_ema)
                    last_beat = time.time()
                pad = t0 + dt - time.time()
                if pad > 0:
                    self.stop_event.wait(pad)
        finally:
            sender.close()
            if self.gang is not None:
                self.gang.stop()
            self.state = LearnerState.STOPPED
            self._beat(core, step_time_ema)

    def _collect_replies(self, sender, arrived) -> None:
        """Moves finished push futures into ``arrived`` (with the emulated downlink delay)."""

        self._apply_registrations()
        for push in sender.take_failed():
            self._lost(push)
        for ref, push in sender.finished():
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._lost(push)
                continue
            self._answered(push, reply, arrived)

    def _lost(self, push) -> None:
        """The push could not be sent, or its syncer (shard) died: it is lost. Register with
        the successor (new epoch); the other shards' fragments go on as they were."""
        if self._superseded(push):
            return
        self._core("push_refused", push.fragment)
        self._reregister(self.shard_of[push.fragment])

    def _answered(self, push, reply, arrived) -> None:
        """The syncer's answer to ``push``: a merge goes into ``arrived`` (with the emulated
        downlink delay and its push's epoch), a refusal is acted on. An answer from an epoch
        this learner has re-registered past is void, a merge too: its fragment's track was
        reset, and adopting it would take an old merge for the newer push's."""
        from islands.syncer.actor import ReplyStatus

        if self._superseded(push):
            return
        if reply.status == ReplyStatus.MERGED:
            update = reply.update if reply.update is not None else reply.params
            nbytes = downlink_lib.update_bytes(update)
            with self.lock:
                self.stats["wire_bytes_down"] += nbytes
            arrived.append((self.arrival_s(time.time(), nbytes), reply.fragment,
                            update, reply.version, push.epoch))
        else:
            reason = (reply.reason if reply.status == ReplyStatus.REJECTED
                      else reply.status.value)
            with self.lock:
                self.stats["refused"] += reply.status == ReplyStatus.REJECTED
                self._core("refused", push.fragment, reason, reply.params, reply.version)
            if reason in ("stale_epoch", "unknown_learner", "bad_session"):
                self._reregister(self.shard_of[push.fragment])

    def _offer_arrived(self, arrived: list, now: float) -> None:
        """Offers the merges in ``arrived`` whose emulated downlink delay is over; one whose push
        went to an epoch this learner has re-registered past since it arrived is dropped (the
        re-registration returned its tokens to the drift and reset the track)."""
        for item in [a for a in arrived if a[0] <= now]:
            arrived.remove(item)
            _, p, update, version, epoch = item
            if superseded(epoch, self.epochs[self.shard_of[p]]):
                continue
            self._core("offer_reply", p, update, version)

    def _superseded(self, push) -> bool:
        """A push to an earlier epoch of its syncer shard than the one this learner has since
        registered with: the re-registration voided it (``LearnerCore.reregistered``), so its
        refusal or loss says nothing about the fragment's track, whose newer push may be out.
        Acting on it would send that fragment again while the newer push is unanswered (its
        drift twice)."""
        return superseded(push.epoch, self.epochs[self.shard_of[push.fragment]])

    # -- the syncer shards ----------------------------------------------------------------------
    def _shard_name(self, syncer_shard: int) -> str:
        name = self.spec.syncer_name
        return name if syncer_shard == 0 else f"{name}-{syncer_shard}"

    def _register_all(self) -> dict:
        """Registers with every syncer shard; returns the fragments and versions by global id.
        Shard 0 hands out the session; the other shards take the same one, so a push carries one
        session whatever shard it goes to."""

        spec = self.spec
        self.syncers, self.epochs, self.shard_of = [], [], {}
        fragments, versions, session, schedule_step = {}, {}, None, None
        for s in range(spec.syncer_shards):
            handle = ray.get_actor(self._shard_name(s), namespace=spec.namespace)
            # (a single syncer, or a region's link standing in for it, takes no session)
            args = (spec.learner, spec.incarnation) + ((None, session) if session else ())
            reg = ray.get(handle.register.remote(*args))
            session = session or reg["session"]
            if s == 0:   # the fleet clock's count (an older syncer or link says none)
                schedule_step = reg.get("schedule_step")
            self.syncers.append(handle)
            self.epochs.append(reg["epoch"])
            ids = reg.get("fragment_ids") or range(len(reg["fragments"]))
            for p, fragment, version in zip(ids, reg["fragments"], reg["versions"]):
                fragments[p], versions[p] = fragment, version
                self.shard_of[p] = s
        self.epoch = self.epochs[0]
        order = sorted(fragments)
        return {"fragments": [fragments[p] for p in order],
                "versions": [versions[p] for p in order], "session": session,
                "schedule_step": schedule_step}

    def _core(self, method: str, *args) -> None:
        """A call that changes the core outside the step itself. In a multi-host unit it waits
        for the next step: every host then makes the unit's calls in the same order (each may
        run a program over the unit's devices, learners/gang.py)."""
        if self.gang is not None:
            self.gang_calls.append((method, args))
            return
        replay(self.core, [(method, args)])

    def _gang_step(self) -> None:
        """A unit's step starts: its other hosts get the calls made since the last step and the
        step's push epochs, then this host makes the same calls."""
        self.gang.check()
        with self.lock:
            calls, self.gang_calls = self.gang_calls, []
            self.gang.step(calls, self.fragment_epochs())
            replay(self.core, calls)

    def fragment_epochs(self) -> list[int]:
        """Per fragment, the epoch of the syncer shard that owns it (what its pushes carry)."""
        return [self.epochs[self.shard_of[p]] for p in range(len(self.shard_of))]

    def syncer_for(self, p: int):
        """The handle of the syncer shard that owns fragment p."""
        return self.syncers[self.shard_of[p]]

    def _reregister(self, syncer_shard: int = 0) -> None:
        """Joins a restarted syncer shard: new epoch, new bases for its fragments; local progress
        is kept as drift. The other shards' fragments are untouched.

        One syncer: waits for it (nothing can merge meanwhile). Several shards: a thread of its
        own tries until the shard answers, and the training loop applies the answer at its next
        iteration, so this learner keeps training and pushing the other shards' fragments while
        one restarts (a blocking try held every step for up to a second per lost push)."""

        sharded = self.spec.syncer_shards > 1
        if sharded:
            with self.lock:
                if syncer_shard in self.registering:
                    return
                self.registering.add(syncer_shard)
        else:
            found = self._register_with(syncer_shard, time.time() + 60.0)
            if found is not None:
                self._joined(syncer_shard, *found)
            return

        def register_in_background():
            found = None
            try:
                found = self._register_with(syncer_shard, None)
            finally:   # the shard stays "registering" until the loop has applied its answer
                with self.lock:
                    if found is None:
                        self.registering.discard(syncer_shard)
                    else:
                        self.registered.append((syncer_shard, *found))

        try:
            threading.Thread(target=register_in_background, daemon=True,
                             name=f"islands-register-{syncer_shard}").start()
        except RuntimeError:   # no thread to be had: the next lost push tries again
            with self.lock:
                self.registering.discard(syncer_shard)

    def _adopted(self) -> list:
        """What this learner adopted, per fragment: a restored syncer takes newer versions."""
        with self.lock:
            return [(t.base_version, {k: np.asarray(v) for k, v in t.base.items()})
                    for t in self.core.tracks]

    def _register_with(self, syncer_shard: int, deadline: Optional[float]
                       ) -> Optional[tuple[dict, Any]]:
        """Registers with shard ``syncer_shard``; returns its answer and its handle (looked up
        anew: a restarted shard is a new actor). A call not yet answered is waited on again,
        not sent again (each send carries the adopted fragments); one whose shard died is sent
        again to its successor, with what was adopted since. Tries until ``deadline`` (None:
        until this learner stops or its run ends). None: it stopped or the deadline passed."""
        sharded = self.spec.syncer_shards > 1
        # One shard keeps the single syncer's fresh session per registration; with several,
        # every shard shares the learner's one session.
        session = self.core.session if sharded else None
        handle, ref = None, None
        while not (self.stop_event.is_set() or self.done.is_set()):
            try:
                if ref is None:
                    handle = ray.get_actor(self._shard_name(syncer_shard),
                                           namespace=self.spec.namespace)
                    args = (self.spec.learner, self.spec.incarnation, self._adopted()) + (
                        (session,) if session else ())
                    ref = handle.register.remote(*args)
                return ray.get(ref, timeout=1.0 if sharded else 10), handle
            except ray.exceptions.GetTimeoutError:
                pass       # still restoring: the same call is waited on again
            except Exception:   # no such actor yet, or it died: a new call next time
                ref = None
            if deadline is not None and time.time() >= deadline:
                return None
            if ref is None:
                self.stop_event.wait(0.5)
        return None

    def _apply_registrations(self) -> None:
        """The training loop takes the answers its registration threads got (core changes stay
        on the training thread: a step may be running while a thread registers)."""
        if not self.registered:
            return
        with self.lock:
            answers, self.registered = self.registered, []
        for syncer_shard, reg, handle in answers:
            self._joined(syncer_shard, reg, handle)
            with self.lock:
                self.registering.discard(syncer_shard)

    def _joined(self, syncer_shard: int, reg: dict, handle) -> None:
        """Takes shard ``syncer_shard``'s registration answer into the core, and its handle
        with it (the sender's pushes then carry the new epoch to the new actor; swapped
        earlier, the old epoch's pushes went to it and were refused as stale)."""
        with self.lock:
            self.syncers[syncer_shard] = handle
        if reg["epoch"] == self.epochs[syncer_shard]:
            # Same syncer, a new session: the drift stays as it is.
            with self.lock:
                self._core("session", reg["session"])
            return
        ids = reg.get("fragment_ids") if self.spec.syncer_shards > 1 else None
        with self.lock:
            self.epochs[syncer_shard] = reg["epoch"]
            self.epoch = self.epochs[0]
            self._core("reregistered", reg["fragments"], reg["versions"], reg["session"], ids)
            self.stats["reregistered"] += 1

    def _beat(self, core, step_time_ema) -> None:
        if self.controller is None or core is None:
            return
        with self.lock:
            beat = Heartbeat(**{**known_stats(self.stats), "learner": self.spec.learner,
                                "incarnation": self.spec.incarnation, "t": time.time(),
                                "state": self.state, "node_id": self.node_id,
                                "timings": dict(self.timings),
                                "fates": core.fates.to_json()})  # the training thread's books
        try:
            self.controller.heartbeat.remote(beat)
        except Exception:  # the controller is gone: the job is ending
            pass


class _Sender:
    """Delays each push by its emulated WAN time, then sends it; keeps the unanswered futures."""

    def __init__(self, unit: LearnerUnit, spec: LearnerSpec):
        self.unit = unit
        self.queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self.pending: list = []   # (ref, push)
        self.failed: list = []    # pushes that could not be sent
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="islands-sender")
        self.seq = 0

    def start(self) -> None:
        self.thread.start()

    def send(self, at_s: float, push) -> None:
        self.seq += 1
        self.queue.put((at_s, self.seq, push))

    def idle(self) -> bool:
        """Nothing left to send: none queued and none in hand (a push taken off the queue counts
        until it is in ``pending`` or ``failed``: its encode and WAN delay take a while)."""
        return self.unsent() == 0

    def unsent(self) -> int:
        """Pushes queued or in the sender's hand (``Queue.unfinished_tasks``, which ``put``
        raises and ``task_done`` lowers once the push is sent or failed)."""
        with self.queue.mutex:
            return self.queue.unfinished_tasks

    def in_flight(self) -> int:
        """Pushes sent and unanswered, queued, or in hand, each counted once (``_loop`` moves a
        sent push into ``pending`` and marks its task done under the same lock)."""
        with self.lock:
            return len(self.pending) + self.unsent()

    def take_failed(self) -> list:
        with self.lock:
            failed, self.failed = self.failed, []
            return failed

    def finished(self) -> list:

        with self.lock:
            if not self.pending:
                return []
            refs = [ref for ref, _ in self.pending]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            ready_set = set(ready)
            done = [(ref, push) for ref, push in self.pending if ref in ready_set]
            self.pending = [(ref, push) for ref, push in self.pending if ref not in ready_set]
            return done

    def _loop(self) -> None:
        while not self.closed.is_set():
            try:
                at_s, _, plan = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            sent = None
            try:
                sent = self._send(at_s, plan)
            finally:
                with self.lock:   # sent or failed: no longer in hand, and counted once
                    if sent is not None:
                        self.pending.append(sent)
                    self.queue.task_done()

    def _send(self, at_s: float, plan) -> Optional[tuple]:
        plan = plan.on_host()   # waits for the encode, off the training thread
        push = plan.push
        with self.unit.lock:
            self.unit.stats["compression_relative_error"] = plan.relative_error
        wait = at_s - time.time()
        if wait > 0 and self.closed.wait(wait):
            return
        try:
            ref = self.unit.syncer_for(push.fragment).push.remote(push)
        except Exception:  # the syncer handle is dead; the training loop re-registers
            with self.lock:
                self.failed.append(push)
            return
        return ref, push   # into ``pending`` by ``_loop``

    def close(self) -> None:
        self.closed.set()


SPARE_NICENESS = 10


def superseded(push_epoch: int, shard_epoch: int) -> bool:
    """Whether a push's answer is void: it went to an earlier epoch of its syncer shard than the
    learner's registration now holds.

    >>> superseded(0, 1), superseded(1, 1)
    (True, False)
    """
    return push_epoch < shard_epoch


@contextlib.contextmanager
def low_priority(niceness: int = SPARE_NICENESS):
    """Runs the block with the calling thread's niceness raised (Linux keeps a niceness per
    thread; threads started inside inherit it), then puts it back where that is allowed."""
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(before + niceness, 19))
    except (AttributeError, OSError):   # no per-thread priority here: run as is
        yield
        return
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except OSError:   # lowering niceness needs privileges: this thread stays low
            pass


def _niceness() -> Optional[int]:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return None


def normal_priority(niceness: Optional[int]) -> bool:
    """Puts every thread of this process back to ``niceness`` (Linux keeps one per thread).
    Lowering a niceness needs privileges (root, CAP_SYS_NICE or RLIMIT_NICE): without them the
    threads stay where they are (False), as ``low_priority`` leaves its thread."""
    if niceness is None:
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return False
    done = True
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:   # not permitted, or the thread has ended
            done = False
    return done


def start_profiler() -> Optional[str]:
    """Starts ``jax.profiler.start_server`` on a free port of this node; its ``host:port`` for
    TensorBoard's or XProf's capture, or None where the platform cannot (logged, never fatal)."""
    import socket

    import jax

    try:
        with socket.socket() as sock:   # a free port: several learners share a node
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        jax.profiler.start_server(port)

        return f"{ray.util.get_node_ip_address()}:{port}"
    except Exception as exc:
        log.warning("JAX profiler server not started: %s", exc)
        return None


def _node_id() -> Optional[str]:
    try:

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None
