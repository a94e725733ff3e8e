"""JobConfig: one YAML, validated once by pydantic before any actor starts.

Errors name the field path, the rule and the values: ``quorum.min_learners: quorum (5) exceeds
learners (4)``. Sections are plain data; ``orchestrator/build.py`` turns them into core objects.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from islands import DEFAULT_OVERLAP, defaults
from islands.faults import HOME_TARGET
from islands.syncer import codec_kinds

from . import accelerators

REGION_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
CODECS = codec_kinds.KINDS


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem as ``field.path: message``."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    vocab_size: int = Field(256, ge=1)
    d_model: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    d_ff: int = Field(256, ge=1)
    seq_len: int = Field(64, ge=2)
    # The forward pass's matmul dtype; params, grads and optimizer state stay float32.
    compute_dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")
        return self


class DataSection(_Section):
    corpus: str = "stdlib"   # "stdlib" or a directory of .py files
    eval_fraction: float = Field(0.05, gt=0, lt=1)
    max_bytes: Optional[int] = Field(2_000_000, gt=0)
    batch_size: int = Field(8, gt=0)
    eval_batches: int = Field(8, gt=0)


BUILTIN_TASK = "islands.tasks.bytelm:task"
TASK_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class TaskSection(_Section):
    """What the learners train (docs/tasks.md): a factory ``package.module:factory`` called with
    ``args``. The default, the built-in byte LM, takes its arguments from ``model:`` and ``data:``
    instead, so ``args`` must stay empty for it."""

    path: str = BUILTIN_TASK
    args: dict[str, Any] = {}

    @field_validator("path")
    @classmethod
    def _path_shape(cls, path):
        if not TASK_PATH.match(path):
            raise ValueError(f"{path!r} must read 'package.module:factory'")
        return path

    @model_validator(mode="after")
    def _builtin_takes_sections(self):
        if self.path == BUILTIN_TASK and self.args:
            raise ValueError(f"args: the built-in task takes its arguments from model: and data:, "
                             f"not task.args (got {sorted(self.args)})")
        return self

    @property
    def builtin(self) -> bool:
        return self.path == BUILTIN_TASK


class InnerOptimizer(_Section):
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    total_steps: int = Field(5000, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    clip_norm: float = Field(1.0, gt=0)


class LearnerSection(_Section):
    inner_optimizer: InnerOptimizer = InnerOptimizer()
    overlap: Literal["carry", "blend"] = DEFAULT_OVERLAP
    merge_alpha: float = Field(0.0, ge=0, le=1)
    # Pads each step to at least this wall time (÷ speed factor): emulates slower hardware.
    min_step_time_s: float = Field(0.0, ge=0)
    eval_every_s: float = Field(10.0, gt=0)
    profiler: bool = False   # each learner starts a JAX profiler server (jax.profiler.start_server)
    # Params and inner state over a learner's devices (learners/mesh.py); batches split by rows.
    sharding: Literal["replicated", "fsdp"] = "replicated"

    @model_validator(mode="after")
    def _alpha_only_blends(self):
        if self.overlap == "carry" and self.merge_alpha != 0.0:
            raise ValueError(f"merge_alpha: {self.merge_alpha} blends the merged fragment, which "
                             "only applies with overlap: blend (carry keeps the local steps "
                             "since the push on top of it)")
        return self


class NesterovOuter(_Section):
    type: Literal["nesterov"] = "nesterov"
    # None: by the rule for the job's sync period (syncer/outer.py, docs/tuning.md).
    lr: Optional[float] = Field(None, gt=0)
    momentum: Optional[float] = Field(None, ge=0, lt=1)


class SgdOuter(_Section):
    type: Literal["sgd"]
    lr: float = Field(1.0, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)


class AdamOuter(_Section):
    type: Literal["adam"]
    lr: float = Field(1e-3, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.99, ge=0, lt=1)


OuterOptimizer = Annotated[Union[NesterovOuter, SgdOuter, AdamOuter], Field(discriminator="type")]


class SyncerSection(_Section):
    fragments: int = Field(4, ge=1, description="P")
    sync_every_steps: int = Field(8, ge=1, description="H")
    overlap_steps: int = Field(defaults.OVERLAP_STEPS, ge=0,
                               description="τ: a reply is adopted τ steps after its push")
    outer_optimizer: OuterOptimizer = NesterovOuter()
    history_versions: int = Field(defaults.HISTORY_VERSIONS, ge=1)
    max_staleness: Optional[int] = Field(defaults.MAX_STALENESS, ge=0)
    outlier_norm_factor: Optional[float] = Field(defaults.OUTLIER_NORM_FACTOR, gt=1)
    staleness_discount: float = Field(defaults.STALENESS_DISCOUNT, ge=0)
    merge_rule: Literal["rda", "mean"] = defaults.MERGE_RULE
    participation_scale: bool = defaults.PARTICIPATION_SCALE
    # Issue 34 (BENCHMARKS.md, "Quality under asynchrony"): the four win on a fleet out of
    # phase and are the same numbers as pull / per_merge / learner / 0 when every round merges
    # whole (round_wait: the round-completion wait, 3 seeds, noisy and mixed fleets at K = 1).
    # (islands.defaults: the one definition the pure cores share)
    outer_gradient: Literal["pull", "rebased"] = defaults.OUTER_GRADIENT
    round_step: Literal["per_merge", "per_round"] = defaults.ROUND_STEP
    staleness_share: float = Field(defaults.STALENESS_SHARE, ge=0)
    schedule_clock: Literal["learner", "fleet"] = defaults.SCHEDULE_CLOCK
    round_wait: float = Field(defaults.ROUND_WAIT, ge=0, le=1)
    snapshot_every_merges: int = Field(10, ge=1)
    snapshot_min_interval_s: Optional[float] = Field(None, ge=0)
    journal: bool = True
    checkpoint_dir: Optional[str] = None
    downlink_full_after_versions: Optional[int] = Field(8, ge=0)
    downlink_max_shadows: Optional[int] = Field(defaults.DOWNLINK_MAX_SHADOWS, ge=1)
    shards: int = Field(1, ge=1, description="S: syncer actors, each merging its own fragments "
                        "(balanced by parameter count); at most P")

    @model_validator(mode="after")
    def _overlap_below_period(self):
        if self.overlap_steps >= self.sync_every_steps:
            raise ValueError(f"overlap_steps: overlap_steps ({self.overlap_steps}) must be below "
                             f"sync_every_steps ({self.sync_every_steps})")
        if self.shards > self.fragments:
            raise ValueError(f"shards: syncer shards ({self.shards}) exceed fragments "
                             f"({self.fragments}): a shard would own no fragment")
        return self


class QuorumSection(_Section):
    min_learners: int = Field(defaults.MIN_LEARNERS, ge=1, description="K")
    grace_gamma: float = Field(defaults.GRACE_GAMMA, ge=0, lt=1)
    grace_cap_s: float = Field(defaults.GRACE_CAP_S, ge=0)


class _Codec(_Section):
    error_feedback: bool = True


class NoneCodec(_Codec):
    type: Literal["none"]


class Bf16Codec(_Codec):
    type: Literal["bf16"]


class Int8Codec(_Codec):
    type: Literal["int8"]
    block_size: int = Field(codec_kinds.DEFAULT_BLOCK_SIZE, gt=0)


class Int4Codec(_Codec):
    type: Literal["int4"] = "int4"
    block_size: int = Field(codec_kinds.DEFAULT_BLOCK_SIZE, gt=0)


class Int2Codec(_Codec):
    type: Literal["int2"]
    block_size: int = Field(codec_kinds.DEFAULT_BLOCK_SIZE, gt=0)


# The block size of the default downlink's nf2, also when `{type: nf2}` is written without one
# (the uplink's nf2 keeps the codecs' default, 64).
DOWNLINK_NF2_BLOCK_SIZE = 256


class Nf2Codec(_Codec):
    type: Literal["nf2"]
    block_size: int = Field(codec_kinds.DEFAULT_BLOCK_SIZE, gt=0)


Compression = Annotated[Union[NoneCodec, Bf16Codec, Int8Codec, Int4Codec, Int2Codec, Nf2Codec],
                        Field(discriminator="type")]


class RegionSection(_Section):
    learners: int = Field(ge=0)
    max_learners: Optional[int] = Field(None, ge=0)
    speed_factors: Union[float, list[float]] = 1.0
    # The emulated WAN (a trial on one machine): off unless asked for. None or 0: no emulated
    # bandwidth cap; 0: no emulated latency. A real network needs neither.
    bandwidth_gbps: Optional[float] = Field(None, ge=0)
    latency_ms: float = Field(0.0, ge=0)
    # The region runs in its own Ray cluster and joins over the link (docs/regions.md): its
    # agent (`islands region join`) launches and restarts its learners; needs `link.port`.
    remote: bool = False
    # What each learner runs on (docs/accelerators.md); Ray reserves its devices.
    accelerator: Literal["cpu", "gpu", "tpu"] = "cpu"
    devices_per_host: Optional[float] = Field(None, gt=0)
    hosts_per_learner: Optional[int] = Field(None, ge=1)
    tpu_type: Optional[Literal[accelerators.TPU_TYPES]] = None
    topology: Optional[str] = Field(None, pattern=accelerators.TOPOLOGY.pattern)

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_learners is not None and self.max_learners < self.learners:
            raise ValueError(f"max_learners: max_learners ({self.max_learners}) is below learners "
                             f"({self.learners})")
        factors = self.speed_factors if isinstance(self.speed_factors, list) else [
            self.speed_factors]
        if isinstance(self.speed_factors, list) and len(factors) != self.learners:
            raise ValueError(f"speed_factors: {len(factors)} entries for {self.learners} "
                             "learners")
        if any(f <= 0 for f in factors):
            raise ValueError(f"speed_factors: each must be > 0, got {factors}")
        self.devices()   # ValueError naming the key
        return self

    def devices(self) -> accelerators.LearnerDevices:
        """What each of the region's learners runs on, defaults filled in."""
        return accelerators.learner_devices(self.accelerator, self.devices_per_host,
                                            self.hosts_per_learner, self.tpu_type, self.topology)


class RestartSection(_Section):
    backoff_initial_s: float = Field(defaults.BACKOFF_INITIAL_S, ge=0)
    backoff_multiplier: float = Field(defaults.BACKOFF_MULTIPLIER, ge=1)
    backoff_max_s: float = Field(defaults.BACKOFF_MAX_S, ge=0)
    max_crash_restarts: Optional[int] = Field(defaults.MAX_CRASH_RESTARTS, ge=0)
    max_preemption_restarts: Optional[int] = Field(defaults.MAX_PREEMPTION_RESTARTS, ge=0)
    # > 0: a reset after 0 s would forgive every crash at once (a deterministic failure then
    # restarts forever at the first backoff). The default is Kubernetes' 10 minutes.
    reset_after_s: Optional[float] = Field(defaults.RESET_AFTER_S, gt=0)
    crash_loop_after: Optional[int] = Field(defaults.CRASH_LOOP_AFTER, ge=2)
    crash_loop_window_steps: int = Field(defaults.CRASH_LOOP_WINDOW_STEPS, ge=0)


class HealthSection(_Section):
    heartbeat_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(defaults.HEARTBEAT_TIMEOUT_S, gt=0)
    straggler_factor: float = Field(defaults.STRAGGLER_FACTOR, gt=1)
    straggler_window_s: float = Field(defaults.STRAGGLER_WINDOW_S, ge=0)
    straggler_min_excess_s: float = Field(defaults.STRAGGLER_MIN_EXCESS_S, ge=0)
    # Warm spare learner processes per region: an int for every local region, or {region: n}.
    spares: Union[int, dict[str, int]] = Field(defaults.SPARES)
    # A restart due while its region's spare prepares waits this long for it (0: never).
    spare_wait_s: float = Field(defaults.SPARE_WAIT_S, ge=0)
    # A failed learner's next process starts at once, prepared while its restart waits.
    prestart_restarts: bool = defaults.PRESTART_RESTARTS
    restart: RestartSection = RestartSection()
    placement_timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _timeout_above_heartbeat(self):
        if self.timeout_s <= self.heartbeat_s:
            raise ValueError(f"timeout_s: timeout_s ({self.timeout_s}) must exceed heartbeat_s "
                             f"({self.heartbeat_s})")
        return self


class MetricsSection(_Section):
    enabled: bool = True
    port: int = Field(9400, ge=0, le=65535)   # 0 picks a free port
    # The address /metrics binds. None: 127.0.0.1 for an embedded cluster, the controller node's
    # address on a real cluster. "0.0.0.0" (every interface) only when asked for.
    host: Optional[str] = Field(None, min_length=1)
    snapshot_every_s: float = Field(2.0, gt=0)
    goodput_window_s: float = Field(300.0, gt=0)   # islands_goodput_ratio{window="5m"}


class ConsoleSection(_Section):
    enabled: bool = True
    port: int = Field(9410, ge=0, le=65535)   # 0 picks a free port
    host: str = Field("127.0.0.1", min_length=1)
    allow_chaos: bool = False
    # The token every console action must carry. None: $ISLANDS_CONSOLE_TOKEN, else the Ray
    # cluster's auth token, else one generated for the job (RUN_DIR/console_token, mode 0600).
    token_file: Optional[str] = Field(None, min_length=1)


class KillEvent(_Section):
    """A learner dies (``ray.kill``, or a hard process exit) or, with target ``syncer``, the syncer."""

    type: Literal["kill"]
    target: str
    at_s: float = Field(ge=0)
    mode: Literal["ray_kill", "exit"] = "ray_kill"
    repair_s: float = Field(0.0, ge=0)   # the learner may restart no earlier than this after


class RegionLossEvent(_Section):
    """Every learner of a region dies at once (a lost slice or node), and its warm spares
    with them; nothing of the region starts again before ``repair_s``."""

    type: Literal["region_loss"]
    target: str                          # a region name
    at_s: float = Field(ge=0)
    repair_s: float = Field(0.0, ge=0)


class SlowdownEvent(_Section):
    type: Literal["slowdown"]
    target: str                          # a learner or a region
    at_s: float = Field(ge=0)
    duration_s: float = Field(gt=0)
    factor: float = Field(gt=1)


class NetworkEvent(_Section):
    """A region's link degrades (extra latency, bandwidth cap) or, as ``partition``, goes silent."""

    type: Literal["network", "partition"]
    target: str                          # a region name
    at_s: float = Field(ge=0)
    duration_s: float = Field(gt=0)
    extra_latency_ms: float = Field(0.0, ge=0)
    bandwidth_gbps: Optional[float] = Field(None, gt=0)
    loss_rate: float = Field(0.0, ge=0, lt=1)


ChaosEvent = Annotated[Union[KillEvent, RegionLossEvent, SlowdownEvent, NetworkEvent],
                       Field(discriminator="type")]


class ChaosSection(_Section):
    """Scripted ``events`` plus, when ``mtbf_s`` is set, seeded Poisson failures (orchestrator/chaos.py).

    The same seed gives the same schedule, so two systems can run under identical faults.
    """

    seed: int = Field(0, ge=0)
    events: list[ChaosEvent] = []
    mtbf_s: Optional[float] = Field(None, gt=0)          # per learner
    repair_s: float = Field(0.0, ge=0)
    kill_mode: Literal["ray_kill", "exit"] = "ray_kill"
    region_mtbf_s: Optional[float] = Field(None, gt=0)
    slowdown_mtbf_s: Optional[float] = Field(None, gt=0)
    slowdown_factor: float = Field(4.0, gt=1)
    slowdown_s: float = Field(10.0, gt=0)
    network_mtbf_s: Optional[float] = Field(None, gt=0)
    network_s: float = Field(10.0, gt=0)
    syncer_mtbf_s: Optional[float] = Field(None, gt=0)
    horizon_s: Optional[float] = Field(None, gt=0)       # default: the run's duration

    def plan(self, learners_by_region: dict, default_horizon_s: float):
        """The fault plan: the scripted events plus the Poisson draws (times from job start)."""
        from . import chaos

        plan = chaos.FaultPlan()
        if self.mtbf_s is not None or any(v is not None for v in (
                self.region_mtbf_s, self.slowdown_mtbf_s, self.network_mtbf_s,
                self.syncer_mtbf_s)):
            plan = chaos.poisson_plan(
                learners_by_region, self.horizon_s or default_horizon_s, seed=self.seed,
                mtbf_s=self.mtbf_s or math.inf, repair_s=self.repair_s,
                kill_mode="kill" if self.kill_mode == "ray_kill" else "exit",
                region_mtbf_s=self.region_mtbf_s, slowdown_mtbf_s=self.slowdown_mtbf_s,
                slowdown_factor=self.slowdown_factor, slowdown_s=self.slowdown_s,
                network_mtbf_s=self.network_mtbf_s, network_s=self.network_s,
                syncer_mtbf_s=self.syncer_mtbf_s)
        for event in self.events:
            if event.type == "kill" and event.target.split(":")[0] == "syncer":
                plan.kill_syncer(event.at_s, event.target)
            elif event.type == "kill":
                plan.crash(event.target, event.at_s, event.repair_s,
                           mode="kill" if event.mode == "ray_kill" else "exit")
            elif event.type == "region_loss":
                plan.lose_region(event.target, event.at_s, event.repair_s)
            elif event.type == "slowdown":
                plan.slow(event.target, event.at_s, event.duration_s, event.factor)
            elif event.type == "network":
                plan.degrade(event.target, event.at_s, event.duration_s,
                             extra_latency_ms=event.extra_latency_ms,
                             bandwidth_gbps=event.bandwidth_gbps, loss_rate=event.loss_rate)
            else:
                plan.partition(event.target, event.at_s, event.duration_s)
        return plan.sorted()


class LinkTlsSection(_Section):
    """The link server's TLS: its certificate and key (PEM files); with ``client_ca_file``,
    region agents must present a certificate signed by that CA (mutual TLS)."""

    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    client_ca_file: Optional[str] = Field(None, min_length=1)


class LinkSection(_Section):
    """The home side of the gRPC link that regions in their own Ray clusters join
    (docs/regions.md). Off unless ``port`` is set."""

    port: Optional[int] = Field(None, ge=0, le=65535)   # None: no link server; 0 picks a free port
    host: str = Field("127.0.0.1", min_length=1)        # the address it binds
    # The bearer token every call must carry: this file's contents, else $ISLANDS_LINK_TOKEN.
    token_file: Optional[str] = Field(None, min_length=1)
    tls: Optional[LinkTlsSection] = None                # required unless host is loopback
    chunk_bytes: int = Field(1 << 20, ge=4096, le=16 << 20)     # one gRPC message's data
    max_message_bytes: int = Field(1 << 30, ge=4096)    # one push, reply or registration, chunked
    keepalive_s: float = Field(10.0, gt=0)              # HTTP/2 pings; a silent peer is dropped
    # A region agent that has not reached home for this long stops its learners and exits (the
    # home's value is the agent's: it comes with the job's config when the agent joins).
    agent_home_timeout_s: float = Field(300.0, gt=0, le=86400)
    # Regional pre-merge (docs/regions.md#pre-merge): a remote region sends one push per fragment
    # round, the token-weighted mean of its learners' drifts (read by the region's link client).
    premerge: bool = False
    premerge_window_s: Optional[float] = Field(None, gt=0, le=600)   # None: quorum.grace_cap_s

    @model_validator(mode="after")
    def _secure_off_loopback(self):
        if self.port is not None and self.tls is None and self.host not in (
                "127.0.0.1", "localhost", "::1"):
            raise ValueError(f"tls: the link binds {self.host}, not loopback, so it needs "
                             "tls.cert_file and tls.key_file")
        return self


class RunSection(_Section):
    duration_s: float = Field(120.0, gt=0)
    run_dir: str = "runs/{name}"
    progress_every_s: float = Field(1.0, gt=0)
    dashboard: bool = True   # the embedded cluster's Ray dashboard (127.0.0.1 only)


class JobConfig(_Section):
    name: str = "islands"
    seed: int = 0
    task: TaskSection = TaskSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    learner: LearnerSection = LearnerSection()
    syncer: SyncerSection = SyncerSection()
    quorum: QuorumSection = QuorumSection()
    # nf2 both ways by default: measured within 1 % of int4 pushes + fp32 replies (and of no
    # compression) at 1 000 steps, 3 seeds, H = 24 and 96, for ~8× fewer bytes (BENCHMARKS.md).
    compression: Compression = Nf2Codec(type="nf2", block_size=64)
    # Across the link too: the codes cross it, and the learner applies them to its own copy.
    downlink_compression: Compression = Nf2Codec(type="nf2", block_size=DOWNLINK_NF2_BLOCK_SIZE)
    regions: dict[str, RegionSection] = {"local": RegionSection(learners=2)}
    health: HealthSection = HealthSection()
    metrics: MetricsSection = MetricsSection()
    console: ConsoleSection = ConsoleSection()
    chaos: Optional[ChaosSection] = None
    run: RunSection = RunSection()
    link: LinkSection = LinkSection()

    @field_validator("downlink_compression", mode="before")
    @classmethod
    def _downlink_nf2_block(cls, codec):
        # `{type: nf2}` written out means the default downlink, not the uplink's block size.
        if isinstance(codec, dict) and codec.get("type") == "nf2" and "block_size" not in codec:
            return {**codec, "block_size": DOWNLINK_NF2_BLOCK_SIZE}
        return codec

    @field_validator("regions")
    @classmethod
    def _region_names(cls, regions):
        if not regions:
            raise ValueError("at least one region is required")
        for name in regions:
            if not REGION_NAME.match(name):
                raise ValueError(f"region name {name!r} must match {REGION_NAME.pattern} "
                                 "(it becomes the Ray resource region:<name>)")
        return regions

    @model_validator(mode="after")
    def _cross_checks(self):
        total = self.total_learners
        if self.quorum.min_learners > total:
            raise _FieldError("quorum.min_learners",
                              f"quorum ({self.quorum.min_learners}) exceeds learners ({total})")
        remote = sorted(name for name, region in self.regions.items() if region.remote)
        if remote and self.link.port is None:
            raise _FieldError("link.port", f"regions {remote} are remote (they join over the "
                              "link) but link.port is not set")
        if self.link.premerge and self.syncer.merge_rule != "mean":
            raise _FieldError("link.premerge", "a pre-merged push merges exactly as its learners' "
                              "pushes only under the weighted mean (RDA averages directions and "
                              "lengths, which a region's mean does not keep): set "
                              "syncer.merge_rule: mean, or link.premerge: false")
        spares = self.health.spares
        if isinstance(spares, dict):
            for name, n in spares.items():
                if name not in self.regions:
                    raise _FieldError(f"health.spares.{name}", f"unknown region {name!r}; "
                                      f"regions are {sorted(self.regions)}")
                if n < 0:
                    raise _FieldError(f"health.spares.{name}", f"must be >= 0, got {n}")
        elif spares < 0:
            raise _FieldError("health.spares", f"must be >= 0, got {spares}")
        for name, region in self.regions.items():
            problem = accelerators.unit_problem(region.devices(), self.learner.sharding,
                                                self.spares_of(name))
            if problem:   # "key: why", the key named first
                key, why = problem.split(": ", 1)
                raise _FieldError(key, f"region {name!r}: {why}")
        if self.chaos is not None:
            learners, regions = set(self.learner_ids()), set(self.regions)
            syncers = {"syncer"} | {f"syncer:{s}" for s in range(self.syncer.shards)}
            home = {HOME_TARGET} if any(r.remote for r in self.regions.values()) else set()
            allowed = {"kill": learners | syncers, "slowdown": learners | regions,
                       "region_loss": regions, "network": regions,
                       "partition": regions | home}
            for i, event in enumerate(self.chaos.events):
                if event.target not in allowed[event.type]:
                    raise _FieldError(f"chaos.events.{i}.target",
                                      f"{event.type} cannot target {event.target!r}; targets are "
                                      f"{sorted(allowed[event.type])}")
        return self

    # -- helpers --------------------------------------------------------------------------------
    @property
    def total_learners(self) -> int:
        return sum(region.learners for region in self.regions.values())

    def learner_ids(self) -> list[str]:
        return [f"{name}:{i}" for name, region in self.regions.items()
                for i in range(region.learners)]

    def spares_of(self, region: str) -> int:
        """Warm spares this job's controller keeps for ``region`` (none for a remote region: its
        agent keeps them, ``configured_spares``)."""
        if self.regions[region].remote:
            return 0
        return self.configured_spares(region)

    def configured_spares(self, region: str) -> int:
        """``health.spares`` for ``region`` as written (an int is every region's)."""
        spares = self.health.spares
        return int(spares.get(region, 0) if isinstance(spares, dict) else spares)

    def region_resources(self) -> dict[str, float]:
        """One ``region:<name>`` unit per host of each learner and spare (a unit of H hosts
        holds H)."""
        return {f"region:{name}": float((max(region.learners, region.max_learners or 0)
                                         + self.spares_of(name)) * region.devices().hosts)
                for name, region in self.regions.items() if not region.remote}

    def speed_factor(self, learner_id: str) -> float:
        region_name, index = learner_id.rsplit(":", 1)
        factors = self.regions[region_name].speed_factors
        return factors[int(index)] if isinstance(factors, list) else float(factors)

    @classmethod
    def from_yaml_text(cls, text: str) -> "JobConfig":
        """Parses YAML strictly (a key written twice is an error, not a silent overwrite)."""
        try:
            raw = load_yaml(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"the config must be a mapping, got {type(raw).__name__}")
        return parse(raw)


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (YAML says keys are
    unique; PyYAML silently keeps the last one, so a region written twice would vanish)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            problems = _duplicate_keys(node, [])
            if problems:
                raise DuplicateKeyError(problems)
        return super().construct_mapping(node, deep=deep)

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        problems = _duplicate_keys(node, [], set(), recursive=True)
        if problems:
            raise DuplicateKeyError(problems)
        return self.construct_document(node)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _duplicate_keys(node, path: list[str], seen_nodes: Optional[set] = None,
                    recursive: bool = False) -> list[str]:
    """``path.key: duplicate key 'key' (lines 3 and 5)`` for every key repeated in a mapping
    (``<<`` merges are not duplicates: explicit keys override merged ones by design)."""
    if recursive:
        if id(node) in seen_nodes:  # an alias: checked once
            return []
        seen_nodes.add(id(node))
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            where = ".".join(path + [name])
            if isinstance(key_node, yaml.ScalarNode):
                ident = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if ident in first:
                    problems.append(f"{where}: duplicate key {name!r} (lines {first[ident]} and "
                                    f"{line})")
                else:
                    first[ident] = line
            if recursive:
                problems += _duplicate_keys(value_node, path + [name], seen_nodes, True)
    elif recursive and isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, path + [str(i)], seen_nodes, True)
    return problems


def load_yaml(text: str):
    """``yaml.safe_load`` with :class:`StrictLoader`: duplicate keys raise, naming their lines.

    Raises:
      ConfigError: listing every duplicate key as
        ``dotted.path: duplicate key 'k' (lines a and b)``.
      yaml.YAMLError: on any other YAML problem.
    """
    loader = StrictLoader(text)
    try:
        return loader.get_single_data()
    except DuplicateKeyError as exc:
        raise ConfigError("\n".join(exc.problems)) from None
    finally:
        loader.dispose()


class _FieldError(ValueError):
    """A cross-field problem that knows the field it belongs to."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")


def _field_loc(loc: tuple, raw) -> list:
    """``loc`` as the YAML spells it: pydantic adds a tagged union's tag (``compression.int8.
    block_size``) and a plain union's member (``speed_factors.float``); neither is a key."""
    out, node = [], raw
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                node = node[part]
            elif isinstance(part, str) and node.get("type") == part:
                continue  # the discriminator's tag
            else:
                node = None
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and node is not None:
            continue  # a union member's name under a scalar value
        else:
            node = None
        out.append(part)
    return out


def _describe(error: dict, raw=None) -> str:
    path = ".".join(str(p) for p in _field_loc(error["loc"], raw))
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    if error["type"] == "union_tag_not_found":
        kinds = {"compression": CODECS, "downlink_compression": CODECS,
                 "syncer.outer_optimizer": ("nesterov", "sgd", "adam")}.get(
            path, ("kill", "region_loss", "slowdown", "network", "partition")
            if re.match(r"^chaos\.events\.\d+$", path) else ())
        path = f"{path}.type" if path else "type"
        return f"{path}: required" + (f"; choose one of {', '.join(kinds)}" if kinds else "")
    if error["type"] == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag")
        expected = error.get("ctx", {}).get("expected_tags", "")
        path = f"{path}.type" if path else "type"
        if "none" in expected and "int4" in expected:
            return f"{path}: unknown codec {tag!r}; choose one of {', '.join(CODECS)}"
        return f"{path}: unknown type {tag!r}; choose one of {expected}"
    message = message.removeprefix("Value error, ")
    if message.startswith(tuple(f"{f}:" for f in ("quorum.", "chaos."))):
        return message  # a cross-field error that already names its field
    named = re.match(r"^([a-z_]+): (.*)$", message, re.S)
    if named and path:  # a section validator naming its own field
        return f"{path}.{named.group(1)}: {named.group(2)}"
    if error["type"] in ("greater_than_equal", "greater_than", "less_than", "less_than_equal"):
        return f"{path}: {message}, got {error.get('input')!r}"
    return f"{path}: {message}" if path else message


def parse(raw: dict) -> JobConfig:
    """Validates a mapping; raises ConfigError listing every problem with its field path."""
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        problems = list(dict.fromkeys(_describe(e, raw) for e in exc.errors()))
        raise ConfigError("\n".join(problems)) from None


def load_config(path: str) -> JobConfig:
    with open(path) as f:
        return JobConfig.from_yaml_text(f.read())
