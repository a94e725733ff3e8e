"""The pure pieces of ``benchmarks/long_run.py``: where the service kills fall, the memory windows
compared, the books and versions checks. The run itself is a benchmark (BENCHMARKS.md)."""

from __future__ import annotations

import doctest
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import long_run  # noqa: E402


def test_doctests():
    assert doctest.testmod(long_run).failed == 0


def test_service_kills_fall_between_the_memory_windows():
    failures = 2000
    plan = long_run.service_kill_plan(failures, 10, 3, 3)
    window = long_run.window_size(failures)
    assert [k for _, k in plan].count("syncer") == 10 and len(plan) == 16
    assert all(window <= at < failures - window for at, _ in plan)
    assert [at for at, _ in plan] == sorted(at for at, _ in plan)
    assert long_run.window_size(60) == 15 and long_run.window_size(2000) == 100


def test_memory_that_grows_with_failures_is_out_of_the_bar():
    samples = [(n, 100_000_000 + 20_000 * n) for n in range(2000)]   # 20 kB per failure
    m = long_run.memory_windows(samples, 2000, 100)
    assert m["within"] is False and m["ratio"] > 1.3
    flat = long_run.memory_windows([(n, 100_000_000 + (n % 7)) for n in range(2000)], 2000, 100)
    assert flat["within"] is True


def test_since_restart_reads_only_the_last_process():
    # A restart at failure 1000 resets the memory: the growth after it is still seen.
    samples = [(n, 200 if n < 1000 else 100 + (n - 1000), 1 if n < 1000 else 2)
               for n in range(2000)]
    m = long_run.since_restart(samples, 2000, 100)
    assert m["pid"] == 2 and m["from_failure"] == 1000 and m["within"] is False


def test_books_check_term_by_term():
    good = {"fragment_tokens": {"processed": 10, "applied": 6, "dropped": 3, "in_flight": 1},
            "tokens_dropped": 1.5, "tokens_dropped_by": {"crash": 1.0, "stopped": 0.5},
            "books_balanced": True}
    assert long_run.books_check(good)["balanced"]
    off = {**good, "fragment_tokens": {**good["fragment_tokens"], "applied": 5}}
    assert not long_run.books_check(off)["balanced"]
    reasons = {**good, "tokens_dropped_by": {"crash": 1.0}}
    assert not long_run.books_check(reasons)["balanced"]


def test_versions_going_back_are_caught():
    assert long_run.versions_monotonic([(0, 1), (1, 1), (0, 2), (0, 3)]) == (True, 0)
    assert long_run.versions_monotonic([(0, 1), (0, 4), (0, 2)]) == (False, 2)


def test_fds_back_per_role_and_learners_against_the_first_window():
    start = {"driver": 40, "controller": 57, "syncer": 55, "link": 49, "learners": [46, 46]}
    same = {**start, "learners": [48, 47]}
    assert long_run.fds_verdict(start, same, 48)["back"]
    # A long-lived process one fd above its start is not back.
    assert not long_run.fds_verdict(start, {**same, "controller": 58}, 48)["back"]
    # A learner above every learner of the first window is not back; nor is one with no sample.
    assert not long_run.fds_verdict(start, {**same, "learners": [49, 46]}, 48)["back"]
    assert long_run.fds_verdict(start, {**same, "learners": [46]}, None)["back"]
    assert not long_run.fds_verdict(start, {**same, "learners": [47]}, None)["back"]
    assert not long_run.fds_verdict(start, {**same, "learners": []}, 48)["back"]


def test_anonymous_memory_is_read_from_the_process_status():
    """``RssAnon`` of this very process: a positive count of bytes, below its whole RSS (which
    also counts the libraries' pages); a process that is gone reads None."""
    import os

    import psutil

    anon = long_run.anon_bytes(os.getpid())
    assert anon is not None and 0 < anon <= psutil.Process().memory_info().rss
    assert long_run.anon_bytes(2 ** 22 + 7) is None   # (above Linux's default pid_max)


def test_connections_between_the_listed_processes_are_counted_at_both_ends():
    """A child process connects to this one three times (this one accepts). Each side holds
    three established connections to the other, counted at most two per pair (so sockets piling
    up between two processes still count as theirs); the two the child closes (this end of each
    then in CLOSE_WAIT) count for neither; a process not listed is nobody's peer, and one gone is left
    out."""
    import os
    import socket
    import subprocess
    import sys

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import socket,sys\n"
         f"cs=[socket.create_connection(('127.0.0.1',{port})) for _ in range(3)]\n"
         "print('up',flush=True)\n"
         "sys.stdin.readline(); cs[0].close(); cs[1].close()\n"
         "print('closed',flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    accepted = []
    try:
        assert child.stdout.readline() == "up\n"   # connected: the child says so, no sleep
        accepted = [server.accept()[0] for _ in range(3)]
        me = os.getpid()
        read = long_run.fds_and_peer_connections([me, child.pid])
        assert read[me][1] == 2 and read[child.pid][1] == 2      # three each, two counted
        assert read[me][0] >= 4 and read[child.pid][0] >= 3      # and the fds are read
        assert long_run.fds_and_peer_connections([me])[me][1] == 0   # the child is not listed
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.stdout.readline() == "closed\n"
        # Two closed by the child: this end of each is in CLOSE_WAIT, not a peer connection;
        # the one left open is counted once at each end.
        expected = {me: 1, child.pid: 1}
        assert wait_for_peers(long_run, [me, child.pid], expected) == expected
        assert long_run.fds_and_peer_connections([2 ** 22 + 7]) == {}
    finally:
        for a in accepted:
            a.close()
        child.stdin.close()
        child.wait(timeout=30)
        server.close()


def wait_for_peers(module, pids, expected: dict, timeout_s: float = 10.0) -> dict:
    """The peer counts once they are ``expected``, or the last read at the timeout: the FIN of
    a closed connection reaches the other end asynchronously."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        now = {pid: peers for pid, (_, peers) in module.fds_and_peer_connections(pids).items()}
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_each_process_count_is_less_its_connections_to_the_listed_ones():
    """``net_fds``: a learner gone before the read is left out (the verdict then sees the list
    short), a role that is down or unread is None, and each count is its fds less its peers."""
    read = {11: (50, 3), 12: (47, 1), 21: (60, 4), 99: (43, 5)}
    learners, raw, roles, roles_raw = long_run.net_fds(
        read, [11, 12, 13], {"controller": 21, "syncer": None, "link": 22, "driver": 99})
    assert (learners, raw) == ([47, 46], [50, 47])
    assert roles == {"controller": 56, "syncer": None, "link": None, "driver": 38}
    assert roles_raw == {"controller": 60, "syncer": None, "link": None, "driver": 43}
    start = {"controller": 56, "syncer": 49, "driver": 38, "learners": [47, 46, 46]}
    end = {**roles, "learners": learners}
    check = long_run.fds_verdict(start, end, 47, learners_training=3)
    assert not check["syncer"] and not check["learners"] and not check["back"]
    assert check["controller"] and check["driver"]


def test_the_driver_is_listed_last(monkeypatch):
    """``job_fds`` lists the learners, the node's own Ray processes (peers, not counted), the
    services found, then this process (the driver) last; a role that is down is not listed and
    comes out None; each count is less its peers."""
    import os

    listed = []

    def read(pids):
        listed.extend(pids)
        return {pid: (40 + i, i) for i, pid in enumerate(pids)}

    monkeypatch.setattr(long_run, "fds_and_peer_connections", read)
    learners, raw, roles, roles_raw = long_run.job_fds(
        [101, 102], {"controller": 201, "syncer": None, "link": 203}, node_pids=[301])
    assert listed == [101, 102, 301, 201, 203, os.getpid()]   # the node's own: peers only
    assert (learners, raw) == ([40, 40], [40, 41])
    assert roles == {"controller": 40, "syncer": None, "link": 40, "driver": 40}
    assert roles_raw == {"controller": 43, "syncer": None, "link": 44, "driver": 45}
