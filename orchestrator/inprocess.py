"""In-process driver: M learners and the syncer in one process, on a virtual clock.

A deterministic discrete-event simulation of the Decoupled DiLoCo data path, built from the core
objects the Ray actors wrap (``LearnerCore``, ``SyncerCore``): the engine of the fast tests, the
benchmarks and the demo. A learner never waits: it steps on while its pushes travel and adopts a
reply at a step boundary. Faults (``chaos.FaultPlan``,
docs/architecture.md#failures-and-reintegration) and operator commands go to the fleet, held by
the same ``owner.Owner`` as the Ray controller's, on the seam's interfaces on this clock
(virtual_groups.py); what takes time on a cluster takes virtual time (``chaos.RestartCosts``).
Goodput (docs/architecture.md#goodput) is exact: applied inner-step seconds over the seconds
each learner's slot existed.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Callable, Optional, Sequence

from islands.faults import FaultKind, FaultWindows
from islands.learners.core import LearnerCore
from islands.learners.loop import LearnerLoop
from islands.orchestrator import fleet as fleet_lib
from islands.orchestrator.chaos import FaultPlan, RestartCosts
from islands.orchestrator.owner import Hooks, Owner
from islands.orchestrator.run_record import RunRecord, StepRecord, series_from_intervals  # noqa: F401
from islands.orchestrator.virtual_groups import (ARRIVE, CHECK, FAULT, FLEET, REPLY, STEP_DONE,
                                                 STEP_START, VirtualLearnerGroup,
                                                 VirtualSyncerGroup)
from islands.orchestrator.virtual_fleet import (Fleet, VirtualMachine, VirtualSpecs,  # noqa: F401
                                                assemble_like, build_syncer_and_learners,
                                                check_plan, restarted_core, task_run)
from islands.syncer import downlink as downlink_lib
from islands.syncer import timing
from islands.syncer.core import SyncerCore
from islands.syncer.validate import SYNCER_DOWN


class _Driver(Hooks):
    """The event loop of ``run_inprocess`` and its per-learner state."""

    def __init__(self, *, learners, syncer, train_step, batch_for, tokens_per_batch, fleet,
                 num_fragments, sync_every_steps, steps, evaluate, eval_every_steps, assemble,
                 faults, restart, opt_init, until_s, commands=()):
        self.cores: list[LearnerCore] = list(learners)
        self.syncer: SyncerCore = syncer
        self.train_step, self.batch_for = train_step, batch_for
        self.tokens_per_batch, self.fleet = tokens_per_batch, fleet
        self.num_fragments, self.sync_every_steps = num_fragments, sync_every_steps
        self.steps, self.until_s = steps, until_s
        self.evaluate, self.eval_every_steps, self.assemble = evaluate, eval_every_steps, assemble
        self.faults = faults if faults is not None else FaultPlan()
        self.commands = sorted(commands, key=lambda c: c[0])   # (time_s, fleet observation)
        self.restart, self.opt_init = restart, opt_init
        self.restart_cost = restart.sampler()   # (promotion?) -> seconds: flat or measured
        self.now = 0.0                           # the virtual clock: the current event's time
        n = len(self.cores)
        self.ids = [core.learner for core in self.cores]
        self.index_of = {name: i for i, name in enumerate(self.ids)}
        self.regions = fleet.regions_of(self.ids)
        check_plan(self.faults, self.ids, self.regions, opt_init)
        self.loops = [self.loop_for(i, core) for i, core in enumerate(self.cores)]
        self.paused = [False] * n
        self.parked = [False] * n        # paused at a step boundary, to start again on resume
        self.rngs = [fleet.noise_rng(i) for i in range(n)]
        self.up = [True] * n
        self.finished_at: list[Optional[float]] = [None] * n
        self.epoch_of = [syncer.epoch] * n
        self.down_since: list[Optional[float]] = [None] * n
        self.start_step = [core.step for core in self.cores]
        self.windows = FaultWindows()
        self.syncer_down_until = -math.inf
        self.events: list = []
        self.seq = itertools.count()
        self.last_eval_step = -1
        self.record = RunRecord(global_params=None, learner_params=[],
                                train_losses=[[] for _ in range(n)], learner_ids=list(self.ids),
                                regions=list(self.regions),
                                down_intervals=[[] for _ in range(n)])
        # ξ_sync as the Ray syncer has it: the fleet latency's round trip + merge time (0 here).
        self.sync_time = timing.SyncTime(round_trip_s=timing.round_trip_s([fleet.latency_s]))
        self.step_s = [0.0] * n          # the seconds of each learner's current step
        self.in_step = [False] * n       # between a step's start and its end
        self.retired_at: list[Optional[float]] = [None] * n   # left the fleet (drained)
        self.held = False   # merges held by a pause when the current turn began
        # The virtual machine, the seam's interfaces on it (virtual_groups.py), the owner on them.
        self.machine = VirtualMachine(self)
        self.groups = VirtualLearnerGroup(self)
        self.shards = VirtualSyncerGroup(self)
        settings = fleet.settings(self.ids, syncer.settings.min_learners)
        self.owner = Owner(settings, num_fragments, self.groups, self.shards, VirtualSpecs(),
                           clock=lambda: self.now, hooks=self,
                           tell=lambda obs: self.schedule(self.now, FLEET, "fleet", [obs]))

    def schedule(self, time_s: float, priority: int, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (time_s, priority, next(self.seq), kind, payload))

    # -- helpers --------------------------------------------------------------------------------
    def slowest_step_s(self) -> float:
        """ξ_step as the Ray controller computes it (``timing.slowest_step_s``): the paces of the
        learners whose slot the fleet holds TRAINING (a dead one until its death is seen)."""
        return timing.slowest_step_s(
            self.loops[self.index_of[slot.learner]].step_time_s
            for slot in self.owner.fleet.slots.values()
            if slot.state == fleet_lib.SlotState.TRAINING and slot.learner in self.index_of)

    def current(self, i: int, incarnation: int) -> bool:
        return self.up[i] and self.cores[i].incarnation == incarnation

    def step_time(self, i: int, now: float) -> float:
        noise = (self.rngs[i].uniform(-self.fleet.step_noise, self.fleet.step_noise)
                 if self.fleet.step_noise else 0.0)
        factor = self.windows.slowdown(self.ids[i], self.regions[i], now)
        # Processes starting on the same cores (restarts, spares preparing) take CPU from it.
        factor *= 1.0 + self.restart.survivor_slowdown_per_start * self.machine.starts.starting
        return self.fleet.nominal_step_s(i) * (1.0 + noise) * factor

    def arrival(self, i: int, now: float, nbytes: int) -> float:
        return self.windows.arrival_s(self.regions[i], now, nbytes, self.fleet.link)

    def global_tree(self) -> Any:
        flat = self.syncer.params_flat()
        return self.assemble(flat) if self.assemble else flat

    def live_fates(self) -> dict:
        """Each running incarnation's own books."""
        return {self.ids[i]: core.fates.to_json() for i, core in enumerate(self.cores)
                if self.up[i]}

    def tokens_applied(self) -> float:
        return self.owner.books.tokens(self.live_fates()).applied / self.num_fragments

    def maybe_eval(self, now_s: float) -> None:
        if self.evaluate is not None:
            self.record.evals.append((now_s, self.tokens_applied(),
                                      float(self.evaluate(self.global_tree()))))

    def watermark(self, i: int) -> int:
        """The current incarnation's applied step (its start step before its first merge)."""
        core = self.cores[i]
        entry = self.syncer.ledger.get(self.ids[i])
        if entry is None or entry.incarnation != core.incarnation:
            return self.start_step[i]
        return entry.applied_step

    def recheck_open_rounds(self, now: float) -> None:
        for p, slot in enumerate(self.syncer.slots):
            if slot.round:
                self.schedule(now, CHECK, "check", p)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> RunRecord:
        self.begin()
        self.advance()
        return self.finish()

    def begin(self) -> None:
        """Time 0: the plan's faults and the commands are scheduled, the fleet has its slots
        and every learner starts its first step."""
        self.faults.reset()
        for t in self.faults.times():
            self.schedule(t, FAULT, "fault", None)
        for t, command in self.commands:
            self.schedule(t, FLEET, "command", command)
        self.maybe_eval(0.0)
        self.fleet_step(0.0, [])  # launches the slots (allocated now): here they exist already
        self.fleet_step(0.0, [fleet_lib.Beat(name, 0, True, ready_at_s=0.0) for name in self.ids])
        for i, core in enumerate(self.cores):
            self.schedule(0.0, STEP_START, "start", (i, core.incarnation))

    def advance(self, until_s: float = math.inf) -> None:
        """Carries out the events up to ``until_s`` (all of them: to the run's end); the clock
        then stands at ``until_s``."""
        while self.events and self.events[0][0] <= until_s:
            now, _, _, kind, payload = heapq.heappop(self.events)
            self.now = now
            getattr(self, "on_" + kind)(now, payload)
            if self.machine.draining:
                self.check_drains(now)
            if kind != "spare":  # a spare getting ready after the last step ends no run
                self.record.end_time_s = now
        if until_s < math.inf:
            self.now = until_s

    def on_start(self, now: float, payload) -> None:
        i, incarnation = payload
        if not self.current(i, incarnation):
            return
        core, loop = self.cores[i], self.loops[i]
        if i in self.machine.draining:
            return  # no new step: it leaves once its pushes are answered (check_drains)
        if self.paused[i]:
            self.parked[i] = True  # the quorum floor holds it; a resume starts it again
            return
        if loop.adopt() and not self.owner.fleet.slots[self.ids[i]].adopted:
            # Its first adopted merge: the fleet may take it as a peer donor from now on.
            self.fleet_step(now, [fleet_lib.Beat(self.ids[i], incarnation, True, adopted=True)])
        if core.step >= self.steps or (self.until_s is not None and now >= self.until_s):
            self.finished_at[i] = now
            return
        loss = loop.train(loop.batch())
        self.record.train_losses[i].append(float(loss))
        dt = self.step_time(i, now)
        loop.record(dt)
        self.step_s[i] = dt
        self.record.tokens_processed += self.tokens_per_batch
        self.record.step_log.append(StepRecord(i, incarnation, core.step, now, dt))
        self.in_step[i] = True
        self.schedule(now + dt, STEP_DONE, "done", payload)

    def on_done(self, now: float, payload) -> None:
        i, incarnation = payload
        if not self.current(i, incarnation):
            return
        core = self.cores[i]
        self.in_step[i] = False
        for plan in self.loops[i].pushes(self.epoch_of[i]):
            self.record.wire_bytes_up += plan.wire_bytes
            self.schedule(self.arrival(i, now, plan.wire_bytes), ARRIVE, "arrive", plan.push)
        self.loops[i].paced(self.step_s[i])   # at the step's end, as the Ray learner's pace
        if (i == 0 and self.eval_every_steps and core.step % self.eval_every_steps == 0
                and core.step > self.last_eval_step):
            self.last_eval_step = core.step
            self.maybe_eval(now)
        self.schedule(now, STEP_START, "start", payload)

    def on_arrive(self, now: float, push) -> None:
        i = self.index_of[push.learner]
        mine = self.current(i, push.incarnation)
        if now < self.syncer_down_until:
            self.count_rejected(SYNCER_DOWN)
            if mine:
                self.cores[i].refused(push.fragment, SYNCER_DOWN)
            return
        verdict = self.syncer.accept_push(push, now)
        if not verdict.ok:
            self.count_rejected(verdict.reason)
            if not mine:
                return  # a dead incarnation's push: its work is dropped with it
            if self.syncer.quarantined.get(push.learner) == push.incarnation:
                self.fleet_step(now, [fleet_lib.Quarantine(push.learner, push.incarnation,
                                                           verdict.reason.value)])
                return
            current, version = self.syncer.fragment(push.fragment) if (
                0 <= push.fragment < len(self.syncer.slots)) else (None, None)
            self.cores[i].refused(push.fragment, verdict.reason.value, current, version)
            return
        self.schedule(now, CHECK, "check", push.fragment)

    def count_rejected(self, reason) -> None:
        self.record.rejected[reason] = self.record.rejected.get(reason, 0) + 1

    def on_check(self, now: float, p: int) -> None:
        if now < self.syncer_down_until:
            return
        if not self.syncer.slots[p].round:
            return
        if timing.merges_held(self.owner.fleet.paused_reason):
            return   # the pause rule: decided again when training resumes (fleet_step)
        # The live set a round waits for: the learners registered there, as on Ray.
        live = timing.live_set(self.syncer.learners)
        decision, _ = self.syncer.timed_decision(p, now, live, self.slowest_step_s(),
                                                 self.sync_time.sync_s)
        if decision.merge:
            result = self.syncer.merge(p, decision.reason.value, live_count=len(live))
            self.sync_time.observe_merge(0.0)   # a merge takes no virtual time
            if result.refused:  # Θ kept: the round's learners start over from it
                for name in result.learners:
                    i = self.index_of[name]
                    self.count_rejected(result.reason)
                    self.cores[i].refused(p, result.reason, result.params, result.version)
                return
            self.record.merges.append(result)
            if any(slot.recovery is not None for slot in self.owner.fleet.slots.values()):
                self.fleet_step(now, [])
            # Each learner's answer: the fragment, or its encoded difference to what it holds
            # (syncer/downlink.py); the same code the Ray syncer runs.
            for name, update in self.syncer.updates(result).items():
                i = self.index_of[name]
                nbytes = downlink_lib.update_bytes(update)
                self.record.wire_bytes_down += nbytes
                self.schedule(self.arrival(i, now, nbytes), REPLY, "reply",
                              (i, self.cores[i].incarnation, p, update, result.version))
        elif decision.wait_until_s is not None:
            self.schedule(decision.wait_until_s, CHECK, "check", p)

    def on_reply(self, now: float, payload) -> None:
        i, incarnation, p, fragment, version = payload
        if self.current(i, incarnation):
            self.cores[i].offer_reply(p, fragment, version)

    # -- the fleet: the same brain as the Ray controller -----------------------------------------
    def loop_for(self, i: int, core: LearnerCore) -> LearnerLoop:
        return LearnerLoop(core, self.train_step, lambda step: self.batch_for(i, step),
                           self.tokens_per_batch, self.num_fragments, self.sync_every_steps)

    def fleet_step(self, now: float, observations: list) -> None:
        """One turn of the owner at ``now``; a syncer shard it killed is seen ended at once
        (the Ray controller sees it at its next tick)."""
        self.now = now   # the groups' clock while the actions are carried out
        self.held = timing.merges_held(self.owner.fleet.paused_reason)
        self.owner.step([self.machine.applied()] + list(observations), now)
        if self.machine.killed():
            self.owner.refresh_syncer_status()
            self.fleet_step(now, self.owner.observe())

    on_fleet = fleet_step   # a "fleet" event: a turn with its observations

    # -- the owner's hooks (owner.Hooks) ----------------------------------------------------------
    def adopted(self, state: fleet_lib.FleetState) -> None:
        # round_wait's periods leave the pause out (the Ray syncer hears it in set_fleet)
        self.syncer.pause_periods(timing.merges_held(state.paused_reason))
        if self.held and not timing.merges_held(state.paused_reason):
            self.recheck_open_rounds(self.now)   # resumed: the rounds the pause held are decided

    def recorded(self, t: fleet_lib.Transition, now: float) -> None:
        self.record.transitions.append((now, t))
        if t.name == "learner_restart_scheduled":
            self.schedule(now + t.fields["delay_s"], FLEET, "fleet", [])
        elif t.name == "learner_draining":
            # The fleet's drain deadline (``fleet.check_drains``): looked at when it falls due,
            # as the Ray controller's loop looks every tick.
            limit = self.owner.fleet.settings.drain_timeout_s
            if math.isfinite(limit):
                self.schedule(now + limit, FLEET, "fleet", [])
        elif t.name == "learner_retired" and t.learner in self.index_of:
            i = self.index_of[t.learner]
            self.machine.draining.discard(i)
            if not self.up[i]:
                self.retired_at[i] = now

    def on_command(self, now: float, command) -> None:
        """An operator's command at its time; one refused is recorded with the reason."""
        try:
            fleet_lib.check_command(self.owner.fleet, command)
            if isinstance(command, fleet_lib.Scale) and command.n > self.owner.fleet.targets.get(
                    command.region, 0):   # (a new slot's name would be no learner of its own)
                raise fleet_lib.CommandError(f"in process, {command.region} scales down only")
        except fleet_lib.CommandError as exc:
            self.record.commands_refused.append((now, command, str(exc)))
            return
        self.fleet_step(now, [command])

    # -- what the groups report ------------------------------------------------------------------
    def on_start_done(self, now: float, payload) -> None:
        for what, item in self.machine.starts.finished(now, payload):
            if what == "restart":
                self.on_restart(now, item)
            else:
                self.on_spare(now, fleet_lib.SpareReady(item, now))

    def on_spare(self, now: float, ready: fleet_lib.SpareReady) -> None:
        """A spare is ready: the fleet hears it through the group's poll, as the Ray
        controller does (not once the job stops, or for a spare it has let go)."""
        self.machine.report(ready)
        observed = self.owner.observe()
        if self.owner.fleet.stopping:
            return
        observed = [o for o in observed if not isinstance(o, fleet_lib.SpareReady)
                    or o.name in self.owner.fleet.spares]
        if observed:
            self.fleet_step(now, observed)

    def on_seen(self, now: float, ended) -> None:
        """A run's end is seen (a death, at its detection time): through the group's poll."""
        self.machine.report(ended)
        self.fleet_step(now, self.owner.observe())

    def on_fault(self, now: float, _payload) -> None:
        for fault in self.faults.due(now):
            if fault.kind in (FaultKind.KILL, FaultKind.EXIT):
                i = self.index_of[fault.target]
                if self.finished_at[i] is not None:
                    self.record.faults_skipped.append((fault, f"{fault.target} has finished"))
                    continue
            obs = fleet_lib.Chaos(fault, "exit" if fault.kind == FaultKind.EXIT else "ray_kill")
            try:
                fleet_lib.check_command(self.owner.fleet, obs)
            except fleet_lib.CommandError as exc:
                self.record.faults_skipped.append((fault, str(exc)))
                continue
            self.fleet_step(now, [obs])

    def check_drains(self, now: float) -> None:
        """Ends the run of each draining learner that is between steps with nothing in flight."""
        for i in sorted(self.machine.draining):
            if self.machine.finish_drain(i, now):
                self.fleet_step(now, self.owner.observe())

    def kill(self, i: int, now: float, reason: str) -> None:
        """Learner i's incarnation dies now: its books are settled at once (its last stats
        are its final beat) for ``reason``, and the syncer drops its open pushes."""
        core, name = self.cores[i], self.ids[i]
        # The watermark is final: forget() drops its open pushes and later ones are refused.
        self.record.watermarks[(i, core.incarnation)] = self.watermark(i)
        run = self.owner.running.get(name)
        if run is not None and run.number == core.incarnation:
            run.ended_with(self.machine.final(i))
        self.owner.refresh_syncer_status()
        self.owner.settle(name, core.incarnation, reason)
        self.record.dropped_pushes += len(self.syncer.forget(self.ids[i]))
        self.up[i] = False
        self.parked[i] = False
        self.down_since[i] = now
        self.recheck_open_rounds(now)

    def on_restart(self, now: float, payload) -> None:
        i, launch, token = payload
        if token != self.machine.restart_token[i]:
            return  # killed again while it was coming back
        if self.until_s is not None and now >= self.until_s:
            return  # the run is over before it is back; its slot stays allocated to the end
        name, incarnation, start_step = self.ids[i], launch.incarnation, launch.start_step
        epoch, frags = self.syncer.register(name, incarnation)
        peer = self.index_of.get(launch.peer) if launch.peer is not None else None
        if peer is not None and not self.up[peer]:
            peer = None  # the peer died meanwhile: a fresh inner state
        # Its schedule resumes where the syncer says under the fleet clock, else where its data does.
        schedule = self.syncer.schedule_start()
        schedule = start_step if schedule is None else schedule
        core, nbytes = restarted_core(
            self.cores[i], frags, self.assemble, incarnation, start_step, schedule,
            lambda params: self.cores[peer].opt_state if peer is not None
            else self.opt_init(params))
        self.record.wire_bytes_restore += nbytes
        self.cores[i] = core
        self.loops[i] = self.loop_for(i, core)
        self.start_step[i] = start_step
        self.up[i] = True
        self.in_step[i] = False
        self.epoch_of[i] = epoch
        self.record.down_intervals[i].append((self.down_since[i], now))
        failed_s = self.down_since[i]
        self.down_since[i] = None
        self.record.restarts.append({
            "learner": name, "incarnation": incarnation, "cause": self.machine.cause_of[i],
            "failed_s": failed_s, "back_s": now, "down_s": now - failed_s,
            "resume_step": start_step, "schedule_step": schedule,
            "peer": self.ids[peer] if peer is not None else None})
        self.fleet_step(now, [fleet_lib.Beat(name, incarnation, True, ready_at_s=now)])
        self.schedule(now, STEP_START, "start", (i, incarnation))

    def on_syncer_back(self, now: float, _payload) -> None:
        """Every live learner re-registers with the new epoch; local progress stays as drift."""
        for i, core in enumerate(self.cores):
            if not self.up[i]:
                continue
            epoch, frags = self.syncer.register(self.ids[i], core.incarnation)
            self.epoch_of[i] = epoch
            core.reregistered([f for f, _ in frags], [v for _, v in frags])
        self.fleet_step(now, [fleet_lib.SyncerStarted(0, self.syncer.epoch)])

    # -- the end --------------------------------------------------------------------------------
    def finish(self) -> RunRecord:
        record = self.record
        self.maybe_eval(record.end_time_s)
        record.global_params = self.global_tree()
        record.learner_params = [core.params for core in self.cores]
        record.steps = [core.step for core in self.cores]
        record.learners = list(self.cores)
        record.faults_fired = list(self.faults.fired)
        record.refusals = list(self.syncer.refusals)
        horizon = self.until_s if self.until_s is not None else record.end_time_s
        for i, core in enumerate(self.cores):
            name = self.ids[i]
            live = None
            if self.up[i]:
                record.watermarks[(i, core.incarnation)] = self.watermark(i)
                end = self.finished_at[i] if self.finished_at[i] is not None else horizon
                live = core.fates.to_json()
            elif self.retired_at[i] is not None:  # left the fleet (drained): allocated until then
                end = self.retired_at[i]
                if self.down_since[i] is not None:
                    record.down_intervals[i].append((self.down_since[i], end))
            else:  # down at the end: allocated (and down) until the horizon
                end = max(horizon, self.down_since[i])
                record.down_intervals[i].append((self.down_since[i], end))
            record.close_slot(self.owner.books, name, end, live, self.num_fragments)
        # The job ends as the Ray controller ends it: stop, then every running learner's run ends.
        self.groups.stop_all(0.0)
        self.fleet_step(record.end_time_s, [fleet_lib.Stop()] + self.owner.observe())
        return record


def run_inprocess(
    *,
    learners: list[LearnerCore],
    syncer: SyncerCore,
    train_step: Callable[[Any, Any, Any], tuple[Any, Any, Any]],
    batch_for: Callable[[int, int], Any],
    tokens_per_batch: int,
    fleet: Fleet,
    num_fragments: int,
    sync_every_steps: int,
    steps: int,
    evaluate: Optional[Callable[[Any], float]] = None,
    eval_every_steps: int = 0,
    assemble: Optional[Callable[[dict], Any]] = None,
    faults: Optional[FaultPlan] = None,
    restart: RestartCosts = RestartCosts(),
    opt_init: Optional[Callable[[Any], Any]] = None,
    until_s: Optional[float] = None,
    commands: Sequence[tuple[float, Any]] = (),
) -> RunRecord:
    """Runs every learner for ``steps`` inner steps (or until ``until_s``) and returns the record.

    Args:
      learners: one LearnerCore per learner, already registered with ``syncer``. The list is not
        modified; restarted learners replace their cores in ``record.learners``.
      syncer: the syncer core.
      train_step: ``(params, opt_state, batch) -> (params, opt_state, loss)``.
      batch_for: ``(learner_index, batch_index) -> batch``; batch index = learner step, so a
        restarted learner that resumes at its applied step trains the dropped batches again.
      tokens_per_batch: tokens in one batch (counters and weights).
      fleet: speeds, regions and links.
      num_fragments, sync_every_steps: P and H.
      steps: inner steps per learner (the step count a learner stops at, restarts included).
      evaluate: loss of a full parameter tree (the global model is evaluated).
      eval_every_steps: evaluate after every this many steps of learner 0 (0 = only start and end).
      assemble: flat ``{path: array}`` -> parameter tree, for ``evaluate`` and restarts (default
        for restarts: shaped like the learner's own params).
      faults: the fault plan, replayed from its start (``reset()``); None: no faults.
      restart: detection, restart and syncer-restart times (virtual seconds).
      opt_init: a fresh inner optimizer state for a restarted learner when no peer is alive;
        required when ``faults`` kills learners.
      until_s: no step starts at or after this virtual time; slots are allocated until then.
      commands: ``(time_s, command)`` operator commands to the fleet (``fleet.Drain``,
        ``fleet.PauseJob``, a ``fleet.Scale`` down); one it refuses is recorded in
        ``record.commands_refused``. A drained learner leaves once its pushes are answered;
        its slot is allocated until then.

    A learner that has done its ``steps`` stays live for the syncer (it is not waited for by K = 1,
    but a K = M round waits for it forever): with K = M and unequal speeds, stop on ``until_s``.
    A fault for a learner that is down or finished is skipped (``record.faults_skipped``).

    Raises:
      ValueError: a fault names an unknown learner or region, or ``opt_init`` is missing.
    """
    return _Driver(learners=learners, syncer=syncer, train_step=train_step, batch_for=batch_for,
                   tokens_per_batch=tokens_per_batch, fleet=fleet, num_fragments=num_fragments,
                   sync_every_steps=sync_every_steps, steps=steps, evaluate=evaluate,
                   eval_every_steps=eval_every_steps, assemble=assemble, faults=faults,
                   restart=restart, opt_init=opt_init, until_s=until_s,
                   commands=commands).run()


def run_task(task, **options) -> RunRecord:
    """Trains ``task`` on the virtual clock (``virtual_fleet.task_run`` says with what)."""
    return run_inprocess(**task_run(task, **options))
