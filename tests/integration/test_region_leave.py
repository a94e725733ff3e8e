"""Region commands end only what they own (orchestrator/safety.py).

`islands region leave` run beside a home job refused to end it, naming the job, and the job
trained on with nothing restarted; `islands region join` into that cluster was refused before it
created anything. A join that is gone left learners and spares: they end once its link (the
join process's own actor, which Ray ends with that process) is gone, and nothing else does.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]

from conftest import TINY_JOB  # noqa: E402
from islands.orchestrator import region_agent  # noqa: E402
from islands.orchestrator.job import run_job  # noqa: E402
from islands.orchestrator.runtime import NAMESPACE, SYNCER_NAME  # noqa: E402
from waiting import wait_for  # noqa: E402  (tests/integration/waiting.py)

ISLANDS = [sys.executable, "-m", "islands.orchestrator.cli"]


def _names() -> set:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE}


def test_region_leave_beside_a_home_job_refuses_naming_it_and_the_job_trains_on(tmp_path):
    from islands.link.client import ClientSettings
    from islands.orchestrator.config import parse

    # A generous hang timeout: on a loaded machine a late heartbeat is not what this tests (an
    # actor the command ended would fail at once, its run ended, not silent).
    config = parse({**TINY_JOB, "name": "leave-beside", "health": {"timeout_s": 60.0}})

    seen: dict = {}

    def leave_beside(controller):
        def run():
            try:
                wait_for(lambda: (ray.get(controller.snapshot.remote())["syncer"]["merges"]
                                  or 0) >= 5, 90, "the home job's first merges")
                seen["actors"], t0 = _names(), time.time()
                address = ray.get_runtime_context().gcs_address
                seen["leave"] = subprocess.run(ISLANDS + ["region", "leave", "--address", address],
                                               capture_output=True, text=True, timeout=120,
                                               env=dict(os.environ))
                # A join pointed at the home's cluster: refused before it creates anything.
                try:
                    region_agent.join(ClientSettings(home="127.0.0.1:1", region="far",
                                                     token="t", tls=False), quiet=True)
                except region_agent.ClusterNotOurs as exc:
                    seen["join"] = str(exc)
                seen["after"], seen["took_s"] = _names(), time.time() - t0
                seen["merges"] = ray.get(controller.snapshot.remote())["syncer"]["merges"]
            except BaseException as exc:   # the job's loop then ends at its cap; shown below
                seen["error"] = repr(exc)

        threading.Thread(target=run, daemon=True).start()

    def trained_on(snap) -> bool:
        return "error" in seen or ("merges" in seen and
                                   (snap["syncer"]["merges"] or 0) >= seen["merges"] + 6)

    run_dir = tmp_path / "home"
    summary = run_job(config, duration_s=120, run_dir=str(run_dir), quiet=True,
                      on_started=leave_beside, until=trained_on)
    assert "error" not in seen, seen["error"]
    print(f"leave and join refused in {seen['took_s']:.1f}s; job ran {summary['duration_s']:.1f}s")
    leave = seen["leave"]
    assert leave.returncode == 1, leave.stdout + leave.stderr
    refusal = leave.stderr.strip().splitlines()[-1]
    assert refusal.startswith("islands region leave: refused: this cluster runs the home job "
                              "'leave-beside'"), leave.stderr
    assert "ended" not in leave.stdout, leave.stdout
    assert "the home job 'leave-beside'" in seen["join"]
    assert seen["after"] == seen["actors"], (seen["actors"], seen["after"])   # nothing ended
    # The job trained on: 6 merges more, nobody restarted, the controller never restarted.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert not {"controller_restarted", "learner_failed", "learner_restarted"} & kinds, kinds
    assert summary["learner_restarts"] == 0
    assert all(l["incarnation"] == 0 for l in summary["learners"].values())
    assert summary["merges"] >= seen["merges"] + 6
    assert summary["books_balanced"] is True


def test_a_gone_joins_leftovers_end_once_its_link_is_gone_and_nothing_else_does():
    """After `islands region join --address` was killed, its detached learners and spares held
    their names. A live join's link refuses any ending; once the link is gone (Ray ends it with
    the join process that owns it), only the recorded region's learners and spares end."""
    from islands.link.client import ClientSettings, LinkClient

    @ray.remote(num_cpus=0)
    class Orphan:
        def ping(self):
            return "here"

    mine = ["islands:far:0", "islands:spare:far:1"]
    other = "islands:near:0"    # no actor of the recorded join: it stays
    orphans = [Orphan.options(name=n, namespace=NAMESPACE, lifetime="detached").remote()
               for n in mine + [other]]
    assert ray.get([o.ping.remote() for o in orphans]) == ["here"] * 3
    try:
        # Nothing recorded: the orphans are not known to be a join's, so nothing ends.
        with pytest.raises(region_agent.ClusterNotOurs, match="no region join is recorded"):
            region_agent.end_leftovers()
        region_agent.write_join_record({"region": "far", "job": "demo", "pid": 4242,
                                        "host": "region-a", "ray_job_id": "gone"})
        # The join's link, alive (owned by this process, as by a join's): refused, naming it.
        link = ray.remote(LinkClient).options(name=SYNCER_NAME, namespace=NAMESPACE,
                                              num_cpus=0).remote(
            ClientSettings(home="127.0.0.1:1", region="far", token="t", tls=False))
        assert ray.get(link.identity.remote(), timeout=60)["region"] == "far"
        with pytest.raises(region_agent.ClusterNotOurs,
                           match=r"the join of region 'far' into job 'demo' \(pid 4242 on "
                                 r"region-a\) is still running"):
            region_agent.end_leftovers()
        assert set(mine + [other]) <= _names()
        ray.kill(link)
        wait_for(lambda: SYNCER_NAME not in _names(), 30, "the link's name to be free")
        plan, ended = region_agent.end_leftovers()
        assert ended == mine and plan.others == (other,)
        assert region_agent.ended_text(plan, ended) == (
            "ended 2 actors the join of region 'far' into job 'demo' (pid 4242 on region-a) "
            f"left ({', '.join(mine)}); left as they are: {other}")
        assert _names() & set(mine + [other]) == {other}
        assert region_agent.read_join_record() is None   # forgotten with its leftovers
    finally:
        region_agent.clear_join_record()
        for name in mine + [other]:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                pass
        deadline = time.time() + 30
        while _names() & set(mine + [other, SYNCER_NAME]) and time.time() < deadline:
            time.sleep(0.2)


def test_region_leave_and_join_with_ray_private_kv_calls_changed_end_nothing_in_one_line(
        monkeypatch):
    """If a Ray upgrade changes ``ray.experimental.internal_kv``, `islands region leave` and
    `islands region join --address` refuse in one line naming the call (exit 1), ending nothing."""
    from islands.link.client import ClientSettings

    @ray.remote(num_cpus=0)
    class Orphan:
        def ping(self):
            return "here"

    orphan = Orphan.options(name="islands:far:0", namespace=NAMESPACE,
                            lifetime="detached").remote()
    assert ray.get(orphan.ping.remote()) == "here"
    try:
        region_agent.write_join_record({"region": "far", "job": "demo", "ray_job_id": "gone"})
        address = ray.get_runtime_context().gcs_address
        # The CLI in its own process, with the private call changed there as an upgrade would
        # (for the join record: Ray's own start-up reads its key-value store too).
        script = ("import sys\n"
                  "from ray.experimental import internal_kv\n"
                  "real = internal_kv._internal_kv_get\n"
                  "def changed(key, *args, **kwargs):\n"
                  "    if key == b'islands:region-join':\n"
                  "        raise AttributeError('no _internal_kv_get in this Ray')\n"
                  "    return real(key, *args, **kwargs)\n"
                  "internal_kv._internal_kv_get = changed\n"
                  "from islands.orchestrator.cli import main\n"
                  f"sys.exit(main(['region', 'leave', '--address', {address!r}]))\n")
        leave = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=120, env=dict(os.environ))
        assert leave.returncode == 1, leave.stdout + leave.stderr
        assert "Traceback" not in leave.stderr, leave.stderr
        assert leave.stderr.strip().splitlines()[-1].startswith(
            "islands region leave: cannot reach the region join record in Ray's key-value store "
            "(ray.experimental.internal_kv._internal_kv_get: AttributeError: no _internal_kv_get "
            "in this Ray): nothing ended"), leave.stderr
        assert "islands:far:0" in _names()   # a gone join's leftover, yet not ended

        from ray.experimental import internal_kv

        def changed(*args, **kwargs):
            raise TypeError("_internal_kv_get() got an unexpected keyword argument 'namespace'")

        monkeypatch.setattr(internal_kv, "_internal_kv_get", changed)
        before = _names()
        with pytest.raises(region_agent.JoinRecordError, match=r"_internal_kv_get: TypeError: "
                           r".*: nothing ended$"):
            region_agent.join(ClientSettings(home="127.0.0.1:1", region="far", token="t",
                                             tls=False), quiet=True)
        assert _names() == before   # nothing created, nothing ended
        monkeypatch.undo()
    finally:
        region_agent.clear_join_record()
        ray.kill(orphan)
        wait_for(lambda: "islands:far:0" not in _names(), 30, "the orphan's name to be free")
