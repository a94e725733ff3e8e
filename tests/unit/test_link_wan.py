"""WAN realism on the link: the relay's loss shaping (the timing, by hand and over real loopback
sockets), its validation, and a partition of the home (the fleet's command, the config's target
and the link server going down and serving again on its port). No Ray.
"""

import random
import socket
import threading
import time

import grpc
import pytest

from islands.faults import (HOME_TARGET, Fault, FaultKind, FaultWindows, Link, rto_s,
                            segment_arrival_s)
from islands.link.relay import Relay

# Seed 788 at loss rate 0.25: the third draw (segment 3) is the only loss among the first 8
# reads, in both directions (found by search; asserted below, so a change of draws shows).
SEED, RATE = 788, 0.25
LOST_3RD = [False, False, True, False, False, False, False, False]


def test_the_seeded_draws_lose_the_third_segment_in_each_direction():
    for direction in ("up", "down"):
        rng = random.Random(f"{SEED}/{direction}")   # as Relay seeds each direction
        assert [rng.random() < RATE for _ in range(8)] == LOST_3RD


def test_the_retransmission_timeout_is_two_round_trips_at_least_200_ms():
    assert rto_s(0.0) == 0.2 and rto_s(0.05) == 0.2     # RTT 100 ms: 2 RTT = 200 ms
    assert rto_s(0.15) == pytest.approx(0.6)            # RTT 300 ms


def test_a_lost_segment_arrives_one_rto_late_and_holds_back_the_next_one():
    """50 ms one way, 1 MB/s (1000 bytes: 1 ms), reads of 1000 bytes at 0, 10, 20, 30 and 500 ms;
    segment 3 is lost. By hand: 1 arrives at 0 + 1 + 50 = 51 ms; 2 at 10 + 1 + 50 = 61 ms; 3 at
    20 + 1 + 50 + RTO 200 = 271 ms; 4 would arrive at 81 ms but waits for 3: 271 ms; 5 is
    past it: 500 + 1 + 50 = 551 ms."""
    link = Link(0.05, 1e6, RATE)
    free_at, last, arrivals = 0.0, 0.0, []
    for now, lost in zip((0.0, 0.01, 0.02, 0.03, 0.5), LOST_3RD):
        last, free_at = segment_arrival_s(now, 1000, link, free_at, last, lost)
        arrivals.append(last)
    assert arrivals == pytest.approx([0.051, 0.061, 0.271, 0.271, 0.551], abs=1e-9)
    # Without the loss, 4 keeps its own time; the bandwidth is never held by a loss.
    assert segment_arrival_s(0.03, 1000, link, 0.021, 0.061, False) == pytest.approx(
        (0.081, 0.031))


def test_overlapping_network_faults_lose_independently():
    windows = FaultWindows()
    windows.add(Fault(0.0, FaultKind.NETWORK, "r", duration_s=10.0, loss_rate=0.5))
    link = windows.link("r", 1.0, Link(0.0, float("inf"), 0.1))
    assert link.loss_rate == pytest.approx(1 - 0.9 * 0.5)
    assert windows.link("r", 11.0, Link(0.0, float("inf"), 0.1)).loss_rate == pytest.approx(0.1)


@pytest.mark.parametrize("bad", [1.0, -0.01, 1.5, float("nan"), "0.1", True])
def test_a_loss_rate_outside_0_to_1_is_refused_naming_the_field(bad):
    from islands.link.client import ClientSettings

    for make in (lambda: Fault(0.0, FaultKind.NETWORK, "r", duration_s=1.0, loss_rate=bad),
                 lambda: Link(0.0, 1.0, bad),
                 lambda: ClientSettings(home="h:1", region="r", token="t", loss_rate=bad)):
        with pytest.raises(ValueError, match="loss_rate must be a number with 0 <= loss_rate < 1"):
            make()
    with pytest.raises(ValueError, match="loss_rate"):
        Relay(("127.0.0.1", 9), "r", loss_rate=bad)


def test_the_config_takes_a_loss_rate_and_a_home_partition_only_with_remote_regions():
    from islands.orchestrator.config import ConfigError, JobConfig

    def job(regions, event):
        link = {"link": {"port": 0}} if any(r.get("remote") for r in regions.values()) else {}
        return JobConfig.model_validate({"regions": regions, "chaos": {"events": [event]},
                                         **link})

    remote = {"a": {"learners": 1}, "far": {"learners": 1, "remote": True}}
    plan = job(remote, {"type": "partition", "target": HOME_TARGET, "at_s": 5,
                        "duration_s": 3}).chaos.plan({"a": 1, "far": 1}, 60)
    assert [(f.kind, f.target, f.duration_s) for f in plan.faults] == [
        (FaultKind.PARTITION, HOME_TARGET, 3.0)]
    lossy = job(remote, {"type": "network", "target": "far", "at_s": 1, "duration_s": 2,
                         "loss_rate": 0.01}).chaos.plan({"a": 1, "far": 1}, 60)
    assert lossy.faults[0].loss_rate == 0.01
    with pytest.raises((ConfigError, ValueError), match="chaos.events.0.target"):
        job({"a": {"learners": 1}}, {"type": "partition", "target": HOME_TARGET, "at_s": 5,
                                     "duration_s": 3})
    with pytest.raises((ConfigError, ValueError), match="loss_rate"):
        job(remote, {"type": "network", "target": "far", "at_s": 1, "duration_s": 2,
                     "loss_rate": 1.0})


def test_a_home_partition_is_the_link_servers_and_needs_a_remote_region():
    from islands.orchestrator import fleet as F
    from islands.orchestrator.health import RestartPolicy

    policy = RestartPolicy(backoff_initial_s=0.5, backoff_multiplier=2.0, backoff_max_s=30.0,
                           max_crash_restarts=2, max_preemption_restarts=None)

    def fleet(regions):
        s = F.FleetSettings(regions=regions, min_learners=1, policy=policy,
                            heartbeat_timeout_s=10.0, startup_timeout_s=60.0,
                            straggler_factor=4.0)
        return F.step(F.initial(s), [], 0.0).fleet

    cut = Fault(1.0, FaultKind.PARTITION, HOME_TARGET, duration_s=8.0)
    result = F.step(fleet({"a": F.RegionPlan(1, 1), "r": F.RegionPlan(2, 2, remote=True)}),
                    [F.Chaos(cut)], 1.0)
    assert [type(a).__name__ for a in result.actions] == ["PartitionHome"]
    assert result.actions[0].fault == cut
    chaos = [t for t in result.transitions if t.name == "chaos"]
    assert chaos and chaos[0].fields["regions"] == ["r"]
    assert result.fleet.link_faults == ()   # the home's own learners are not cut off
    with pytest.raises(F.CommandError, match="a home partition cuts the link"):
        F.check_command(fleet({"a": F.RegionPlan(1, 1)}), F.Chaos(cut))


# -- the relay over real sockets ------------------------------------------------------------------
class _Peer:
    """A loopback TCP server: ``sink`` records each read with its time; ``source`` sends
    ``segments`` at ``times`` (seconds after the accept, recorded as sent); ``echo`` echoes."""

    def __init__(self, mode: str, segments=(), gap_s: float = 0.0):
        self.mode, self.segments, self.gap_s = mode, list(segments), gap_s
        self.reads: list[tuple[float, bytes]] = []
        self.sent_s: list[float] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            if self.mode == "source":
                start = time.time()
                for i, seg in enumerate(self.segments):
                    _sleep_until(start + i * self.gap_s)
                    self.sent_s.append(time.time())
                    conn.sendall(seg)
                self.done.wait(30)
                return
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                self.reads.append((time.time(), data))
                if self.mode == "echo":
                    conn.sendall(data)
        self.done.set()


def _sleep_until(t):
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.005))


def _last_byte_times(reads, segments):
    """When each segment's last byte arrived (reads may join or split segments)."""
    times, seen, ends = [], 0, []
    for seg in segments:
        seen += len(seg)
        ends.append(seen)
    got = 0
    for t, data in reads:
        got += len(data)
        while len(times) < len(ends) and got >= ends[len(times)]:
            times.append(t)
    return times


LATENCY_S, GAP_S = 0.05, 0.06
# Sent every 60 ms over 50 ms: segment 3 (sent at 120 ms) arrives 200 ms late at 370 ms, and
# 4, 5 and 6 (due at 230, 290, 350 ms) wait for it; 7 and 8 keep their own times.
EXPECTED_DELAYS = [0.05, 0.05, 0.25, 0.19, 0.13, 0.07, 0.05, 0.05]


def test_the_hand_worked_delays_follow_from_segment_arrival_s():
    link, free_at, last, delays = Link(LATENCY_S, float("inf")), 0.0, 0.0, []
    for i, lost in enumerate(LOST_3RD):
        last, free_at = segment_arrival_s(i * GAP_S, 1000, link, free_at, last, lost)
        delays.append(last - i * GAP_S)
    assert delays == pytest.approx(EXPECTED_DELAYS, abs=1e-9)


@pytest.mark.parametrize("direction", ["up", "down"])
def test_relay_loss_delays_bytes_as_computed_and_never_drops_or_reorders_them(direction):
    segments = [bytes([65 + i]) * 1000 for i in range(8)]
    peer = _Peer("sink" if direction == "up" else "source", segments, GAP_S)
    relay = Relay(("127.0.0.1", peer.port), "far", latency_s=LATENCY_S, loss_rate=RATE,
                  seed=SEED)
    client = socket.create_connection(("127.0.0.1", relay.port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if direction == "up":
            sent, start = [], time.time()
            for i, seg in enumerate(segments):
                _sleep_until(start + i * GAP_S)
                sent.append(time.time())
                client.sendall(seg)
            client.shutdown(socket.SHUT_WR)
            assert peer.done.wait(10)
            reads = peer.reads
        else:
            reads, total = [], sum(map(len, segments))
            client.settimeout(10)
            while sum(len(d) for _, d in reads) < total:
                data = client.recv(65536)
                reads.append((time.time(), data))
            peer.done.set()
            sent = peer.sent_s
        arrived = _last_byte_times(reads, segments)
        delays = [a - s for a, s in zip(arrived, sent)]
        print(direction, [f"{d * 1e3:.0f}" for d in delays])
        assert b"".join(d for _, d in reads) == b"".join(segments)   # all, in order
        assert relay.counters()["losses"] == 1
        for got, want in zip(delays, EXPECTED_DELAYS):
            # Never early (the relay holds bytes until their time); late by scheduling only.
            assert want - 0.005 <= got <= want + 0.06, (delays, EXPECTED_DELAYS)
    finally:
        client.close()
        relay.close()


def test_heavy_loss_delivers_every_byte_in_order_both_ways():
    payload = random.Random(1).randbytes(300_000)
    peer = _Peer("echo")
    relay = Relay(("127.0.0.1", peer.port), "far", latency_s=0.001, loss_rate=0.3, seed=7)
    client = socket.create_connection(("127.0.0.1", relay.port))
    client.settimeout(20)
    try:
        rng, cuts = random.Random(2), [0]
        while cuts[-1] < len(payload):   # writes of 500 B to 20 kB
            cuts.append(min(len(payload), cuts[-1] + rng.randint(500, 20_000)))
        sender = threading.Thread(target=lambda: [client.sendall(payload[a:b]) for a, b in
                                                  zip(cuts, cuts[1:])])
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = client.recv(65536)
            assert chunk, "the relay closed before every byte came back"
            got += chunk
        sender.join()
        assert bytes(got) == payload
        assert relay.counters()["losses"] > 0
        assert relay.counters()["up"] == relay.counters()["down"] == len(payload)
    finally:
        client.close()
        relay.close()


# -- a partition of the home: the link server down and back on its port ----------------------------
class _EpochHome:
    """The home backend's one call Hello makes (the Ray actors stand behind it in a job)."""

    def epoch(self):
        return 7


def test_a_home_partition_cuts_every_connection_and_serves_again_on_the_same_port():
    from islands.link import link_pb2 as pb
    from islands.link import link_pb2_grpc as pb_grpc
    from islands.link.server import Partitionable, ServerSettings, serve
    from islands.link import wire

    settings = ServerSettings(port=0, token="t")
    config = '{"name": "j", "regions": {"far": {"learners": 1, "remote": true}}}'
    server, port, servicer = serve(_EpochHome(), config, settings, with_servicer=True)
    net = Partitionable(servicer, settings, server, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.LinkStub(channel)
    hello = pb.HelloRequest(region="far", agent="a", protocol=wire.PROTOCOL)
    md = (("authorization", "Bearer t"),)
    try:
        assert stub.Hello(hello, timeout=10, metadata=md).epoch == 7
        until = net.partition(1.5)
        assert net.partitioned()
        with pytest.raises(grpc.RpcError) as cut:
            stub.Hello(hello, timeout=0.5, metadata=md)
        assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED)
        with pytest.raises(ConnectionRefusedError):   # the home's port answers nobody
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        # wait_for_ready: the call waits out the window and is served by the new server.
        reply = stub.Hello(hello, timeout=15, metadata=md, wait_for_ready=True)
        assert reply.epoch == 7 and time.time() >= until - 0.05
        assert not net.partitioned() and net.partitions == 1
        assert servicer.regions["far"]["agent"] == "a"   # the same servicer's state
    finally:
        channel.close()
        net.stop(0)
