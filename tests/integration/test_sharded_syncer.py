"""A sharded syncer (syncer.shards = 2) on a real local Ray cluster: both shards merge, a killed
shard restarts alone from its own snapshot while the other keeps merging, and no fragment's
version ever goes back."""

import time

import pytest

ray = pytest.importorskip("ray")

from islands.orchestrator.cli import format_status  # noqa: E402
from islands.orchestrator.config import JobConfig  # noqa: E402
from islands.orchestrator.controller import NAMESPACE, Controller, controller_options  # noqa: E402

pytestmark = pytest.mark.ray

SHARDED = {
    "name": "shardtest",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
    "data": {"max_bytes": 200_000, "batch_size": 4, "eval_batches": 1},
    "learner": {"min_step_time_s": 0.05, "eval_every_s": 30.0},
    "syncer": {"fragments": 4, "shards": 2, "sync_every_steps": 4, "overlap_steps": 1,
               "snapshot_every_merges": 1,
               "snapshot_min_interval_s": 0},
    "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
    "compression": {"type": "int8"},
    "regions": {"us-east": {"learners": 1}, "eu-west": {"learners": 1}},
    "health": {"heartbeat_s": 0.5, "timeout_s": 10.0},
    "metrics": {"enabled": False},
}


def wait_for(predicate, timeout_s, what):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(scope="module")
def job(shared_ray, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    controller = ray.remote(Controller).options(**controller_options(str(run_dir))).remote(
        JobConfig.model_validate(SHARDED), str(run_dir))
    ray.get(controller.start.remote())
    snap = lambda: ray.get(controller.snapshot.remote())  # noqa: E731
    yield controller, snap
    ray.get(controller.shutdown.remote(), timeout=120)


def shard_rows(snapshot):
    return {row["shard"]: row for row in snapshot["syncer"].get("shards") or []}


def test_a_killed_shard_restarts_alone_while_the_other_keeps_merging(job):
    controller, snap = job
    # Both shards merge their own fragments (4 fragments of unequal sizes, split by parameters).
    rows = wait_for(lambda: (lambda r: r if len(r) == 2 and all(x["merges"] >= 2 for x in r.values())
                             else None)(shard_rows(snap())), 120, "merges on both shards")
    assert sorted(rows[0]["fragments"] + rows[1]["fragments"]) == [0, 1, 2, 3]
    table = format_status(ray.get(controller.status_table.remote()))
    assert "syncer shard 0" in table and "syncer shard 1" in table

    before = snap()["syncer"]["versions"]
    killed_at = time.time()
    ray.get(controller.chaos_kill.remote("syncer:1"))
    restarted = wait_for(lambda: (lambda r: r if r.get(1, {}).get("epoch") == 1 else None)(
        shard_rows(snap())), 90, "shard 1 restarted with epoch 1")
    assert restarted[0]["epoch"] == 0                  # shard 0 was never restarted
    evs, _ = ray.get(controller.events_since.remote(0))
    failed = [e for e in evs if e["event"] == "syncer_failed"]
    started = [e for e in evs if e["event"] == "syncer_started" and e.get("shard") == 1]
    assert [e.get("shard") for e in failed] == [1]
    assert started, "no syncer_started event for shard 1"
    # Shard 0 merged while shard 1 was out: between the kill and shard 1's first merge after its
    # restart (its own merge logs, by wall-clock time). A learner that waited on shard 1 (it
    # re-registered on its training thread, up to a second per lost push) pushed nothing then.
    shard1 = ray.get_actor("islands:syncer-1", namespace=NAMESPACE)
    back = wait_for(lambda: ray.get(shard1.recent_merges.remote(killed_at)), 60,
                    "shard 1's first merge after its restart")
    back_at = min(m["t"] for m in back)
    shard0 = ray.get_actor("islands:syncer", namespace=NAMESPACE)
    during = [m for m in ray.get(shard0.recent_merges.remote(killed_at)) if m["t"] < back_at]
    assert during, f"no shard-0 merge while shard 1 was out ({back_at - killed_at:.1f} s)"
    assert {m["fragment"] for m in during} <= set(rows[0]["fragments"])

    # Snapshots at every merge and the learners' adopted copies: no version goes back.
    after = snap()["syncer"]["versions"]
    assert all(a >= b for a, b in zip(after, before, strict=True)), (before, after)
    merges = shard_rows(snap())[1]["merges"]
    wait_for(lambda: shard_rows(snap())[1]["merges"] > merges + 2, 60, "shard 1 merging again")
    final = snap()
    assert all(a >= b for a, b in zip(final["syncer"]["versions"], after, strict=True))
    assert final["learner_states"].get("training") == 2   # the learners never restarted
