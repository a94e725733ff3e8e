"""Learners train on the devices their region asked for, or not at all (docs/accelerators.md).

The shared local Ray cluster (tests/integration/clusters.py) declares one logical GPU and was
started (as ``islands run`` starts its embedded one) from a driver pinned to
``JAX_PLATFORMS=cpu``: every worker process inherits that.
A GPU region's learner, its warm spare and a GPU unit of 2 hosts must each get their own platform
(CUDA), find no CUDA on this machine and refuse to train with the one-line device check, as a
configuration failure that is not retried (the cluster's one node is marked for their regions,
so the regions are blocked; the cause it names depends on the jaxlib installed: the
``likely_cause`` fixture; where a CUDA device is usable the module is skipped); a CPU region in
the same job stays pinned to the CPU and trains. With the old inheritance back (a GPU learner
keeping the controller's
``JAX_PLATFORMS=cpu``) the GPU learner would train on the CPU and this module fails.
"""

import os

import pytest

ray = pytest.importorskip("ray")

from conftest import TINY_JOB  # noqa: E402
from islands.orchestrator.cli import format_status  # noqa: E402
from islands.orchestrator.config import JobConfig  # noqa: E402
from islands.orchestrator.controller import NAMESPACE, Controller, controller_options  # noqa: E402
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]

JOB = {
    **TINY_JOB, "name": "devices",
    "regions": {"cpu": {"learners": 1},
                "gpu": {"learners": 1, "accelerator": "gpu", "devices_per_host": 0.25},
                "pair": {"learners": 1, "accelerator": "gpu", "devices_per_host": 0.25,
                         "hosts_per_learner": 2},
                # Only a warm spare (a region whose learners fail first keeps none).
                "warm": {"learners": 0, "accelerator": "gpu", "devices_per_host": 0.25}},
    "health": {"heartbeat_s": 0.5, "timeout_s": 20.0, "spares": {"warm": 1},
               "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 0.5}}}


@pytest.fixture(scope="module")
def likely_cause() -> str:
    """The cause the device check names on this machine, which depends on the jaxlib installed:
    a CPU-only one has no CUDA plugin; one with a CUDA plugin finds no NVIDIA device on the node
    (where one is, the module is skipped: its GPU learners would train). Either way the mismatch
    is deterministic: a configuration failure, not retried."""
    from islands.learners.devices import device_files_present, plugin_installed

    # Where the learners run: a worker of the shared cluster, which has this environment.
    has_plugin = ray.get(ray.remote(lambda: plugin_installed("gpu")).options(
        num_cpus=0).remote())
    if not has_plugin:
        return "a CPU-only jaxlib: no GPU plugin is installed where the learner runs"
    if device_files_present("gpu"):
        pytest.skip("a CUDA plugin and an NVIDIA device are here: the GPU learners would train")
    return "no NVIDIA device on this node"


@pytest.fixture(scope="module")
def job(tmp_path_factory, likely_cause):
    config = JobConfig.model_validate(JOB)
    # The shared cluster's workers inherit the pin (clusters.shared_cluster): a GPU learner that
    # kept it would train on the CPU.
    assert ray.cluster_resources().get("GPU") == 1
    assert ray.get(ray.remote(lambda: os.environ.get("JAX_PLATFORMS")).options(
        num_cpus=0).remote()) == "cpu"
    run_dir = tmp_path_factory.mktemp("run")
    controller = ray.remote(Controller).options(**controller_options(str(run_dir))).remote(
        config, str(run_dir))
    ray.get(controller.start.remote())
    yield controller, lambda: ray.get(controller.snapshot.remote())
    ray.get(controller.shutdown.remote(), timeout=120)
    ray.kill(controller)


def events(controller, kind=None):
    found, _ = ray.get(controller.events_since.remote(0))
    return [e for e in found if kind is None or e["event"] == kind]


def test_gpu_learners_refuse_the_cpu_and_cpu_learners_stay_on_it(job, likely_cause):
    controller, snap = job
    retired = lambda: {e["learner"]: e for e in events(controller, "learner_retired")}  # noqa: E731
    wait_for(lambda: {"gpu:0", "pair:0"} <= set(retired()), 180,
             "the GPU learner and the GPU unit retired", describe=lambda: events(controller)[-12:])
    failed = {e["learner"]: e for e in events(controller, "learner_failed")}
    for learner in ("gpu:0", "pair:0"):
        line = failed[learner]["detail"]
        # Its own environment asked JAX for CUDA (the inherited cpu pin was replaced) ...
        assert "JAX gave it no backend (JAX_PLATFORMS=cuda did not start" in line, line
        assert "JAX_PLATFORMS=cpu" not in line, line
        # ... and the one line names the region, its request and the likely cause.
        region = learner.split(":")[0]
        assert f"device check failed: region {region} asked Ray for num_gpus=0.25" in line, line
        assert f"likely cause: {likely_cause}" in line, line
        assert failed[learner]["cause"] == "config"
    # Not retried in a loop: one incarnation each, no restart, the region marked misconfigured.
    learners = snap()["learners"]
    assert learners["gpu:0"]["state"] == "failed" and learners["gpu:0"]["incarnation"] == 0
    assert learners["gpu:0"]["restarts"] == {} and learners["pair:0"]["restarts"] == {}
    # The mark is the node's (the cluster's only one, so it blocks the regions).
    node = ray.get_runtime_context().get_node_id()
    marks = ray.get(controller.status_table.remote())["misconfigured"]
    assert {m["region"] for m in marks} >= {"gpu", "pair"}, marks
    assert all(m["node"] == node and m["blocked"] for m in marks), marks
    with pytest.raises(ray.exceptions.RayTaskError, match="its learners cannot train there"):
        ray.get(controller.scale.remote("gpu", 2))


def test_the_spare_gets_the_same_check_and_is_not_relaunched(job):
    controller, snap = job
    ended = wait_for(lambda: [e for e in events(controller, "spare_ended")
                              if e["region"] == "warm"], 120, "the GPU spare ended",
                     describe=lambda: [(e["elapsed_s"], e["event"], e.get("learner") or e.get("spare"), e.get("state") or e.get("to")) for e in events(controller)])
    assert "device check failed: region warm asked Ray for num_gpus=0.25" in ended[0]["reason"]
    # The CPU learner trains on meanwhile; no second spare of the GPU region is launched.
    steps = (snap()["learners"]["cpu:0"]["step"] or 0)
    wait_for(lambda: (snap()["learners"]["cpu:0"]["step"] or 0) >= steps + 20, 120,
             "the CPU learner 20 steps further")
    launched = [e for e in events(controller, "spare_launched") if e["region"] == "warm"]
    assert len(launched) == 1, launched
    assert "warm" in {m["region"] for m in ray.get(controller.status_table.remote())[
        "misconfigured"]}


def test_the_cpu_learner_proves_its_cpu_and_shows_it(job):
    controller, snap = job
    wait_for(lambda: snap()["learners"]["cpu:0"]["state"] == "training", 120, "cpu:0 training")
    learner = ray.get_actor("islands:cpu:0", namespace=NAMESPACE)
    env = ray.get(learner.environment.remote())
    assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    devices = wait_for(lambda: snap()["learners"]["cpu:0"].get("devices"), 60, "cpu:0's devices")
    assert devices["backend"] == "cpu" and devices["count"] == 1 and devices["error"] is None
    shown = [e for e in events(controller, "learner_devices") if e["learner"] == "cpu:0"]
    assert shown and shown[0]["backend"] == "cpu"
    table = format_status(ray.get(controller.status_table.remote()))
    assert any(line.startswith("cpu:0") and "cpu 1× cpu" in line for line in table.splitlines())
    node = ray.get_runtime_context().get_node_id()
    assert (f"MISCONFIGURED region gpu on node {node} (region blocked: every node of it is "
            "marked): device check failed") in table
    from islands.orchestrator.metrics import device_counts

    assert device_counts(snap()["learners"]).get(("cpu", "cpu")) == 1


def test_an_operator_clears_the_node_and_the_region_tries_it_again(job, capsys):
    """``islands clear-misconfigured --all``: the marks go, so the warm region starts a spare
    again; it fails its check on the same node and marks it again (the node was not fixed)."""
    controller, _ = job
    from islands.orchestrator.cli import main

    launched = len([e for e in events(controller, "spare_launched") if e["region"] == "warm"])
    assert main(["clear-misconfigured", "--all"]) == 0
    assert "cleared every marked node" in capsys.readouterr().out
    cleared = {e["region"] for e in events(controller, "node_misconfigured_cleared")}
    assert cleared >= {"gpu", "pair", "warm"}, cleared
    assert all(e["origin"] == "cli" for e in events(controller, "node_misconfigured_cleared"))
    wait_for(lambda: len([e for e in events(controller, "spare_launched")
                          if e["region"] == "warm"]) > launched, 60, "a new warm spare")
    wait_for(lambda: "warm" in {m["region"] for m in ray.get(
        controller.status_table.remote())["misconfigured"]}, 120, "warm marked again")
    # A node that is not marked is refused, naming the marked ones.
    assert main(["clear-misconfigured", "no-such-node"]) == 2
    assert "node 'no-such-node' is not marked misconfigured" in capsys.readouterr().err
