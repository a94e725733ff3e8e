"""The one translator from a validated JobConfig to the plain settings every part is built from.

Both bodies (the Ray controller and the in-process driver) and the benchmarks call these; no
other module reads JobConfig sections to build core objects. ``tests/unit/test_config_reach.py``
walks every JobConfig field and shows it reaches the object that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from islands.learners.devices import DeviceRequest
from islands.learners.spec import LearnerSpec, TrainingSpec
from islands.syncer import fragments as fragments_lib
from islands.syncer import timing
from islands.syncer.actor import SyncerSpec
from islands.syncer.codec_kinds import DEFAULT_BLOCK_SIZE
from islands.syncer.core import SyncerSettings
from islands.syncer.merge import MergeRule, OuterGradientRule, RoundStep, ScheduleClock
from islands.syncer.outer import rule as outer_rule

from . import fleet as fleet_lib
from .fleet import FleetSettings, RegionPlan
from .health import RestartPolicy, drain_timeout_s
from .owner import Hooks

# Settings read by the job runner and the CLI rather than by a core object.
CLI_ONLY = ("name", "run.duration_s", "run.run_dir", "run.progress_every_s", "run.dashboard",
            "metrics.enabled", "metrics.port", "metrics.host", "metrics.snapshot_every_s",
            "link.token_file", "console.enabled", "console.port", "console.host",
            "console.allow_chaos", "console.token_file")


def codec_block_size(config) -> int:
    """The codec's block size (codecs without blocks ignore it)."""
    return getattr(config.compression, "block_size", DEFAULT_BLOCK_SIZE)


def task_args(config) -> dict:
    """The task factory's keyword arguments: ``task.args``, or for the built-in byte LM its
    ``model:`` and ``data:`` sections and the job's seed."""
    if not config.task.builtin:
        return dict(config.task.args)
    d = config.data
    return dict(model=config.model.model_dump(), corpus=d.corpus, eval_fraction=d.eval_fraction,
                max_bytes=d.max_bytes, batch_size=d.batch_size, eval_batches=d.eval_batches,
                seed=config.seed)


def training_spec(config) -> TrainingSpec:
    syncer = config.syncer
    return TrainingSpec(
        task_path=config.task.path,
        task_args=task_args(config),
        model=config.model.model_dump(),
        batch_size=config.data.batch_size,
        corpus=config.data.corpus,
        eval_fraction=config.data.eval_fraction,
        max_bytes=config.data.max_bytes,
        inner=config.learner.inner_optimizer.model_dump(),
        fragments=syncer.fragments,
        sync_every_steps=syncer.sync_every_steps,
        overlap_steps=syncer.overlap_steps,
        merge_alpha=config.learner.merge_alpha,
        carry_overlap=config.learner.overlap == "carry",
        sharding=config.learner.sharding,
        codec_kind=config.compression.type,
        codec_block_size=codec_block_size(config),
        error_feedback=config.compression.error_feedback,
        seed=config.seed,
    )


def syncer_settings(config) -> SyncerSettings:
    s, q = config.syncer, config.quorum
    return SyncerSettings(
        min_learners=q.min_learners, grace_gamma=q.grace_gamma, grace_cap_s=q.grace_cap_s,
        overlap_steps=s.overlap_steps, history_versions=s.history_versions,
        max_staleness=s.max_staleness, outlier_norm_factor=s.outlier_norm_factor,
        staleness_discount=s.staleness_discount, merge_rule=MergeRule(s.merge_rule),
        participation_scale=s.participation_scale,
        outer_gradient=OuterGradientRule(s.outer_gradient), round_step=RoundStep(s.round_step),
        staleness_share=s.staleness_share, schedule_clock=ScheduleClock(s.schedule_clock),
        round_wait=s.round_wait,
        inner_schedule=inner_schedule(config),
        # The built-in task's batches are B·L tokens; another task's size is its own (unchecked).
        tokens_per_step=(config.data.batch_size * config.model.seq_len if config.task.builtin
                         else None))


def inner_schedule(config) -> tuple:
    """The learners' inner learning-rate schedule as the syncer checks drifts against it."""
    from islands.learners.inner import END_LR_FRACTION

    inner = config.learner.inner_optimizer
    return (inner.lr, inner.warmup_steps, inner.total_steps, END_LR_FRACTION)


def restart_policy(config) -> RestartPolicy:
    return RestartPolicy(**config.health.restart.model_dump())


def fleet_settings(config) -> FleetSettings:
    regions = {}
    for name, region in config.regions.items():
        factors = region.speed_factors
        factors = (tuple(float(f) for f in factors) if isinstance(factors, list)
                   else (float(factors),) * region.learners)
        ceiling = region.max_learners if region.max_learners is not None else region.learners
        # (a unit of several hosts has no spares, so none is prestarted for it either)
        regions[name] = RegionPlan(region.learners, ceiling, factors, remote=region.remote,
                                   spares=config.spares_of(name),
                                   prestart=(config.health.prestart_restarts
                                             and region.devices().hosts == 1))
    return FleetSettings(regions=regions, min_learners=config.quorum.min_learners,
                         policy=restart_policy(config),
                         heartbeat_timeout_s=config.health.timeout_s,
                         straggler_factor=config.health.straggler_factor,
                         straggler_window_s=config.health.straggler_window_s,
                         straggler_min_excess_s=config.health.straggler_min_excess_s,
                         spare_wait_s=config.health.spare_wait_s,
                         syncer_shards=config.syncer.shards,
                         drain_timeout_s=drain_timeout_s(config.health.timeout_s))


@dataclass(frozen=True)
class ControllerSettings:
    """What the controller itself reads (the fleet's settings are ``fleet_settings``)."""

    eval_every_s: float
    eval_batches: int
    placement_timeout_s: float
    goodput_window_s: float
    heartbeat_s: float


def controller_settings(config) -> ControllerSettings:
    return ControllerSettings(eval_every_s=config.learner.eval_every_s,
                              eval_batches=config.data.eval_batches,
                              placement_timeout_s=config.health.placement_timeout_s,
                              goodput_window_s=config.metrics.goodput_window_s,
                              heartbeat_s=config.health.heartbeat_s)


def learner_devices(config, region: str):
    """What each learner of ``region`` runs on and asks Ray for (``accelerators.LearnerDevices``)."""
    return config.regions[region].devices()


def learner_spec(config, training: TrainingSpec, launch, corpus_ref=None,
                 jax_cache_dir: Optional[str] = None) -> LearnerSpec:
    """The spec of one learner incarnation the fleet decided to launch (a ``fleet.Launch``):
    its whole environment (``runtime.process_env``) and the devices it must find at start."""
    from .runtime import Role, host_options, process_env

    region = config.regions[launch.region]
    devices = region.devices()
    return LearnerSpec(
        learner=launch.learner, shard_index=launch.shard % launch.num_shards,
        num_shards=launch.num_shards, training=training, incarnation=launch.incarnation,
        start_step=launch.start_step, speed_factor=launch.speed_factor,
        min_step_time_s=config.learner.min_step_time_s, latency_ms=region.latency_ms,
        bandwidth_gbps=region.bandwidth_gbps or 0.0, heartbeat_s=config.health.heartbeat_s,
        drain_timeout_s=config.health.timeout_s,
        peer=f"islands:{launch.peer_actor or launch.peer}" if launch.peer else None,
        corpus_ref=corpus_ref, env=process_env(Role.LEARNER, devices, jax_cache_dir),
        device_request=device_request(launch.region, devices),
        syncer_shards=config.syncer.shards, profiler=config.learner.profiler,
        hosts=devices.hosts,
        member_options=host_options(launch.region, devices) if devices.hosts > 1 else {})


def device_request(region: str, devices) -> DeviceRequest:
    """What a learner of ``region`` must find at start (learners/devices.py), with what it asked
    Ray for, for the message when it does not."""
    from .accelerators import ray_request

    asked = ", ".join(f"{k}={v}" for k, v in ray_request(devices).items()) or "no accelerator"
    return DeviceRequest(region, devices.accelerator, devices.devices_per_host, asked)


# What a promoted spare takes from the learner spec it stands in for (the rest is the job's).
IDENTITY_FIELDS = ("learner", "shard_index", "num_shards", "incarnation", "start_step",
                   "speed_factor", "latency_ms", "bandwidth_gbps", "peer")


def identity(spec: LearnerSpec) -> dict:
    return {f: getattr(spec, f) for f in IDENTITY_FIELDS}


def spare_spec(config, training: TrainingSpec, name: str, region: str, corpus_ref=None,
               jax_cache_dir: Optional[str] = None) -> LearnerSpec:
    """A warm spare of ``region``: a learner spec with no identity yet (``spare``), on the
    region's devices (its environment is set before JAX loads, and its devices are checked when
    it prepares, so a promoted spare is the learner it stands in for)."""
    from .runtime import Role, process_env

    r = config.regions[region]
    devices = r.devices()
    return LearnerSpec(learner=name, shard_index=0, num_shards=1, training=training,
                       min_step_time_s=config.learner.min_step_time_s, latency_ms=r.latency_ms,
                       bandwidth_gbps=r.bandwidth_gbps or 0.0, heartbeat_s=config.health.heartbeat_s,
                       drain_timeout_s=config.health.timeout_s,
                       corpus_ref=corpus_ref, env=process_env(Role.SPARE, devices, jax_cache_dir),
                       device_request=device_request(region, devices),
                       syncer_shards=config.syncer.shards, spare=True,
                       profiler=config.learner.profiler)


def fragment_layout(config) -> tuple[list[list[str]], tuple]:
    """Each fragment's parameter paths for a JobConfig, and the global fragment ids each syncer
    shard owns (as the home controller assigns them); shapes only, no values. The home's link
    server routes a remote push by them."""
    from islands.learners.factories import build_training
    from islands.syncer import shards as shards_lib

    _, template, _, _ = build_training(training_spec(config), abstract=True)
    plan = fragments_lib.partition(template, config.syncer.fragments)
    fragments = [fragments_lib.extract(template, plan, p) for p in range(plan.num_fragments)]
    owned = (shards_lib.assign_fragments(shards_lib.fragment_sizes(fragments),
                                         config.syncer.shards)
             if config.syncer.shards > 1 else (tuple(range(len(fragments))),))
    return [sorted(f) for f in fragments], owned


def link_server_settings(config, token: str):
    """The home link server's settings (``link``); ``token`` is read by the caller (a file or
    the environment, never the config itself)."""
    from islands.link.server import ServerSettings

    link, tls = config.link, config.link.tls
    return ServerSettings(port=link.port or 0, host=link.host, token=token,
                          cert_file=tls.cert_file if tls else None,
                          key_file=tls.key_file if tls else None,
                          client_ca_file=tls.client_ca_file if tls else None,
                          chunk_bytes=link.chunk_bytes, max_total_bytes=link.max_message_bytes,
                          keepalive_s=link.keepalive_s)


def chaos_plan(config):
    """The job's seeded fault plan (None without a ``chaos`` section)."""
    if config.chaos is None:
        return None
    return config.chaos.plan({name: [f"{name}:{i}" for i in range(region.learners)]
                              for name, region in config.regions.items()},
                             config.run.duration_s)


def syncer_options(config, run_dir: str) -> dict:
    """Everything of the syncer's spec but the initial fragments. Snapshots go under the run dir,
    or into a per-job subdirectory of ``syncer.checkpoint_dir`` (a user's directory is only ever
    written into)."""
    from islands.syncer.state import snapshot_directory

    outer = config.syncer.outer_optimizer.model_dump()
    kind = outer.pop("type")
    if kind == "nesterov":   # unset values come from the rule for this sync period
        lr, momentum = outer_rule(config.syncer.sync_every_steps)
        outer["lr"] = lr if outer["lr"] is None else outer["lr"]
        outer["momentum"] = momentum if outer["momentum"] is None else outer["momentum"]
    return dict(settings=syncer_settings(config), outer_kind=kind, outer_kwargs=outer,
                codec_kind=config.compression.type, codec_block_size=codec_block_size(config),
                downlink_kind=config.downlink_compression.type,
                downlink_block_size=getattr(config.downlink_compression, "block_size",
                                            DEFAULT_BLOCK_SIZE),
                downlink_error_feedback=config.downlink_compression.error_feedback,
                downlink_full_after_versions=config.syncer.downlink_full_after_versions,
                downlink_max_shadows=config.syncer.downlink_max_shadows,
                checkpoint_dir=snapshot_directory(config.syncer.checkpoint_dir, run_dir,
                                                  config.name),
                snapshot_every_merges=config.syncer.snapshot_every_merges,
                snapshot_min_interval_s=snapshot_min_interval_s(config.syncer),
                journal=config.syncer.journal,
                round_trip_s=timing.round_trip_s(r.latency_ms / 1000.0
                                                 for r in config.regions.values()))


def snapshot_min_interval_s(syncer) -> float:
    """``syncer.snapshot_min_interval_s``, or its default: 30 s with the merge journal (which
    already makes every merge durable), none without it (snapshots are all a restart has)."""
    if syncer.snapshot_min_interval_s is not None:
        return float(syncer.snapshot_min_interval_s)
    return 30.0 if syncer.journal else 0.0


def syncer_spec(config, template, run_dir: str, is_embedding=None) -> SyncerSpec:
    """The syncer's spec: the initial global fragments of ``template`` and ``syncer_options``.

    ``is_embedding``: the task's merge hint (``path -> bool``); None keeps the ``embed/`` prefix.
    """
    plan = fragments_lib.partition(template, config.syncer.fragments)
    frags = [{k: _np(v) for k, v in fragments_lib.extract(template, plan, p).items()}
             for p in range(plan.num_fragments)]
    embeddings = (None if is_embedding is None
                  else tuple(path for path in plan.paths if is_embedding(path)))
    return SyncerSpec(fragments=frags, embedding_paths=embeddings,
                      **syncer_options(config, run_dir))


def _np(x):
    import numpy as np

    return np.asarray(x, dtype=np.float32)


def warms_compile_cache(config) -> bool:
    """Whether the controller compiles and steps the model once at the job's start, so that
    restarts load the compile cache instead of compiling. It compiles for its own CPU, whose
    programs only CPU learners can load (the cache is per platform): where every learner of
    this cluster runs on an accelerator it would cost the start a CPU compile and step of the
    model (minutes for 124M on single-threaded XLA) for nothing."""
    return any(not r.remote and r.devices().accelerator == "cpu"
               for r in config.regions.values())


def job_task(config, share) -> tuple:
    """The job's task, built once by its controller: (training spec, the built-in corpus's
    train bytes as ``share`` put them in the object store or None, task, initial params).
    Every learner maps the same train bytes instead of reading them."""
    from islands.learners.unit import build_task, build_training, is_builtin, load_corpus

    training = training_spec(config)
    corpus_ref, train_bytes = None, None
    if is_builtin(training):
        train_bytes = load_corpus(training).train
        corpus_ref = share(train_bytes)
    task = build_task(training, train_bytes)
    _, template, _, _ = build_training(training, task=task)
    return training, corpus_ref, task, template


def num_params(tree) -> int:
    """The parameters in a tree of arrays (the job's model, in its start event)."""
    import jax

    return sum(int(v.size) for v in jax.tree_util.tree_leaves(tree))


class ControllerBody(Hooks):
    """The controller's side of its owner: what a learner, a spare or a syncer shard starts from
    (``owner.LaunchSpecs``, built from the job's config) and the hooks its role hears."""

    def __init__(self, controller):   # a controller.Controller
        self.c = controller

    def learner(self, a: fleet_lib.Launch) -> tuple:
        c = self.c
        spec = learner_spec(c.config, c.training, a, c.corpus_ref, c.jax_cache_dir)
        return (learner_devices(c.config, a.region), spec,
                identity(spec) if a.spare else None)

    def spare(self, a: fleet_lib.LaunchSpare) -> tuple:
        c = self.c
        return learner_devices(c.config, a.region), spare_spec(
            c.config, c.training, a.name, a.region, c.corpus_ref, c.jax_cache_dir)

    def syncer(self, s: int) -> tuple:
        from islands.syncer.shards import syncer_shard_name

        from .runtime import syncer_options

        c = self.c
        return (c.shard_specs[s], dict(syncer_options(c.jax_cache_dir), name=syncer_shard_name(s)),
                c.settings.placement_timeout_s)

    def recorded(self, t: fleet_lib.Transition, now: float) -> None:
        self.c.role.recorded(t)

    def attach_link(self):
        return None if self.c.role.owns_syncers else self.c.role.attach_link
