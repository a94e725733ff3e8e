"""The link server's exactly-once replies outlive its process (link/server.py: ReplyJournal):
a reply journaled by one life answers the retry that reaches the next, a push the earlier life
took but never got an answer for is answered as in doubt (never sent to the syncer again), a torn
last line is cut off, and the file stays bounded. Over a real gRPC link: a server that dies with
a journaled reply still on its way, and its successor on the same port answering the retry."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from islands.link.server import IN_DOUBT, LinkServer, PushOnce, ReplyJournal, ServerSettings


def _wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _reply(version: int = 8, value: float = 2.5):
    from islands.syncer.actor import Reply

    return Reply("merged", 0, 0, {"w": np.full(3, value, np.float32)}, version)


def _lines(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_reply_journaled_by_one_life_answers_the_retry_in_the_next(tmp_path):
    first = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert first.run("a", lambda: _reply(), about={"learner": "far:0"}).version == 8
    kinds = [(r["id"], r["kind"]) for r in _lines(tmp_path / ReplyJournal.FILE)]
    assert kinds == [("a", "taken"), ("a", "reply")]   # taken before the syncer, then its reply

    # The server's process died; a new one over the same directory gets the region's retry.
    again = PushOnce(journal=ReplyJournal(str(tmp_path)))
    reply = again.run("a", lambda: pytest.fail("merged twice"))
    assert reply.status.value == "merged" and reply.version == 8
    assert reply.params["w"].tolist() == [2.5, 2.5, 2.5]
    assert again.counts["answered_from_journal"] == 1 and again.counts["taken"] == 0
    assert again.run("a", lambda: pytest.fail("merged twice")).version == 8   # a later retry too
    assert again.run("b", lambda: _reply(9)).version == 9   # a new push goes to the syncer


def test_a_push_taken_but_never_answered_is_in_doubt_and_not_taken_again(tmp_path):
    journal = ReplyJournal(str(tmp_path))
    journal.taken("c", {"learner": "far:0", "fragment": 1, "step": 12})
    # ... and the process died while the syncer held it.
    again = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert again.recovered == {"c": ("taken", {"learner": "far:0", "fragment": 1, "step": 12})}
    with pytest.raises(RuntimeError, match="in doubt"):   # nothing to answer it with: no syncer
        again.run("c", lambda: pytest.fail("sent to the syncer again"))
    refused = _reply(5)
    answered = again.run("c", lambda: pytest.fail("sent to the syncer again"),
                         in_doubt=lambda: refused)
    assert answered is refused and again.counts["in_doubt"] == 2
    # Its answer is journaled in turn: a third life gives the same one.
    third = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert third.run("c", lambda: pytest.fail("taken"), in_doubt=lambda: pytest.fail("asked")
                     ).version == 5


def test_a_failed_first_arrival_lets_the_next_life_take_it(tmp_path):
    first = PushOnce(journal=ReplyJournal(str(tmp_path)))

    def down():
        raise RuntimeError("the home syncer is restarting")

    with pytest.raises(RuntimeError):
        first.run("d", down)
    again = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert "d" not in again.recovered
    assert again.run("d", lambda: _reply(3)).version == 3


def test_a_torn_last_line_is_cut_off_and_the_rest_answers(tmp_path):
    first = PushOnce(journal=ReplyJournal(str(tmp_path)))
    first.run("e", lambda: _reply(4))
    path = tmp_path / ReplyJournal.FILE
    whole = path.read_bytes()
    with open(path, "ab") as f:   # the process died mid-line (the reply of push "f")
        f.write(b'{"id":"f","kind":"reply","reply":"CgZtZXJn')
    journal = ReplyJournal(str(tmp_path))
    assert journal.counts["torn"] == 1 and path.read_bytes() == whole
    again = PushOnce(journal=journal)
    assert again.run("e", lambda: pytest.fail("merged twice")).version == 4
    assert again.run("g", lambda: _reply(6)).version == 6
    assert [r["id"] for r in _lines(path)] == ["e", "e", "g", "g"]   # every line whole again


def test_an_unreadable_line_is_skipped(tmp_path):
    path = tmp_path / ReplyJournal.FILE
    path.write_text('not json\n{"kind": "reply"}\n')
    journal = ReplyJournal(str(tmp_path))
    assert journal.recovered() == {} and journal.counts["unreadable"] == 2


def test_the_journal_compacts_by_bytes_to_the_newest_pushes(tmp_path):
    # Each push journals a "taken" line and a "reply" line of about the same size; a bound of 3
    # reply lines' bytes compacts the file once it holds 6, to the newest pushes' last lines
    # within 3 (2 or 3 of them, as the lines' lengths fall), off the lock.
    probe = ReplyJournal(str(tmp_path / "probe"))
    probe.answered("p0", _reply(0))
    reply_line = (tmp_path / "probe" / ReplyJournal.FILE).stat().st_size
    bound = 3 * reply_line
    journal = ReplyJournal(str(tmp_path), max_bytes=bound)
    once = PushOnce(journal=journal)
    path = tmp_path / ReplyJournal.FILE
    for i in range(10):
        once.run(f"p{i}", lambda i=i: _reply(i))
        assert journal.wait_compacted(10.0)
        assert path.stat().st_size == journal.size < 2 * bound   # never left at the trigger
    assert journal.counts["compacted"] >= 2 and journal.counts["write_errors"] == 0
    ids = [r["id"] for r in _lines(path)]
    assert ids[-1] == "p9" and "p0" not in ids and len(set(ids)) >= 2
    again = PushOnce(journal=ReplyJournal(str(tmp_path), max_bytes=bound))
    assert again.run("p9", lambda: pytest.fail("merged twice")).version == 9
    with pytest.raises(ValueError, match="max_bytes"):
        ReplyJournal(str(tmp_path), max_bytes=0)


def test_a_reply_larger_than_the_bound_is_kept_alone(tmp_path):
    journal = ReplyJournal(str(tmp_path), max_bytes=10)   # smaller than any line
    once = PushOnce(journal=journal)
    for i in range(4):
        once.run(f"p{i}", lambda i=i: _reply(i))
        journal.wait_compacted(10.0)
    # the newest push's lines only (its reply after its "taken" when that was journaled while
    # the last compaction ran): its reply still answers a retry
    records = _lines(tmp_path / ReplyJournal.FILE)
    assert {r["id"] for r in records} == {"p3"} and records[-1]["kind"] == "reply"
    again = PushOnce(journal=ReplyJournal(str(tmp_path), max_bytes=10))
    assert again.run("p3", lambda: pytest.fail("merged twice")).version == 3


def test_lines_journaled_while_a_compaction_runs_are_kept_and_not_held_up(tmp_path):
    """The compaction reads and rewrites off the lock: pushes journal meanwhile (the lock is
    free while ``_kept`` reads), and their lines follow the kept ones after the swap."""
    journal = ReplyJournal(str(tmp_path), max_bytes=1)
    for i in range(3):
        journal.answered(f"old{i}", _reply(i))
    journal.wait_compacted(10.0)          # (each append past the bound starts one)
    cut = journal.size
    kept, total = journal._kept(cut)      # the compaction's read, as its thread runs it
    assert len(kept) == 1 and journal.lock.acquire(blocking=False)   # nobody holds the lock
    journal.lock.release()
    journal._compaction = "running"       # (the thread's mark: no second one starts)
    journal.taken("new", {"learner": "far:0"})   # journaled mid-compaction
    journal.answered("new", _reply(7))
    journal._compact(cut)
    ids = [r["id"] for r in _lines(tmp_path / ReplyJournal.FILE)]
    assert ids == ["old2", "new", "new"] and journal._compaction is None
    assert journal.size == (tmp_path / ReplyJournal.FILE).stat().st_size
    again = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert again.run("new", lambda: pytest.fail("merged twice")).version == 7
    assert again.run("old2", lambda: pytest.fail("merged twice")).version == 2


def test_a_restarted_link_server_binds_its_port_again_and_counts_its_incarnation(tmp_path):
    """As Ray restarts the actor: the same arguments (``link.port`` 0, one start id)."""
    config = '{"name": "j", "regions": {"far": {"learners": 1, "remote": true}}}'
    settings = ServerSettings(port=0, token="t")
    args = (config, settings, [["w"]], ((0,),))
    first = LinkServer(*args, state_dir=str(tmp_path), start_id="run-1")
    port = first.port
    first.stop()
    again = LinkServer(*args, state_dir=str(tmp_path), start_id="run-1")
    try:
        assert again.port == port and again.address() == first.address()
        assert (first.incarnation, again.incarnation) == (0, 1)
        assert again.info()["incarnation"] == 1
    finally:
        again.stop()
    fresh = LinkServer(*args, state_dir=str(tmp_path), start_id="run-2")   # a new job run
    try:
        assert fresh.incarnation == 0
    finally:
        fresh.stop()


# -- over a real gRPC link whose server dies with a journaled reply on its way ------------------
class _Home:
    """A home backend whose syncer merges each push at once (or fails the test if it must not
    be asked); counts the pushes it took."""

    def __init__(self, refuse: bool = False):
        self.taken, self.refuse = 0, refuse

    def epoch(self):
        return 0

    def push(self, push):
        from islands.syncer.actor import Reply

        if self.refuse:
            raise AssertionError("the restarted server sent a push to the syncer again")
        self.taken += 1
        return Reply("merged", push.fragment, 0, {"w": np.full(3, 2.5, np.float32)}, 8)

    def fragment(self, p):
        return {"w": np.zeros(3, np.float32)}, 8


def test_a_reply_lost_with_the_server_is_answered_from_the_journal_by_its_successor(tmp_path):
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.server import serve
    from islands.syncer import codec as C
    from islands.syncer.validate import Push

    settings = ServerSettings(port=0, token="t")
    config = '{"name": "j", "regions": {"far": {"learners": 1, "remote": true}}}'
    home = _Home()
    server, port, servicer = serve(home, config, settings, with_servicer=True,
                                   journal=ReplyJournal(str(tmp_path)))
    servicer.hold_until_s = time.time() + 60   # the reply is journaled, then held
    client = LinkClient(ClientSettings(home=f"127.0.0.1:{port}", region="far", token="t",
                                       tls=False, report_every_s=3600, backoff_max_s=0.5))
    codec = C.make_codec("int8", block_size=4)
    codes = C.to_numpy(C.encode_tree(codec, {"w": np.array([0.5, -1.0, 0.25], np.float32)}))
    push = Push(learner="far:0", fragment=0, codes=codes, base_version=7, epoch=0, c_tokens=64,
                c_steps=2, incarnation=0, step=2, tokens_done=64, compute_s=0.1, wire_bytes=8)
    replies = []
    sender = threading.Thread(target=lambda: replies.append(client._send_push(push)))
    later = None
    try:
        sender.start()
        _wait_for(lambda: servicer.held == 1, what="the merged push's reply to be held")
        server.stop(grace=None).wait(5)   # the server dies: the reply never left
        later, _, successor = serve(_Home(refuse=True), config,
                                    ServerSettings(port=port, token="t"), with_servicer=True,
                                    journal=ReplyJournal(str(tmp_path)))
        sender.join(30)
        assert not sender.is_alive()
        (reply,) = replies
        assert reply.status == "merged" and reply.version == 8
        assert home.taken == 1                        # merged once, by the first server
        assert successor.pushes.counts["answered_from_journal"] == 1
        assert client.counts["Push_retries"] >= 1 and client.counts.get("pushes_lost", 0) == 0
    finally:
        servicer.hold_until_s = 0.0
        client.close()
        server.stop(0)
        if later is not None:
            later.stop(0)


def test_a_push_in_flight_when_the_server_died_is_refused_in_doubt_with_the_fragment(tmp_path):
    from islands.link import link_pb2 as pb
    from islands.link import wire
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.server import serve
    from islands.syncer import codec as C
    from islands.syncer.validate import Push

    config = '{"name": "j", "regions": {"far": {"learners": 1, "remote": true}}}'
    ReplyJournal(str(tmp_path)).taken("in-flight", {"learner": "far:0", "fragment": 0})
    server, port, servicer = serve(_Home(refuse=True), config, ServerSettings(port=0, token="t"),
                                   with_servicer=True, journal=ReplyJournal(str(tmp_path)))
    client = LinkClient(ClientSettings(home=f"127.0.0.1:{port}", region="far", token="t",
                                       tls=False, report_every_s=3600))
    try:
        codec = C.make_codec("int8", block_size=4)
        codes = C.to_numpy(C.encode_tree(codec, {"w": np.ones(3, np.float32)}))
        push = Push(learner="far:0", fragment=0, codes=codes, base_version=7, epoch=0,
                    c_tokens=64, c_steps=2, incarnation=0, step=2, tokens_done=64,
                    compute_s=0.1, wire_bytes=8)
        request = wire.push_to_pb(push)
        request.push_id = "in-flight"   # the retry of the push the earlier life took
        reply = wire.reply_from_pb(client._streamed("Push", request, pb.PushReply, 30))
        assert reply.status.value == "rejected" and reply.reason == IN_DOUBT
        assert reply.version == 8 and reply.params["w"].tolist() == [0.0, 0.0, 0.0]
        assert servicer.pushes.counts["in_doubt"] == 1
    finally:
        client.close()
        server.stop(0)


def _compaction_errors_logged(caplog) -> list:
    return [r for r in caplog.records
            if r.levelname == "ERROR" and "compaction failed" in r.getMessage()]


def test_a_failed_compaction_backs_off_and_says_so_once(tmp_path, caplog):
    """The compaction cannot write its temporary file (a folder holds its place): the journal
    goes on taking replies, does not try again at every append but once the file grew by
    another 2 × max_bytes, logs the failure once, and compacts again once it can."""
    import logging

    caplog.set_level(logging.DEBUG, logger="islands.link")
    probe = ReplyJournal(str(tmp_path / "probe"))
    probe.answered("p0", _reply(0))
    line = (tmp_path / "probe" / ReplyJournal.FILE).stat().st_size
    bound = 2 * line - 8   # (the lines' timestamps differ in length by a few bytes)
    journal = ReplyJournal(str(tmp_path), max_bytes=bound)
    path = tmp_path / ReplyJournal.FILE
    (tmp_path / (ReplyJournal.FILE + ".tmp")).mkdir()
    for i in range(4):                    # 4 lines = 2 × bound: the first try, which fails
        journal.answered(f"p{i}", _reply(i))
        assert journal.wait_compacted(10.0)
    assert journal.counts["compaction_errors"] == 1
    for i in range(4, 7):                 # 3 more lines: less than another 2 × bound
        journal.answered(f"p{i}", _reply(i))
        assert journal.wait_compacted(10.0)
    assert journal.counts["compaction_errors"] == 1, "tried again at an append"
    journal.answered("p7", _reply(7))     # 2 × bound more: tried again, fails again
    assert journal.wait_compacted(10.0)
    assert journal.counts["compaction_errors"] == 2
    assert len(_compaction_errors_logged(caplog)) == 1, "logged more than once"
    assert journal.size == path.stat().st_size and journal.counts["write_errors"] == 0
    (tmp_path / (ReplyJournal.FILE + ".tmp")).rmdir()
    for i in range(8, 12):               # 4 more lines: the next try, which works
        journal.answered(f"p{i}", _reply(i))
        assert journal.wait_compacted(10.0)
    assert journal.counts["compacted"] == 1
    assert any("compaction works again" in r.getMessage() for r in caplog.records)
    assert journal.size == path.stat().st_size < 2 * bound
    again = PushOnce(journal=ReplyJournal(str(tmp_path), max_bytes=bound))
    assert again.run("p11", lambda: pytest.fail("merged twice")).version == 11


def test_a_write_cut_short_is_cut_back_and_the_size_recounted(tmp_path):
    """A real partial write: the file-size limit (RLIMIT_FSIZE) stops a reply's line halfway.
    The torn part is cut off, ``size`` is the file's, and the next reply's line is whole (not
    glued to the torn one), so a retry of it is answered from the journal."""
    resource = pytest.importorskip("resource")
    import signal

    journal = ReplyJournal(str(tmp_path))
    path = tmp_path / ReplyJournal.FILE
    big = _reply(0)
    big = type(big)("merged", 0, 0, {"w": np.zeros(1 << 18, np.float32)}, 0)   # ~1.4 MB
    journal.answered("p0", big)           # (the limit below stays above pytest's own files)
    before = path.stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (before + 40, hard))
        journal.answered("p1", _reply(1))   # 40 bytes land, then EFBIG
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert journal.counts["write_errors"] == 1
    assert journal.size == path.stat().st_size == before
    journal.answered("p2", _reply(2))
    assert journal.size == path.stat().st_size
    again = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert again.run("p2", lambda: pytest.fail("merged twice")).version == 2
    assert again.journal.counts["unreadable"] == 0


def test_a_compaction_opens_nothing_after_its_swap_so_no_reply_is_lost(tmp_path, monkeypatch):
    """Opening the journal's file for appending fails from the compaction on (descriptors run
    out, say): the compacted file is appended to through the handle it was written with, so the
    replies journaled after it are on disk and a retry of any of them is answered."""
    import islands.link.server as server

    journal = ReplyJournal(str(tmp_path), max_bytes=1)
    real_open = open

    def no_append_open(file, mode="r", *args, **kwargs):
        if str(file) == journal.path and "a" in mode:
            raise OSError(24, "Too many open files")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(server, "open", no_append_open, raising=False)
    for i in range(4):
        journal.answered(f"p{i}", _reply(i))
        assert journal.wait_compacted(10.0)
    assert journal.counts["compacted"] >= 1
    assert journal.counts["write_errors"] == 0 and journal.counts["compaction_errors"] == 0
    assert journal.size == (tmp_path / ReplyJournal.FILE).stat().st_size
    monkeypatch.undo()
    again = PushOnce(journal=ReplyJournal(str(tmp_path)))
    assert again.run("p3", lambda: pytest.fail("merged twice")).version == 3
