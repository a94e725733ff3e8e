"""One local Ray cluster for the integration modules that fit on it.

A cluster start and stop costs 10-15 s on the 2-core machine, once per module before. Modules
that use the ``shared_ray`` fixture (tests/conftest.py) run one after another on one cluster,
whose regions are the union of theirs; each leaves it as it found it: every actor of the job
namespace ended and gone from Ray's list before the next module starts. Modules that need a
cluster of their own (a second cluster, a head started by ``ray start``) run after them, and the
shared cluster is stopped before their first test.

The cluster is started the way ``islands run`` starts its embedded one on a CPU machine: from a
driver pinned to ``JAX_PLATFORMS=cpu``, which every worker inherits (test_learner_devices proves
that a GPU region's learners do not keep that pin), with one logical GPU for those regions, and
with this folder on the workers' ``PYTHONPATH`` (test_task_service's learners import their task
from a test module by name).
"""

from __future__ import annotations

import os
import time

NAMESPACE = "islands"
SHARED_CPUS = 4
# The union of the shared modules' regions, each with the most any of them declares. A region
# that a test needs absent (test_cold_start's "never") is in none of them.
SHARED_RESOURCES = {"region:a": 3, "region:b": 1, "region:us-east": 3, "region:eu-west": 3,
                    "region:one": 2, "region:pair": 2, "region:east": 3, "region:west": 3,
                    "region:cpu": 1, "region:gpu": 1, "region:warm": 1}
SHARED_GPUS = 1   # logical: test_learner_devices' GPU regions ask for 0.25 each
HERE = os.path.dirname(os.path.abspath(__file__))

_state = {"shared": False}


def shared_cluster() -> None:
    """Connects this process to the shared cluster, starting it on first use (or after a module
    that needed its own)."""
    import ray

    if ray.is_initialized():
        if _state["shared"]:
            return
        ray.shutdown()
    pinned = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    before = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)   # the workers inherit the environment the cluster starts with
    try:
        ray.init(address="local", num_cpus=SHARED_CPUS, num_gpus=SHARED_GPUS,
                 resources=SHARED_RESOURCES, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, _node_ip_address="127.0.0.1")
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _state["shared"] = True


def leave_shared_cluster() -> None:
    """Stops the shared cluster if it is up (a module about to start or join another)."""
    import ray

    if _state["shared"] and ray.is_initialized():
        ray.shutdown()
    _state["shared"] = False


def end_job_actors(timeout_s: float = 60.0) -> None:
    """Ends every named actor of the job namespace (the syncer and learners are detached: they
    outlive the controller by design) and waits until Ray lists none, so the next module starts
    on an empty cluster. Fails naming what stayed."""
    import ray

    def named() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a.get("namespace") == NAMESPACE]

    for name in named():
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except Exception:   # it ended meanwhile
            pass
    deadline = time.monotonic() + timeout_s
    left = named()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = named()
    assert not left, f"actors still named in {NAMESPACE!r} {timeout_s:g}s after the kill: {left}"


def process_tree(pid: int) -> list:
    """``pid``'s process and everything under it now: for a process that started a Ray cluster,
    its daemons and, under the raylet, every worker. Empty if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def end_process_tree(tree: list, timeout_s: float = 30.0) -> list:
    """SIGKILLs whatever of ``tree`` (from :func:`process_tree`) still runs and waits until it
    has exited; returns the pids that outlived the wait. psutil checks that each process is
    still the one noted (its start time), so a reused pid is never signalled."""
    import psutil

    def running(p) -> bool:
        try:
            # An exited process whose parent (here, often pid 1) has not reaped it has ended.
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    for p in tree:
        try:
            if running(p):
                p.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.time() + timeout_s
    while (left := [p for p in tree if running(p)]) and time.time() < deadline:
        time.sleep(0.1)   # polling: a non-child's exit raises no event here
    return [p.pid for p in left]
