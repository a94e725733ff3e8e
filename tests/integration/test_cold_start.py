"""A cold start as KubeRay makes it, and the unattended re-run after it, on a real local cluster.

KubeRay submits the job once the head is up, while a region's worker pods may still be starting:
the job waits for them (bounded by ``health.placement_timeout_s``, saying what is short), then
fails naming the region, in one line with rc 1 from the CLI. A re-run on the same persistent run
dir (``--resume-or-start``, the chart's entrypoint) resumes the first run.

A node joining mid-wait (a region's node 20 s after the job started, the job waiting and then
training on it) is tests/integration/test_job_submit.py, against a `ray start` head: a second node
joins a cluster on this machine only with multi-node Ray on, which the suite's in-process clusters
keep off.
"""

import json
import os
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from conftest import TINY_JOB  # noqa: E402

from islands.orchestrator.config import parse  # noqa: E402
from islands.orchestrator.job import CapacityError, run_job  # noqa: E402


@pytest.fixture(scope="module")
def cluster(shared_ray):
    """A cluster the job joins (not one it starts): region a is there, region "never" never
    comes."""
    yield


def test_a_region_that_never_comes_fails_after_the_wait_naming_it(cluster, tmp_path, capsys):
    config = parse({**TINY_JOB, "name": "cold-never",
                    "regions": {"a": {"learners": 2}, "never": {"learners": 1}},
                    "health": {"placement_timeout_s": 4}})
    t0 = time.monotonic()
    with pytest.raises(CapacityError, match=r"^region 'never' needs 1 'region:never' resources, "
                                            r"the cluster has 0.* \(waited [45]s for nodes to "
                                            r"join"):
        run_job(config, duration_s=5, run_dir=str(tmp_path / "run"))
    assert time.monotonic() - t0 >= 4
    out = capsys.readouterr().out
    assert ("islands: waiting for capacity (0s of 4s): region 'never' needs 1 'region:never' "
            "resources, the cluster has 0") in out
    assert "region 'a'" not in out   # only what is short


def test_the_cli_ends_a_capacity_wait_with_one_line_and_rc_1(cluster, tmp_path, capsys):
    from islands.orchestrator.cli import main

    (tmp_path / "job.yaml").write_text(json.dumps({
        **TINY_JOB, "name": "cold-cli", "regions": {"never": {"learners": 1}},
        "health": {"placement_timeout_s": 2}}))
    rc = main(["run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run"),
               "--duration", "5"])
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.err.startswith("islands: region 'never' needs 1 'region:never' resources")
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


# Slow: two jobs (~25 s); the choice is tests/unit/test_run_dir.py's, a resume test_resume.py's.
@pytest.mark.slow
def test_a_rerun_on_a_persistent_run_dir_resumes(cluster, tmp_path, capsys):
    config = parse({**TINY_JOB, "name": "cold-rerun"})
    run_dir = str(tmp_path / "run")   # the chart's persistent run dir (storage.existingClaim)
    first = run_job(config, duration_s=20, run_dir=run_dir, resume_or_start=True,
                    until=lambda snap: (snap["syncer"]["merges"] or 0) >= 8)
    out = capsys.readouterr().out
    assert f"islands: starting a new run in {run_dir}" in out
    assert "waiting for capacity" not in out   # the nodes were there
    assert first["merges"] > 0
    # The RayJob's retry, or a re-install: the same command on the same run dir.
    second = run_job(config, duration_s=12, run_dir=run_dir, resume_or_start=True,
                     until=lambda snap: (snap["syncer"]["merges"] or 0) >= first["merges"] + 4)
    assert f"islands: resuming the run in {run_dir}" in capsys.readouterr().out
    assert second["merges"] > first["merges"]
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    started = [e for e in events if e["event"] == "syncer_started"]
    assert started[-1]["restored_from"] is not None
