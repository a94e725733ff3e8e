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
