"""`islands run --resume`: a stopped job continues from its newest snapshot in the same run dir
(the loss goes on where it stopped, merges and the data resume point too); without a flag the
run dir is refused and nothing in it changes."""

import json
import os

import pytest

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]

from islands.orchestrator.job import RunDirError, run_job  # noqa: E402

def test_resume_continues_where_the_job_stopped(tmp_path, tiny_job):
    config = tiny_job("resume-itest")
    run_dir = str(tmp_path / "run")
    # Each run ends on progress, not a fixed length (its duration is the cap).
    first = run_job(config, duration_s=20, run_dir=run_dir, quiet=True,
                    until=lambda snap: (snap["syncer"]["merges"] or 0) >= 12)
    assert first["merges"] > 0 and first["final_eval_loss"] < first["initial_eval_loss"]
    listing = sorted(os.listdir(run_dir))
    with pytest.raises(RunDirError, match="--resume"):
        run_job(config, duration_s=5, run_dir=run_dir, quiet=True)
    assert sorted(os.listdir(run_dir)) == listing  # refused before anything was written

    second = run_job(config, duration_s=15, run_dir=run_dir, quiet=True, resume=True,
                     until=lambda snap: (snap["syncer"]["merges"] or 0) >= first["merges"] + 6)
    # No jump back to the initial loss: the resumed job starts from the first one's model.
    assert second["initial_eval_loss"] == pytest.approx(first["final_eval_loss"], rel=0.02)
    assert second["merges"] > first["merges"]  # versions continue from the snapshot
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    started = [e for e in events if e["event"] == "syncer_started"]
    assert started[-1]["restored_from"] == first["merges"]
    resumed = [e for e in events if e["event"] == "learner_launched"][-2:]
    assert all(e["resume_step"] > 0 for e in resumed)
    assert os.path.exists(os.path.join(run_dir, "summary.1.json"))  # the first summary is kept
