"""A learner unit of several hosts: one process per host, one SPMD program over all their devices
(docs/accelerators.md#multi-host-units).

The unit's leader is the ``LearnerUnit`` actor the controller launched, in bundle 0 of the unit's
placement group. It starts one ``GangMember`` per other host in the group's other bundles, and every
process joins ``jax.distributed`` scoped to the unit (the leader's process is its coordinator), so
the mesh spans the unit's devices and XLA runs the train step, the drift and the push encode as
one program with cross-host collectives.

Only the leader talks to the service: it registers with the syncer, pushes, receives replies,
heartbeats and answers a restarting peer. The members replay it: before each inner step the leader
sends them, in order, every call that changed its ``LearnerCore`` since the last step (a reply
offered, a refusal, a re-registration) and the step's push epochs; each member makes the same
calls on its own core and runs the same step, so every process issues the same programs in the
same order and holds the same state. Replicated parameters make every value the leader reads
(codes, bases, a peer's inner state) present on its own devices: pushing from host 0 moves no
bytes between hosts, and the alternative (each host pushing its shards to syncer shards) would
only pay off with FSDP across hosts, which units do not do yet.

One failure domain: members are created by the leader, so Ray ends them when the leader dies;
a member that dies ends the leader's ``run`` (checked at every step) or, when the leader is
blocked in a collective, the leader's process through ``jax.distributed``'s heartbeat timeout
(``UNIT_HEARTBEAT_TIMEOUT_S``, far below JAX's 100 s default). Either way the controller sees the
unit fail and restarts it whole.
"""

from __future__ import annotations

import logging
import queue
import socket
from dataclasses import dataclass, field
from typing import Any, Optional

import ray

from .devices import apply_env, check_devices

log = logging.getLogger("islands.learner")

# jax.distributed's missed-heartbeat limit inside a unit (JAX's default is 100 s): a host that
# died while the others wait in a collective fails the unit in seconds, not minutes.
UNIT_HEARTBEAT_TIMEOUT_S = 10
MEMBER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StepOps:
    """What a member replays before one inner step: the leader's core calls since the previous
    step, in order, as ``(method, args)``, and the push epochs of the step's fragments."""

    seq: int
    calls: tuple
    epochs: tuple
    stop: bool = False


@dataclass(frozen=True)
class StartState:
    """Everything the leader knows at registration that a member must hold too."""

    learner: str
    incarnation: int
    shard_index: int
    num_shards: int
    start_step: int
    flat: dict                 # the global parameters, flat {path: array}
    versions: tuple
    session: str
    opt_state: Any = None      # a peer's inner state (numpy), or None for a fresh one
    schedule_step: Optional[int] = None   # the inner schedule's count (None: start_step)


@dataclass
class MemberInfo:
    """A member host's identity inside its unit."""

    learner: str
    host_index: int
    hosts: int
    coordinator: str
    env: dict = field(default_factory=dict)   # the leader's (``runtime.process_env``)
    device_request: Any = None                 # learners/devices.py: checked like the leader


def member_name(learner: str, incarnation: int, host: int) -> str:
    """A member's actor name (``islands:eu:0@3/host1``): operators and chaos find a unit's
    hosts by it."""
    return f"islands:{learner}@{incarnation}/host{host}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def join_unit(coordinator: str, hosts: int, host_index: int, request=None) -> None:
    """Joins this process to its unit's ``jax.distributed`` (before anything else uses JAX) and
    checks this host's devices (learners/devices.py). CPU units run their collectives over
    gloo; GPU and TPU units over their own interconnect."""
    import jax

    if _accelerator(request) == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=hosts, process_id=host_index,
                               initialization_timeout=int(MEMBER_START_TIMEOUT_S),
                               heartbeat_timeout_seconds=UNIT_HEARTBEAT_TIMEOUT_S)
    # Every process publishes its devices when its backend starts, and each one's backend start
    # waits for all of them: start it here, on every host, before anyone waits on another.
    check_devices(request)


def _accelerator(request) -> str:
    return request.accelerator if request is not None else "cpu"


class Gang:
    """The leader's side of a unit: its members, their ``run`` futures, and the ordered stream of
    step ops they replay."""

    def __init__(self, spec):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.hosts = spec.hosts
        self.learner = spec.learner
        self.request = spec.device_request
        self.seq = 0
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError(f"{spec.learner}: a unit of {spec.hosts} hosts must be launched "
                               "in its placement group (one bundle per host)")
        ip = ray.util.get_node_ip_address()
        self.coordinator = f"{ip}:{free_port()}"
        self.members, self.runs = [], []
        for host in range(1, spec.hosts):
            info = MemberInfo(spec.learner, host, spec.hosts, self.coordinator, dict(spec.env),
                              spec.device_request)
            options = dict(spec.member_options)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=host)
            member = ray.remote(GangMember).options(
                name=member_name(spec.learner, spec.incarnation, host),
                namespace=spec.namespace, max_concurrency=4, **options).remote(info, spec.training)
            self.members.append(member)
            self.runs.append(member.run.remote())

    def join(self) -> None:
        join_unit(self.coordinator, self.hosts, 0, self.request)

    def start(self, state: StartState) -> None:
        for member in self.members:
            member.start.remote(state)

    def step(self, calls: list, epochs) -> None:
        """Sends the members this step's ops (fire and forget; they replay in ``seq`` order)."""
        self.seq += 1
        ops = StepOps(self.seq, tuple(calls), tuple(epochs))
        for member in self.members:
            member.ops.remote(ops)

    def check(self) -> None:
        """Raises if a member's ``run`` has ended: the unit has failed."""

        ready, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in ready:
            host = self.runs.index(ref) + 1
            try:
                ray.get(ref)
                why = "returned"
            except Exception as exc:
                why = repr(exc)[:300]
            raise RuntimeError(f"{self.learner}: host {host} of its {self.hosts}-host unit "
                               f"ended ({why}); the unit fails as one")

    def stop(self) -> None:
        self.seq += 1
        for member in self.members:
            member.ops.remote(StepOps(self.seq, (), (), stop=True))


class GangMember:
    """A non-leader host of a learner unit: joins the unit, builds the same program as the
    leader, and replays the leader's steps. Created by ``Gang`` only."""

    def __init__(self, info: MemberInfo, training):
        apply_env(info.env)   # before JAX loads in this process, replacing what it inherited
        self.info = info
        self.training = training
        self.inbox: "queue.Queue" = queue.Queue()
        self.started: "queue.Queue" = queue.Queue(maxsize=1)
        self.state = "starting"
        self.step = None

    def start(self, state: StartState) -> None:
        self.started.put(state)

    def ops(self, ops: StepOps) -> None:
        self.inbox.put(ops)

    def status(self) -> dict:
        return {"learner": self.info.learner, "host": self.info.host_index,
                "state": self.state, "step": self.step}

    def run(self) -> dict:
        """Joins the unit, waits for the leader's start state, then replays its steps until told
        to stop. Any error ends this member, which fails the unit."""
        try:
            self._run()
        finally:
            self.state = "stopped"
        return self.status()

    def _next_ops(self, pending: dict, seq: int) -> StepOps:
        while seq not in pending:   # calls may run concurrently: put them back in order
            ops = self.inbox.get()
            pending[ops.seq] = ops
        return pending.pop(seq)

    def _run(self) -> None:
        import jax

        from islands.syncer.fragments import assembler

        from .loop import LearnerLoop
        from .task import TaskStream
        from .factories import (learner_core, build_task, build_training, learner_layout,
                           meshed_steps, place_learner_state)

        info, tspec = self.info, self.training
        join_unit(info.coordinator, info.hosts, info.host_index, info.device_request)
        task = build_task(tspec)
        task, template, optimizer, train_step = build_training(tspec, abstract=True, task=task)
        state: StartState = self.started.get(timeout=MEMBER_START_TIMEOUT_S)
        stream = TaskStream(task, state.shard_index, state.num_shards)
        first_batch = stream.batch_at(state.start_step).batch
        layout = learner_layout(tspec, task, template, optimizer, first_batch, jax.devices())
        train_step, batch_at = meshed_steps(layout, train_step, stream.batch_at)
        params = assembler(template)(state.flat)
        params, opt_state = place_learner_state(
            layout, optimizer, params, state.opt_state,
            state.start_step if state.schedule_step is None else state.schedule_step)
        core = learner_core(tspec, state.learner, params, opt_state, list(state.versions),
                             state.incarnation, state.start_step, state.session, layout)
        loop = LearnerLoop(core, train_step, batch_at, int(task.tokens(first_batch)),
                           tspec.fragments, tspec.sync_every_steps)
        core.compile_pushes()
        self.state = "training"
        pending: dict = {}
        seq = 1
        while True:
            ops = self._next_ops(pending, seq)
            seq += 1
            if ops.stop:
                return
            replay(core, ops.calls)
            loop.adopt()
            loss = loop.train(loop.batch())
            loop.prefetch(core.step + 1)
            float(loss)
            loop.record(0.0)
            for plan in loop.pushes(list(ops.epochs)):
                jax.block_until_ready(plan.push.codes)   # the leader sends them; ours go nowhere
            self.step = core.step


def replay(core, calls) -> None:
    """Makes the leader's recorded core calls on a member's core, in order."""
    for method, args in calls:
        if method == "session":
            core.session = args[0]
        else:
            getattr(core, method)(*args)
