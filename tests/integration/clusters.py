"""One local Ray cluster for the integration modules that fit on it.

A cluster start and stop costs 10-15 s on the 2-core machine, once per module before. Modules
that use the ``shared_ray`` fixture (tests/conftest.py) run one after another on one cluster,
whose regions are the union of theirs; each leaves it as it found it: every actor of the job
namespace ended and gone from Ray's list before the next module starts. Modules that need a
cluster of their own (a logical GPU, a second cluster, a worker environment of their own) run
after them, and the shared cluster is stopped before their first test.
"""

from __future__ import annotations

import time

NAMESPACE = "islands"
SHARED_CPUS = 4
# The union of the shared modules' regions, each with the most any of them declares. A region
# that a test needs absent (test_cold_start's "never") is in none of them.
SHARED_RESOURCES = {"region:a": 3, "region:b": 1, "region:us-east": 3, "region:eu-west": 3,
                    "region:one": 2, "region:pair": 2, "region:east": 3, "region:west": 3}

_state = {"shared": False}


def shared_cluster() -> None:
    """Connects this process to the shared cluster, starting it on first use (or after a module
    that needed its own)."""
    import ray

    if ray.is_initialized():
        if _state["shared"]:
            return
        ray.shutdown()
    ray.init(address="local", num_cpus=SHARED_CPUS, resources=SHARED_RESOURCES,
             namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
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
