"""A whole `islands run` (embedded Ray cluster, run dir) under a scripted chaos plan: a lost region
with a repair delay, a degraded and a partitioned link, a slowdown and a syncer kill. Every planned
fault fires, the job keeps training through all of them, and the books balance."""

import json

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from islands.orchestrator.config import parse  # noqa: E402
from islands.orchestrator.job import run_job  # noqa: E402

REPAIR_S = 4.0

CONFIG = {
    "name": "chaos-itest",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
    "data": {"max_bytes": 300_000, "batch_size": 4, "eval_batches": 2},
    "learner": {"min_step_time_s": 0.05, "eval_every_s": 5.0},
    "syncer": {"fragments": 2, "sync_every_steps": 4, "overlap_steps": 1,
               "snapshot_every_merges": 5},
    "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
    "compression": {"type": "int4"},
    "regions": {"a": {"learners": 2, "latency_ms": 5}, "b": {"learners": 1, "latency_ms": 5}},
    "health": {"heartbeat_s": 0.5, "timeout_s": 8.0,
               "restart": {"backoff_initial_s": 0.2}},
    "metrics": {"enabled": False},
    "run": {"dashboard": False},
    "chaos": {"seed": 7, "events": [
        {"type": "network", "target": "a", "at_s": 4, "duration_s": 4,
         "extra_latency_ms": 300, "bandwidth_gbps": 0.01},
        {"type": "slowdown", "target": "a:1", "at_s": 5, "duration_s": 3, "factor": 3},
        {"type": "region_loss", "target": "b", "at_s": 8, "repair_s": REPAIR_S},
        {"type": "partition", "target": "a", "at_s": 14, "duration_s": 2},
        {"type": "kill", "target": "syncer", "at_s": 20},
    ]},
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chaos-run")
    summary = run_job(parse(CONFIG), duration_s=40, run_dir=str(run_dir), quiet=True)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return run_dir, summary, events


def test_every_planned_fault_fired_and_training_went_on(finished_run):
    run_dir, summary, events = finished_run
    fired = summary["chaos_fired"]
    assert [f["kind"] for f in fired] == ["network", "slowdown", "region_loss", "partition",
                                          "syncer_kill"]
    assert not [f for f in fired if f["message"].startswith("not fired")], fired
    # The lost region's learner failed, waited for its repair, and came back to contribute.
    failed = [e for e in events if e["event"] == "learner_failed" and e["learner"] == "b:0"]
    restarted = [e for e in events if e["event"] == "learner_restarted" and e["learner"] == "b:0"]
    assert failed and restarted
    assert restarted[0]["elapsed_s"] - failed[0]["elapsed_s"] >= REPAIR_S - 1.0
    assert any(e["event"] == "learner_recovered" and e["learner"] == "b:0" for e in events)
    # The syncer came back with a new epoch, and merges continued after it.
    assert summary["syncer_epoch"] == 1 and summary["syncer_restarts"] == 1
    restart_at = next(e["elapsed_s"] for e in events
                      if e["event"] == "syncer_started" and e["epoch"] == 1)
    assert summary["merges"] > 0 and restart_at < summary["duration_s"]


def test_summary_and_books(finished_run):
    run_dir, summary, events = finished_run
    for key in ("goodput", "tokens_applied", "tokens_dropped", "merges", "learner_restarts",
                "wire_bytes", "initial_eval_loss", "final_eval_loss", "duration_s", "learners",
                "regions"):
        assert key in summary, key
    assert json.loads((run_dir / "summary.json").read_text())["merges"] == summary["merges"]
    assert 0.0 < summary["goodput"] < 1.0  # a lost region costs goodput
    assert summary["learner_restarts"] >= 1 and summary["tokens_applied"] > 0
    assert (summary["tokens_applied"] + summary["tokens_dropped"] + summary["tokens_in_flight"]
            == summary["tokens_processed"])
    assert summary["regions"]["a"]["wire_bytes_up"] > 0 and summary["wire_bytes"] > 0
    metrics_lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(metrics_lines) >= 5
    kinds = {e["event"] for e in events}
    assert {"job_started", "chaos", "learner_failed", "syncer_failed", "job_stopped"} <= kinds
