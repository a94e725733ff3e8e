"""What a learner is told: the job's training settings (``TrainingSpec``) and one incarnation's
identity, place and environment (``LearnerSpec``). Plain frozen dataclasses, built by
``orchestrator/build.py`` and read by the learner actor (``unit.py``) and a unit's other hosts
(``gang.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from islands import CARRY_OVERLAP
from islands.syncer.codec_kinds import DEFAULT_BLOCK_SIZE

from .devices import DeviceRequest


@dataclass(frozen=True)
class TrainingSpec:
    """Model, data and optimizer settings shared by every learner of a job (from JobConfig)."""

    model: dict                       # ModelConfig fields
    batch_size: int = 8
    corpus: str = "stdlib"
    eval_fraction: float = 0.05
    max_bytes: Optional[int] = 2_000_000
    inner: dict = field(default_factory=dict)   # inner_optimizer kwargs
    fragments: int = 4
    sync_every_steps: int = 8
    overlap_steps: int = 2
    merge_alpha: float = 0.0
    carry_overlap: bool = CARRY_OVERLAP
    sharding: str = "replicated"       # over the learner's devices: "replicated" or "fsdp"
    codec_kind: str = "int4"
    codec_block_size: int = DEFAULT_BLOCK_SIZE
    error_feedback: bool = True
    seed: int = 0
    # What is trained (learners/task.py): a factory's import path and its keyword arguments.
    task_path: str = "islands.tasks.bytelm:task"
    task_args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LearnerSpec:
    """One learner incarnation: who it is, where, how fast, and whom it talks to."""

    learner: str
    shard_index: int
    num_shards: int
    training: TrainingSpec
    incarnation: int = 0
    start_step: int = 0
    speed_factor: float = 1.0
    min_step_time_s: float = 0.0
    # The emulated WAN; 0: none (a real network's own time only).
    latency_ms: float = 0.0
    bandwidth_gbps: float = 0.0
    heartbeat_s: float = 1.0
    # A drain waits this long at most for its in-flight pushes' answers (the job's
    # health.timeout_s); one unanswered then is given up, and the learner leaves.
    drain_timeout_s: float = 30.0
    namespace: str = "islands"
    syncer_name: str = "islands:syncer"
    # Syncer shards (syncer/shards.py): shard s > 0 is named ``<syncer_name>-<s>``.
    syncer_shards: int = 1
    controller_name: Optional[str] = "islands:controller"
    peer: Optional[str] = None        # a healthy learner's actor name for the inner state
    corpus_ref: Any = None            # the train bytes in Ray's object store (read once, shared)
    # A warm spare (orchestrator/fleet.py): ``learner`` is the spare's name until ``promote``
    # gives it a learner's identity; it prepares everything it can without one and waits.
    spare: bool = False
    profiler: bool = False   # start a JAX profiler server in this process (learner.profiler)
    # The process's whole JAX/XLA environment (``runtime.process_env``: a value, or None for
    # removed), applied in the actor before JAX loads, replacing whatever it inherited. Set here
    # rather than in its Ray runtime_env, which carries only what must be there when the process
    # starts (``runtime.start_env``): what is decided per learner (its devices) stays out of the
    # runtime_env, so learners of one job share one, and a warm spare is any learner's.
    env: dict = field(default_factory=dict)
    # The devices it must find at start (learners/devices.py); None: not checked (by hand).
    device_request: Optional[DeviceRequest] = None
    # A unit of several hosts (learners/gang.py): this actor is host 0 and starts the others
    # in its placement group's other bundles, with these Ray options (CPUs, devices, region).
    hosts: int = 1
    member_options: dict = field(default_factory=dict)
