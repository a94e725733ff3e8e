"""The owner's handlers over both group kinds: the same ``owner.Owner`` handler carries an action
out on the Ray ``groups.LearnerGroups`` (a real actor on a real local cluster, answering as a
learner unit answers its control calls) and on the in-process driver's virtual group, and each
ends as that body's learner would.
"""

import threading

import pytest

ray = pytest.importorskip("ray")

from islands.orchestrator import fleet as F  # noqa: E402
from islands.orchestrator.chaos import FaultPlan  # noqa: E402
from islands.orchestrator.groups import LearnerGroups  # noqa: E402
from islands.orchestrator.groups_api import Incarnation  # noqa: E402
from islands.orchestrator.health import RestartPolicy  # noqa: E402
from islands.orchestrator.owner import Owner  # noqa: E402
from islands.orchestrator.runtime import NAMESPACE, learner_actor_name  # noqa: E402
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]


@ray.remote(num_cpus=0, max_concurrency=4)
class Unit:
    """A learner unit's control surface (learners/unit.py), recording every call; its run ends
    when it is stopped."""

    def __init__(self):
        self.calls, self.done = [], threading.Event()

    def ping(self) -> dict:
        return {"state": "training", "incarnation": 0, "start_step": 0}

    def wait_done(self) -> dict:
        self.done.wait(60)
        return {"learner": "t:0", "incarnation": 0, "state": "stopped", "step": 3}

    def drain(self):
        self.calls.append(("drain",))

    def pause(self, paused, order):
        self.calls.append(("pause", paused, order > 0))

    def hang(self, duration_s):
        self.calls.append(("hang", duration_s))

    def slowdown(self, factor, duration_s):
        self.calls.append(("slowdown", factor, duration_s))

    def link_fault(self, fault):
        self.calls.append(("link_fault", fault.kind.value))

    def stop(self):
        self.done.set()

    def seen(self) -> list:
        return list(self.calls)


def test_the_owners_handlers_are_control_calls_on_a_ray_learner():
    handle = Unit.options(name=learner_actor_name("t:0"), namespace=NAMESPACE).remote()
    groups = LearnerGroups()
    assert groups.reattach("t:0", "t:0")["state"] == "training"
    settings = F.FleetSettings({"t": F.RegionPlan(1, 1)}, 1, RestartPolicy())
    owner = Owner(settings, 1, groups, None, None, clock=lambda: 0.0)
    slow = FaultPlan().slow("t:0", at_s=0.0, duration_s=5.0, factor=2.0).faults[0]
    link = FaultPlan().degrade("t", at_s=0.0, duration_s=5.0, extra_latency_ms=50).faults[0]
    for action in (F.DrainLearner("t:0"), F.PauseLearner("t:0", True), F.Hang("t:0", 9.0),
                   F.Slowdown(("t:0",), slow), F.LinkFault(("t:0",), link)):
        owner.handlers[type(action)](action)
    # Fire-and-forget calls on a threaded actor (as a learner unit is): all of them arrive.
    calls = wait_for(lambda: (lambda c: c if len(c) >= 5 else None)(
        ray.get(handle.seen.remote(), timeout=30)), 30, "the five control calls")
    assert sorted(calls, key=repr) == sorted(
        [("drain",), ("pause", True, True), ("hang", 9.0), ("slowdown", 2.0, 5.0),
         ("link_fault", "network")], key=repr)
    # A run that returns is a fleet observation with its final stats.
    groups.stop_all(timeout_s=30)
    (ended,) = groups.ended()
    assert ended == F.RunEnded("t:0", 0) and ended.final["step"] == 3
    ray.kill(handle)


def test_a_bury_ends_the_ray_learner_and_the_owner_closes_it():
    handle = Unit.options(name=learner_actor_name("t:1"), namespace=NAMESPACE).remote()
    groups = LearnerGroups()
    groups.reattach("t:1", "t:1")
    settings = F.FleetSettings({"t": F.RegionPlan(1, 1)}, 1, RestartPolicy())
    owner = Owner(settings, 1, groups, None, None, clock=lambda: 0.0)
    owner.running["t:1"] = Incarnation(0)
    owner.do_kill(F.Kill("t:1", 0, "bury", reason="quarantine"))
    assert "t:1" not in owner.running and "t:1" in owner.closed

    # ray.kill is asynchronous: a call sent just after it can still be served (CI saw one
    # answered), so the learner's end is waited for, not expected at the next call.
    def ended() -> bool:
        try:
            ray.get(handle.seen.remote(), timeout=30)
            return False
        except ray.exceptions.RayActorError:
            return True

    wait_for(ended, 60, "the buried learner's actor to end")
