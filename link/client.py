"""The region side of the link: ``LinkClient``, the region cluster's stand-in for the home syncer.

In a region's own Ray cluster this actor is named ``islands:syncer``: the region's learners
register and push to it exactly as they would to the syncer, and the region agent (the controller
in region mode, ``region.py``) forgets, reads status and forwards heartbeats through it. Every call
leaves over one gRPC channel (one HTTP/2 connection, calls multiplexed on it) through the region's
``Relay``, with a deadline, keepalive and reconnection with backoff. While the link is down calls
wait (up to their deadline) and the learners keep training: a push that cannot leave in time is
answered as refused, and the learner's own rules take it from there.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import grpc

from islands.syncer.status import SyncerStatus
from islands.syncer.validate import SYNCER_DOWN

from . import link_pb2 as pb
from . import link_pb2_grpc as pb_grpc
from . import wire
from .relay import Relay
from .security import channel_credentials, token_metadata

log = logging.getLogger("islands.link")

# Refusal reasons of the link itself (the syncer's are syncer/validate.py: RejectReason).
class LinkRefused(RuntimeError):
    """The home refused the region: the message has the gRPC status and the home's reason."""


LINK_DOWN = SYNCER_DOWN  # the learner keeps its drift and pushes it again (learners/core.py)


@dataclass(frozen=True)
class ClientSettings:
    """How a region reaches home (``islands region join`` flags)."""

    home: str                         # HOST:PORT of the home's link server
    region: str
    token: str
    ca_file: Optional[str] = None     # None with tls: the system roots
    cert_file: Optional[str] = None   # mutual TLS
    key_file: Optional[str] = None
    tls: bool = True
    server_name: Optional[str] = None  # the name in the home's certificate (default: HOST)
    call_timeout_s: float = 10.0      # every unary call's deadline
    register_timeout_s: float = 120.0
    # A push's deadline, its round's merge included. At least the job's
    # link.agent_home_timeout_s once joined: a push is given up on only when the agent leaves too
    # (a push given up on may have merged at home, and its drift would go again).
    push_timeout_s: float = 300.0
    keepalive_s: float = 2.0
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 4.0
    report_every_s: float = 1.0
    latency_ms: float = 0.0           # the emulated WAN on the relay
    bandwidth_gbps: Optional[float] = None
    loss_rate: float = 0.0            # per relayed segment, played as a TCP retransmit (Relay)
    loss_seed: int = 0

    def __post_init__(self):
        from islands.faults import check_loss_rate

        check_loss_rate("loss_rate", self.loss_rate)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.home.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--home must be HOST:PORT, got {self.home!r}")
        return host.strip("[]"), int(port)


def backoff_s(attempt: int, initial_s: float, max_s: float, jitter: float = 0.0) -> float:
    """Exponential backoff before retry ``attempt`` (0-based): initial·2^attempt, capped, with
    ``jitter`` ∈ [0, 1) taking up to that fraction off.

    >>> [backoff_s(a, 0.25, 4.0) for a in range(7)]
    [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    """
    return min(max_s, initial_s * 2 ** attempt) * (1.0 - jitter)


def open_channel(settings: ClientSettings, target: str, chunk_bytes: int) -> grpc.Channel:
    host, _ = settings.host_port
    options = [("grpc.max_receive_message_length", chunk_bytes + wire.CHUNK_OVERHEAD_BYTES),
               ("grpc.max_send_message_length", chunk_bytes + wire.CHUNK_OVERHEAD_BYTES),
               ("grpc.keepalive_time_ms", int(settings.keepalive_s * 1000)),
               ("grpc.keepalive_timeout_ms", int(settings.keepalive_s * 1000)),
               ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0),
               ("grpc.initial_reconnect_backoff_ms", int(settings.backoff_initial_s * 1000)),
               ("grpc.min_reconnect_backoff_ms", int(settings.backoff_initial_s * 1000)),
               ("grpc.max_reconnect_backoff_ms", int(settings.backoff_max_s * 1000)),
               # one connection for every call of the region, not one per stub
               ("grpc.use_local_subchannel_pool", 1)]
    if not settings.tls:
        return grpc.insecure_channel(target, options=options)
    options.append(("grpc.ssl_target_name_override", settings.server_name or host))
    return grpc.secure_channel(target, channel_credentials(settings.ca_file, settings.cert_file,
                                                           settings.key_file), options=options)


class LinkClient:
    """Create in the region cluster with ``ray.remote(LinkClient).options(name="islands:syncer",
    max_concurrency=...)``; ``hello()`` first (the agent needs the job's config)."""

    def __init__(self, settings: ClientSettings):
        self.settings = settings
        bandwidth = (settings.bandwidth_gbps * 1e9 / 8 if settings.bandwidth_gbps
                     else float("inf"))
        self.relay = Relay(settings.host_port, settings.region, settings.latency_ms / 1e3,
                           bandwidth, settings.loss_rate, settings.loss_seed)
        self.chunk_bytes = wire.DEFAULT_CHUNK_BYTES
        self.max_total_bytes = wire.DEFAULT_MAX_TOTAL_BYTES
        self.channel = open_channel(settings, f"127.0.0.1:{self.relay.port}", self.chunk_bytes)
        self.stub = pb_grpc.LinkStub(self.channel)
        self.metadata = token_metadata(settings.token)
        self.lock = threading.Lock()
        self.epoch = -1
        self.beats: dict[str, dict] = {}
        self.slots: list[dict] = []
        self.slots_set_s = time.time()   # when the agent last set them: its liveness at home
        self.status_cache: dict = {"epoch": None, "versions": [], "merges": 0, "ledger": {},
                                   "registered": {}, "quarantined": {}, "rejected": {},
                                   "staleness_counts": {}}
        self.counts = collections.Counter()   # calls, retries, refusals by kind
        self.in_flight = collections.Counter()   # (learner, fragment): pushes not answered yet
        self.connected = False
        self.reconnects = 0
        self.last_ok_s: Optional[float] = None
        self.last_merged_s: Optional[float] = None
        self.closed = threading.Event()
        self.started_s = time.time()
        self.home_ended: Optional[str] = None   # the home said its job ended (a report's reply)
        self.home_paused: Optional[str] = None  # the home's pause reason as the agent last heard it
        self.premerger = None   # link.premerge: set from the job's config at hello()
        self.push_timeout_s = settings.push_timeout_s
        self.channel.subscribe(self._on_state, try_to_connect=True)
        self.reporter = threading.Thread(target=self._report_loop, daemon=True,
                                         name="islands-link-report")
        self.reporter.start()

    # -- the channel ----------------------------------------------------------------------------
    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        ready = state == grpc.ChannelConnectivity.READY
        with self.lock:
            if ready and not self.connected and self.last_ok_s is not None:
                self.reconnects += 1
            self.connected = ready

    def _retrying(self, what: str, fn, deadline_s: float):
        """Calls ``fn(timeout_s)`` until it succeeds or ``deadline_s`` (absolute) passes;
        retries UNAVAILABLE and DEADLINE_EXCEEDED with backoff, raises anything else."""
        attempt = 0
        while True:
            left = deadline_s - time.time()
            if left <= 0:
                raise TimeoutError(f"link call {what}: no answer from home before its deadline")
            try:
                result = fn(left)
                self.last_ok_s = time.time()
                return result
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.CANCELLED):
                    raise
                self.counts[f"{what}_retries"] += 1
                pause = backoff_s(attempt, self.settings.backoff_initial_s,
                                  self.settings.backoff_max_s, random.random() * 0.2)
                attempt += 1
                if self.closed.wait(min(pause, max(0.0, deadline_s - time.time()))):
                    raise TimeoutError(f"link call {what}: the link is closing") from exc

    def _unary(self, method: str, request, timeout_s: float):
        call = getattr(self.stub, method)
        return self._retrying(method, lambda left: call(
            request, timeout=min(left, self.settings.call_timeout_s),
            metadata=self.metadata, wait_for_ready=True), time.time() + timeout_s)

    def _streamed(self, method: str, request, reply_type, timeout_s: float):
        call = getattr(self.stub, method)

        def once(left):
            replies = call(wire.chunks(request, self.chunk_bytes, self.max_total_bytes),
                           timeout=left, metadata=self.metadata, wait_for_ready=True)
            return wire.assemble(replies, reply_type, self.max_total_bytes)

        return self._retrying(method, once, time.time() + timeout_s)

    # -- joining --------------------------------------------------------------------------------
    def hello(self) -> dict:
        """Joins the job: {epoch, config (a dict), shard_base, num_shards}.

        Raises:
          LinkRefused: refused (a wrong token: UNAUTHENTICATED; not a remote region of the
            job: FAILED_PRECONDITION), with the home's message.
        """
        try:
            reply = self._unary("Hello", pb.HelloRequest(region=self.settings.region,
                                                         agent=socket.gethostname(),
                                                         protocol=wire.PROTOCOL),
                                self.settings.register_timeout_s)
        except grpc.RpcError as exc:
            raise LinkRefused(f"{exc.code().name}: {exc.details()}") from None
        self.chunk_bytes, self.max_total_bytes = int(reply.chunk_bytes), int(reply.max_total_bytes)
        self.epoch = int(reply.epoch)
        config = json.loads(reply.config_json)
        self.push_timeout_s = max(self.settings.push_timeout_s, float(
            config.get("link", {}).get("agent_home_timeout_s", 0.0)))
        self.premerger = premerger(config, self.settings.region, self._send_push)
        return {"epoch": self.epoch, "config": json.loads(reply.config_json),
                "shard_base": int(reply.shard_base), "num_shards": int(reply.num_shards)}

    # -- the syncer's interface, for the region's learners and agent -----------------------------
    def ready(self) -> dict:
        return {"epoch": self.epoch, "versions": self.status_cache.get("versions"),
                "restored_from": None}

    def register(self, learner: str, incarnation: int, adopted: Optional[list] = None,
                 session: Optional[str] = None, syncer_shard: int = 0) -> dict:
        """Registers with the home's syncer shard ``syncer_shard`` (the region's ``LinkShard``
        actors pass theirs); ``session``: the one the learner carries to the other shards."""
        reply = self._streamed("Register", wire.register_to_pb(learner, incarnation, adopted,
                                                               session or "", syncer_shard),
                               pb.RegisterReply, self.settings.register_timeout_s)
        reg = wire.registration_from_pb(reply)
        if syncer_shard == 0:
            self.epoch = reg["epoch"]
        if self.premerger is not None:
            self.premerger.registered(learner, incarnation)
        return reg

    def push(self, push):
        """Sends a push and returns the home's reply when its round merged (or the refusal);
        with ``link.premerge``, as part of its region's one push of the round."""
        from islands.syncer import codec as codec_lib

        push = _numpy_push(push, codec_lib)
        self.counts["pushes"] += 1
        key = (push.learner, push.fragment)
        with self.lock:
            self.in_flight[key] += 1
            if self.in_flight[key] > 1:   # a learner pushes a fragment again only once answered
                self.counts["pushes_while_unanswered"] += 1
                log.warning("link: %s pushed fragment %d (step %d) while %d earlier push(es) of "
                            "it are unanswered", push.learner, push.fragment, push.step,
                            self.in_flight[key] - 1)
        try:
            reply = (self.premerger.push(push) if self.premerger is not None
                     else self._send_push(push))
        finally:
            with self.lock:
                self.in_flight[key] -= 1
        if reply.status == "merged":   # the tokens a merge applied (WAN bytes per merged token)
            self.counts["merged_tokens"] += push.c_tokens
        return reply

    def _send_push(self, push):
        """One push over the WAN (a learner's, or its region's pre-merged one)."""
        from islands.syncer.actor import Reply

        self.counts["wan_pushes"] += 1
        request = wire.push_to_pb(push)
        # Its retries (after a cut connection) carry the same id: the home merges it once and
        # answers each retry with that merge's reply (server.py: PushOnce).
        request.push_id = uuid.uuid4().hex
        try:
            reply = self._streamed("Push", request, pb.PushReply, self.push_timeout_s)
        except (TimeoutError, grpc.RpcError) as exc:
            self.counts["pushes_lost"] += 1
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            code = exc.code().name if isinstance(exc, grpc.RpcError) else "DEADLINE"
            self.counts[f"pushes_lost_{code}"] += 1
            log.warning("link: push of %s fragment %d given up (%s): %s", push.learner,
                        push.fragment, code, detail)
            # Nothing to start over from: the learner keeps its drift for the next push.
            return Reply("rejected", push.fragment, push.epoch, reason=LINK_DOWN,
                         detail=f"the push could not reach home: {detail}"[:300])
        reply = wire.reply_from_pb(reply)
        self.counts[f"pushes_{reply.status}"] += 1
        if reply.status == "merged":
            self.last_merged_s = time.time()
        return reply

    def forget(self, learner: str, incarnation: Optional[int] = None, reason: str = "") -> int:
        if self.premerger is not None:
            self.premerger.forgotten(learner, incarnation)
        reply = self._unary("Forget", pb.ForgetRequest(learner=learner,
                                                       incarnation=-1 if incarnation is None
                                                       else incarnation, reason=reason),
                            self.push_timeout_s)
        return int(reply.dropped)

    def set_fleet(self, slowest_step_s: float, paused: bool = False) -> None:
        """The home syncer's pace is the home controller's to set."""

    def status(self) -> SyncerStatus:
        """The home syncer's status as the home's last report reply gave it."""
        with self.lock:
            return SyncerStatus.from_dict(self.status_cache)

    def refusals_since(self, total: int) -> tuple[list, int]:
        return [], total  # refusals are the home's events

    def global_params(self):
        """The global parameters now, fetched over the link (a fallback: the agent evaluates
        nothing, and learners start from their registration)."""
        reply = self._streamed("Fetch", pb.FetchRequest(), pb.FetchReply,
                               self.settings.register_timeout_s)
        flat = {}
        for fragment in reply.fragments:
            flat.update(wire.fragment_from_pb(fragment))
        return flat, [int(v) for v in reply.versions]

    def fragment_at(self, p: int, version: int):
        return None

    def snapshot_now(self):
        return None

    def ping(self) -> str:
        return "ok"

    def identity(self) -> dict:
        """A region's link, alive with its ``islands region join`` process (which owns it):
        a region command seeing it ends nothing (orchestrator/safety.py)."""
        return {"kind": "link", "region": self.settings.region, "home": self.settings.home}

    def wait_closed(self) -> None:
        self.closed.wait()

    # -- the agent's side -----------------------------------------------------------------------
    def beat(self, beat: dict) -> None:
        with self.lock:
            self.beats[beat["learner"]] = beat

    def set_slots(self, slots: list) -> None:
        with self.lock:
            self.slots = list(slots)
            self.slots_set_s = time.time()

    def link_fault(self, fault) -> None:
        """Chaos on this region's link (a partition resets the connection; see ``Relay``)."""
        self.relay.add_fault(fault)

    def home_state(self) -> dict:
        """What the agent decides to stay or leave on: whether the home said its job ended, and
        seconds since the home last answered a call (or since this link started); and the home's
        pause as last passed on (a restarted agent starts from it)."""
        with self.lock:
            return {"ended": self.home_ended, "paused": self.home_paused,
                    "since_ok_s": time.time() - (self.last_ok_s or self.started_s)}

    def link_status(self) -> dict:
        with self.lock:
            return {"region": self.settings.region, "connected": self.connected,
                    "reconnects": self.reconnects, "epoch": self.epoch,
                    "last_ok_s": self.last_ok_s, "last_merged_s": self.last_merged_s,
                    "bytes": self.relay.counters(),
                    "counts": dict(self.counts),
                    "premerge": (dict(self.premerger.counts) if self.premerger is not None
                                 else None)}

    def close(self) -> None:
        self.closed.set()
        self.channel.close()
        self.relay.close()

    def _report_loop(self) -> None:
        while not self.closed.wait(self.settings.report_every_s):
            with self.lock:
                beats, self.beats = list(self.beats.values()), {}
                slots = list(self.slots)
                agent_age_s = time.time() - self.slots_set_s
            counters = self.relay.counters()
            request = pb.ReportRequest(
                region=self.settings.region,
                slots=[pb.SlotReport(**s) for s in slots],
                beats_json=[json.dumps(b, default=str) for b in beats],
                link_bytes_up=counters["up"], link_bytes_down=counters["down"],
                link_reconnects=self.reconnects, agent_age_s=agent_age_s)
            try:
                reply = self.stub.Report(request, timeout=self.settings.call_timeout_s,
                                         metadata=self.metadata)
                status = json.loads(reply.status_json)
                self.last_ok_s = time.time()
            except grpc.RpcError as exc:
                self.counts["report_failures"] += 1
                with self.lock:  # the beats go with the next report
                    for b in beats:
                        self.beats.setdefault(b["learner"], b)
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("link: home refused the token: %s", exc.details())
                continue
            if status.get("ended"):
                self.home_ended = str(status["ended"])
            restarts = status.pop("restart", None) or []
            if restarts:
                self._tell_agent(restarts)
            paused = status.pop("paused", None)
            if paused != self.home_paused:
                self._tell_agent_pause(paused)
            with self.lock:
                self.status_cache = {**self.status_cache, **status}

    def _tell_agent_pause(self, reason) -> None:
        """Training at home paused (its reason) or resumed (None): the agent pauses or resumes
        the region's learners. Told again at the next report if the agent was not reachable."""
        import ray

        from islands.orchestrator.runtime import CONTROLLER_NAME, NAMESPACE

        try:
            ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE).home_pause.remote(reason)
            self.home_paused = reason
        except Exception as exc:
            log.warning("link: could not pass the home's pause to the agent: %r", exc)

    def _tell_agent(self, restarts: list) -> None:
        """The home found these incarnations hung: the agent restarts them (if still current)."""
        import ray

        from islands.orchestrator.runtime import CONTROLLER_NAME, NAMESPACE

        try:
            agent = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
            for r in restarts:
                agent.home_verdict.remote(r["learner"], int(r["incarnation"]), r["cause"])
        except Exception as exc:  # no agent: the home shows them unreachable once it sees that
            log.warning("link: could not pass the home's restarts %s to the agent: %r",
                        restarts, exc)


def premerger(config: dict, region: str, send):
    """The region's ``PreMerger`` when the job's config (a JobConfig as a dict) turns
    ``link.premerge`` on, else None. Its window: ``link.premerge_window_s``, by default the
    home's ``quorum.grace_cap_s`` (docs/regions.md#pre-merge)."""
    from islands.orchestrator import build
    from islands.orchestrator.config import JobConfig

    job = JobConfig.model_validate(config)
    if not job.link.premerge:
        return None
    from .premerge import Encoder, PreMerger

    return PreMerger(region, Encoder(job.compression.type, build.codec_block_size(job)),
                     premerge_window_s(job), send)


def premerge_window_s(job) -> float:
    """How long a region's round waits for its other learners after its first push."""
    if job.link.premerge_window_s is not None:
        return float(job.link.premerge_window_s)
    return float(job.quorum.grace_cap_s)


def _numpy_push(push, codec_lib):
    """The push with numpy codes (a learner may hand over device arrays)."""
    import dataclasses

    return dataclasses.replace(push, codes=codec_lib.to_numpy(push.codes))


# -- diagnosing a link that does not come up, before any local Ray cluster starts ----------------
def preflight(settings: ClientSettings, timeout_s: float = 5.0) -> int:
    """One Hello straight to home (no relay, no Ray), within ``timeout_s``: returns the home's
    epoch, or raises ``LinkRefused`` with one line naming the cause (a wrong token, an unknown
    CA, a missing or refused client certificate, an expired certificate, plaintext against TLS,
    nothing listening)."""
    host, port = settings.host_port
    local = check_local_files(settings)
    if local:
        raise LinkRefused(local)
    channel = open_channel(settings, f"{host}:{port}", wire.DEFAULT_CHUNK_BYTES)
    try:
        reply = pb_grpc.LinkStub(channel).Hello(
            pb.HelloRequest(region=settings.region, agent=socket.gethostname(),
                            protocol=wire.PROTOCOL),
            timeout=timeout_s, metadata=token_metadata(settings.token))
        return int(reply.epoch)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise LinkRefused(f"the home refused the token ({details})") from None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise LinkRefused(f"{code.name}: {details}") from None
        cause = diagnose_transport(settings, timeout_s)
        raise LinkRefused(cause or f"home {settings.home} unreachable ({code.name}: "
                          f"{details.splitlines()[0][:200] if details else 'no detail'})") from None
    finally:
        channel.close()


# OpenSSL/BoringSSL alert and error names -> what the operator must fix.
_ALERTS = (("CERTIFICATE_REQUIRED", "the home requires a client certificate (mutual TLS): pass "
                                    "--client-cert and --client-key"),
           ("CERTIFICATE_EXPIRED", "the home refused this region's client certificate: it has "
                                   "expired"),
           ("UNKNOWN_CA", "the home does not trust this region's client certificate (signed by "
                          "another CA than its link.tls.client_ca_file)"),
           ("BAD_CERTIFICATE", "the home refused this region's client certificate"),
           ("WRONG_VERSION_NUMBER", "the home does not speak TLS (a plaintext link): pass "
                                    "--insecure, on loopback only"),
           ("RECORD_LAYER_FAILURE", "the home does not speak TLS (a plaintext link): pass "
                                    "--insecure, on loopback only"))


def tls_cause(exc: BaseException, settings: ClientSettings) -> Optional[str]:
    """The one-line cause of a failed TLS handshake with the home, from Python's ssl error.

    >>> import ssl
    >>> s = ClientSettings(home="h:1", region="r", token="t", ca_file="ca.pem")
    >>> e = ssl.SSLCertVerificationError(1, "verify failed")
    >>> e.verify_code, e.verify_message = 10, "certificate has expired"
    >>> tls_cause(e, s)
    "the home's certificate has expired"
    >>> tls_cause(ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] alert"), s)[:40]
    'the home requires a client certificate ('
    """
    import ssl

    if isinstance(exc, ssl.SSLCertVerificationError):
        code = getattr(exc, "verify_code", None)
        if code == 10:
            return "the home's certificate has expired"
        if code in (7, 18, 19, 20, 21):  # 7: an issuer of that name, but not the one that signed
            where = settings.ca_file or "the system's roots"
            return (f"unknown CA: the home's certificate is not signed by a CA in {where} "
                    "(--ca-cert)")
        if code == 62:
            return (f"the home's certificate is not for "
                    f"{settings.server_name or settings.host_port[0]!r} (--server-name)")
        return f"the home's certificate was refused: {getattr(exc, 'verify_message', exc)}"
    text = str(exc).upper()
    for needle, cause in _ALERTS:
        if needle in text:
            return cause
    if isinstance(exc, ssl.SSLError):
        return f"TLS with the home failed: {exc}"
    return None


def diagnose_transport(settings: ClientSettings, timeout_s: float = 5.0) -> Optional[str]:
    """Why a channel to home does not come up: connects and (unless ``--insecure``) shakes TLS
    hands with Python's ssl, which names what gRPC only calls UNAVAILABLE. None: no cause found."""
    import ssl

    host, port = settings.host_port
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return f"nothing listens at {settings.home} (connection refused)"
    except OSError as exc:
        return f"cannot reach {settings.home}: {exc}"
    with sock:
        if not settings.tls:
            # A plaintext client: does the home answer a TLS hello? Then it speaks TLS.
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            try:
                with context.wrap_socket(sock, server_hostname=host) as tls:
                    tls.version()
                return ("the home speaks TLS but this region connects in plaintext (--insecure): "
                        "drop --insecure and pass --ca-cert")
            except (ssl.SSLError, OSError):
                return None
        context = ssl.create_default_context(cafile=settings.ca_file)
        if settings.cert_file:
            context.load_cert_chain(settings.cert_file, settings.key_file)
        try:
            with context.wrap_socket(sock, server_hostname=settings.server_name or host) as tls:
                # TLS 1.3: the home refuses a client certificate after the handshake, with an
                # alert read here; silence until the timeout means the handshake was accepted.
                tls.settimeout(min(timeout_s, 1.5))
                try:
                    if tls.recv(1) == b"":  # closed on us right after the handshake
                        return refused_client_cert(settings)
                except socket.timeout:
                    return None
        except ConnectionResetError:
            return refused_client_cert(settings)
        except (ssl.SSLError, OSError) as exc:
            return tls_cause(exc, settings)
    return None


def refused_client_cert(settings: ClientSettings) -> str:
    """The home closed a TLS connection it had just accepted: it refused our client side."""
    if not settings.cert_file:
        return ("the home requires a client certificate (mutual TLS): pass --client-cert and "
                "--client-key")
    return (f"the home refused this region's client certificate {settings.cert_file} (not "
            "signed by the CA in its link.tls.client_ca_file)")


def certificate_expiry(path: str) -> Optional[float]:
    """A PEM certificate's notAfter as a Unix time (None: unreadable as one)."""
    import ssl

    try:
        not_after = ssl._ssl._test_decode_cert(path)["notAfter"]  # stdlib's own PEM decoder
        return ssl.cert_time_to_seconds(not_after)
    except Exception:
        return None


def check_local_files(settings: ClientSettings, now_s: Optional[float] = None) -> Optional[str]:
    """What is wrong with this region's own TLS files before anything connects: a client
    certificate without its key (or the reverse), an unreadable file, an expired certificate."""
    if not settings.tls:
        return None
    if (settings.cert_file is None) != (settings.key_file is None):
        return "mutual TLS needs both --client-cert and --client-key"
    now_s = time.time() if now_s is None else now_s
    for flag, path in (("--ca-cert", settings.ca_file), ("--client-cert", settings.cert_file),
                       ("--client-key", settings.key_file)):
        if path and not os.access(path, os.R_OK):
            return f"{flag} {path} cannot be read"
    for flag, path in (("--client-cert", settings.cert_file), ("--ca-cert", settings.ca_file)):
        expiry = certificate_expiry(path) if path else None
        if expiry is not None and expiry < now_s:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expiry))
            return f"{flag} {path} expired at {when}: the home would refuse it"
    return None


class LinkShard:
    """Syncer shard ``s`` > 0 of a home job with ``syncer.shards`` > 1, in a region's cluster
    (named ``islands:syncer-<s>`` there, as the shard is at home): the region's learners find
    every shard by name as they would at home; registrations name the shard, everything else is
    the one ``LinkClient``'s (a push goes to the home shard that owns its fragment)."""

    def __init__(self, syncer_shard: int, namespace: str, link_name: str = "islands:syncer"):
        import ray

        self.syncer_shard = int(syncer_shard)
        self.link = ray.get_actor(link_name, namespace=namespace)
        self.closed = threading.Event()

    def _get(self, ref, timeout_s: Optional[float] = None):
        import ray

        return ray.get(ref, timeout=timeout_s)

    def ready(self) -> dict:
        return self._get(self.link.ready.remote(), 30)

    def register(self, learner: str, incarnation: int, adopted: Optional[list] = None,
                 session: Optional[str] = None) -> dict:
        return self._get(self.link.register.remote(learner, incarnation, adopted, session,
                                                   self.syncer_shard))

    def push(self, push):
        return self._get(self.link.push.remote(push))

    def forget(self, learner: str, incarnation: Optional[int] = None, reason: str = "") -> int:
        return 0   # the link forgets at every home shard at once (the agent calls it there)

    def set_fleet(self, slowest_step_s: float, paused: bool = False) -> None:
        """The home syncer's pace is the home controller's to set."""

    def ping(self) -> str:
        return "ok"

    def wait_closed(self) -> None:
        self.closed.wait()
