"""A region in its own Ray cluster, joined to a home job over the gRPC link — on loopback.

Two processes, two local Ray clusters: ``islands run`` (the home: the syncer, one local learner
and the link server, TLS with a throwaway CA, mutual TLS, a bearer token) and
``islands region join`` (the region agent and its learner). This test process talks gRPC to the
home for the security checks and joins the region's cluster to drive its chaos commands.
Asserted: the remote learner's merges reach the home syncer and its books; a 10 s partition of
the link costs no restart and the region contributes again within seconds of its end; a killed
remote learner is restarted by its agent while the home restarts nothing; a wrong token, a
missing token and an oversized message are refused with their status.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import yaml

from clusters import end_process_tree, process_tree
from conftest import TINY_JOB

ISLANDS = [sys.executable, "-m", "islands.orchestrator.cli"]
HANG_TIMEOUT_S = 20.0   # the home's health.timeout_s: above the 8 s partition, no false hangs


def _reader(proc, lines: "queue.Queue"):
    for line in proc.stdout:
        lines.put(line)


def _wait_line(lines, proc, needle, timeout_s):
    deadline = time.time() + timeout_s
    seen = []
    while time.time() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None, f"exited {proc.returncode}: {''.join(seen[-20:])}"
            continue
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} in {timeout_s}s: {''.join(seen[-20:])}")


def _wait(predicate, timeout_s, what):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _stop(proc) -> list:
    """SIGTERM (a clean stop, as Kubernetes stops a pod: summary, then its own cluster's
    shutdown), then SIGKILL to whatever of its process tree is left: its Ray daemons and their
    workers, noted before the signal. Signalling only its process group left workers (not in
    that group) orphaned, running on for a minute or more and loading later modules. Not SIGINT: a test run started in the background
    of a non-interactive shell (`bash .ci/run &`) ignores SIGINT, its children inherit that,
    and the home then ran on until the 120 s wait below was over. Returns the pids that
    outlived SIGKILL (it raises nothing, so that a teardown stops every process it has). Its
    cluster as noted once it was up (``proc.cluster``) counts too: a test that waited for the
    process itself has reaped it, and its pid may be another process's by now."""
    tree = list(getattr(proc, "cluster", []))
    if proc.returncode is None:
        tree += process_tree(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    # ... and any worker a daemon started since (psutil checks each one is still the same)
    tree += [child for d in list(tree) if d.is_running() for child in d.children(recursive=True)]
    if proc.returncode is None:   # not reaped: its pid still names its group
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # anything of the group outside the tree
        except ProcessLookupError:
            pass
    left = end_process_tree(tree)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        left.append(proc.pid)
    return left


def _stop_all(*procs) -> None:
    """Stops each of ``procs`` (None skipped), then fails if a process of any outlived SIGKILL;
    in a ``finally`` that a test's failure is passing through, it says so instead, so as not
    to replace that failure."""
    left = [pid for proc in procs if proc is not None for pid in _stop(proc)]
    if not left:
        return
    import psutil

    described = []
    for pid in left:
        try:
            p = psutil.Process(pid)
            described.append(f"{pid} {p.name()} ({p.status()})")
        except psutil.Error:
            described.append(f"{pid} (gone since)")
    message = f"processes of a stopped cluster outlived SIGKILL: {described}"
    if sys.exc_info()[0] is not None:
        print(message)
        return
    raise AssertionError(message)


def _token_auth_in_this_process():
    """Ray's token auth, as every other module's cluster has it: one token (~/.ray/auth_token)
    for the two clusters and this process. Ray caches the mode per process when it is first
    read (here, maybe at collection), so it is set and refreshed the way ``ray.init`` does for a
    new local cluster. Switching auth off instead would outlive the module and leave later
    modules unable to reach their own clusters."""
    from ray._private.authentication import authentication_token_setup as auth

    auth._enable_token_auth()
    auth.ensure_token_if_auth_enabled()


def _start_region(join_args, env, cwd):
    """``islands region join`` in its own session; returns it (its output on ``proc.lines``)
    and its Ray cluster's address once the agent is up."""
    region = subprocess.Popen(ISLANDS + join_args, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=str(cwd),
                              start_new_session=True)
    region.lines = queue.Queue()
    threading.Thread(target=_reader, args=(region, region.lines), daemon=True).start()
    line = _wait_line(region.lines, region, "Ray cluster at", 240)
    region.cluster = process_tree(region.pid)   # its daemons, for _stop
    return region, line.rsplit("Ray cluster at ", 1)[1].strip()


def _start_home(config_file, duration_s: float, cwd):
    """``islands run`` of a home job in its own session, up to its link's line; returns the
    process, its output lines, the env (for the region's side) and the link's port."""
    # Its own state dir: the home's embedded cluster address (home_address) is this module's,
    # not the user's file that any other `islands run` on the machine rewrites.
    xdg = cwd / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1",
           "XDG_RUNTIME_DIR": str(xdg)}
    env.pop("RAY_ADDRESS", None)
    home = subprocess.Popen(ISLANDS + ["run", str(config_file), "--duration", str(duration_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(cwd), start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(home, lines), daemon=True).start()
    try:
        line = _wait_line(lines, home, "islands: link on", 240)
    except BaseException:
        _stop(home)
        raise
    home.cluster = process_tree(home.pid)   # its daemons, for _stop
    return home, lines, env, int(line.split("link on ", 1)[1].split()[0].rsplit(":", 1)[1])


def _close(region, home) -> None:
    """This process leaves the cluster it joined; the region's and the home's processes end."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _stop_all(region, home)


@pytest.fixture(scope="module")
def two_clusters(tmp_path_factory):
    from islands.link.security import throwaway_pki

    tmp = tmp_path_factory.mktemp("link")
    pki = throwaway_pki(str(tmp / "pki"))
    token_file = tmp / "token"
    token_file.write_text("the-right-token\n")
    config = {**TINY_JOB, "name": "linktest",
              "regions": {"home": {"learners": 1}, "far": {"learners": 1, "remote": True}},
              # Two syncer shards (one fragment each) and the default encoded downlink (nf2
              # replies): both cross the link.
              "syncer": {**TINY_JOB["syncer"], "shards": 2},
              "health": {"timeout_s": HANG_TIMEOUT_S},
              "link": {"port": 0, "token_file": str(token_file), "max_message_bytes": 8 << 20,
                       "keepalive_s": 2.0, "agent_home_timeout_s": 20.0,
                       "tls": {"cert_file": pki.server_cert, "key_file": pki.server_key,
                               "client_ca_file": pki.ca_cert}},
              "run": {"dashboard": False, "run_dir": str(tmp / "home")}}
    (tmp / "home.yaml").write_text(yaml.safe_dump(config))
    _token_auth_in_this_process()
    home, home_lines, env, port = _start_home(tmp / "home.yaml", 900, tmp)
    region = None
    try:
        join_args = ["region", "join", "--home", f"127.0.0.1:{port}", "--region", "far",
                     "--token-file", str(token_file), "--ca-cert", pki.ca_cert,
                     "--client-cert", pki.client_cert, "--client-key", pki.client_key,
                     "--server-name", "localhost", "--run-dir", str(tmp / "far")]
        region, address = _start_region(join_args, env, tmp)
        import ray

        ray.init(address=address, namespace="islands", log_to_driver=False)
        yield {"port": port, "pki": pki, "tmp": tmp, "home": home, "region": region,
               "address": address,
               "join_args": join_args, "env": env, "token_file": token_file,
               "home_lines": home_lines,
               "link": ray.get_actor("islands:syncer", namespace="islands"),
               "agent": ray.get_actor("islands:controller", namespace="islands")}
    finally:
        _close(region, home)


def _stub(ctx, token=None):
    from islands.link import link_pb2_grpc
    from islands.link.security import channel_credentials

    pki = ctx["pki"]
    creds = channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)
    channel = grpc.secure_channel(f"127.0.0.1:{ctx['port']}", creds,
                                  options=[("grpc.ssl_target_name_override", "localhost")])
    return link_pb2_grpc.LinkStub(channel), (("authorization", f"Bearer {token}"),) if token else ()


def test_a_wrong_or_missing_token_and_an_oversized_message_are_refused(two_clusters):
    from islands.link import link_pb2 as pb

    hello = pb.HelloRequest(region="far", protocol=1)
    for token, words in (("not-the-token", "wrong bearer token"), (None, "without a bearer")):
        stub, metadata = _stub(two_clusters, token)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Hello(hello, timeout=30, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert words in refused.value.details()
    stub, metadata = _stub(two_clusters, "the-right-token")
    with pytest.raises(grpc.RpcError) as refused:  # a region the job does not have
        stub.Hello(pb.HelloRequest(region="elsewhere", protocol=1), timeout=30,
                   metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not a remote region" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:  # declares 1 GiB; the job allows 8 MiB
        list(stub.Register(iter([pb.Chunk(total_bytes=1 << 30, data=b"x")]), timeout=30,
                           metadata=metadata))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as refused:  # one message above the frame limit
        list(stub.Register(iter([pb.Chunk(total_bytes=4 << 20, data=b"x" * (3 << 20))]),
                           timeout=30, metadata=metadata))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A push to an epoch the home syncer never had is refused by the syncer's fencing.
    reply = stub.Hello(hello, timeout=30, metadata=metadata)
    assert json.loads(reply.config_json)["name"] == "linktest" and reply.num_shards == 2


def _events(agent, since=0):
    import ray

    events, _ = ray.get(agent.events_since.remote(since))
    return events


def test_remote_merges_partition_and_a_local_restart(two_clusters):
    import ray

    link, agent = two_clusters["link"], two_clusters["agent"]
    status = lambda: ray.get(link.link_status.remote())  # noqa: E731
    # 1. The remote learner's pushes merge at home, on both syncer shards (one fragment each),
    # and its replies are encoded updates: down is about up (nf2:256 replies vs nf2:64 pushes),
    # where fp32 fragments would be ~14x up.
    _wait(lambda: status()["counts"].get("pushes_merged", 0) >= 3, 300, "3 remote merges")
    first = status()
    assert first["bytes"]["up"] > 0 and first["bytes"]["down"] > 0
    ledger = _wait(lambda: (ray.get(link.status.remote()).ledger.get("far:0") or {})
                   if len((ray.get(link.status.remote()).ledger.get("far:0") or {})
                          .get("merged_steps") or {}) == 2 else None, 120,
                   "far:0 merged on both shards")
    assert sorted(int(p) for p in ledger["merged_steps"]) == [0, 1]
    beat = _wait(lambda: next((b for b in [ray.get(agent.snapshot.remote())["learners"].get("far:0")]
                               if b and b.get("wire_bytes_up_total")), None), 60, "far:0 bytes")
    assert 0 < beat["wire_bytes_down_total"] < 2 * beat["wire_bytes_up_total"], beat

    # 2. A 10 s partition of the link: no restart; contributing again within seconds of its end.
    before = len(_events(agent))
    ray.get(agent.chaos_network.remote("far", 10.0, partition=True))
    t_cut = time.time()
    time.sleep(1.0)
    assert not status()["connected"]
    end = t_cut + 10.0
    merged_after = _wait(lambda: (status()["last_merged_s"] or 0) > end
                         and status()["last_merged_s"], 60, "a merge after the partition")
    assert merged_after - end < 20.0, f"first merge {merged_after - end:.1f}s after the end"
    after = status()
    assert after["reconnects"] >= 1
    kinds = [e["event"] for e in _events(agent)[before:]]
    assert "learner_failed" not in kinds and "learner_restarted" not in kinds, kinds

    # 3. A killed remote learner is restarted by its agent, and contributes again.
    before = len(_events(agent))
    ray.get(agent.chaos_kill.remote("far:0"))
    t_kill = time.time()
    _wait(lambda: any(e["event"] == "learner_ready" and e.get("incarnation") == 1
                      for e in _events(agent)[before:]), 180, "far:0 incarnation 1 ready")
    _wait(lambda: (status()["last_merged_s"] or 0) > t_kill + 1, 120, "merges from incarnation 1")

    # 4. The home: its books hold the remote learner's incarnations; it restarted nothing.
    home_dir = two_clusters["tmp"] / "home"
    rows = _wait(lambda: [json.loads(line) for line in
                          (home_dir / "metrics.jsonl").read_text().splitlines()
                          if '"far:0"' in line and '"incarnation": 1' in line], 60,
                 "the home's snapshot of far:0 incarnation 1")
    last = rows[-1]
    assert last["link"]["far"]["up"] > 0 and last["link"]["far"]["reconnects"] >= 1
    assert last["tokens"]["balanced"]
    home_events = [json.loads(line) for line in (home_dir / "events.jsonl").read_text().splitlines()]
    restarted = [e.get("learner") for e in home_events if e["event"] == "learner_restarted"]
    assert set(restarted) <= {"far:0"}, restarted  # mirrored from the agent, none of its own
    assert not [e for e in home_events if e["event"] in ("syncer_failed", "learner_failed")
                and e.get("learner") != "far:0"]
    failed = [e for e in home_events if e["event"] == "learner_failed"]
    assert failed and all(e["learner"] == "far:0" for e in failed)


def test_a_home_partition_shorter_than_the_agents_timeout_restarts_nothing(two_clusters):
    """``islands chaos partition --home`` at home: the link server drops every region's link for
    8 s (below link.agent_home_timeout_s and health.timeout_s, 20 s each here). The remote
    learner trains on through it, nothing restarts on either side, the agent stays, merges
    resume within seconds of its end, and the home's books balance.

    A push in flight at the cut may have merged at home: its retry is answered with that reply
    and merges once (tests/unit/test_link_once.py checks exactly that on a real link). The
    push after the one that waited out the partition carries that long push's rounding as
    error feedback and may be refused once as an outlier; the learner starts over without it
    (before, it rode in every push and far:0 was quarantined and restarted, in the next test)."""
    import ray

    from waiting import wait_for

    ctx, home_dir = two_clusters, two_clusters["tmp"] / "home"
    link, agent = ctx["link"], ctx["agent"]
    status = lambda: ray.get(link.link_status.remote())  # noqa: E731
    step = lambda: int(ray.get(agent.status_table.remote())["learners"]["far:0"].get(  # noqa
        "step") or 0)
    wait_for(lambda: status()["connected"] and (status()["last_merged_s"] or 0)
             > time.time() - 30, 180, "the region merging at home", describe=status)
    home_address = (ctx["tmp"] / "xdg" / "islands" / "embedded_cluster_address").read_text()
    seen_home, seen_region = len(_home_events(home_dir)), len(_events(agent))
    reconnects = status()["reconnects"]
    done = subprocess.run(ISLANDS + ["chaos", "partition", "--home", "--duration", "8",
                                     "--address", home_address.strip()],
                          env=ctx["env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "partition of the home" in done.stdout
    cut = wait_for(lambda: next((e for e in _home_events(home_dir)[seen_home:]
                                 if e["event"] == "chaos" and e.get("target") == "@home"), None),
                   30, "the home's chaos event")
    assert cut["regions"] == ["far"] and cut["duration_s"] == 8.0
    t_cut, end = cut["t"], cut["t"] + 8.0
    # The region's link goes down, and its learner trains on while it is.
    wait_for(lambda: not status()["connected"], 8.0, "the region's link to go down",
             describe=status)
    step_down, left = step(), end - 0.5 - time.time()
    assert left > 1.0, f"the link went down {8 - left:.1f}s into the 8 s window"
    wait_for(lambda: step() >= step_down + 2, left,
             "the remote learner's steps during the partition", describe=step)
    assert not status()["connected"]   # still inside the window
    # Merges resume within seconds of its end, over a reconnected channel.
    merged_after = wait_for(lambda: (status()["last_merged_s"] or 0) > end
                            and status()["last_merged_s"], 60, "a merge after the partition",
                            describe=status)
    print(f"home partition at {t_cut:.1f}: first merge {merged_after - end:.1f}s after its end")
    assert merged_after - end < 20.0
    assert status()["reconnects"] > reconnects
    # Nothing restarted on either side; the agent did not leave.
    home_new = _home_events(home_dir)[seen_home:]
    assert not [e for e in home_new if e["event"] in (
        "learner_failed", "learner_restarted", "learner_unreachable", "learner_unhealthy")], [
        e["event"] for e in home_new]
    region_new = [e["event"] for e in _events(agent)[seen_region:]]
    assert "learner_failed" not in region_new and "learner_restarted" not in region_new
    assert ctx["region"].poll() is None, "the agent left during a partition shorter than " \
        "link.agent_home_timeout_s"
    # The home's books balance in a snapshot taken after the merges resumed.
    row = wait_for(lambda: next((r for r in reversed(_home_rows(home_dir))
                                 if r["t"] > merged_after), None),
                   60, "a home snapshot after the merges resumed")
    assert row["tokens"]["balanced"], row["tokens"]
    assert row["learners"]["far:0"]["state"] == "training"
    # Over the remote learner's next merges: no quarantine. The first push after the long one
    # that waited out the partition may be refused once as an outlier (the long push's rounding
    # rides in it as error feedback); the learner then starts over clean, residual included
    # (before, the residual rode in every push: quarantined, restarted).
    merged_before = status()["counts"].get("pushes_merged", 0)
    wait_for(lambda: status()["counts"].get("pushes_merged", 0) >= merged_before + 4, 60,
             "four more merges of the remote learner", describe=status)
    print("link after the home partition:", status()["counts"])
    new_events = _home_events(home_dir)[seen_home:]
    garbage = [e for e in new_events if e["event"] == "push_refused"
               and e.get("reason") in ("outlier_norm", "bad_shape", "not_finite")]
    assert len(garbage) <= 1, garbage
    assert not [e for e in new_events if e["event"] in ("learner_quarantined", "learner_failed")]


def _home_rows(home_dir):
    return [json.loads(line) for line in (home_dir / "metrics.jsonl").read_text().splitlines()]


def _home_events(home_dir):
    return [json.loads(line) for line in (home_dir / "events.jsonl").read_text().splitlines()]


def _with(args, **flags):
    """``args`` with each flag's value replaced (None: the flag dropped); flags spelled with
    their dashes, e.g. ``**{"--ca-cert": path}``."""
    out, i = [], 0
    while i < len(args):
        if args[i] in flags:
            if flags[args[i]] is not None:
                out += [args[i], flags[args[i]]]
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def test_link_errors_are_named_in_one_line_before_a_region_cluster_starts(two_clusters):
    """Each wrong setting of ``islands region join`` ends in seconds with rc 2 and one line on
    stderr naming the cause; no Ray cluster is started (so nothing registers or merges)."""
    from islands.link.security import throwaway_pki

    ctx, tmp = two_clusters, two_clusters["tmp"]
    other = throwaway_pki(str(tmp / "other-ca"))              # another CA entirely
    expired = throwaway_pki(str(tmp / "expired"), client_expired=True)
    wrong_token = tmp / "wrong-token"
    wrong_token.write_text("not-the-token\n")
    args = ctx["join_args"]
    cases = [
        ("wrong token", _with(args, **{"--token-file": str(wrong_token)}), "refused the token"),
        ("unknown CA", _with(args, **{"--ca-cert": other.ca_cert}), "unknown CA"),
        ("client certificate from another CA",
         _with(args, **{"--client-cert": other.client_cert, "--client-key": other.client_key}),
         "refused this region's client certificate"),
        ("missing client certificate", _with(args, **{"--client-cert": None,
                                                      "--client-key": None}),
         "requires a client certificate"),
        ("expired client certificate",
         _with(args, **{"--client-cert": expired.client_cert,
                        "--client-key": expired.client_key}), "expired"),
        ("plaintext against TLS", args + ["--insecure"], "speaks TLS"),
    ]
    seen = len(_home_events(tmp / "home"))
    for name, case_args, words in cases:
        t0 = time.time()
        done = subprocess.run(ISLANDS + case_args, capture_output=True, text=True,
                              env=ctx["env"], cwd=str(tmp), timeout=60)
        took = time.time() - t0
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        print(f"{name}: rc {done.returncode} in {took:.1f}s: {lines}")
        assert done.returncode == 2, (name, done.returncode, done.stdout, done.stderr)
        assert len(lines) == 1 and words in lines[0], (name, lines)
        assert "Ray cluster at" not in done.stdout and "Started a local Ray" not in done.stderr
        assert took < 15.0, f"{name}: {took:.1f}s"  # a process start (imports) and one call
    # Nothing of theirs reached the home's fleet: no new learner, no restart of far:0.
    new = [e for e in _home_events(tmp / "home")[seen:] if e.get("learner")]
    assert all(e["learner"] in ("home:0", "far:0") for e in new), new
    assert not [e for e in new if e["event"] in ("learner_restarted", "learner_launched")], new


def test_the_cli_operates_the_region_cluster_at_the_address_join_printed(two_clusters):
    """An operator's shell on the region's machine (none of the suite's Ray settings) reaches
    the region cluster with the 127.0.0.1 address `islands region join` printed."""
    from waiting import wait_for

    env = {k: v for k, v in two_clusters["env"].items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    address = two_clusters["address"]

    def islands(*args):
        done = subprocess.run(ISLANDS + list(args) + ["--address", address], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    table = json.loads(islands("status", "--json"))
    assert list(table["learners"]) == ["far:0"]   # the region cluster's own learners
    assert "slowed far:0 x2.0" in islands("chaos", "slowdown", "far:0", "--factor", "2",
                                          "--duration", "1")
    wait_for(lambda: [e for e in _events(two_clusters["agent"])
                      if e["event"] == "chaos" and e.get("target") == "far:0"], 60,
             "the region agent's chaos event for far:0")
    # `islands region leave` while the join runs: refused, naming it; nothing is ended.
    done = subprocess.run(ISLANDS + ["region", "leave", "--address", address], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "refused: the join of region 'far' into job" in done.stderr, done.stderr[-2000:]
    assert "is still running" in done.stderr and "ended" not in done.stdout, done.stderr
    assert list(json.loads(islands("status", "--json"))["learners"]) == ["far:0"]


def _lose_machine(proc) -> float:
    """``proc``'s whole cluster dies at once, as a lost machine: SIGKILL to every process of its
    tree (its Ray daemons and their workers, which are not in its process group) and to its
    group. Returns the time of the kill."""
    import psutil

    tree, new = [], process_tree(proc.pid)
    t_kill = time.time()
    while new:   # all silent at once (then killed one by one), with any worker forked meanwhile
        for p in new:
            try:
                p.suspend()
            except psutil.NoSuchProcess:
                pass
        tree += new
        new = [c for p in new if p.is_running() for c in p.children()
               if c not in tree]
    left = end_process_tree(tree)
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # not reaped yet: still its group's pid
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    assert not left, f"processes of a lost cluster outlived SIGKILL: {left}"
    return t_kill


def _kill_the_agents_cluster(ctx):
    """The module's agent's whole cluster dies at once (:func:`_lose_machine`). This process
    leaves that cluster first: the module fixture's connection to it (``ctx["link"]``,
    ``ctx["agent"]``) must not outlive it, nor reach the next test, whose own ``ray.init`` it
    would refuse. Returns the time of the kill, or None where the agent is gone already (a test
    before this one killed it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    region = ctx["region"]
    if region.poll() is not None:
        return None
    return _lose_machine(region)


def test_a_killed_agents_learner_is_failed_at_home_within_the_hang_timeout(two_clusters):
    """The agent's whole cluster dies at once (every process of it SIGKILLed, as a lost machine):
    its learner stops beating, and the home says so within the hang timeout (20 s here)."""
    from waiting import wait_for

    home_dir = two_clusters["tmp"] / "home"
    # Training at home first (the books it must show).
    wait_for(lambda: (_home_rows(home_dir) or [{}])[-1].get("learners", {}).get(
        "far:0", {}).get("state") == "training", 120, "far:0 training at home")
    seen = len(_home_events(home_dir))
    t_kill = _kill_the_agents_cluster(two_clusters)
    assert t_kill is not None, "the module's agent was gone before this test"

    def unreachable():
        return next((e for e in _home_events(home_dir)[seen:]
                     if e["event"] == "learner_unreachable" and e["learner"] == "far:0"), None)

    event = wait_for(unreachable, HANG_TIMEOUT_S + 15.0, "far:0 unreachable at home")
    detected_s = event["t"] - t_kill
    print(f"far:0 seen unreachable at home {detected_s:.1f}s after its agent's cluster died")
    # Its last heartbeat left up to 2 s before the kill (beats every 1 s, reports every 1 s).
    assert detected_s <= HANG_TIMEOUT_S + 4.0, f"{detected_s:.1f}s: beyond the hang timeout"
    new = _home_events(home_dir)[seen:]
    failed = [e for e in new if e["event"] == "learner_failed" and e["learner"] == "far:0"]
    assert failed and failed[0]["cause"] == "hang", failed
    silent_s = float(failed[0]["detail"].split(" for ", 1)[1].split("s;", 1)[0])
    # the hang timeout, as a local one's
    assert HANG_TIMEOUT_S <= silent_s <= HANG_TIMEOUT_S + 2.0, failed[0]["detail"]
    # Its state, the progress line's count and the books say so.
    row = wait_for(lambda: next((r for r in reversed(_home_rows(home_dir))
                                 if r.get("learners", {}).get("far:0", {}).get("state")
                                 == "unreachable"), None), 30, "a row with far:0 unreachable")
    assert row["alive"] == 1 and row["total"] == 2, (row["alive"], row["total"])
    assert row["tokens"]["balanced"]
    recovery = row["goodput"]["badput_s"].get("infrastructure_recovery", 0.0)
    later = wait_for(lambda: next((r for r in reversed(_home_rows(home_dir)) if r["elapsed_s"]
                                   > row["elapsed_s"] + 2), None), 30, "a later row")
    assert later["goodput"]["badput_s"]["infrastructure_recovery"] > recovery + 1.0, (
        "an unreachable learner's seconds count as recovery badput")
    assert later["learners"]["far:0"]["state"] == "unreachable"  # nothing restarts it at home


def _ray_processes_of(address):
    """Pids of live processes whose command line names this Ray cluster's GCS (its daemons)."""
    port = address.rsplit(":", 1)[1]
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"127.0.0.1:{port}" in cmd or f"gcs_server_port={port}" in cmd:
            pids.append(int(pid))
    return pids


@pytest.mark.slow  # an agent rejoins, is stopped, another joins and the home ends: ~50 s
def test_an_agent_leaves_cleanly_on_sigterm_and_with_its_home_job(two_clusters):
    """An agent that comes back re-registers its learner at home (it was unreachable); SIGTERM
    ends an agent cleanly with no Ray daemon of its cluster left; ending the home job ends a
    joined agent within link.agent_home_timeout_s (20 s here)."""
    from waiting import wait_for

    ctx, home_dir = two_clusters, two_clusters["tmp"] / "home"
    far_state = lambda: (_home_rows(home_dir) or [{}])[-1].get(  # noqa: E731
        "learners", {}).get("far:0", {}).get("state")
    agents = []
    try:
        # 0. The module's agent is gone (the test above kills it; run alone, this one does, once
        #    far:0 trains: a learner still starting is not found unreachable) and far:0 is
        #    unreachable at home.
        if ctx["region"].poll() is None:
            wait_for(lambda: far_state() == "training", 180, "far:0 training at home",
                     describe=far_state)
        _kill_the_agents_cluster(ctx)
        wait_for(lambda: far_state() == "unreachable", HANG_TIMEOUT_S + 60,
                 "far:0 unreachable at home", describe=far_state)
        # 1. The agent comes back: the home takes far:0 back from unreachable.
        seen = len(_home_events(home_dir))
        agent, address = _start_region(ctx["join_args"], ctx["env"], ctx["tmp"])
        agents.append(agent)
        wait_for(lambda: far_state() == "training", 180, "far:0 training at home again",
                 describe=far_state)
        # ... and trains on there (issue 36: every rejoin's pushes were refused as outliers,
        # with no live peer in its region, until it was quarantined and retired): the home
        # merges 3 rounds of its new incarnation's pushes, none refused as garbage.
        import ray

        ray.init(address=address, namespace="islands", log_to_driver=False)
        try:
            link = ray.get_actor("islands:syncer", namespace="islands")
            far = lambda: ray.get(link.status.remote(), timeout=30).ledger.get(  # noqa: E731
                "far:0") or {}
            incarnation = _home_rows(home_dir)[-1]["learners"]["far:0"]["incarnation"]
            first = wait_for(lambda: far().get("incarnation") == incarnation and far(), 120,
                             "far:0's rejoined incarnation in the home's ledger",
                             describe=lambda: (incarnation, far()))
            wait_for(lambda: far().get("applied_step", 0) >= first["applied_step"] + 12
                     and far().get("incarnation") == incarnation, 180,
                     "far:0's rejoined incarnation merged 3 rounds at home",
                     describe=lambda: (first, far()))
        finally:
            ray.shutdown()
        new = [e for e in _home_events(home_dir)[seen:] if e.get("learner") == "far:0"]
        garbage = [e for e in new if e["event"] == "push_refused" and e["reason"] in (
            "outlier_norm", "non_finite", "bad_shape", "bad_counters")]
        assert not garbage, garbage[:3]
        assert not [e for e in new if e["event"] in ("learner_quarantined", "learner_retired")]
        # 2. SIGTERM: the agent stops its learner, shuts its cluster down and exits 0.
        assert _ray_processes_of(address), "no Ray daemons found for the region's cluster"
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=120) == 0
        left = wait_for(lambda: not _ray_processes_of(address) or None, 30,
                        "the region cluster's Ray daemons to exit",
                        describe=lambda: _ray_processes_of(address))
        assert left
        # 3. Another agent joins; then the home job ends (a clean stop): the agent leaves.
        agent, address = _start_region(ctx["join_args"], ctx["env"], ctx["tmp"])
        agents.append(agent)
        _wait_line(agent.lines, agent, "learner_ready", 180)  # reporting to home by now
        t_end = time.time()
        ctx["home"].send_signal(signal.SIGTERM)   # a clean stop (see _stop)
        rc = agent.wait(timeout=20.0 + 30.0)
        took = time.time() - t_end
        out = []
        while not agent.lines.empty():
            out.append(agent.lines.get())
        said = [line for line in out if "stopping the learners and leaving" in line]
        print(f"the agent left {took:.1f}s after the home job was told to stop: {said}")
        assert rc == 0 and said, out[-20:]
        assert "home job 'linktest'" in said[0]  # told by the home, not timed out
        assert took <= 20.0, f"{took:.1f}s: beyond link.agent_home_timeout_s"
        # The home, stopped by SIGTERM, exits 143 (128 + SIGTERM) after its clean stop, its
        # summary saying so (it aborted at exit, 134, after the summary).
        rc = ctx["home"].wait(timeout=120)
        home_out = []
        while not ctx["home_lines"].empty():
            home_out.append(ctx["home_lines"].get())
        assert rc == 143, home_out[-20:]
        assert json.loads((home_dir / "summary.json").read_text())["stopped_by"] == "sigterm"
        wait_for(lambda: not _ray_processes_of(address) or None, 30,
                 "the left agent's Ray daemons to exit",
                 describe=lambda: _ray_processes_of(address))
    finally:
        _stop_all(*agents)
