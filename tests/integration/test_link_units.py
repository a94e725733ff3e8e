"""A multi-host learner unit in a remote region: a home job (one learner, the syncer, the link
server) and a region whose one learner is a unit of two hosts (two processes joined by
jax.distributed over gloo), in its own Ray cluster, on loopback as test_link.py sets them up.

Asserted: the unit trains and its merges reach the home's books; killing one of its hosts in the
region restarts the whole unit there once, which the home sees as that learner's one restart
(its agent's), and the unit merges again; the home's books balance. About 1 minute on 2 cores.
"""

import pytest
import yaml

from conftest import TINY_JOB
from test_link import (_close, _home_events, _home_rows, _start_home, _start_region,
                       _token_auth_in_this_process, _wait)

# Slow (two clusters and a two-host unit: about 75 s on 2 cores): `python -m pytest -m slow tests`.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _ledger(rows) -> dict:
    rows = [r for r in rows if "pair:0" in (r.get("learners") or {})]
    return rows[-1]["learners"]["pair:0"] if rows else {}


def test_a_remote_two_host_unit_trains_and_restarts_as_a_unit_in_its_region(tmp_path):
    import ray

    from islands.learners.gang import member_name

    token_file = tmp_path / "token"
    token_file.write_text("units-token\n")
    config = {**TINY_JOB, "name": "linkunits",
              "regions": {"home": {"learners": 1},
                          "pair": {"learners": 1, "hosts_per_learner": 2, "remote": True}},
              "health": {"timeout_s": 30.0},  # several clusters on 2 cores: no false hangs
              "link": {"port": 0, "token_file": str(token_file), "keepalive_s": 2.0,
                       "agent_home_timeout_s": 60.0},
              "run": {"dashboard": False, "run_dir": str(tmp_path / "home")}}
    (tmp_path / "home.yaml").write_text(yaml.safe_dump(config))
    _token_auth_in_this_process()
    home, _, env, port = _start_home(tmp_path / "home.yaml", 900, tmp_path)
    region = None
    home_dir = tmp_path / "home"
    try:
        region, address = _start_region(
            ["region", "join", "--home", f"127.0.0.1:{port}", "--region", "pair",
             "--token-file", str(token_file), "--insecure", "--run-dir", str(tmp_path / "pair")],
            env, tmp_path)
        # 1. The unit trains and its tokens merge at home.
        first = _wait(lambda: (lambda e: e if (e.get("step") or 0) >= 8 else None)(
            _ledger(_home_rows(home_dir))), 300, "pair:0 training")
        assert first["unit"].startswith("2×1"), first
        tokens = lambda: _home_rows(home_dir)[-1]["tokens"]  # noqa: E731
        # (the home syncer's bytes down to a learner grow only when a merge answers it)
        merged_down = lambda: _home_rows(home_dir)[-1]["syncer"]["wire_bytes_down"].get(  # noqa
            "pair:0", 0)
        _wait(lambda: merged_down() > 0, 120, "a merge with pair:0")
        incarnation = first["incarnation"]

        # 2. One host of the unit is killed in the region: the agent restarts the whole unit.
        ray.init(address=address, namespace="islands", log_to_driver=False)
        ray.kill(ray.get_actor(member_name("pair:0", incarnation, 1), namespace="islands"),
                 no_restart=True)
        _wait(lambda: (_ledger(_home_rows(home_dir)).get("incarnation") == incarnation + 1
                       and _ledger(_home_rows(home_dir)).get("state") == "training"), 240,
              "pair:0 back as a unit")
        ray.get_actor(member_name("pair:0", incarnation + 1, 1), namespace="islands")
        down = merged_down()
        _wait(lambda: merged_down() > down, 120, "a merge with the new unit")
        restarts = [e for e in _home_events(home_dir)
                    if e["event"] == "learner_restarted" and e.get("learner") == "pair:0"]
        assert len(restarts) == 1 and restarts[0].get("remote"), restarts
        _wait(lambda: tokens().get("balanced"), 60, "books balanced")
    finally:
        _close(region, home)
