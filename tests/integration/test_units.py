"""Multi-host learner units on a real local Ray cluster (learners/gang.py): a unit of two
processes, joined by jax.distributed over gloo on this one machine, trains beside one-process
learners in one job; killing one of its hosts fails and restarts the whole unit, once, while
the other learners keep their pace. One cluster and one job for the module.
"""

import time

import pytest

ray = pytest.importorskip("ray")

from conftest import TINY_JOB  # noqa: E402
from islands.learners.gang import member_name  # noqa: E402
from islands.orchestrator.cli import format_status  # noqa: E402
from islands.orchestrator.config import JobConfig  # noqa: E402
from islands.orchestrator.controller import (NAMESPACE, SYNCER_NAME, Controller,  # noqa: E402
                                             controller_options)
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

pytestmark = pytest.mark.ray

JOB = {
    **TINY_JOB, "name": "units", "learner": {**TINY_JOB["learner"], "eval_every_s": 3.0},
    # Region "one": two one-process learners. Region "pair": one unit of 2 hosts (processes).
    "regions": {"one": {"learners": 2}, "pair": {"learners": 1, "hosts_per_learner": 2}},
    "health": {"heartbeat_s": 0.5, "timeout_s": 20.0,
               "restart": {"backoff_initial_s": 0.5, "backoff_max_s": 1.0}}}


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


def steps(snap) -> dict:
    return {name: s.get("step") or 0 for name, s in snap()["learners"].items()}


def test_a_two_host_unit_trains_beside_one_host_learners_and_loss_falls(job):
    controller, snap = job
    wait_for(lambda: snap()["learner_states"].get("training") == 3, 240,
             "3 units training", describe=lambda: snap()["learners"])
    # Both regions' pushes are merged by the one syncer.
    wait_for(lambda: all((s.get("step") or 0) >= 24 for s in snap()["learners"].values()), 120,
             "every unit past 24 steps", describe=lambda: steps(snap))
    # islands status shows each unit's hosts and devices.
    table = format_status(ray.get(controller.status_table.remote()))
    assert [line.split()[:3] for line in table.splitlines() if line.startswith("pair:0")] == [
        ["pair:0", "pair", "2×1"]]
    assert snap()["learners"]["one:0"]["unit"] == "1×1 cpu"
    syncer = ray.get_actor(SYNCER_NAME, namespace=NAMESPACE)
    ledger = ray.get(syncer.status.remote()).ledger
    assert ledger["pair:0"]["merged_tokens_total"] > 0, ledger
    assert ledger["one:0"]["merged_tokens_total"] > 0, ledger
    initial = wait_for(lambda: snap()["initial_eval_loss"], 60, "the initial evaluation")
    wait_for(lambda: (snap()["eval_loss"] or initial) < initial - 0.1, 180,
             "eval loss falling", describe=lambda: (initial, snap()["eval_loss"]))


def test_killing_one_host_restarts_the_whole_unit_once(job):
    controller, snap = job
    before = snap()["learners"]["pair:0"]["incarnation"]
    t0, s0 = time.time(), steps(snap)
    wait_for(lambda: steps(snap)["one:0"] >= s0["one:0"] + 20, 60, "one:0 steps")
    rate_before = (steps(snap)["one:0"] - s0["one:0"]) / (time.time() - t0)

    host1 = ray.get_actor(member_name("pair:0", before, 1), namespace=NAMESPACE)
    ray.kill(host1, no_restart=True)
    t1, s1 = time.time(), steps(snap)
    wait_for(lambda: snap()["learners"]["pair:0"]["incarnation"] == before + 1
             and snap()["learners"]["pair:0"]["state"] == "training", 180,
             "pair:0 restarted as a unit", describe=lambda: snap()["learners"]["pair:0"])
    rate_during = (steps(snap)["one:0"] - s1["one:0"]) / (time.time() - t1)
    # Its new hosts exist, the old ones are gone with their leader.
    ray.get_actor(member_name("pair:0", before + 1, 1), namespace=NAMESPACE)
    with pytest.raises(ValueError):
        ray.get_actor(member_name("pair:0", before, 1), namespace=NAMESPACE)
    restarts = [e for e in events(controller, "learner_restarted") if e["learner"] == "pair:0"]
    assert len(restarts) == 1, restarts
    # The others never wait for it: their pace during the restart (a 2-process start on
    # these same 2 cores) stays within half of before.
    assert rate_during >= 0.5 * rate_before, (rate_before, rate_during)
    wait_for(lambda: snap()["tokens"]["balanced"], 60, "books balanced",
             describe=lambda: snap()["tokens"])
