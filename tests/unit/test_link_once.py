"""A push crosses the link exactly once: when a cut connection loses its reply, the region's
retry is answered with the first arrival's reply and the home's syncer never takes it twice
(link/server.py: PushOnce; link/client.py gives each push an id its retries share)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from islands.link.server import PushOnce


def _wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- PushOnce on its own -----------------------------------------------------------------------
def test_a_retry_while_the_first_arrival_is_in_flight_gets_its_reply_and_takes_nothing():
    once = PushOnce()
    release, taken = threading.Event(), []

    def take():
        taken.append(1)
        release.wait(10)
        return "merged v7"

    results = []
    first = threading.Thread(target=lambda: results.append(once.run("a", take)))
    first.start()
    _wait_for(lambda: taken, what="the first arrival to reach the syncer")
    retry = threading.Thread(target=lambda: results.append(once.run("a", take)))
    retry.start()
    release.set()
    first.join(10), retry.join(10)
    assert results == ["merged v7", "merged v7"] and len(taken) == 1
    assert once.counts["taken"] == 1 and once.counts["answered_again"] == 1
    assert once.run("a", take) == "merged v7" and len(taken) == 1   # a late retry, too


def test_a_first_arrival_that_failed_lets_the_retry_go_to_the_syncer():
    once = PushOnce()
    calls = []

    def take():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the home syncer is restarting")
        return "merged"

    with pytest.raises(RuntimeError, match="restarting"):
        once.run("b", take)
    assert once.run("b", take) == "merged" and len(calls) == 2


def test_pushes_without_an_id_are_each_taken():
    once = PushOnce()
    calls = []
    once.run("", lambda: calls.append(1))
    once.run("", lambda: calls.append(1))
    assert len(calls) == 2 and not once.entries


def test_a_retry_whose_own_call_ended_gives_up_without_taking_it():
    once = PushOnce()
    release = threading.Event()
    first = threading.Thread(target=lambda: once.run("c", lambda: release.wait(10)))
    first.start()
    _wait_for(lambda: "c" in once.entries, what="the first arrival")
    with pytest.raises(ConnectionAbortedError, match="push c"):
        once.run("c", lambda: pytest.fail("taken twice"), is_active=lambda: False, poll_s=0.01)
    release.set()
    first.join(10)


def test_only_answered_pushes_are_let_go_of_beyond_the_limit():
    once = PushOnce(keep=2)
    release = threading.Event()
    slow = threading.Thread(target=lambda: once.run("in-flight", lambda: release.wait(10)))
    slow.start()
    _wait_for(lambda: "in-flight" in once.entries, what="the slow push")
    for i in range(4):
        once.run(f"p{i}", lambda: "ok")
    assert list(once.entries) == ["in-flight", "p3"]   # the oldest answered went first
    release.set()
    slow.join(10)


# -- over a real gRPC link whose home is partitioned mid-push ----------------------------------
class _SlowHome:
    """A home backend whose syncer answers a push when the test releases it (its round merges
    then); counts the pushes it took."""

    def __init__(self):
        self.taken = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def epoch(self):
        return 0

    def push(self, push):
        from islands.syncer.actor import Reply

        with self.lock:
            self.taken += 1
        assert self.release.wait(30)
        return Reply("merged", push.fragment, 0, {"w": np.full(3, 2.5, np.float32)}, 8)


@pytest.mark.parametrize("merged", ["while_cut", "after_the_retry_arrived"])
def test_a_push_whose_reply_a_home_partition_cut_is_merged_once_and_answered(merged):
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.server import Partitionable, ServerSettings, serve
    from islands.syncer import codec as C
    from islands.syncer.validate import Push

    settings = ServerSettings(port=0, token="t")
    config = '{"name": "j", "regions": {"far": {"learners": 1, "remote": true}}}'
    home = _SlowHome()
    server, port, servicer = serve(home, config, settings, with_servicer=True)
    net = Partitionable(servicer, settings, server, port)
    client = LinkClient(ClientSettings(home=f"127.0.0.1:{port}", region="far", token="t",
                                       tls=False, report_every_s=3600, backoff_max_s=0.5))
    codec = C.make_codec("int8", block_size=4)
    codes = C.to_numpy(C.encode_tree(codec, {"w": np.array([0.5, -1.0, 0.25], np.float32)}))
    push = Push(learner="far:0", fragment=0, codes=codes, base_version=7, epoch=0, c_tokens=64,
                c_steps=2, incarnation=0, step=2, tokens_done=64, compute_s=0.1, wire_bytes=8)
    replies = []
    sender = threading.Thread(target=lambda: replies.append(client._send_push(push)))
    try:
        sender.start()
        _wait_for(lambda: home.taken == 1, what="the push to reach the home's syncer")
        net.partition(1.0)   # the connection and the call in flight are cut; the client retries
        if merged == "while_cut":
            home.release.set()
        else:
            _wait_for(lambda: not net.partitioned(), what="the partition to end")
            _wait_for(lambda: servicer.pushes.counts["arrivals"] >= 2,
                      what="the client's retry to reach home")
            home.release.set()
        sender.join(30)
        assert not sender.is_alive()
        (reply,) = replies
        assert reply.status == "merged" and reply.version == 8
        assert reply.params["w"].tolist() == [2.5, 2.5, 2.5]
        assert home.taken == 1                      # merged once: the retry took nothing
        assert client.counts["Push_retries"] >= 1   # ... though the push did go again
        assert servicer.pushes.counts["answered_again"] >= 1
        assert client.counts.get("pushes_lost", 0) == 0
    finally:
        home.release.set()
        client.close()
        net.stop(0)
