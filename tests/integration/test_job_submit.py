"""`ray job submit` of a short demo job, and of the user's custom-task example shipped with
--working-dir, against a real local head node (`ray start --head`)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB_YAML = """
name: submitted
model: {d_model: 32, n_layers: 1, n_heads: 2, d_ff: 64, seq_len: 32}
data: {max_bytes: 200000, batch_size: 4, eval_batches: 2}
learner: {min_step_time_s: 0.05, eval_every_s: 5.0}
syncer: {fragments: 2, sync_every_steps: 4, overlap_steps: 1}
regions:
  us-east: {learners: 1}
  eu-west: {learners: 1}
metrics: {enabled: false}
"""


def ray_cli(*args, env, timeout=120, check=True):
    # Ray's CLI under this test's own interpreter: the head's workers then run it too (a `ray`
    # found on PATH may belong to another Python, with another islands installed).
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=check)


def _stop_session(proc: subprocess.Popen) -> None:
    """Stops the head this test started, and only it: `ray start --block` runs in a session of
    its own, and every Ray process it started is in that session (``ray stop`` would kill every
    Ray cluster on the machine)."""
    if proc.poll() is None:
        # A graceful stop took ~30 s here (and SIGTERM then 5 s more, every time); nothing of
        # this throwaway head needs keeping.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_started(proc: subprocess.Popen, log_path, timeout_s: float = 180) -> None:
    """`ray start --block` prints "Ray runtime started" once the head (and its job agent) is up."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = open(log_path).read()
        if "Ray runtime started" in text:
            return
        if proc.poll() is not None:
            pytest.fail("ray start exited: " + text[-3000:])
        time.sleep(0.5)
    pytest.fail("ray start did not finish starting: " + open(log_path).read()[-3000:])


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    # A private HOME: ray start writes its auth token to ~/.ray/auth_token, job submit reads it.
    # Multi-node on: a region's node joins this head in one test (the suite turns it off so a
    # local cluster stays on loopback; with it on, both nodes still bind 127.0.0.1 as told).
    env = {**os.environ, "HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    # A fresh head makes its own token; a ray.init earlier in this process left
    # RAY_AUTH_MODE=token behind, which would make `ray start` demand an existing one.
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    log = open(home / "ray-start.log", "w")
    gcs_port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus", "3", "--node-ip-address", "127.0.0.1",
         "--port", str(gcs_port), "--dashboard-host", "127.0.0.1", "--dashboard-port", "8299",
         # free ports of its own: another Ray cluster on this machine may hold the defaults
         "--dashboard-agent-listen-port", str(_free_port()),
         "--dashboard-agent-grpc-port", str(_free_port()),
         "--metrics-export-port", str(_free_port()),
         "--resources", json.dumps({"region:us-east": 1, "region:eu-west": 1}),
         "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        _wait_until_started(proc, home / "ray-start.log")
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs_port}"}
    finally:
        _stop_session(proc)
        log.close()


def submit(env, working_dir, *run_args):
    """`ray job submit` of `islands run job.yaml` from ``working_dir``. The head's job agent may
    still be starting after the head is up: it says so, and we ask again (for up to 2 minutes)."""
    deadline = time.time() + 120
    while True:
        result = ray_cli("job", "submit", "--address", "http://127.0.0.1:8299",
                         "--working-dir", str(working_dir), "--",
                         sys.executable, "-m", "islands.orchestrator.cli", "run", "job.yaml",
                         *run_args, env=env, timeout=400, check=False)
        if "No available agent" not in result.stderr or time.time() > deadline:
            return result
        time.sleep(2)


def test_ray_job_submit_runs_the_job(head, tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "job.yaml").write_text(JOB_YAML)
    run_dir = tmp_path / "run"
    t0 = time.time()
    result = submit(head, job_dir, "--duration", "13", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in (result.stdout + result.stderr).lower()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["merges"] > 0
    assert summary["tokens_applied"] > 0
    assert set(summary["regions"]) == {"us-east", "eu-west"}
    assert time.time() - t0 < 400


@pytest.mark.slow  # a second submission, about 30 s; the custom task's own path is tests/integration/test_task_service.py
def test_ray_job_submit_trains_the_custom_task_example(head, tmp_path):
    """examples/custom_task/ travels as the job's working_dir (a runtime_env): the learners
    import my_task from it, the MSE falls, and the export restores with plain orbax."""
    example = os.path.join(REPO, "examples", "custom_task")
    run_dir = tmp_path / "run"
    result = submit(head, example, "--duration", "12", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["merges"] > 0
    assert summary["final_eval_loss"] < 0.5 * summary["initial_eval_loss"]
    import orbax.checkpoint as ocp

    params = ocp.StandardCheckpointer().restore(str(run_dir / "export" / "params"))
    assert set(params) == {"layer1", "layer2"} and params["layer1"]["w"].shape == (3, 32)


def _job_logs(env, job_id: str) -> str:
    return ray_cli("job", "logs", "--address", "http://127.0.0.1:8299", job_id, env=env,
                   check=False).stdout


@pytest.mark.slow  # a second node joins: about 90 s on 2 cores
def test_a_submitted_job_waits_for_region_nodes_that_join_later_then_trains(head, tmp_path):
    """The cold start KubeRay makes: the job is submitted while a region's nodes are still on
    their way. It waits (saying for what), the region's node joins once it said so, and the job
    trains on it."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "job.yaml").write_text(JOB_YAML.replace(
        "  eu-west: {learners: 1}\n", "  eu-west: {learners: 1}\n  late: {learners: 1}\n")
        + "health: {placement_timeout_s: 150}\n")
    run_dir = tmp_path / "run"
    submitted = ray_cli("job", "submit", "--no-wait", "--address", "http://127.0.0.1:8299",
                        "--working-dir", str(job_dir), "--", sys.executable, "-m",
                        "islands.orchestrator.cli", "run", "job.yaml", "--duration", "15",
                        "--run-dir", str(run_dir), env=head, check=False)
    found = re.search(r"raysubmit_\w+", submitted.stdout + submitted.stderr)
    assert found, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    job_id = found.group(0)
    wait_for(lambda: "waiting for capacity" in _job_logs(head, job_id), 120,
             "the job to say it waits for region 'late'", every_s=1.0)
    assert "region 'late' needs 1 'region:late' resources" in _job_logs(head, job_id)
    # The region's node comes while the job waits (a TPU pod still provisioning).
    home = head["HOME"]
    log = open(os.path.join(home, "late-node.log"), "w")
    node = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--address",
         head["RAY_ADDRESS"], "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
         "--dashboard-agent-listen-port", str(_free_port()),
         "--dashboard-agent-grpc-port", str(_free_port()),
         "--metrics-export-port", str(_free_port()),
         "--resources", json.dumps({"region:late": 1}), "--disable-usage-stats"],
        env=head,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_started(node, os.path.join(home, "late-node.log"))
        from ray.job_submission import JobStatus, JobSubmissionClient

        jobs = JobSubmissionClient("http://127.0.0.1:8299")
        status = wait_for(lambda: (s := jobs.get_job_status(job_id)).is_terminal() and s, 300,
                          "the job to end", every_s=2.0,
                          describe=lambda: _job_logs(head, job_id)[-3000:])
        logs = _job_logs(head, job_id)
        assert status == JobStatus.SUCCEEDED, logs[-3000:]
        assert re.search(r"the cluster holds every region after (\d+)s", logs), logs[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert set(summary["regions"]) == {"us-east", "eu-west", "late"}
        assert summary["merges"] > 0 and summary["tokens_applied"] > 0
        events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
        late_started = [e for e in events if e.get("learner", "").startswith("late")]
        assert late_started, "the late region's learner never appeared in the events"
    finally:
        _stop_session(node)
        log.close()
