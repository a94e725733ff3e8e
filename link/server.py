"""The home side of the link: a gRPC server that admits a remote region's learners into the home
syncer's rounds, quorum and books.

``LinkServicer`` turns each call into one call on a ``home`` backend (``RayHome``: the job's
syncer and controller actors by name); ``serve`` starts it with the token interceptor, TLS and the
size limits; ``LinkServer`` is the thin Ray actor the job starts when ``link.port`` is set. Ray
restarts it when its process dies (``LINK_SERVER_MAX_RESTARTS``): it binds the same port again
and answers the retries of pushes it had taken from ``ReplyJournal`` (``RUN_DIR/link``).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import logging
import os
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Optional

import grpc

from . import link_pb2 as pb
from . import link_pb2_grpc as pb_grpc
from . import wire
from .security import TokenInterceptor, server_credentials

log = logging.getLogger("islands.link")

LINK_SERVER_NAME = "islands:link"
# Ray restarts the link server's actor this many times (as the home controller's); each restart
# binds the same port and answers retried pushes from the journal.
LINK_SERVER_MAX_RESTARTS = 10
LINK_DIR = "link"          # RUN_DIR/link: the reply journal and the server's port
# A retried push that an earlier life of the link server took but never got the syncer's answer
# for: it may have merged (or may still merge). It is refused with the current global fragment,
# so the learner starts over from it (its drift is not sent again: it merges once at most).
IN_DOUBT = "in_doubt"


@dataclass(frozen=True)
class ServerSettings:
    """What the link server is started with (built from JobConfig ``link``)."""

    port: int
    host: str = "127.0.0.1"
    token: str = ""
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    client_ca_file: Optional[str] = None
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    max_total_bytes: int = wire.DEFAULT_MAX_TOTAL_BYTES
    keepalive_s: float = 10.0
    max_workers: int = 64          # concurrent calls (a push holds one until its round merges)

    @property
    def max_message_bytes(self) -> int:
        return self.chunk_bytes + wire.CHUNK_OVERHEAD_BYTES


def shard_plan(config: dict, region: str) -> tuple[int, int]:
    """(first data shard of ``region``, shards in the job): regions take consecutive shards in
    config order, as the home fleet numbers its slots. ``config`` is a JobConfig as a dict."""
    base = 0
    for name, section in config["regions"].items():
        if name == region:
            break
        base += int(section["learners"])
    return base, sum(int(s["learners"]) for s in config["regions"].values())


class PushOnce:
    """Exactly-once pushes over a link that retries. The region's link sends a push again when
    its connection is cut before the reply arrived (a partition, a reset, a home whose link
    server restarted in place); the home may have taken it already and merged it. Each push
    carries an id that its retries share: the first arrival goes to the syncer, a retry waits
    for that one's reply and gets the same reply. Only a first arrival that failed (the home
    call raised: the syncer never answered it) lets a retry go to the syncer itself.

    The replies of the last ``keep`` pushes are kept (a learner's next push of a fragment comes
    only after its reply, so a few per learner and fragment is plenty); a push still in flight is
    never let go of.

    With a ``journal`` (``ReplyJournal``) the replies outlive the process: each push is journaled
    as taken before it goes to the syncer and with its reply before that leaves, and a new
    ``PushOnce`` over the same journal (the restarted link server) answers a retry from it. A
    retry of a push taken but never answered there (the server died while the syncer held it) is
    in doubt: ``run``'s ``in_doubt()`` answers it instead of the syncer.
    """

    def __init__(self, keep: int = 4096, journal: Optional["ReplyJournal"] = None):
        self.keep = int(keep)
        self.lock = threading.Lock()
        self.entries: collections.OrderedDict = collections.OrderedDict()  # id -> _Taken
        # arrivals, taken, answered_again, retried_after_failure, answered_from_journal, in_doubt
        self.counts = collections.Counter()
        self.journal = journal
        # What an earlier life journaled: id -> ("reply", encoded) or ("taken", about).
        self.recovered: dict = journal.recovered() if journal is not None else {}

    def run(self, push_id: str, take, is_active=lambda: True, poll_s: float = 0.25,
            about: Optional[dict] = None, in_doubt: Optional[Callable] = None):
        """``take()`` (the push to the syncer) once for ``push_id``; its reply to every arrival.
        ``about``: what the journal records of the push (learner, fragment, step, …);
        ``in_doubt()``: the reply to a push an earlier life took and never answered.

        Raises:
          ConnectionAbortedError: this arrival's own call ended (``is_active()`` turned False)
            while the first one was still in flight: nobody is left to answer.
        """
        if not push_id:
            return take()
        with self.lock:
            self.counts["arrivals"] += 1
        while True:
            with self.lock:
                entry = self.entries.get(push_id)
                first = entry is None
                if first:
                    entry = self.entries[push_id] = _Taken()
                    earlier = self.recovered.pop(push_id, None)
                    self._trim()
            if first:
                return self._first(push_id, entry, earlier, take, about, in_doubt)
            while not entry.done.wait(poll_s):
                if not is_active():
                    raise ConnectionAbortedError(f"push {push_id}: the caller left")
            if not entry.failed:
                with self.lock:
                    self.counts["answered_again"] += 1
                return entry.reply
            with self.lock:
                self.counts["retried_after_failure"] += 1

    def _first(self, push_id, entry, earlier, take, about, in_doubt):
        """The first arrival (in this life) of ``push_id``: answers it and wakes its retries."""
        journal = self.journal
        try:
            if earlier is not None and earlier[0] == "reply":
                try:
                    entry.reply = journal.decode(earlier[1])
                except Exception as exc:   # a corrupt entry: the push is in doubt
                    log.error("link: the journaled reply to push %s is unreadable: %r",
                              push_id, exc)
                    earlier = ("taken", {})
                else:
                    with self.lock:
                        self.counts["answered_from_journal"] += 1
                    log.info("link: push %s answered from the journal (its reply was lost)",
                             push_id)
                    entry.done.set()
                    return entry.reply
            if earlier is not None:   # taken by an earlier life, never answered
                with self.lock:
                    self.counts["in_doubt"] += 1
                if in_doubt is None:
                    raise RuntimeError(f"push {push_id} is in doubt and nothing answers it")
                log.warning("link: push %s (%s) was taken before the link server restarted and "
                            "its reply never came: answered as in doubt", push_id, earlier[1])
                entry.reply = in_doubt()
            else:
                with self.lock:
                    self.counts["taken"] += 1
                if journal is not None:
                    journal.taken(push_id, about)
                entry.reply = take()
        except BaseException:
            with self.lock:
                self.entries.pop(push_id, None)
                if earlier is not None and earlier[0] == "taken":
                    self.recovered[push_id] = earlier   # its retry is still in doubt
            if journal is not None and earlier is None:
                journal.failed(push_id)
            entry.failed = True
            entry.done.set()
            raise
        if journal is not None:
            journal.answered(push_id, entry.reply)   # before the reply leaves
        entry.done.set()
        return entry.reply

    def _trim(self) -> None:
        """Lets go of the oldest answered pushes beyond ``keep`` (under the lock)."""
        excess = len(self.entries) - self.keep
        for push_id in list(self.entries):
            if excess <= 0:
                break
            if self.entries[push_id].done.is_set():
                del self.entries[push_id]
                excess -= 1


class _Taken:
    """A push the home took: its reply once the syncer answered."""

    __slots__ = ("done", "reply", "failed")

    def __init__(self):
        self.done = threading.Event()
        self.reply = None
        self.failed = False


def _encode_reply(reply) -> bytes:
    return wire.reply_to_pb(reply).SerializeToString()


def _decode_reply(data: bytes):
    return wire.reply_from_pb(pb.PushReply.FromString(data))


# The reply journal's size bound (``ReplyJournal.max_bytes``; docs/operations.md): once the file
# holds twice this, it is compacted to the newest pushes' last lines within it.
JOURNAL_MAX_BYTES = 1 << 30
# A journal line starts with its push id (``_append`` writes it first): read without parsing a
# line that may hold a whole fp32 fragment.
_ID_PREFIX = re.compile(rb'^\{"id":("(?:[^"\\]|\\.)*")')


def _line_id(line: bytes) -> Optional[str]:
    """The push id of a journal line; None for a line that does not parse."""
    match = _ID_PREFIX.match(line)
    try:
        if match is not None:
            return json.loads(match.group(1))
        return json.loads(line)["id"]
    except (ValueError, KeyError, TypeError):
        return None


def _write_all(f, data: bytes) -> None:
    """Writes all of ``data`` to an unbuffered file (a raw write may take part of it)."""
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:
            raise OSError(f"wrote nothing of {len(view)} bytes")
        view = view[n:]


class ReplyJournal:
    """The link server's exactly-once replies, on disk: ``RUN_DIR/link/replies.jsonl``, one JSON
    object a line, appended (and flushed) as it happens, so they outlive the server's process:

    - ``{"id": PUSH_ID, "t": …, "kind": "taken", "about": {"learner", "incarnation",
      "fragment", "step", "epoch"}}``: before the push goes to the syncer;
    - ``{"id": …, "t": …, "kind": "reply", "reply": BASE64}``: the syncer's reply (the link's
      ``PushReply`` message, serialized), before it leaves for the region;
    - ``{"id": …, "t": …, "kind": "failed"}``: the syncer call raised (a retry may take it again).

    A push's last line says where it stands. A torn last line (the process died mid-write) is cut
    off when the journal is opened, and any line that does not parse is skipped.

    Bounded by bytes (a reply can carry a whole fp32 fragment): once the file holds
    ``2 × max_bytes`` it is compacted to the newest pushes' last lines that fit in ``max_bytes``
    (the newest one always, however large). The compaction runs in a background thread off the
    lock the pushes journal under: it reads and rewrites the file up to where it stood, and only
    the swap (the lines appended meanwhile copied after the kept ones, then ``os.replace``) holds
    the lock. So the file stays under about ``2 × max_bytes`` plus what is journaled while one
    compaction runs. Flushed, not fsynced: it outlives the process, not the machine (whose loss
    takes the home's syncer with it).

    Failures leave a usable journal and are logged once (until the operation works again, which
    is logged too); ``counts`` has them all:

    - a write that fails (a full disk) is cut back to where the line began, so no torn line is
      left for the next one to be glued to (where the cut fails too, the next line starts on a
      new line), and ``size`` is recounted from the file: the reply stays in memory;
    - a compaction that fails leaves the file as it was (its temporary file removed) and is
      tried again only once the file grew by another ``2 × max_bytes``, not at every append;
    - the compacted file is written through the handle the journal then appends to, opened
      before the swap: nothing is opened after ``os.replace``, so no failure there can leave the
      journal without a file (or the replies journaled since the compaction began without one).
    """

    FILE = "replies.jsonl"

    def __init__(self, directory: str, max_bytes: int = JOURNAL_MAX_BYTES,
                 encode: Callable[[Any], bytes] = _encode_reply,
                 decode: Callable[[bytes], Any] = _decode_reply):
        if int(max_bytes) <= 0:
            raise ValueError(f"max_bytes: the reply journal's bound must be > 0, got {max_bytes}")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, self.FILE)
        self.max_bytes = int(max_bytes)
        self.encode, self.decode = encode, decode
        self.lock = threading.Lock()
        # written, write_errors, torn, unreadable, compacted, compaction_errors
        self.counts = collections.Counter()
        self._last = self._read()   # what the file held when opened: id -> last record
        # Unbuffered: a write that fails leaves nothing in a buffer to land later, mid-line.
        self._file = open(self.path, "ab", buffering=0)
        self.size = self._file_size()   # bytes in the file
        self._compaction: Optional[threading.Thread] = None
        self._compact_at = 2 * self.max_bytes   # the size that starts the next compaction
        self._torn = False        # a failed write left part of a line the cut could not remove
        self._failing: set = set()   # operations failing now ("write", "compaction"): logged

    def _read(self) -> "collections.OrderedDict[str, dict]":
        """Every push's last record; cuts a torn last line off the file first."""
        last: collections.OrderedDict = collections.OrderedDict()
        if not os.path.exists(self.path):
            return last
        with open(self.path, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):   # the process died mid-line: that push's line is not there
                self.counts["torn"] += 1
                log.warning("link: reply journal %s ends in a torn line (%d bytes); cut off",
                            self.path, len(data) - end)
                f.truncate(end)
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                push_id = record["id"]
            except (ValueError, KeyError, TypeError):
                self.counts["unreadable"] += 1
                continue
            last.pop(push_id, None)
            last[push_id] = record
        return last

    def recovered(self) -> dict:
        """What the journal held when it was opened, for a new ``PushOnce``: id -> ("reply",
        encoded bytes) for an answered push, ("taken", about) for one taken and never answered
        (in doubt); a failed one is not there (its retry goes to the syncer)."""
        out = {}
        with self.lock:
            for push_id, record in self._last.items():
                kind = record.get("kind")
                if kind == "reply":
                    try:
                        out[push_id] = ("reply", base64.b64decode(record["reply"]))
                    except (KeyError, ValueError, TypeError):
                        self.counts["unreadable"] += 1
                elif kind == "taken":
                    out[push_id] = ("taken", record.get("about") or {})
        return out

    def taken(self, push_id: str, about: Optional[dict] = None) -> None:
        self._append({"id": push_id, "kind": "taken", "about": about or {}})

    def answered(self, push_id: str, reply) -> None:
        try:
            encoded = base64.b64encode(self.encode(reply)).decode("ascii")
        except Exception as exc:   # never fails the push: its merge happened
            self.counts["write_errors"] += 1
            log.error("link: the reply to push %s could not be journaled: %r", push_id, exc)
            return
        self._append({"id": push_id, "kind": "reply", "reply": encoded})

    def failed(self, push_id: str) -> None:
        self._append({"id": push_id, "kind": "failed"})

    def _append(self, record: dict) -> None:
        record = {"id": record.pop("id"), **record, "t": round(time.time(), 3)}   # id first
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
        with self.lock:
            start = self.size
            try:
                _write_all(self._file, b"\n" + line if self._torn else line)
            except (OSError, ValueError) as exc:   # a full disk: the replies stay in memory
                self.counts["write_errors"] += 1
                self._cut_back(start)
                self._failed("write", "the replies stay in memory", exc)
                return
            self._torn = False
            self._works("write")
            self.counts["written"] += 1
            self.size = self._file_size()
            if self.size < self._compact_at or self._compaction is not None:
                return
            self._compaction = threading.Thread(target=self._compact, args=(self.size,),
                                                name="reply-journal-compaction", daemon=True)
            self._compaction.start()

    def _file_size(self) -> int:
        """The journal file's size as the file has it (not as the appends added it up)."""
        return os.fstat(self._file.fileno()).st_size

    def _cut_back(self, start: int) -> None:
        """After a failed write (under the lock): the file is cut back to ``start``, where the
        line began, and ``size`` recounted from it; where the cut fails, the next line starts
        on a new line (the torn part is then a line of its own, skipped when read)."""
        try:
            os.ftruncate(self._file.fileno(), start)
        except (OSError, ValueError):
            self._torn = True
        try:
            self.size = self._file_size()
        except (OSError, ValueError):
            pass

    def _failed(self, what: str, consequence: str, exc: BaseException) -> None:
        """Logs a failing operation once (under the lock), until it works again."""
        if what in self._failing:
            log.debug("link: reply journal %s: %s failed again: %r", self.path, what, exc)
            return
        self._failing.add(what)
        log.error("link: reply journal %s: %s failed: %r; %s (said once, until it works again)",
                  self.path, what, exc, consequence)

    def _works(self, what: str) -> None:
        if what in self._failing:
            self._failing.discard(what)
            log.warning("link: reply journal %s: %s works again", self.path, what)

    def _kept(self, cut: int) -> tuple[list[tuple[int, int]], int]:
        """The (offset, length) of each push's last line in the file's first ``cut`` bytes,
        newest last, as many of the newest as fit in ``max_bytes`` (at least one); their
        total length. Reads line by line: a line may be a whole fragment."""
        last: collections.OrderedDict = collections.OrderedDict()
        with open(self.path, "rb") as f:
            offset = 0
            while offset < cut:
                line = f.readline()
                if not line:
                    break
                push_id = _line_id(line.rstrip(b"\n"))
                if push_id is not None and line.endswith(b"\n"):
                    last.pop(push_id, None)
                    last[push_id] = (offset, len(line))
                offset += len(line)
        kept, total = [], 0
        for offset, length in reversed(list(last.values())):
            if kept and total + length > self.max_bytes:
                break
            kept.append((offset, length))
            total += length
        return kept[::-1], total

    def _compact(self, cut: int) -> None:
        """Rewrites the file's first ``cut`` bytes as the newest pushes' last lines (``_kept``),
        off the lock; then, under it, appends what was journaled since ``cut`` and swaps the
        file in. The rewritten file's handle becomes the journal's (nothing is opened after the
        swap). A failure leaves the journal as it was; the next try waits for the file to grow
        by another ``2 × max_bytes``."""
        tmp = self.path + ".tmp"
        dst = None
        try:
            kept, _ = self._kept(cut)
            # Append mode, as the journal's own handle (O_APPEND): it becomes ``self._file``,
            # and a write cut back by ``_cut_back`` (ftruncate, which leaves a plain handle's
            # position past the end) must not put the next line after a hole of NUL bytes.
            dst = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                                    0o666), "ab", buffering=0)
            with open(self.path, "rb") as src:
                for offset, length in kept:
                    src.seek(offset)
                    _write_all(dst, src.read(length))
            with self.lock:
                with open(self.path, "rb") as src:
                    src.seek(cut)
                    tail = src.read()
                _write_all(dst, tail)   # (a torn end stays one: _torn still holds)
                os.replace(tmp, self.path)
                old, self._file, dst = self._file, dst, None
                self.size = self._file_size()
                self._compact_at = 2 * self.max_bytes
                self.counts["compacted"] += 1
                self._works("compaction")
            try:
                old.close()
            except OSError:
                pass
        except (OSError, ValueError) as exc:
            if dst is not None:
                try:
                    dst.close()
                    os.remove(tmp)
                except OSError:
                    pass
            with self.lock:
                self.counts["compaction_errors"] += 1
                self._compact_at = self.size + 2 * self.max_bytes
                self._failed("compaction", f"the file stays as it is; tried again once it holds "
                             f"{self._compact_at} bytes", exc)
        finally:
            with self.lock:
                self._compaction = None

    def wait_compacted(self, timeout_s: Optional[float] = None) -> bool:
        """Waits for a compaction under way to end; whether none runs now."""
        with self.lock:
            running = self._compaction
        if running is not None:
            running.join(timeout_s)
        with self.lock:
            return self._compaction is None

    def close(self) -> None:
        self.wait_compacted()
        with self.lock:
            self._file.close()


class LinkServicer(pb_grpc.LinkServicer):
    def __init__(self, home, config_json: str, settings: ServerSettings,
                 journal: Optional[ReplyJournal] = None):
        self.home, self.settings = home, settings
        self.config_json = config_json
        self.config = json.loads(config_json)
        self.lock = threading.Lock()
        self.regions: dict[str, dict] = {}   # per region: what its agent last reported
        self.ended: Optional[str] = None     # set when the home job ends: agents are told so
        # Kept across a partition (the same servicer); with a journal, across a restart too.
        self.pushes = PushOnce(journal=journal)
        self.hold_until_s = 0.0              # chaos: replies wait until then (hold_replies)
        self.held = 0

    # -- helpers --------------------------------------------------------------------------------
    def _read(self, stream, message_type, context):
        try:
            return wire.assemble(stream, message_type, self.settings.max_total_bytes)
        except wire.WireError as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))

    def _send(self, msg, context):
        try:
            yield from wire.chunks(msg, self.settings.chunk_bytes, self.settings.max_total_bytes)
        except wire.WireError as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))

    def _call(self, context, fn, *args):
        try:
            return fn(*args)
        except wire.WireError as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))
        except Exception as exc:  # the syncer or controller is restarting: try again later
            log.warning("link: home call %s failed: %r", getattr(fn, "__name__", fn), exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"home syncer unavailable: {exc!r}"[:300])

    def _remote_region(self, region: str, context) -> None:
        regions = self.config["regions"]
        remote = sorted(n for n, r in regions.items() if r.get("remote"))
        if region not in regions or not regions[region].get("remote"):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"region {region!r} is not a remote region of job "
                          f"{self.config.get('name')!r}; its remote regions are {remote}")

    # -- the calls ------------------------------------------------------------------------------
    def Hello(self, request, context):
        if self.ended:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.ended)
        if request.protocol != wire.PROTOCOL:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"link protocol {request.protocol} is not {wire.PROTOCOL}")
        self._remote_region(request.region, context)
        base, total = shard_plan(self.config, request.region)
        epoch = self._call(context, self.home.epoch)
        with self.lock:
            self.regions.setdefault(request.region, {})["agent"] = request.agent
        log.info("link: region %s joined from %s (epoch %d)", request.region, request.agent, epoch)
        return pb.HelloReply(epoch=epoch, config_json=self.config_json, shard_base=base,
                             num_shards=total, chunk_bytes=self.settings.chunk_bytes,
                             max_total_bytes=self.settings.max_total_bytes)

    def Register(self, request_iterator, context):
        msg = self._read(request_iterator, pb.RegisterRequest, context)
        learner, incarnation, adopted, session, syncer_shard = wire.register_from_pb(msg)
        self._remote_region(learner.rsplit(":", 1)[0], context)
        shards = getattr(self.home, "num_shards", 1)   # a home backend without shards has one
        if syncer_shard >= shards:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"syncer shard {syncer_shard}: the job has {shards}")
        reg = self._call(context, self.home.register, learner, incarnation, adopted, session,
                         syncer_shard)
        yield from self._send(wire.registration_to_pb(reg), context)

    def Push(self, request_iterator, context):
        msg = self._read(request_iterator, pb.PushRequest, context)
        try:
            push = wire.push_from_pb(msg)
        except wire.WireError as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))
        about = {"learner": push.learner, "incarnation": int(push.incarnation),
                 "fragment": int(push.fragment), "step": int(push.step),
                 "epoch": int(push.epoch)}
        try:
            reply = self.pushes.run(msg.push_id, lambda: self._call(context, self.home.push, push),
                                    context.is_active, about=about,
                                    in_doubt=lambda: self._in_doubt(push, context))
        except ConnectionAbortedError as exc:
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        self._hold(context)
        yield from self._send(wire.reply_to_pb(reply), context)

    def _in_doubt(self, push, context):
        """The reply to a push an earlier life of this server took and never got the syncer's
        answer for: it may have merged, or may still. Sending it again could merge it twice; so it
        is refused (``IN_DOUBT``) with the current global fragment, from which the learner starts
        over (its drift counts as refused in its books, whatever became of it at home)."""
        from islands.syncer.actor import Reply

        now = getattr(self.home, "fragment", None)
        params, version = (self._call(context, now, push.fragment) if now is not None
                           else (None, -1))
        return Reply("rejected", push.fragment, push.epoch, params, int(version),
                     reason=IN_DOUBT, detail="the home's link server restarted while the home "
                     "held this push: it may have merged; start over from the global fragment")

    def _hold(self, context) -> None:
        """Chaos (``LinkServer.hold_replies``): the reply, journaled already, waits."""
        if time.time() >= self.hold_until_s:
            return
        with self.lock:
            self.held += 1
        while time.time() < self.hold_until_s and context.is_active():
            time.sleep(0.05)

    def Forget(self, request, context):
        wire.check_known_fields(request)
        dropped = self._call(context, self.home.forget, request.learner,
                             int(request.incarnation), request.reason)
        return pb.ForgetReply(dropped=int(dropped))

    def Report(self, request, context):
        try:
            wire.check_known_fields(request)
            beats = [wire.parse_json(b, "beats_json") for b in request.beats_json]
        except wire.WireError as exc:
            context.abort(grpc.StatusCode[exc.code], str(exc))
        self._remote_region(request.region, context)
        if self.ended:  # the home's controller is gone: the agent is told to leave
            with self.lock:
                self.regions.setdefault(request.region, {})["told_ended_s"] = time.time()
            return pb.ReportReply(status_json=json.dumps({"ended": self.ended}))
        report = {"region": request.region, "t": time.time(),
                  "slots": [{"learner": s.learner, "incarnation": int(s.incarnation),
                             "state": s.state, "shard": int(s.shard), "last_cause": s.last_cause,
                             "restarts_json": s.restarts_json}
                            for s in request.slots],
                  "beats": beats,
                  "link_bytes": {"up": int(request.link_bytes_up),
                                 "down": int(request.link_bytes_down)},
                  "reconnects": int(request.link_reconnects),
                  "agent_age_s": float(request.agent_age_s)}
        with self.lock:
            self.regions.setdefault(request.region, {}).update(
                last_report_s=report["t"], link_bytes=report["link_bytes"],
                reconnects=report["reconnects"])
        status = self._call(context, self.home.report, report)
        return pb.ReportReply(status_json=json.dumps(status, default=str))

    def Fetch(self, request_iterator, context):
        msg = self._read(request_iterator, pb.FetchRequest, context)
        flat, versions = self._call(context, self.home.global_params)
        plan = self.home.fragment_paths()
        wanted = list(msg.fragments) or list(range(len(plan)))
        if any(p >= len(plan) for p in wanted):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"fragments {wanted}: the job has {len(plan)}")
        reply = pb.FetchReply(versions=[int(versions[p]) for p in wanted], fragments=[
            wire.fragment_to_pb({k: flat[k] for k in plan[p]}) for p in wanted])
        yield from self._send(reply, context)


def serve(home, config_json: str, settings: ServerSettings, with_servicer: bool = False,
          journal: Optional[ReplyJournal] = None):
    """Starts the link server; returns it and the bound port (``settings.port`` 0 picks one),
    and its servicer ``with_servicer``. ``journal``: where its exactly-once replies are kept.

    Without a certificate the server is plaintext (loopback trials and tests only; a job config
    that binds another address must give one: checked in JobConfig).
    """
    servicer = LinkServicer(home, config_json, settings, journal)
    server, port = _start(servicer, settings, settings.port)
    return (server, port, servicer) if with_servicer else (server, port)


def _start(servicer: LinkServicer, settings: ServerSettings, port: int):
    """A gRPC server for ``servicer`` on ``port`` (0: any); (server, bound port)."""
    options = [("grpc.max_receive_message_length", settings.max_message_bytes),
               ("grpc.max_send_message_length", settings.max_message_bytes),
               ("grpc.keepalive_time_ms", int(settings.keepalive_s * 1000)),
               ("grpc.keepalive_timeout_ms", int(settings.keepalive_s * 1000)),
               ("grpc.http2.min_ping_interval_without_data_ms", 1000),
               ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_ping_strikes", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.max_workers,
                                                    thread_name_prefix="islands-link"),
                         interceptors=[TokenInterceptor(settings.token)], options=options)
    pb_grpc.add_LinkServicer_to_server(servicer, server)
    address = f"{settings.host}:{port}"
    if settings.cert_file:
        bound = server.add_secure_port(address, server_credentials(
            settings.cert_file, settings.key_file, settings.client_ca_file))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"link server could not bind {address}")
    server.start()
    return server, bound


class Partitionable:
    """A link server the home's network can fail under: ``partition(duration_s)`` stops it at
    once (every region's connection is closed and its calls in flight are cancelled, as a home
    whose network fails looks from every region at the same moment) and serves again on the same
    port, with the same servicer (its regions' state), when the window ends. Meanwhile each
    region's connection attempts are refused; their channels retry with backoff, as under a
    region's own partition (``Relay``)."""

    def __init__(self, servicer: LinkServicer, settings: ServerSettings, server, port: int):
        self.servicer, self.settings, self.server, self.port = servicer, settings, server, port
        self.lock = threading.Lock()
        self.until_s = 0.0           # the window's end (wall clock); 0: none
        self.partitions = 0
        self._timer: Optional[threading.Timer] = None

    def partition(self, duration_s: float) -> float:
        """Cuts every region's link for ``duration_s`` (a window in force is extended);
        returns when it ends (wall clock)."""
        if not duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        with self.lock:
            end = time.time() + duration_s
            was_up = self.until_s == 0.0
            self.until_s = max(self.until_s, end)
            self.partitions += 1
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.until_s - time.time(), self._heal)
            self._timer.daemon = True
            server = self.server if was_up else None
        if server is not None:
            server.stop(grace=None).wait(5)   # cancels calls in flight, closes the connections
        self._timer.start()
        log.warning("link: home partitioned for %.1fs (every region's link is cut)", duration_s)
        return self.until_s

    def partitioned(self) -> bool:
        with self.lock:
            return self.until_s > 0.0

    def _heal(self) -> None:
        with self.lock:
            if time.time() < self.until_s - 0.01:   # extended meanwhile: its own timer heals
                return
            for _ in range(50):   # the port is ours: a rebind can race the old close
                try:
                    self.server, _ = _start(self.servicer, self.settings, self.port)
                    break
                except (OSError, RuntimeError) as exc:
                    last = exc
                    time.sleep(0.1)
            else:
                log.error("link: could not serve again on port %d: %r", self.port, last)
                return
            self.until_s = 0.0
        log.warning("link: the home's partition ended; serving again on port %d", self.port)

    def stop(self, grace: float) -> None:
        with self.lock:
            if self._timer is not None:
                self._timer.cancel()
            self.until_s = 0.0
            server = self.server
        server.stop(grace=grace).wait(5)


class RayHome:
    """The backend the link server calls in the home cluster: the syncer shards and the
    controller, by name. A push goes to the shard that owns its fragment, a registration to the
    shard the learner names, a forget to every shard (as the home controller's own)."""

    def __init__(self, namespace: str, syncer_name: str, controller_name: str, paths: list,
                 timeout_s: float = 30.0, owned: Optional[tuple] = None):
        self.namespace, self.syncer_name, self.controller_name = (namespace, syncer_name,
                                                                  controller_name)
        self.paths, self.timeout_s = paths, timeout_s
        self.owned = owned or (tuple(range(len(paths))),)   # global fragment ids per shard
        self.shard_of = {p: s for s, ids in enumerate(self.owned) for p in ids}
        self._syncers: dict[int, Any] = {}

    @property
    def num_shards(self) -> int:
        return len(self.owned)

    def _actor(self, name):
        import ray

        return ray.get_actor(name, namespace=self.namespace)

    def _shard_name(self, s: int) -> str:
        return self.syncer_name if s == 0 else f"{self.syncer_name}-{s}"

    def _sync(self, method: str, *args, timeout_s: Optional[float] = None, shard: int = 0):
        """Calls syncer shard ``shard``; after its restart the new handle is looked up again."""
        import ray

        for attempt in range(2):
            if self._syncers.get(shard) is None:
                self._syncers[shard] = self._actor(self._shard_name(shard))
            try:
                return ray.get(getattr(self._syncers[shard], method).remote(*args),
                               timeout=timeout_s or self.timeout_s)
            except ray.exceptions.RayActorError:
                self._syncers[shard] = None
                if attempt:
                    raise
        raise RuntimeError("unreachable")

    def epoch(self) -> int:
        return int(self._sync("ready")["epoch"])

    def register(self, learner, incarnation, adopted, session: str = "", syncer_shard: int = 0):
        return self._sync("register", learner, incarnation, adopted or None, session or None,
                          shard=syncer_shard)

    def push(self, push):
        import ray

        # An unknown fragment goes to shard 0, whose core refuses it as one.
        shard = self.shard_of.get(push.fragment, 0)
        try:  # the reply comes when the round merges: no timeout of ours (the client's deadline)
            return self._sync("push", push, timeout_s=3600.0, shard=shard)
        except ray.exceptions.RayActorError:
            from islands.syncer.actor import Reply

            # The syncer died with the push: as a local learner sees it, re-register.
            return Reply("rejected", push.fragment, -1, reason="stale_epoch",
                         detail="the home syncer restarted")

    def forget(self, learner, incarnation, reason):
        return sum(int(self._sync("forget", learner, incarnation, reason, shard=s))
                   for s in range(self.num_shards))

    def report(self, report: dict) -> dict:
        import ray

        controller = self._actor(self.controller_name)
        return ray.get(controller.link_report.remote(report), timeout=self.timeout_s)

    def global_params(self):
        """(flat parameters, versions by global fragment id) from every shard."""
        flat, versions = {}, [0] * len(self.paths)
        for s, ids in enumerate(self.owned):
            part, local = self._sync("global_params", shard=s)
            flat.update(part)
            for p, v in zip(ids, local, strict=True):
                versions[p] = v
        return flat, versions

    def fragment(self, p: int):
        """(global fragment ``p`` now, its version), from the shard that owns it."""
        s = self.shard_of.get(p, 0)
        part, local = self._sync("global_params", shard=s)
        return {k: part[k] for k in self.paths[p]}, int(local[list(self.owned[s]).index(p)])

    def fragment_paths(self) -> list:
        return self.paths


class LinkServer:
    """The Ray actor that serves the link in the home cluster (named ``islands:link``).

    Started with ``max_restarts`` (``LINK_SERVER_MAX_RESTARTS``): when its process dies, Ray
    runs ``__init__`` again with the same arguments. With a ``state_dir`` (``RUN_DIR/link``) it
    then finds its own earlier life there (``server.json``, the same ``start_id``): it binds the
    port that life bound (the regions know that address; ``link.port`` 0 too), counts one more
    ``incarnation``, and answers retried pushes from the ``ReplyJournal`` there. A new job run
    (another ``start_id``) binds ``link.port`` afresh and keeps the journal's replies.
    """

    STATE_FILE = "server.json"

    def __init__(self, config_json: str, settings: ServerSettings, paths: list, owned: tuple,
                 namespace: str = "islands", syncer_name: str = "islands:syncer",
                 controller_name: str = "islands:controller", state_dir: Optional[str] = None,
                 start_id: str = "", rebind_s: float = 30.0):
        """``paths``, ``owned``: each fragment's parameter paths and each syncer shard's fragments
        (``orchestrator.build.fragment_layout``), by which a remote push is routed."""
        self.home = RayHome(namespace, syncer_name, controller_name, paths, owned=owned)
        self.job = json.loads(config_json).get("name")
        self.state_dir, self.start_id = state_dir, start_id
        self.incarnation, self.started_s = 0, time.time()
        self.journal = ReplyJournal(state_dir) if state_dir else None
        earlier = self._earlier_life()
        if earlier is not None:
            self.incarnation = int(earlier.get("incarnation", 0)) + 1
            settings = dataclasses.replace(settings, port=int(earlier["port"]))
        self.settings = settings
        deadline = time.time() + (rebind_s if earlier is not None else 0.0)
        while True:   # a restart's port: the dead process's socket may take a moment to go
            try:
                server, self.port, self.servicer = serve(self.home, config_json, settings,
                                                         with_servicer=True, journal=self.journal)
                break
            except (OSError, RuntimeError):
                if time.time() >= deadline:
                    raise
                time.sleep(0.2)
        self.net = Partitionable(self.servicer, settings, server, self.port)
        self._write_state()
        if self.incarnation:
            recovered = self.servicer.pushes.recovered
            log.warning("link: the link server restarted (incarnation %d) on %s; its journal "
                        "holds %d replies and %d pushes in doubt", self.incarnation,
                        self.address(), sum(1 for k, _ in recovered.values() if k == "reply"),
                        sum(1 for k, _ in recovered.values() if k == "taken"))
            self._tell_home_controller(
                "link_server_restarted", incarnation=self.incarnation, address=self.address(),
                replies_journaled=sum(1 for k, _ in recovered.values() if k == "reply"),
                pushes_in_doubt=sum(1 for k, _ in recovered.values() if k == "taken"))

    @staticmethod
    def _tell_home_controller(event: str, **fields) -> None:
        """An event in the home job's log (events.jsonl); the link serves on without it."""
        try:
            import ray

            from islands.orchestrator.runtime import CONTROLLER_NAME, NAMESPACE

            if not ray.is_initialized():   # a bare server (not an actor): no Ray to start here
                return
            ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE).emit.remote(event, **fields)
        except Exception as exc:   # no controller (a test's bare server): the log line says it
            log.info("link: could not tell the controller %s: %r", event, exc)

    def _earlier_life(self) -> Optional[dict]:
        """This job run's earlier life of the server (its state file), or None."""
        if not (self.state_dir and self.start_id):
            return None
        try:
            with open(os.path.join(self.state_dir, self.STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError):
            return None
        return state if state.get("start_id") == self.start_id and "port" in state else None

    def _write_state(self) -> None:
        if not self.state_dir:
            return
        path = os.path.join(self.state_dir, self.STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump({"start_id": self.start_id, "host": self.settings.host, "port": self.port,
                       "incarnation": self.incarnation, "pid": os.getpid(),
                       "started_s": self.started_s}, f)
        os.replace(path + ".tmp", path)

    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def info(self) -> dict:
        """Its address, incarnation (restarts by Ray), process, and the exactly-once counts."""
        return {"address": self.address(), "incarnation": self.incarnation, "pid": os.getpid(),
                "started_s": self.started_s, "pushes": dict(self.servicer.pushes.counts),
                "journal": dict(self.journal.counts) if self.journal is not None else None,
                "held": self.servicer.held}

    def hold_replies(self, duration_s: float) -> None:
        """Chaos: the replies to pushes wait (journaled already) for up to ``duration_s`` before
        they leave, as replies lost on the way look if the server dies meanwhile."""
        self.servicer.hold_until_s = time.time() + float(duration_s)

    def end(self, wait_s: float = 3.0) -> list:
        """The home job ended: every later report is answered so, for up to ``wait_s`` or until
        each region that reported lately was told. Returns the regions told."""
        servicer = self.servicer
        servicer.ended = f"the home job {self.job!r} has ended"
        t0 = time.time()
        told: list = []
        with servicer.lock:
            recent = [r for r, st in servicer.regions.items()
                      if t0 - st.get("last_report_s", 0.0) < 2 * wait_s]
        while time.time() - t0 < wait_s:
            with servicer.lock:
                told = [r for r in recent
                        if servicer.regions[r].get("told_ended_s", 0.0) >= t0]
            if len(told) == len(recent):
                return told
            time.sleep(0.1)
        return told

    def partition(self, duration_s: float) -> float:
        """The home's network fails for ``duration_s``: every region's link is cut at once
        (``islands chaos partition --home``); returns when it ends (wall clock)."""
        return self.net.partition(duration_s)

    def partition_status(self) -> dict:
        return {"partitioned": self.net.partitioned(), "until_s": self.net.until_s,
                "partitions": self.net.partitions}

    def stop(self) -> None:
        self.net.stop(grace=1.0)
        if self.journal is not None:
            self.journal.close()

    def ping(self) -> str:
        return "ok"
