"""The run dir's event log and the structured log lines are the same events."""

import json

from islands.orchestrator.job import RunDir, progress_line

EVENTS = [
    {"t": 100.0, "elapsed_s": 1.5, "event": "learner_failed", "learner": "us-east:1",
     "cause": "crash"},
    {"t": 101.0, "elapsed_s": 2.5, "event": "learner_restarted", "learner": "us-east:1",
     "incarnation": 1},
]


def test_json_log_lines_are_the_events_jsonl_lines(tmp_path, capsys):
    run = RunDir(str(tmp_path), log_format="json")
    run.add_events(EVENTS)
    run.close()
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    stored = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert logged == stored == EVENTS


def test_text_log_lines_name_the_event_and_its_fields(tmp_path, capsys):
    run = RunDir(str(tmp_path))
    run.add_events(EVENTS[:1])
    run.close()
    line = capsys.readouterr().err.strip()
    assert line == "event     1.5s learner_failed learner=us-east:1 cause=crash"


def test_progress_line():
    snap = {"elapsed_s": 12.25, "syncer": {"merges": 40}, "tokens": {"applied": 123456},
            "train_loss": 2.5, "eval_loss": None, "goodput": {"goodput": 0.9312},
            "alive": 3, "total": 4, "paused_reason": None}
    assert progress_line(snap) == ("[   12.2s] merges    40  tokens applied   123,456  train 2.500  "
                                   "eval -  goodput 0.931  learners 3/4")


# -- a new job never reuses (or deletes) a run dir holding an earlier run ---------------------------

import os  # noqa: E402

import pytest  # noqa: E402

from islands.orchestrator import job  # noqa: E402
from islands.orchestrator.config import parse  # noqa: E402
from islands.orchestrator.job import RunDirError, prepare_run_dir  # noqa: E402


def earlier_run(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "events.jsonl").write_text('{"event": "job_started"}\n')
    (path / "summary.json").write_text('{"merges": 7}')
    return sorted(os.listdir(path))


def test_an_absent_or_empty_or_unrelated_run_dir_is_used_as_it_is(tmp_path):
    assert prepare_run_dir(str(tmp_path / "new"), False, False) == str(tmp_path / "new")
    assert prepare_run_dir(str(tmp_path), False, False) == str(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "jax_cache").mkdir()
    assert prepare_run_dir(str(tmp_path), False, False) == str(tmp_path)


@pytest.mark.parametrize("marker", ["events.jsonl", "metrics.jsonl", "summary.json"])
def test_a_run_dir_holding_a_run_is_refused_without_a_flag(tmp_path, marker):
    (tmp_path / marker).write_text("{}\n")
    with pytest.raises(RunDirError) as info:
        prepare_run_dir(str(tmp_path), resume=False, force=False)
    message = str(info.value)
    assert str(tmp_path) in message and marker in message
    assert "--resume" in message and "--force" in message
    assert (tmp_path / marker).read_text() == "{}\n"


def test_syncer_snapshots_alone_mark_a_run(tmp_path):
    (tmp_path / "syncer" / "40").mkdir(parents=True)
    with pytest.raises(RunDirError, match="syncer/ snapshots"):
        prepare_run_dir(str(tmp_path), False, False)


def test_resume_continues_the_same_dir(tmp_path):
    before = earlier_run(tmp_path)
    assert prepare_run_dir(str(tmp_path), resume=True, force=False) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(RunDirError, match="holds no earlier run"):
        prepare_run_dir(str(tmp_path / "nothing"), resume=True, force=False)


def test_force_starts_a_new_subdirectory_and_deletes_nothing(tmp_path):
    before = earlier_run(tmp_path)
    first = prepare_run_dir(str(tmp_path), resume=False, force=True)
    second = prepare_run_dir(str(tmp_path), resume=False, force=True)
    assert os.path.dirname(first) == os.path.dirname(second) == str(tmp_path)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    assert os.listdir(first) == [] and (tmp_path / "summary.json").read_text() == '{"merges": 7}'
    assert set(before) <= set(os.listdir(tmp_path))


def test_resume_and_force_together_are_refused(tmp_path):
    with pytest.raises(RunDirError, match="not both"):
        prepare_run_dir(str(tmp_path), resume=True, force=True)


def test_a_file_is_not_a_run_dir(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(RunDirError, match="not a directory"):
        prepare_run_dir(str(tmp_path / "f"), False, False)


def test_run_dir_appends_and_keeps_the_earlier_summary(tmp_path, capsys):
    earlier_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"old": 1}\n')
    run = RunDir(str(tmp_path))
    run.add_events(EVENTS[:1])
    run.add_snapshot({"new": 2})
    run.write_summary({"merges": 9})
    run.write_summary({"merges": 10})
    run.close()
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    assert events[0] == '{"event": "job_started"}' and len(events) == 2
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"old": 1}', '{"new": 2}']
    assert json.loads((tmp_path / "summary.json").read_text()) == {"merges": 10}
    assert json.loads((tmp_path / "summary.1.json").read_text()) == {"merges": 7}
    assert json.loads((tmp_path / "summary.2.json").read_text()) == {"merges": 9}


def test_a_user_checkpoint_dir_holding_this_jobs_snapshots_is_refused(tmp_path):
    config = parse({"name": "demo", "syncer": {"checkpoint_dir": str(tmp_path / "ckpt")}})
    (tmp_path / "ckpt" / "demo" / "12").mkdir(parents=True)
    with pytest.raises(RunDirError, match="syncer.checkpoint_dir") as info:
        job.check_snapshot_dir(config, str(tmp_path / "run"), resume=False)
    assert str(tmp_path / "ckpt" / "demo") in str(info.value)
    job.check_snapshot_dir(config, str(tmp_path / "run"), resume=True)
    other = parse({"name": "other", "syncer": {"checkpoint_dir": str(tmp_path / "ckpt")}})
    job.check_snapshot_dir(other, str(tmp_path / "run"), resume=False)


def test_run_job_refuses_a_used_run_dir_before_ray_starts(tmp_path, monkeypatch):
    import ray

    before = earlier_run(tmp_path)
    monkeypatch.setattr(job, "start_ray", lambda *a, **k: pytest.fail("Ray must not start"))
    with pytest.raises(RunDirError, match=str(tmp_path)):
        job.run_job(parse({}), duration_s=1, run_dir=str(tmp_path), quiet=True)
    assert sorted(os.listdir(tmp_path)) == before
    assert not ray.is_initialized()


class _Remote:
    """A stand-in for an actor method: ``.remote(*args)`` records the call, returns the value."""

    def __init__(self, calls, name, value):
        self.calls, self.name, self.value = calls, name, value

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return self.value


class _FakeController:
    def __init__(self, calls):
        snap = {"elapsed_s": 0.0, "syncer": {}, "tokens": {"applied": 0}, "goodput":
                {"goodput": 0.0}, "alive": 0, "total": 0}
        for name, value in (("start", None), ("serve_metrics", 9400), ("events_since", ([], 0)),
                            ("snapshot", snap), ("shutdown", {"merges": 0})):
            setattr(self, name, _Remote(calls, name, value))


@pytest.mark.parametrize("resume,embedded,host,expected_host", [
    (False, True, None, "127.0.0.1"), (True, False, "10.1.2.3", "10.1.2.3")])
def test_run_job_hands_resume_to_the_controller_and_a_host_to_serve_metrics(
        tmp_path, monkeypatch, resume, embedded, host, expected_host):
    import ray

    calls = []
    if resume:
        earlier_run(tmp_path)
    monkeypatch.setattr(job, "start_ray", lambda config, address: embedded)
    monkeypatch.setattr(job, "check_capacity", lambda config: None)
    monkeypatch.setattr(job, "wait_for_capacity", lambda config, timeout_s, **kw: None)
    monkeypatch.setattr(job, "_kill_job_actors", lambda controller: None)
    monkeypatch.setattr(job, "_forget_embedded_address", lambda: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)

    class _Actor:
        def options(self, **options):
            return self

        def remote(self, *args, **kwargs):
            calls.append(("Controller", args, kwargs))
            return _FakeController(calls)

    monkeypatch.setattr(ray, "remote", lambda cls: _Actor())
    config = parse({"metrics": {"host": host} if host else {},
                    "run": {"progress_every_s": 1.0}})
    job.run_job(config, duration_s=0.01, run_dir=str(tmp_path), quiet=True, resume=resume)
    (name, args, kwargs), = [c for c in calls if c[0] == "Controller"]
    assert args == (config, os.path.abspath(str(tmp_path))) and kwargs == {"resume": resume}
    (_, args, _), = [c for c in calls if c[0] == "serve_metrics"]
    assert args == (9400, expected_host)


def test_resume_or_start_starts_a_first_run_and_resumes_a_later_one(tmp_path):
    from islands.orchestrator.job import resumable

    path = tmp_path / "run"
    assert not resumable(str(path))                         # nothing yet: a first run starts
    assert prepare_run_dir(str(path), resume=False) == str(path)
    (path / "events.jsonl").write_text("{}\n")
    assert resumable(str(path))                             # a retry finds it and continues
    assert prepare_run_dir(str(path), resume=True) == str(path)


def test_a_run_dir_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path):
    import os

    if os.geteuid() == 0:   # root writes anywhere: a file where a directory must go instead
        blocked = tmp_path / "file"
        blocked.write_text("mine")
        target = blocked / "run"
    else:
        blocked = tmp_path / "ro"
        blocked.mkdir(mode=0o500)
        target = blocked / "run"
    with pytest.raises(RunDirError, match="cannot be created or written"):
        prepare_run_dir(str(target), False, False)
    assert blocked.exists()


def test_the_job_waits_for_regions_that_join_later_and_gives_up_naming_them():
    """KubeRay submits the job once the head is up; TPU worker pods may still be provisioning.
    The job waits (bounded by health.placement_timeout_s, saying what it waits for) instead of
    failing at once. A fake clock: the nodes of region a join at t = 20 s."""
    from islands.orchestrator.config import parse
    from islands.orchestrator.job import wait_for_capacity

    config = parse({"name": "j", "regions": {"a": {"learners": 2}}})
    now = [0.0]
    said = []

    def read():   # (cluster_resources(), nodes()) as Ray would answer at the fake time
        return ({"CPU": 2.0, "region:a": 2.0 if now[0] >= 20.0 else 0.0}, [])

    def sleep(s):
        now[0] += s

    wait_for_capacity(config, 60.0, read=read, sleep=sleep, clock=lambda: now[0],
                      say=lambda line, **_: said.append(line))
    assert now[0] == 20.0
    assert said[0].startswith("islands: waiting for capacity (0s of 60s): region 'a' needs 2")
    assert len(said) == 3   # waiting at 0 s and at 10 s, then the all-clear at 20 s
    assert said[-1] == "islands: the cluster holds every region after 20s"
    # Never joining: the same message, once the timeout is spent.
    now[0] = 0.0
    with pytest.raises(RuntimeError, match=r"region 'a' needs 2 .* \(waited 15s for nodes"):
        wait_for_capacity(config, 15.0, read=lambda: ({"CPU": 2.0}, []), sleep=sleep,
                          clock=lambda: now[0], say=lambda *a, **k: None)
