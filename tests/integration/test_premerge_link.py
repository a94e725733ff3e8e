"""Regional pre-merge over a real link: a home job (one learner, the syncer, the link server) and a
remote region of two learners in its own Ray cluster, on loopback, as test_link.py sets them up —
once flat and once with ``link.premerge``, on the same seed and for the same time.

Asserted with pre-merge on: the region trains (its learners' tokens merge at home), its pushes
leave as pre-merged pairs, a remote learner killed mid-run is restarted by its agent and its
pair's tokens are neither lost nor counted twice (the home's books balance), its WAN bytes up
per merged token (the link relay's socket counts) are about half the flat run's (< 0.65), and
the final eval loss is within a loose bound of the flat run's.
"""

import json
import queue
import subprocess
import threading

import pytest
import yaml

from clusters import process_tree
from conftest import TINY_JOB
from test_link import (ISLANDS, _events, _reader, _start_home, _stop_all,
                       _token_auth_in_this_process, _wait, _wait_line)

DURATION_S = 90


def _kill_one_remote_learner(address: str) -> None:
    """Joins the region's cluster, waits for pre-merged rounds, kills far:1 through the agent's
    chaos command and waits until its next incarnation is ready."""
    import ray

    ray.init(address=address, namespace="islands", log_to_driver=False)
    try:
        link = ray.get_actor("islands:syncer", namespace="islands")
        agent = ray.get_actor("islands:controller", namespace="islands")
        _wait(lambda: (ray.get(link.link_status.remote())["premerge"] or {}).get("groups", 0)
              >= 5, 120, "5 pre-merged rounds")
        before = len(_events(agent))
        ray.get(agent.chaos_kill.remote("far:1"))
        _wait(lambda: any(e["event"] == "learner_ready" and e.get("learner") == "far:1"
                          and e.get("incarnation") == 1 for e in _events(agent)[before:]),
              120, "far:1 incarnation 1 ready")
    finally:
        ray.shutdown()


def _run(tmp, premerge: bool) -> dict:
    """Runs the home for DURATION_S with the region joined (with pre-merge, a remote learner is
    killed once); returns both summaries and the home's rows and events."""
    mode = "premerge" if premerge else "flat"
    tmp = tmp / mode
    tmp.mkdir()
    token_file = tmp / "token"
    token_file.write_text("premerge-token\n")
    config = {**TINY_JOB, "name": f"pm-{mode}", "seed": 7,
              "regions": {"home": {"learners": 1}, "far": {"learners": 2, "remote": True}},
              "syncer": {**TINY_JOB["syncer"], "merge_rule": "mean"},
              "health": {"timeout_s": 30.0},  # two clusters on 2 cores: no false hangs
              "link": {"port": 0, "token_file": str(token_file), "keepalive_s": 2.0,
                       "agent_home_timeout_s": 30.0, "premerge": premerge,
                       # about one sync period of these learners on 2 shared cores
                       "premerge_window_s": 3.0},
              "run": {"dashboard": False, "run_dir": str(tmp / "home")}}
    (tmp / "home.yaml").write_text(yaml.safe_dump(config))
    home, _, env, port = _start_home(tmp / "home.yaml", DURATION_S, tmp)
    region = None
    try:
        region = subprocess.Popen(
            ISLANDS + ["region", "join", "--home", f"127.0.0.1:{port}", "--region", "far",
                       "--token-file", str(token_file), "--insecure",
                       "--run-dir", str(tmp / "far")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(tmp),
            start_new_session=True)
        region_lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(region, region_lines), daemon=True).start()
        line = _wait_line(region_lines, region, "Ray cluster at", 240)
        region.cluster = process_tree(region.pid)   # its daemons, for _stop_all
        if premerge:
            _kill_one_remote_learner(line.rsplit("Ray cluster at ", 1)[1].strip())
        # The home job ends at its duration and tells the agent, which leaves with its summary.
        assert home.wait(timeout=DURATION_S + 300) == 0
        assert region.wait(timeout=120) == 0
    finally:
        _stop_all(region, home)
    return {"home": json.loads((tmp / "home" / "summary.json").read_text()),
            "far": json.loads((tmp / "far" / "summary.json").read_text()),
            "rows": [json.loads(r) for r in (tmp / "home" / "metrics.jsonl").read_text()
                     .splitlines()],
            "events": [json.loads(r) for r in (tmp / "home" / "events.jsonl").read_text()
                       .splitlines()]}


def _bytes_per_merged_token(run) -> float:
    link = run["far"]["link"]
    return link["bytes"]["up"] / link["counts"]["merged_tokens"]


@pytest.mark.slow
def test_premerge_halves_the_regions_wan_bytes_per_merged_token(tmp_path):
    _token_auth_in_this_process()
    flat = _run(tmp_path, premerge=False)
    merged = _run(tmp_path, premerge=True)
    pm = merged["far"]["link"]["premerge"]
    print("flat link:", json.dumps(flat["far"]["link"]))
    print("premerge link:", json.dumps(merged["far"]["link"]))
    # It trained: the region's tokens merged at home, mostly as pre-merged pairs.
    assert merged["far"]["link"]["counts"]["merged_tokens"] > 0
    assert pm["groups"] >= 5 and pm["grouped_pushes"] == 2 * pm["groups"], pm
    assert flat["far"]["link"]["premerge"] is None
    # The home's books balance, flat and pre-merged (every learner's token applied, dropped
    # with a reason, or in flight), and both remote learners' tokens are in its ledger.
    for run in (flat, merged):
        assert run["rows"][-1]["tokens"]["balanced"], run["rows"][-1]["tokens"]
    last = merged["rows"][-1]
    assert {"far:0", "far:1"} <= set(last["learners"]), sorted(last["learners"])
    # The killed learner: failed and restarted by its agent (mirrored at home), its books
    # settled; the home restarted nobody of its own.
    failed = [e for e in merged["events"] if e["event"] == "learner_failed"]
    assert [e["learner"] for e in failed] == ["far:1"], failed
    assert any(e["event"] == "learner_restarted" and e["learner"] == "far:1"
               for e in merged["events"])
    print("tokens at the end:", json.dumps(last["tokens"]))
    # WAN bytes up per merged token: about 1/L with L = 2.
    ratio = _bytes_per_merged_token(merged) / _bytes_per_merged_token(flat)
    print(f"bytes up per merged token: flat {_bytes_per_merged_token(flat):.3f}, "
          f"premerge {_bytes_per_merged_token(merged):.3f}, ratio {ratio:.3f}")
    assert ratio < 0.65, ratio
    # Eval loss: loosely the flat run's (same seed and time; timing differs run to run).
    f_loss, m_loss = flat["home"]["final_eval_loss"], merged["home"]["final_eval_loss"]
    print(f"final eval loss: flat {f_loss:.4f}, premerge {m_loss:.4f} "
          f"(initial {merged['home']['initial_eval_loss']:.4f})")
    assert m_loss < merged["home"]["initial_eval_loss"]
    assert abs(m_loss - f_loss) < 0.15 * f_loss
