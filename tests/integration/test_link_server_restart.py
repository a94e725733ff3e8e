"""The home's link server restarts and a remote region trains on: a home and a region joined over
the link (two local Ray clusters on loopback, as test_link.py sets them up).

The link server (the ``islands:link`` actor) holds its replies a while (journaled already: a
reply on its way), and is killed by Ray with a restart allowed. Asserted: it comes back on the
same address (one more incarnation); the retry of the push whose reply it lost is answered from
its reply journal, not merged again, and no push reaches the home syncer twice (each push id is
journaled as taken once, across both lives); the remote learner keeps merging after it with no
restart of its own (its incarnation unchanged, nothing failed at home); the home's books balance.
"""

import collections
import json
import time

import pytest
import yaml

from conftest import TINY_JOB
from test_link import (_close, _home_events, _home_rows, _start_home, _start_region,
                       _token_auth_in_this_process, _wait)

# Slow (two clusters and a link server restart: about 65 s on 2 cores): `python -m pytest -m slow tests`.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def home_and_region(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("linkrestart")
    token_file = tmp / "token"
    token_file.write_text("link-restart-token\n")
    config = {**TINY_JOB, "name": "linkrestart",
              "regions": {"home": {"learners": 1}, "far": {"learners": 1, "remote": True}},
              "health": {"timeout_s": 30.0},  # two clusters on 2 cores: no false hangs
              "link": {"port": 0, "token_file": str(token_file), "keepalive_s": 2.0,
                       "agent_home_timeout_s": 60.0},
              "run": {"dashboard": False, "run_dir": str(tmp / "home")}}
    (tmp / "home.yaml").write_text(yaml.safe_dump(config))
    _token_auth_in_this_process()
    # _start_home gives the home its own $XDG_RUNTIME_DIR (tmp/xdg), where its embedded
    # cluster's address is written: this process joins that cluster.
    home, _, env, port = _start_home(tmp / "home.yaml", 900, tmp)
    region = None
    try:
        region, _ = _start_region(["region", "join", "--home", f"127.0.0.1:{port}", "--region",
                                   "far", "--token-file", str(token_file), "--insecure",
                                   "--run-dir", str(tmp / "far")], env, tmp)
        address = (tmp / "xdg" / "islands" / "embedded_cluster_address").read_text().strip()
        import ray

        ray.init(address=address, namespace="islands", log_to_driver=False)
        yield {"home_dir": tmp / "home", "port": port,
               "link": ray.get_actor("islands:link", namespace="islands")}
    finally:
        _close(region, home)


def _far_ledger() -> dict:
    """far:0 in the home syncer's ledger ({} before it merged)."""
    import ray

    try:
        status = ray.get(ray.get_actor("islands:syncer", namespace="islands").status.remote(),
                         timeout=10)
    except Exception:
        return {}
    return status.ledger.get("far:0") or {}


def _info(link):
    """The link server's info, or None while it is down or restarting."""
    import ray

    try:
        return ray.get(link.info.remote(), timeout=10)
    except Exception:
        return None


def test_the_link_server_restarts_on_its_address_and_the_region_merges_on_exactly_once(
        home_and_region):
    import ray

    link, home_dir = home_and_region["link"], home_and_region["home_dir"]
    t0 = time.time()
    # far:0 merging at home on both fragments.
    _wait(lambda: len(_far_ledger().get("merged_steps") or {}) == 2, 240,
          "far:0 merged on both fragments")
    before = _info(link)
    assert before["incarnation"] == 0
    assert before["address"].endswith(f":{home_and_region['port']}")
    incarnation = _far_ledger()["incarnation"]

    # 1. Replies are held (journaled first): one merged push's reply is on its way when the
    # server is killed, with Ray's restart allowed.
    ray.get(link.hold_replies.remote(120.0))
    _wait(lambda: (_info(link) or {}).get("held", 0) >= 1, 120, "a reply held on its way")
    merged_at_kill = dict(_far_ledger()["merged_steps"])
    t_kill = time.time()
    ray.kill(link, no_restart=False)

    # 2. It comes back, on the same address, one incarnation on.
    after = _wait(lambda: (lambda i: i if i and i["incarnation"] == 1 else None)(_info(link)),
                  120, "the link server restarted")
    print(f"link server back {time.time() - t_kill:.1f}s after the kill: {after}")
    assert after["address"] == before["address"] and after["pid"] != before["pid"]

    # 3. The lost reply's retry is answered from the journal; far:0 merges again on both
    # fragments through the restarted server.
    _wait(lambda: (_info(link) or {}).get("pushes", {}).get("answered_from_journal", 0) >= 1,
          120, "the lost reply answered from the journal")
    _wait(lambda: all(int(s) > merged_at_kill.get(p, -1)
                      for p, s in (_far_ledger().get("merged_steps") or {}).items())
          and len(_far_ledger().get("merged_steps") or {}) == 2, 180,
          "far:0 merging on both fragments after the restart")
    counts = _info(link)["pushes"]
    print(f"link server after the restart: {counts}; journal {_info(link)['journal']}")
    assert counts.get("taken", 0) >= 1   # new pushes went to the syncer

    # 4. Exactly once: across both lives, no push id was sent to the syncer twice.
    records = [json.loads(line) for line in
               (home_dir / "link" / "replies.jsonl").read_text().splitlines()]
    taken = collections.Counter(r["id"] for r in records if r["kind"] == "taken")
    assert taken and max(taken.values()) == 1, taken.most_common(3)
    assert any(r["kind"] == "reply" and r["t"] < t_kill for r in records)

    # 5. No restart of the remote learner (same incarnation), nothing failed at home; the
    # home's books balance after it.
    assert _far_ledger()["incarnation"] == incarnation
    events = [e for e in _home_events(home_dir) if e["t"] > t0]
    assert not [e for e in events if e["event"] in (
        "learner_failed", "learner_restarted", "learner_unreachable", "syncer_failed")], events
    (restarted,) = [e for e in events if e["event"] == "link_server_restarted"]
    assert restarted["incarnation"] == 1 and restarted["address"] == before["address"]
    row = _wait(lambda: next((r for r in reversed(_home_rows(home_dir))
                              if r["t"] > t_kill + 5 and r["tokens"].get("balanced") is not None),
                             None), 60, "a metrics row after the restart")
    assert row["tokens"]["balanced"], json.dumps(row["tokens"])
    assert row["learners"]["far:0"]["incarnation"] == incarnation
    assert row["learners"]["far:0"]["state"] == "training"
