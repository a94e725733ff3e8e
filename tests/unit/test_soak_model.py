"""The soak's prediction charges each start what the service paid for that kind of start, in the
state the service spent it in (``benchmarks/soak.py``: ``start_charges``, ``measured_costs``;
the in-process fleet's ``restart_wait_s``)."""

from __future__ import annotations

import doctest
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import soak  # noqa: E402

from islands.orchestrator.virtual_fleet import Fleet  # noqa: E402


def _restart(events, t, who, inc, wait, start, spare=None, prestarted=True):
    events.append(dict(t=t, event="learner_failed", learner=who))
    if spare and prestarted:
        events.append(dict(t=t, event="spare_launched", learner=who, spare=spare))
    events.append(dict(t=t + wait, event="learner_restarted", learner=who, incarnation=inc,
                       **({"spare": spare} if spare else {})))
    events.append(dict(t=t + wait + start, event="learner_ready", learner=who, incarnation=inc))


def test_doctests():
    assert doctest.testmod(soak).failed == 0


def test_prestarted_restarts_are_the_models_restarts_split_into_wait_and_start():
    events = [dict(t=0.0, event="spare_launched", spare="pool")]   # a warm spare of the region
    _restart(events, 10.0, "a:0", 1, wait=4.0, start=0.5, spare="s1")
    _restart(events, 20.0, "a:0", 2, wait=6.0, start=1.5, spare="s2")
    _restart(events, 40.0, "a:1", 1, wait=0.1, start=9.0)                       # a new process
    _restart(events, 60.0, "a:1", 2, wait=0.0, start=0.4, spare="pool", prestarted=False)
    costs = soak.measured_costs(events)
    # Every restart without a ready warm spare: its start after the mean wait.
    assert costs["restart_samples_s"] == (0.5, 1.5, 9.0)
    assert abs(costs["restart_wait_s"] - (4.0 + 6.0 + 0.1) / 3) < 1e-9
    # A ready warm spare's promotion: the whole failure -> ready.
    assert costs["promote_samples_s"] == (0.4,)
    kinds = [c["how"] for c in soak.start_charges(events)]
    assert kinds == ["prestarted", "prestarted", "new", "spare"]


def test_an_attempt_killed_before_it_was_ready_is_no_sample():
    events = []
    _restart(events, 0.0, "b:0", 1, wait=3.0, start=0.5, spare="s1")
    events[-1] = dict(t=3.2, event="learner_failed", learner="b:0")   # killed while starting
    _restart(events, 3.2, "b:0", 2, wait=2.0, start=0.7, spare="s2")
    events.pop(-4)   # that failure is the one the next restart answers
    assert [(c["seconds"], c["wait_s"]) for c in soak.start_charges(events)] == [(2.7, 2.0)]


def test_the_virtual_fleet_waits_its_restart_wait_before_each_start():
    settings = Fleet([1.0, 1.0], regions=["a", "a"], restart_wait_s=4.2).settings(
        ["a:0", "a:1"], 1)
    policy = settings.policy
    assert policy.backoff_initial_s == policy.backoff_max_s == 4.2
    assert policy.backoff_multiplier == 1.0
    assert Fleet([1.0], regions=["a"]).settings(["a:0"], 1).policy.backoff_max_s == 0.0


def test_a_restart_still_under_way_at_the_end_is_censored_there():
    # Too busy a machine: no restart finishes. The model must charge them to the end, not
    # fall back to a flat guess.
    events = [dict(t=0.0, event="learner_failed", learner="a:0"),
              dict(t=0.0, event="spare_launched", learner="a:0", spare="s1"),
              dict(t=5.0, event="learner_failed", learner="a:1"),
              dict(t=5.0, event="spare_launched", learner="a:1", spare="s2"),
              dict(t=50.0, event="learner_restarted", learner="a:1", incarnation=1, spare="s2"),
              dict(t=100.0, event="learner_retired", learner="a:0", reason="stopped"),
              dict(t=100.0, event="job_stopped")]
    charges = soak.start_charges(events)
    assert sorted((c["how"], c["seconds"], c["wait_s"]) for c in charges) == [
        ("unfinished", 95.0, 45.0), ("unfinished", 100.0, 100.0)]
    costs = soak.measured_costs(events)
    assert sorted(costs["restart_samples_s"]) == [0.0, 50.0] and costs["restart_wait_s"] == 72.5


def _titled(pid: int, title: str, timeout_s: float = 10.0) -> None:
    """Waits until process ``pid`` carries ``title`` (its shell has exec'd)."""
    import time

    import psutil

    deadline = time.time() + timeout_s
    while " ".join(psutil.Process(pid).cmdline()).split(" ")[0] != title:
        assert time.time() < deadline, f"pid {pid} never titled {title}"
        time.sleep(0.02)


def _started_after(pid: int, timeout_s: float = 10.0):
    """A new process (titled as one of the job's actors) whose start, in clock ticks, is later
    than process ``pid``'s: started again until it is (two can start in one tick)."""
    import subprocess
    import time

    deadline = time.time() + timeout_s
    while True:
        proc = subprocess.Popen(["bash", "-c", 'exec -a "ray::LearnerUnit.run" sleep 60'])
        if soak.start_ticks(proc.pid) > soak.start_ticks(pid):
            return proc
        proc.kill()
        proc.wait()
        assert time.time() < deadline, "no later process start"


def test_the_leak_check_counts_this_runs_processes_and_lists_older_ones_apart():
    """A process titled as a job's actor is this run's leak if it started at or after the run's
    driver; one started before (an earlier test's cluster left it, reparented away) is listed
    apart, with its parent, and not counted. An idle worker and a zombie are never counted."""
    import subprocess

    # An older one: an orphan, its parent shell exits at once.
    older_pid = int(subprocess.run(
        ["bash", "-c", '(exec -a "ray::Syncer.run" sleep 60) >/dev/null 2>&1 & echo $!'],
        capture_output=True, text=True, check=True).stdout)
    idle = subprocess.Popen(["bash", "-c", 'exec -a "ray::IDLE" sleep 60'])
    ours = None
    try:
        _titled(older_pid, "ray::Syncer.run")
        _titled(idle.pid, "ray::IDLE")
        ours = _started_after(older_pid)
        _titled(ours.pid, "ray::LearnerUnit.run")
        since = soak.start_ticks(ours.pid)   # "the driver" started with it
        mine = {str(p) for p in (older_pid, idle.pid, ours.pid)}   # the machine may hold others
        pids = lambda found: [f.split()[1] for f in found if f.split()[1] in mine]  # noqa: E731
        counted, older = soak.job_processes(since)
        assert pids(counted) == [str(ours.pid)], counted
        assert any(f.startswith(f"pid {ours.pid} ray::LearnerUnit.run") for f in counted)
        assert pids(older) == [str(older_pid)], older
        ours.kill()
        ours.wait()   # reaped: gone
        assert pids(soak.leaked_processes(since, timeout_s=5.0)[0]) == []
        ours2 = subprocess.Popen(["bash", "-c", 'exec -a "ray::Controller.run" sleep 60'])
        _titled(ours2.pid, "ray::Controller.run")
        mine.add(str(ours2.pid))
        ours2.kill()   # not reaped yet: a zombie, which has ended
        assert pids(soak.leaked_processes(since, timeout_s=5.0)[0]) == []
        ours2.wait()
    finally:
        for p in [idle] + ([ours] if ours else []):
            p.kill()
            p.wait()
        os.kill(older_pid, 9)
