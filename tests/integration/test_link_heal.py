"""The region agent heals itself, and leaves when its home is gone — two loopback clusters.

The same two clusters as ``test_link.py`` (its module fixture, a home and one remote region, each
with one learner). Asserted: an agent actor killed mid-run is restarted by Ray in its own cluster
and re-attaches to its running learner (the same process and incarnation, still merging); the
home restarts nothing, its merged versions keep growing and its books balance. A pause at home
holds across an agent restart; a learner that died while its agent was down is relaunched. An
agent Ray no longer restarts fails its ``join`` (rc 1) after ending its learner. Then the home
is killed without a word: a joined agent stops its learner and exits within
``link.agent_home_timeout_s`` (20 s here), leaving no Ray daemon behind.
"""

import json
import os
import subprocess
import time

import pytest

from test_link import (ISLANDS, _home_events, _home_rows, _ray_processes_of,  # noqa: F401
                       _lose_machine, _start_region, _stop_all, _wait_line, two_clusters)
from waiting import wait_for

ray = pytest.importorskip("ray")

# Slow (two clusters and four agent restarts: about 2 minutes on 2 cores): `python -m pytest -m slow tests`.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _far(row):
    return row.get("learners", {}).get("far:0", {})


def _merged(row):
    return sum(row.get("syncer", {}).get("versions") or [])


def _agent_restarts(agent) -> int:
    """How many times Ray restarted the agent so far (its newest ``controller_restarted``)."""
    return max([e["restarts"] for e in ray.get(agent.events_since.remote(0), timeout=60)[0]
                if e["event"] == "controller_restarted"], default=0)


def _restarted(agent, restarts: int):
    """The agent's ``controller_restarted`` event of its ``restarts``-th restart, once up (a
    call made while Ray restarts it waits for it)."""
    return next((e for e in ray.get(agent.events_since.remote(0), timeout=180)[0]
                 if e["event"] == "controller_restarted" and e["restarts"] == restarts), None)


def test_a_killed_agent_comes_back_and_the_home_restarts_nothing(two_clusters):
    ctx = two_clusters
    link, agent, home_dir = ctx["link"], ctx["agent"], ctx["tmp"] / "home"
    learner = ray.get_actor("islands:far:0", namespace="islands")
    status = lambda: ray.get(link.link_status.remote(), timeout=30)  # noqa: E731
    wait_for(lambda: status()["counts"].get("pushes_merged", 0) >= 3, 300, "3 remote merges")
    wait_for(lambda: _far((_home_rows(home_dir) or [{}])[-1]).get("state") == "training", 120,
             "far:0 training at home")
    before = ray.get(learner.ping.remote(), timeout=30)
    at_kill = _home_rows(home_dir)[-1]
    seen = len(_home_events(home_dir))
    restarts = _agent_restarts(agent)

    t_kill = time.time()
    ray.kill(agent, no_restart=False)   # as a crash of its process: Ray restarts it
    restarted = wait_for(lambda: _restarted(agent, restarts + 1), 180,
                         "the region agent restarted")
    back_s = time.time() - t_kill
    print(f"the region agent was back {back_s:.1f}s after it was killed: {restarted}")
    assert restarted["learners_kept"] == ["far:0"] and restarted["relaunched"] == []
    # The same learner process and incarnation, training under the restarted agent.
    after = ray.get(learner.ping.remote(), timeout=30)
    assert (after["pid"], after["incarnation"]) == (before["pid"], before["incarnation"]), after
    table = ray.get(agent.status_table.remote(), timeout=30)
    assert table["learners"]["far:0"]["state"] == "training", table["learners"]
    t_back = time.time()
    wait_for(lambda: (status()["last_merged_s"] or 0) > t_back, 120,
             "a remote merge after the agent came back")

    # The home: far:0 heard from again (its steps go on), merged versions grew, nothing restarted.
    def later_row():
        rows = _home_rows(home_dir)
        return next((r for r in reversed(rows) if _far(r).get("step", 0) > _far(at_kill)["step"]
                     and r["elapsed_s"] > at_kill["elapsed_s"] + back_s + 5), None)

    row = wait_for(later_row, 120, "a home row with far:0 stepping after the agent's restart")
    assert _far(row)["state"] == "training" and _far(row)["incarnation"] == before["incarnation"]
    assert _merged(row) > _merged(at_kill), (_merged(row), _merged(at_kill))
    assert row["tokens"]["balanced"], row["tokens"]
    new = [e for e in _home_events(home_dir)[seen:] if e.get("learner") == "far:0"]
    assert not [e for e in new if e["event"] in ("learner_unhealthy", "learner_failed",
                                                 "learner_restarted", "learner_unreachable",
                                                 "learner_launched")], new
    assert not [e for e in _home_events(home_dir)[seen:]
                if e["event"] in ("learner_restarted", "controller_restarted")]


def _home_address(home) -> str:
    """The home's Ray address, as the daemons of the cluster ``islands run`` started in its
    own session were given it."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != home.pid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    raise AssertionError("no Ray daemon with a --gcs-address in the home's session")


def _at_home(ctx, command: str) -> str:
    """``islands pause`` or ``islands resume`` on the home's cluster."""
    done = subprocess.run(ISLANDS + [command, "--address", _home_address(ctx["home"])],
                          capture_output=True, text=True, env=ctx["env"], cwd=str(ctx["tmp"]),
                          timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


def test_the_homes_pause_holds_across_an_agent_restart(two_clusters):
    """Paused at home, the agent restarts: its learner stays paused (the link passes the home's
    pause on changes only, so the restarted agent takes it from the link), and resumes with
    the home."""
    ctx = two_clusters
    link, agent = ctx["link"], ctx["agent"]
    learner = ray.get_actor("islands:far:0", namespace="islands")
    state = lambda: ray.get(learner.ping.remote(), timeout=30)["state"]  # noqa: E731
    _at_home(ctx, "pause")
    wait_for(lambda: state() == "paused", 60, "far:0 paused with its home", describe=state)
    restarts = _agent_restarts(agent)
    ray.kill(agent, no_restart=False)
    back = wait_for(lambda: _restarted(agent, restarts + 1), 180, "the agent restarted")
    assert back["learners_kept"] == ["far:0"], back
    reason = ray.get(agent.status_table.remote(), timeout=30)["paused_reason"]
    assert reason and reason.startswith("paused at home"), reason
    assert state() == "paused"   # its first step held it before any call could reach it
    t_resume = time.time()
    _at_home(ctx, "resume")
    wait_for(lambda: state() == "training", 60, "far:0 training again with its home",
             describe=state)
    status = lambda: ray.get(link.link_status.remote(), timeout=30)  # noqa: E731
    wait_for(lambda: (status()["last_merged_s"] or 0) > t_resume, 120,
             "a remote merge after the home resumed")


def test_an_agent_restarted_after_its_learner_died_relaunches_it(two_clusters):
    """The learner dies while its agent is down: the restarted agent relaunches it (a new
    incarnation); the home mirrors that from the agent's reports and restarts nothing itself."""
    ctx = two_clusters
    link, agent, home_dir = ctx["link"], ctx["agent"], ctx["tmp"] / "home"
    learner = ray.get_actor("islands:far:0", namespace="islands")
    number = ray.get(learner.ping.remote(), timeout=30)["incarnation"]
    restarts = _agent_restarts(agent)
    seen = len(_home_events(home_dir))
    ray.kill(agent, no_restart=False)
    ray.kill(learner, no_restart=True)   # before the restarted agent looks for it
    back = wait_for(lambda: _restarted(agent, restarts + 1), 180, "the agent restarted")
    assert back["learners_kept"] == [] and back["relaunched"] == ["far:0"], back
    t_back = time.time()
    wait_for(lambda: any(e["event"] == "learner_ready" and e.get("incarnation") == number + 1
                         for e in ray.get(agent.events_since.remote(0), timeout=30)[0]),
             180, f"far:0 incarnation {number + 1} ready")
    status = lambda: ray.get(link.link_status.remote(), timeout=30)  # noqa: E731
    wait_for(lambda: (status()["last_merged_s"] or 0) > t_back, 120,
             "merges from the relaunched learner")
    row = wait_for(lambda: next((r for r in reversed(_home_rows(home_dir))
                                 if _far(r).get("incarnation") == number + 1
                                 and _far(r).get("state") == "training"), None), 120,
                   f"the home's row of far:0 incarnation {number + 1} training")
    assert row["tokens"]["balanced"], row["tokens"]
    new = [e for e in _home_events(home_dir)[seen:] if e.get("learner") == "far:0"]
    kinds = [e["event"] for e in new]
    # Mirrored from the agent's reports: the old incarnation failed there, the new one runs.
    assert "learner_restarted" in kinds, kinds
    failed = [e for e in new if e["event"] == "learner_failed"]
    assert failed and all(e["detail"] == "reported by its region agent" for e in failed), failed
    # None of the home's own: no hang seen, no restart asked of the agent, never unreachable.
    assert not {"learner_unhealthy", "learner_restart_scheduled",
                "learner_unreachable"} & set(kinds), kinds
    # The agent's own books, across its two restarts and a relaunch: balanced.
    books = ray.get(agent.summary.remote(), timeout=60)
    assert books["books_balanced"], books["fragment_tokens"]


def test_an_agent_ray_no_longer_restarts_ends_its_learner_and_the_join_fails(two_clusters):
    """Ray gives up on an agent (its restarts spent; here ``ray.kill`` with no restart): the
    ``join`` process ends its learner and exits 1, for whatever runs it to run it again (a
    RayJob's ``backoffLimit``). Then a new agent joins, for the next test."""
    ctx = two_clusters
    region, home_dir = ctx["region"], ctx["tmp"] / "home"
    address = ray.get_runtime_context().gcs_address
    ray.kill(ctx["agent"], no_restart=True)
    ray.shutdown()   # this process leaves the region's cluster before that cluster ends
    line = _wait_line(region.lines, region, "stopping the learners and leaving", 60)
    assert "the region agent died and Ray no longer restarts it" in line, line
    assert region.wait(timeout=120) == 1
    wait_for(lambda: not _ray_processes_of(address) or None, 30,
             "the failed join's Ray daemons to exit", describe=lambda: _ray_processes_of(address))
    seen = len(_home_events(home_dir))
    ctx["region"], address = _start_region(ctx["join_args"], ctx["env"], ctx["tmp"])
    ray.init(address=address, namespace="islands", log_to_driver=False)
    wait_for(lambda: [e for e in _home_events(home_dir)[seen:] if e.get("learner") == "far:0"
                      and e["event"] == "learner_restarted"], 180,
             "far:0 taken back at home under the new agent")


def test_an_agent_whose_home_is_gone_stops_its_learner_and_exits(two_clusters):
    """The home killed without a word (every process of it, as a lost machine): nothing
    tells the agent its job ended, so it leaves on ``link.agent_home_timeout_s``."""
    ctx = two_clusters
    home, region = ctx["home"], ctx["region"]
    try:
        # The home's books after every restart above, once far:0 trains again: balanced.
        def far_training():
            rows = _home_rows(ctx["tmp"] / "home")
            return rows and _far(rows[-1]).get("state") == "training" and rows[-1]

        last = wait_for(far_training, 120, "far:0 training at home",
                        describe=lambda: _far(_home_rows(ctx["tmp"] / "home")[-1]))
        assert last["tokens"]["balanced"], last["tokens"]
        address = ray.get_runtime_context().gcs_address
        ray.shutdown()   # this process leaves the region's cluster before that cluster ends
        t_kill = _lose_machine(home)
        line = _wait_line(region.lines, region, "stopping the learners and leaving", 20.0 + 30.0)
        said_s = time.time() - t_kill
        print(f"the agent left {said_s:.1f}s after its home was killed: {line.strip()}")
        assert "no answer from home for" in line and "agent_home_timeout_s = 20s" in line, line
        # Not before the timeout (the last answer came up to a report period, 1 s, before the
        # kill); after it, at the agent's next look at its link (0.25 s), on 2 loaded cores.
        assert 20.0 - 2.0 <= said_s <= 20.0 + 10.0, f"{said_s:.1f}s"
        assert region.wait(timeout=180) == 0
        summary = json.loads((ctx["tmp"] / "far" / "summary.json").read_text())
        assert summary["learners"]["far:0"]["state"] == "retired", summary["learners"]
        assert summary["books_balanced"], summary["fragment_tokens"]
        wait_for(lambda: not _ray_processes_of(address) or None, 30, "the left agent's Ray "
                 "daemons to exit", describe=lambda: _ray_processes_of(address))
    finally:
        _stop_all(region)   # the fixture stops the agent it started, not this one
