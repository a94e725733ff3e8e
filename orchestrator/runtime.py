"""How the job's actors run on Ray: names, CPU shares, a learner's devices, the single-threaded
XLA environment and the shared persistent compilation cache."""

from __future__ import annotations

import os
from typing import Any

from .accelerators import (LearnerDevices, gang_strategy, ray_request, tpu_slice_request,
                           unit_bundle, xla_device_flags)

NAMESPACE = "islands"
CONTROLLER_NAME = "islands:controller"
SYNCER_NAME = "islands:syncer"
CPUS = {"controller": 0.1, "syncer": 0.2, "learner": 0.25}
CONTROLLER_MAX_RESTARTS = 10
# The controller, the syncer shards and the link's ends run on the head node: the metrics and
# link Services of the Helm chart point at the head pod, and the link's Secrets are mounted there.
ON_HEAD = {"node:__internal_head__": 0.001}


def learner_actor_name(learner_id: str) -> str:
    """"us-east:0" -> "islands:us-east:0"."""
    return f"islands:{learner_id}"


def controller_options(run_dir: str) -> dict:
    """Ray options for the controller. It shares the learners' XLA flags and compilation cache, so
    the train step it compiles before launching them is a cache hit in every learner."""
    # It restarts (and rebuilds its state from its saved books, the syncer and the running
    # learners); calls made while it restarts wait for it instead of failing.
    return dict(name=CONTROLLER_NAME, namespace=NAMESPACE, num_cpus=CPUS["controller"],
                resources=dict(ON_HEAD), max_concurrency=16, max_restarts=CONTROLLER_MAX_RESTARTS, max_task_retries=-1,
                runtime_env={"env_vars": single_thread_env(os.path.join(run_dir, "jax_cache"))})


# The syncer and the learners are detached: actors an actor creates die with it, and the job's
# actors must outlive a controller restart. The job runner kills them when the job ends.
def syncer_options(jax_cache_dir: str) -> dict:
    return dict(name=SYNCER_NAME, namespace=NAMESPACE, num_cpus=CPUS["syncer"], max_restarts=0,
                resources=dict(ON_HEAD), max_concurrency=1000, runtime_env={"env_vars": single_thread_env(jax_cache_dir)},
                lifetime="detached")


def learner_options(learner: str, region: str,
                    devices: LearnerDevices = LearnerDevices(), group: Any = None) -> dict:
    """Ray options for a learner of ``region``: a unit of ``region:<name>``, its CPU share and its
    devices (``build.learner_devices``), so Ray reserves them and sets what the learner sees.
    ``group``: a multi-host unit's placement group; the learner is its host 0 (bundle 0)."""
    options = dict(name=learner_actor_name(learner), namespace=NAMESPACE, max_restarts=0,
                   max_concurrency=8, lifetime="detached", **host_options(region, devices))
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0)
    return options


def host_options(region: str, devices: LearnerDevices) -> dict:
    """What one host of a learner unit asks Ray for: its CPU share, one ``region:<name>`` unit
    and the host's devices (a unit's other hosts get these, placed in their own bundles)."""
    request = ray_request(devices)
    resources = {f"region:{region}": 1, **request.pop("resources", {})}
    return dict(num_cpus=CPUS["learner"], resources=resources, **request)


def unit_group_name(learner: str, incarnation: int) -> str:
    """The placement group of one incarnation of a multi-host unit: named, so a restarted
    controller finds and releases it."""
    return f"islands-unit:{learner}:{incarnation}"


def reserve_unit(learner: str, incarnation: int, region: str, devices: LearnerDevices) -> Any:
    """Asks Ray for a multi-host unit's placement group, one bundle per host (a TPU slice
    through ``ray.util.tpu``); the unit's actors wait in Ray until it is placed."""
    import ray
    from ray.util.placement_group import placement_group

    name = unit_group_name(learner, incarnation)
    if devices.accelerator == "tpu":
        from ray.util.tpu import slice_placement_group

        request = tpu_slice_request(devices, region, CPUS["learner"], name)
        return slice_placement_group(**request).placement_group
    marker = f"region:{region}"
    nodes = sum(1 for n in ray.nodes()
                if n.get("Alive") and n.get("Resources", {}).get(marker, 0.0) > 0)
    bundle = unit_bundle(region, devices, CPUS["learner"])
    return placement_group([dict(bundle) for _ in range(devices.hosts)],
                           strategy=gang_strategy(devices, nodes), name=name,
                           lifetime="detached")


def release_unit(learner: str, incarnation: int) -> None:
    """Frees a unit incarnation's placement group (its actors are ended first); gone already
    is fine."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        remove_placement_group(get_placement_group(unit_group_name(learner, incarnation)))
    except Exception:   # never created, or released already
        pass


def learner_env(base: dict, devices: LearnerDevices) -> dict:
    """A learner's environment: ``base`` (``single_thread_env``) with its devices' platform and
    flags. CPU learners stay pinned to the CPU (Ray does not hide a node's GPUs from an actor
    that asked for none); GPU and TPU learners let JAX pick the devices Ray assigned them."""
    env = dict(base)
    env.pop("JAX_PLATFORMS", None)
    if devices.jax_platform is not None:
        env["JAX_PLATFORMS"] = devices.jax_platform
    flags = xla_device_flags(devices)
    if flags:
        env["XLA_FLAGS"] = f"{flags} {env.get('XLA_FLAGS', '')}".strip()
    return env


def single_thread_env(jax_cache_dir: str) -> dict:
    """Small CPU thread pools (several learners share a few cores), JAX on the CPU, and the shared
    persistent compilation cache (a restarted learner loads its step instead of compiling it).

    The controller and the syncer run with it as is: they ask Ray for no accelerator, so they
    must not open one. A learner's own devices replace the platform (``learner_env``)."""
    return {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "OMP_NUM_THREADS": "1",
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": jax_cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def enable_compile_cache(path: str) -> None:
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
