"""Warm spares on a real local Ray cluster: a killed learner's place is taken by a spare that
had everything ready (process, task, compiled step), a new spare follows, the books balance.
One cluster and one job for the module; every wait is on real state with a timeout.
"""

import pytest

ray = pytest.importorskip("ray")

from conftest import TINY_JOB  # noqa: E402
from islands.orchestrator.cli import format_status  # noqa: E402
from islands.orchestrator.config import JobConfig  # noqa: E402
from islands.orchestrator.controller import (NAMESPACE, Controller,  # noqa: E402
                                             controller_options)
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

pytestmark = pytest.mark.ray

JOB = {
    **TINY_JOB, "name": "spares",
    # A backoff far longer than the test: only a promotion can bring the learner back in time.
    "health": {"heartbeat_s": 0.5, "timeout_s": 8.0, "spares": 1,
               "restart": {"backoff_initial_s": 120.0, "backoff_max_s": 120.0}}}


@pytest.fixture(scope="module")
def job(shared_ray, tmp_path_factory):
    config = JobConfig.model_validate(JOB)
    run_dir = tmp_path_factory.mktemp("run")
    controller = ray.remote(Controller).options(**controller_options(str(run_dir))).remote(
        config, str(run_dir))
    ray.get(controller.start.remote())
    snap = lambda: ray.get(controller.snapshot.remote())  # noqa: E731
    yield controller, snap
    ray.get(controller.shutdown.remote(), timeout=120)
    ray.kill(controller)


def events(controller, kind):
    found, _ = ray.get(controller.events_since.remote(0))
    return [e for e in found if e["event"] == kind]


def test_a_killed_learner_is_replaced_by_a_ready_spare_at_once(job):
    controller, snap = job
    wait_for(lambda: snap()["learner_states"].get("training") == 2, 180, "2 learners training")
    ready = wait_for(lambda: [s for s in snap()["spares"].values() if s["state"] == "ready"],
                     180, "a ready spare", describe=lambda: snap()["spares"])
    assert len(ready) == 1
    table = ray.get(controller.status_table.remote())
    assert "spare spare:a:0: region a  ready" in format_status(table)
    wait_for(lambda: (snap()["syncer"]["merges"] or 0) >= 2, 60, "first merges")

    ray.get(controller.chaos_kill.remote("a:1"))
    # The backoff is 120 s: training again well before it means the spare took over.
    wait_for(lambda: snap()["learners"]["a:1"]["incarnation"] == 1
             and snap()["learners"]["a:1"]["state"] == "training", 30,
             "a:1 training again on the spare", describe=lambda: snap()["learners"]["a:1"])
    promoted = events(controller, "spare_promoted")
    assert [(e["learner"], e["spare"]) for e in promoted] == [("a:1", "spare:a:0")]
    # Cheap start: the promoted spare's start took a sliver of the CPU its preparation did
    # (process CPU-seconds, which the machine's load does not change).
    timings = wait_for(lambda: (snap()["learners"]["a:1"].get("timings") or {}).get(
        "cpu_start_s") is not None and snap()["learners"]["a:1"]["timings"], 30,
        "a:1's first step's CPU-seconds")
    prepared = sum(timings[f"cpu_{p}_s"] for p in ("boot", "load", "import", "model",
                                                    "warm_step", "warm_pushes"))
    assert timings["cpu_start_s"] < 0.25 * prepared, timings
    # Its first merged contribution closes the recovery, with its phases.
    recovery = wait_for(lambda: snap()["recoveries"], 60, "a:1's recovery record")[0]
    assert recovery["cause"] == "crash" and recovery["total_s"] < 30
    # A new spare starts behind it once nobody is starting, and gets ready.
    wait_for(lambda: any(n != "spare:a:0" and s["state"] == "ready"
                         for n, s in snap()["spares"].items()), 180, "a new ready spare",
             describe=lambda: snap()["spares"])
    tokens = snap()["tokens"]
    assert tokens["balanced"], tokens
