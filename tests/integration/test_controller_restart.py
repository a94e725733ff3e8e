"""The controller is no single point of failure: killed mid-run, Ray restarts it; it rebuilds its
state from its saved books, the running syncer and the running learners, none of which stops,
and the job ends with books that balance and a summary as if nothing happened."""

import json
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]

from islands.orchestrator.job import run_job  # noqa: E402

def test_a_killed_controller_comes_back_and_no_learner_stops(tmp_path, tiny_job):
    killed = {}

    def kill_when_merging(controller):
        def wait_then_kill():
            deadline = time.time() + 60
            while time.time() < deadline:  # real state, polled with a timeout
                snap = ray.get(controller.snapshot.remote())
                if (snap["syncer"]["merges"] or 0) >= 20:
                    killed["merges"] = snap["syncer"]["merges"]
                    killed["steps"] = {n: l["step"] for n, l in snap["learners"].items()}
                    ray.kill(controller, no_restart=False)
                    return
                time.sleep(0.2)
            killed["error"] = "no merges within 60 s"

        threading.Thread(target=wait_then_kill, daemon=True).start()

    run_dir = tmp_path / "run"
    # Ends once the restarted controller saw 10 more merges and every learner step on (35 s cap).
    def came_back_and_merged(snap) -> bool:
        return ("merges" in killed and (snap["syncer"]["merges"] or 0) >= killed["merges"] + 10
                and all(snap["learners"].get(n, {}).get("step", 0) > s
                        for n, s in killed["steps"].items()))

    summary = run_job(tiny_job("controller-itest"), duration_s=35, run_dir=str(run_dir),
                      quiet=True, on_started=kill_when_merging, until=came_back_and_merged)
    assert "error" not in killed and killed.get("merges", 0) >= 20
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (restarted,) = [e for e in events if e["event"] == "controller_restarted"]
    assert restarted["learners_kept"] == ["a:0", "a:1"] and restarted["relaunched"] == []
    assert not [e for e in events if e["event"] == "training_paused"]  # nobody stood still
    # Nobody was restarted because of it: same incarnations, steps went on from where they were.
    assert summary["learner_restarts"] == 0
    assert all(l["incarnation"] == 0 for l in summary["learners"].values())
    assert all(summary["learners"][n]["step"] > killed["steps"][n] for n in killed["steps"])
    assert summary["merges"] > killed["merges"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    ft = summary["fragment_tokens"]  # each term counted where it happens, in exact integers
    assert ft["applied"] + ft["dropped"] + ft["in_flight"] == ft["processed"] > 0
    assert summary["books_balanced"] is True
    assert 0.0 < summary["goodput"] <= 1.0


@ray.remote(num_cpus=0)
class _Pinged:
    """Stands in for a learner unit at its ping (threaded, as a learner is: it answers beside its
    long run): answers after ``delay`` seconds."""

    def __init__(self, delay: float):
        self.delay = delay

    def ping(self) -> dict:
        time.sleep(self.delay)
        return {"incarnation": 3, "state": "done", "start_step": 7}


def test_reattach_ends_an_unplaced_learner_and_its_unit_groups_but_waits_for_a_slow_one():
    """A restarted controller's re-attach: an actor under a learner's name that Ray has not
    placed is ended with its unit's placement groups (it would hold the name the relaunch needs);
    one that is placed but slow to answer gets longer and is kept."""
    from ray.util.placement_group import placement_group

    from islands.orchestrator.groups import LearnerGroups, placed
    from islands.orchestrator.runtime import NAMESPACE, learner_actor_name, unit_group_name

    groups = LearnerGroups()
    unplaced = _Pinged.options(name=learner_actor_name("t:0"), namespace=NAMESPACE,
                               resources={"no-such-resource": 1}).remote(0.0)
    orphan_group = placement_group([{"no-such-resource": 1}], name=unit_group_name("t:0", 2),
                                   lifetime="detached")
    slow = _Pinged.options(name=learner_actor_name("t:1"), namespace=NAMESPACE,
                           max_concurrency=8).remote(1.5)
    try:
        ray.get(slow.__ray_ready__.remote(), timeout=60)
        assert not placed(unplaced, 0.5) and placed(slow)
        assert groups.reattach("t:0", "t:0", timeout_s=0.5) is None
        with pytest.raises(ValueError):   # ended: its name is free for the relaunch
            ray.get_actor(learner_actor_name("t:0"), namespace=NAMESPACE)
        table = ray.util.placement_group_table()
        assert table[orphan_group.id.hex()]["state"] == "REMOVED"
        # Placed but slow (1.5 s against a 0.5 s ping): waited for, not ended.
        assert groups.reattach("t:1", "t:1", timeout_s=0.5) == {
            "incarnation": 3, "state": "done", "start_step": 7}
        assert ray.get_actor(learner_actor_name("t:1"), namespace=NAMESPACE)
    finally:
        for handle in (unplaced, slow):
            ray.kill(handle)
