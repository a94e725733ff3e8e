"""A home restart keeps a remote region's work: a home with two syncer shards and a region joined
over the link (two local Ray clusters on loopback, as test_link.py sets them up).

Asserted: a killed home syncer shard restarts alone (epoch + 1) and the remote learner, which
pushes through the link to it, re-registers with that shard only and merges there again, with
no restart of its own; a killed home controller comes back (Ray restarts it) and the remote
learner keeps merging through it, again with no restart; the home's books balance throughout.
Then the region keeps a warm spare in its own cluster and promotes it when its learner is
killed, and the home sees the learner come back and merge.

About 2 minutes on 2 cores (two clusters, two restarts).
"""

import json
import time

import pytest
import yaml

from conftest import TINY_JOB
from test_link import (_close, _home_events, _home_rows, _start_home, _start_region,
                       _token_auth_in_this_process, _wait)

# Slow (two clusters, two restarts and a spare: about 2 minutes on 2 cores): `python -m pytest -m slow tests`.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def home_and_region(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("homerestart")
    token_file = tmp / "token"
    token_file.write_text("home-restart-token\n")
    config = {**TINY_JOB, "name": "homerestart",
              "regions": {"home": {"learners": 1}, "far": {"learners": 1, "remote": True}},
              "syncer": {**TINY_JOB["syncer"], "shards": 2},
              # two clusters on 2 cores: no false hangs; the region keeps one warm spare
              "health": {"timeout_s": 30.0, "spares": {"far": 1}},
              "link": {"port": 0, "token_file": str(token_file), "keepalive_s": 2.0,
                       "agent_home_timeout_s": 60.0},
              "run": {"dashboard": False, "run_dir": str(tmp / "home")}}
    (tmp / "home.yaml").write_text(yaml.safe_dump(config))
    _token_auth_in_this_process()
    # _start_home gives the home its own $XDG_RUNTIME_DIR (tmp/xdg), where its embedded
    # cluster's address is written: this process joins that cluster.
    home, _, env, port = _start_home(tmp / "home.yaml", 900, tmp)
    xdg = tmp / "xdg"
    region = None
    try:
        region, region_address = _start_region(["region", "join", "--home", f"127.0.0.1:{port}", "--region",
                                   "far", "--token-file", str(token_file), "--insecure",
                                   "--run-dir", str(tmp / "far")], env, tmp)
        address = (xdg / "islands" / "embedded_cluster_address").read_text().strip()
        import ray

        ray.init(address=address, namespace="islands", log_to_driver=False)
        yield {"tmp": tmp, "home_dir": tmp / "home", "region": region, "env": env,
               "region_address": region_address,
               "controller": ray.get_actor("islands:controller", namespace="islands")}
    finally:
        _close(region, home)


def _far(home_dir) -> dict:
    """The home's newest view of far:0 (its row in metrics.jsonl), or {}."""
    rows = [r for r in _home_rows(home_dir) if "far:0" in (r.get("learners") or {})]
    return rows[-1]["learners"]["far:0"] if rows else {}


def _far_merged_steps(controller=None) -> dict:
    """far:0's merged step per fragment in the home syncer shards' books (each asked by name:
    a restarted shard is a new actor)."""
    import ray

    out = {}
    for name in ("islands:syncer", "islands:syncer-1"):
        try:
            status = ray.get(ray.get_actor(name, namespace="islands").status.remote(), timeout=10)
        except Exception:   # restarting
            continue
        entry = status.ledger.get("far:0") or {}
        out.update({int(p): s for p, s in (entry.get("merged_steps") or {}).items()})
    return out


def test_a_home_syncer_shard_and_the_home_controller_restart_and_the_region_keeps_merging(
        home_and_region):
    import ray

    controller, home_dir = home_and_region["controller"], home_and_region["home_dir"]
    merged = _wait(lambda: (lambda m: m if len(m) == 2 else None)(_far_merged_steps(controller)),
                   240, "far:0 merged on both shards")
    incarnation = _far(home_dir).get("incarnation", 0)

    # 1. Home syncer shard 1 is killed: it alone restarts, epoch 1; far:0 merges there again.
    ray.get(controller.chaos_kill.remote("syncer:1"))
    t_kill = time.time()
    started = _wait(lambda: next((e for e in _home_events(home_dir)
                                  if e["event"] == "syncer_started" and e.get("shard") == 1
                                  and e["t"] > t_kill), None), 120, "shard 1 restarted")
    assert started["epoch"] == 1
    _wait(lambda: _far_merged_steps(controller).get(1, -1) > merged[1], 120,
          "far:0 merging on the restarted shard")
    after_shard = _far_merged_steps(controller)

    # 2. The home controller is killed: Ray restarts it; far:0 keeps merging through it.
    ray.kill(controller, no_restart=False)
    t_kill = time.time()
    _wait(lambda: any(e["event"] == "controller_restarted" and e["t"] > t_kill
                      for e in _home_events(home_dir)), 120, "the home controller restarted")
    _wait(lambda: min(_far_merged_steps(controller).get(p, -1) - after_shard[p]
                      for p in (0, 1)) > 0, 120, "far:0 merging on both shards after it")

    # 3. No restart of the remote learner, no failure at home; the books balance.
    events = _home_events(home_dir)
    assert not [e for e in events if e.get("learner") == "far:0"
                and e["event"] in ("learner_failed", "learner_restarted")], events
    assert [e.get("shard") for e in events if e["event"] == "syncer_started"].count(0) == 1
    row = _wait(lambda: next((r for r in reversed(_home_rows(home_dir))
                              if r["t"] > t_kill and r["tokens"].get("balanced") is not None),
                             None), 60, "a metrics row after the restarts")
    assert row["tokens"]["balanced"], json.dumps(row["tokens"])
    assert _far(home_dir).get("incarnation", 0) == incarnation


def test_the_regions_warm_spare_takes_a_killed_learners_place(home_and_region):
    """The agent keeps ``health.spares: {far: 1}`` in the region's cluster; killing far:0 there
    (the CLI at the address join printed) promotes it, and the home sees far:0 back, merging."""
    import subprocess
    import sys

    from test_link import _wait_line

    ctx = home_and_region
    home_dir, region = ctx["home_dir"], ctx["region"]
    _wait_line(region.lines, region, "spare_ready", 240)
    before = _far(home_dir).get("incarnation", 0)
    merged = _far_merged_steps()
    out = subprocess.run([sys.executable, "-m", "islands.orchestrator.cli", "chaos", "kill",
                          "far:0", "--address", ctx["region_address"]], env=ctx["env"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    promoted = _wait_line(region.lines, region, "spare_promoted", 120)
    assert "far:0" in promoted
    _wait(lambda: _far(home_dir).get("incarnation", 0) > before, 120,
          "the home sees far:0's next incarnation")
    _wait(lambda: any(_far_merged_steps().get(p, -1) > merged.get(p, -1) for p in (0, 1)),
          120, "far:0 merging again")
