"""How the job's actors run on Ray: names, CPU shares, a learner's devices, the single-threaded
XLA environment and the shared persistent compilation cache."""

from __future__ import annotations

import enum
import os
import signal
import threading
from typing import Any, Optional

from .accelerators import (LearnerDevices, gang_strategy, learner_devices, ray_request,  # noqa: F401 (doctests)
                           tpu_slice_request, unit_bundle, xla_device_flags)

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
                runtime_env=cpu_runtime_env(Role.CONTROLLER, os.path.join(run_dir, "jax_cache")))


# The syncer and the learners are detached: actors an actor creates die with it, and the job's
# actors must outlive a controller restart. The job runner kills them when the job ends.
def syncer_options(jax_cache_dir: str) -> dict:
    return dict(name=SYNCER_NAME, namespace=NAMESPACE, num_cpus=CPUS["syncer"], max_restarts=0,
                resources=dict(ON_HEAD), max_concurrency=1000, runtime_env=cpu_runtime_env(Role.SYNCER, jax_cache_dir),
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
    # Only what must be there when the process starts (``start_env``; a learner's, a spare's
    # and a unit host's are the same): the rest of its environment the learner sets itself
    # (``LearnerSpec.env``). Ray merges this into the env_vars of the actor that creates it (the
    # controller, or a unit's host 0), a key given here replacing that actor's.
    runtime_env = {"env_vars": start_env(Role.LEARNER)}
    return dict(num_cpus=CPUS["learner"], resources=resources, runtime_env=runtime_env, **request)


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


class Role(str, enum.Enum):
    """The kinds of process a job runs. Each gets its managed environment from ``process_env``
    (what it sets itself) and, all but the driver, ``start_env`` (what Ray must start it with)."""

    DRIVER = "driver"              # ``islands run``, ``islands region join``, the CLI
    CONTROLLER = "controller"      # the home controller, and a region agent's controller
    SYNCER = "syncer"              # a syncer shard (and a region's link stand-ins for it)
    LINK_SERVER = "link_server"    # the home's end of the region link
    REGION_AGENT = "region_agent"  # a region's end of the link (its syncer stand-ins)
    LEARNER = "learner"            # a learner unit's host 0
    SPARE = "spare"                # a warm spare (a learner without an identity yet)
    UNIT_HOST = "unit_host"        # a multi-host unit's other hosts

    def __str__(self) -> str:
        return self.value


DEVICE_ROLES = frozenset({Role.LEARNER, Role.SPARE, Role.UNIT_HOST})
# Every variable the job decides for its processes; ``process_env`` gives each one a value or
# None (must not be set). Nothing else is touched: CUDA_VISIBLE_DEVICES and TPU_VISIBLE_CHIPS
# are Ray's, set from what the learner asked for.
MANAGED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE",
               "XLA_PYTHON_CLIENT_MEM_FRACTION", "OMP_NUM_THREADS", "JAX_COMPILATION_CACHE_DIR",
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
# glibc's malloc arenas, given to each process as Ray starts it (glibc reads MALLOC_ARENA_MAX
# then, never later, so it cannot be part of what a process sets itself). glibc gives each
# thread that allocates an arena of its own (up to 8 per core) and keeps what is freed there
# for that arena's next use. The controller runs many threads (Ray's core worker and gRPC, its
# owner loop, the console) for the job's whole life, and its resident memory grew with the
# job's failures under glibc's default (benchmarks/NOTES.md, "glibc's arenas"): it and the other
# long-lived service processes run with two. Every other process the job starts is given the
# node's own value ("${MALLOC_ARENA_MAX}", which Ray expands from the node's environment, to ""
# where it has none, and glibc reads "" as unset): without a value of its own it would take the
# controller's, since Ray passes an actor's env_vars on to the actors it creates, and a
# learner's data pipeline may allocate from many threads at once. The driver is left as
# started.
SERVICE_MALLOC_ARENAS = "2"
NODE_MALLOC_ARENAS = "${MALLOC_ARENA_MAX}"
SERVICE_ROLES = frozenset({Role.CONTROLLER, Role.SYNCER, Role.LINK_SERVER, Role.REGION_AGENT})


def start_env(role: Role) -> dict:
    """What a process of ``role`` must have in its environment when Ray starts it.

    >>> start_env(Role.CONTROLLER), start_env(Role.LEARNER)
    ({'MALLOC_ARENA_MAX': '2'}, {'MALLOC_ARENA_MAX': '${MALLOC_ARENA_MAX}'})
    """
    role = Role(role)
    if role is Role.DRIVER:
        raise ValueError("the driver is not started by Ray: its environment is the operator's")
    return {"MALLOC_ARENA_MAX": SERVICE_MALLOC_ARENAS if role in SERVICE_ROLES
            else NODE_MALLOC_ARENAS}


# The JAX platform of each accelerator (``JAX_PLATFORMS`` takes these names).
JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
# Of a GPU share, what XLA may preallocate: the rest is for the CUDA context and cuDNN/cuBLAS
# workspaces, which live outside XLA's pool.
GPU_MEMORY_HEADROOM = 0.9
SINGLE_THREAD_CPU_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def process_env(role: Role, devices: Optional[LearnerDevices] = None,
                jax_cache_dir: Optional[str] = None) -> dict:
    """The whole managed environment of one process of the job: ``{name: value or None}`` for
    every name in ``MANAGED_ENV`` (None: removed), decided from the process's role and devices.

    Ray passes an actor's ``runtime_env`` on to every actor it creates (and the embedded cluster
    takes the driver's environment), so nothing may be left to inheritance: a learner created by
    the CPU-pinned controller must still get its own platform. Only learners, spares and unit
    hosts open an accelerator, each the one its region asked Ray for; every other process is
    pinned to the CPU and preallocates nothing.

    >>> process_env(Role.CONTROLLER)["JAX_PLATFORMS"], process_env(Role.DRIVER)["XLA_PYTHON_CLIENT_PREALLOCATE"]
    ('cpu', 'false')
    >>> env = process_env(Role.LEARNER, learner_devices("gpu", 0.25))
    >>> env["JAX_PLATFORMS"], env["XLA_PYTHON_CLIENT_MEM_FRACTION"], env["XLA_FLAGS"]
    ('cuda', '0.225', None)
    >>> process_env(Role.SPARE, learner_devices("cpu", 4))["XLA_FLAGS"]
    '--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false'
    """
    role = Role(role)
    if role in DEVICE_ROLES:
        devices = devices if devices is not None else LearnerDevices()
    elif devices is not None and devices.accelerator != "cpu":
        raise ValueError(f"a {role} process opens no accelerator (asked for {devices.accelerator})")
    else:
        devices = LearnerDevices()
    env: dict = dict.fromkeys(MANAGED_ENV)
    env["JAX_PLATFORMS"] = JAX_PLATFORM[devices.accelerator]
    env["OMP_NUM_THREADS"] = "1"   # several processes share a few cores
    if devices.accelerator == "cpu":
        # Small thread pools, N virtual devices for a CPU learner of N > 1, and never a GPU.
        env["XLA_FLAGS"] = " ".join(f for f in (xla_device_flags(devices),
                                                SINGLE_THREAD_CPU_FLAGS) if f)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    elif devices.accelerator == "gpu":
        # XLA's pool takes its share of the card up front (a fractional learner shares it).
        share = min(1.0, devices.devices_per_host) * GPU_MEMORY_HEADROOM
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{share:.6g}"
    if jax_cache_dir is not None:
        env.update({"JAX_COMPILATION_CACHE_DIR": jax_cache_dir,
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})
    return env


def ray_env_vars(env: dict) -> dict:
    """``env`` as a Ray ``runtime_env``'s ``env_vars`` (which can set, not remove: what must
    be absent is left out, and the process removes it itself where it matters)."""
    return {k: v for k, v in env.items() if v is not None}


def cpu_env(jax_cache_dir: Optional[str] = None, role: Role = Role.CONTROLLER) -> dict:
    """The ``runtime_env`` env_vars of a process that runs JAX only on the CPU (controller,
    syncer shards, link ends)."""
    return ray_env_vars(process_env(role, jax_cache_dir=jax_cache_dir))


def cpu_runtime_env(role: Role, jax_cache_dir: Optional[str] = None) -> dict:
    """A CPU process's Ray ``runtime_env``: its variables set explicitly, not inherited, and
    what it must have from its start (``start_env``)."""
    return {"env_vars": {**cpu_env(jax_cache_dir, role), **start_env(role)}}


def enable_compile_cache(path: str) -> None:
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a Kubernetes pod's stop): left like Ctrl+C, through the same clean shutdown."""


NOT_INSTALLED = object()   # sigterm_interrupts changed nothing: only the main thread can


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the shutdown short
    raise Terminated()


def sigterm_interrupts():
    """Makes SIGTERM raise :class:`Terminated` in the main thread, which a driver's Ctrl+C path
    catches. Call it after ``ray.init``: Ray's own handler raises ``SystemExit``, with which
    ``islands run`` wrote its summary and then aborted at exit (code 134). Returns what to give
    :func:`hold_sigterm` and :func:`restore_sigterm`: the handler it replaced, or
    ``NOT_INSTALLED``."""
    if threading.current_thread() is not threading.main_thread():
        return NOT_INSTALLED
    return signal.signal(signal.SIGTERM, _raise_terminated)


def hold_sigterm(previous) -> None:
    """At the start of the clean stop: a SIGTERM arriving now must not cut it short (the
    summary, the export), so it is ignored until :func:`restore_sigterm`."""
    if previous is not NOT_INSTALLED:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def restore_sigterm(previous) -> None:
    """Puts back the handler :func:`sigterm_interrupts` replaced; one Python cannot name (set
    from C, given as None) becomes the default."""
    if previous is not NOT_INSTALLED:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
