"""Faults and the link emulation, below every layer: learners, the syncer and the orchestrator
use them without importing each other.

A ``Fault`` is one planned fault (a kill, a lost region, a slowdown, a network fault or partition,
a syncer kill); ``FaultWindows`` answers, for a time, which slowdowns and link faults are in force
and when a message sent over a region's emulated WAN ``Link`` arrives. Plans of faults are built in
``islands.orchestrator.chaos``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence


SYNCER_TARGET = "syncer"
HOME_TARGET = "@home"  # a partition of the home: every remote region's link at once (never a
                       # region name: those are [a-z0-9-])

# TCP's floor on a retransmission timeout (Linux's TCP_RTO_MIN, RFC 6298 suggests 1 s).
MIN_RTO_S = 0.2


def syncer_shard_of(target: str) -> int:
    """The syncer shard a kill target names: "syncer" (shard 0) or "syncer:<s>".

    >>> syncer_shard_of("syncer"), syncer_shard_of("syncer:2")
    (0, 2)
    """
    if target == SYNCER_TARGET:
        return 0
    head, _, tail = str(target).partition(":")
    if head == SYNCER_TARGET and tail.isdigit():
        return int(tail)
    raise ValueError(f"target of a syncer_kill must be {SYNCER_TARGET!r} or "
                     f"'{SYNCER_TARGET}:<shard>', got {target!r}")


class FaultKind(str, enum.Enum):
    """What a fault does; the values are the ``kind`` field of chaos events and logs."""

    KILL = "kill"                  # ray.kill of one learner actor
    EXIT = "exit"                  # hard process exit inside one learner (os._exit)
    REGION_LOSS = "region_loss"    # target = region: every learner of it dies (lost slice / node)
    SLOWDOWN = "slowdown"          # target = learner (or region): step time × factor for a while
    NETWORK = "network"            # target = region: extra latency, bandwidth cap, loss for a while
    PARTITION = "partition"        # target = region (or HOME_TARGET: every remote region's link)
    SYNCER_KILL = "syncer_kill"    # target = "syncer"
    HANG = "hang"                  # target = learner: no steps, no heartbeats (found by timeout)


# Faults after which a learner is gone until it is restarted.
LEARNER_LOSS_KINDS = frozenset({FaultKind.KILL, FaultKind.EXIT, FaultKind.REGION_LOSS,
                                FaultKind.HANG})


def check_time(name: str, value: float, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return float(value)


def check_loss_rate(name: str, value: float) -> float:
    """``value`` as a loss probability per segment, 0 ≤ x < 1 (1 would never deliver).

    >>> check_loss_rate("loss_rate", 0.01)
    0.01
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number with 0 <= {name} < 1, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Fault:
    """One planned fault.

    Attributes:
      at_s: when it happens, seconds from the start of the run.
      kind: what happens.
      target: a learner id ("us-east:0"), a region name, or "syncer".
      duration_s: kills: the repair delay before the learner may restart (0 = immediately);
        slowdown, network, partition: how long it lasts.
      factor: slowdown: step time multiplier (≥ 1).
      extra_latency_ms: network: added one-way latency.
      bandwidth_gbps: network: bandwidth cap (None: no cap).
      loss_rate: network: probability that a relayed segment is lost (0 ≤ x < 1; see
        ``segment_arrival_s``).

    Raises:
      ValueError: naming the field, for a negative or non-finite time, an empty target, a
        slowdown factor below 1, a non-positive bandwidth cap or a loss rate outside [0, 1).
    """

    at_s: float
    kind: FaultKind
    target: str
    duration_s: float = 0.0
    factor: float = 1.0
    extra_latency_ms: float = 0.0
    bandwidth_gbps: Optional[float] = None
    loss_rate: float = 0.0

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", FaultKind(self.kind))
        except ValueError:
            raise ValueError(f"kind must be one of {', '.join(k.value for k in FaultKind)}, "
                             f"got {self.kind!r}") from None
        object.__setattr__(self, "at_s", check_time("at_s", self.at_s))
        object.__setattr__(self, "duration_s", check_time("duration_s", self.duration_s))
        object.__setattr__(self, "extra_latency_ms",
                           check_time("extra_latency_ms", self.extra_latency_ms))
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target must be a non-empty string, got {self.target!r}")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not math.isfinite(self.factor) or self.factor < 1.0:
            raise ValueError(f"factor must be a finite number >= 1, got {self.factor!r}")
        if self.bandwidth_gbps is not None:
            check_time("bandwidth_gbps", self.bandwidth_gbps, positive=True)
        object.__setattr__(self, "loss_rate", check_loss_rate("loss_rate", self.loss_rate))
        if self.kind in (FaultKind.SLOWDOWN, FaultKind.NETWORK, FaultKind.PARTITION) \
                and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0 for a {self.kind.value} fault, "
                             f"got {self.duration_s}")
        if self.kind == FaultKind.SYNCER_KILL:
            syncer_shard_of(self.target)  # "syncer" or "syncer:<shard>"

    @property
    def syncer_shard(self) -> int:
        """The syncer shard a ``syncer_kill`` hits ("syncer" is shard 0)."""
        return syncer_shard_of(self.target)

    @property
    def end_s(self) -> float:
        """When the fault's period ends (for kills: when the repair is done)."""
        return self.at_s + self.duration_s

    def order_key(self) -> tuple:
        return (self.at_s, list(FaultKind).index(self.kind), self.target)


@dataclass(frozen=True)
class Link:
    """A region's link at one moment: one-way latency, bandwidth, and the probability that a
    segment is lost (emulated by the region's relay only: ``segment_arrival_s``)."""

    latency_s: float
    bandwidth_bytes_per_s: float
    loss_rate: float = 0.0

    def __post_init__(self):
        check_loss_rate("loss_rate", self.loss_rate)


def emulated_bytes_per_s(bandwidth_gbps: Optional[float]) -> float:
    """A region's emulated bandwidth in bytes per second; None or 0 (the default): no cap.

    >>> emulated_bytes_per_s(1.0), emulated_bytes_per_s(0), emulated_bytes_per_s(None)
    (125000000.0, inf, inf)
    """
    return bandwidth_gbps * 1e9 / 8 if bandwidth_gbps else math.inf


def rto_s(latency_s: float) -> float:
    """TCP's retransmission timeout on a link of one-way ``latency_s``: twice the round trip,
    at least ``MIN_RTO_S`` (the RTO is about SRTT + 4·RTTVAR, floored; 2·RTT is a steady link's).

    >>> rto_s(0.05), rto_s(0.15)
    (0.2, 0.6)
    """
    return max(MIN_RTO_S, 2.0 * (2.0 * latency_s))


def segment_arrival_s(now_s: float, nbytes: int, link: Link, free_at_s: float,
                      last_arrival_s: float, lost: bool) -> tuple[float, float]:
    """When a segment read at ``now_s`` reaches the far end, and when the link is free again.

    A TCP relay cannot drop bytes, so it plays what a lost packet does to a TCP stream: the
    segment arrives one retransmission timeout late (``rto_s``), and, the stream being in order,
    everything sent behind it waits for it at the receiver (head-of-line blocking): that wait,
    not the lost bytes, is what loss costs a TCP stream. The sender keeps sending meanwhile, so
    the bandwidth is not held. Congestion control's rate cut after a loss is not played.

    Args:
      now_s: when the relay read the segment.
      nbytes: its size.
      link: the link as it is now.
      free_at_s: when the link finishes sending what is ahead of it (bytes / bandwidth each).
      last_arrival_s: when the segment ahead of it arrives.
      lost: whether it is lost (a draw of the direction's seeded ``random.Random``).

    Returns:
      (arrival_s, free_at_s after it).

    >>> link = Link(0.05, 1e6)   # 50 ms, 1 MB/s: 1000 bytes take 1 ms
    >>> [round(t, 6) for t in segment_arrival_s(0.02, 1000, link, 0.0, 0.061, lost=True)]
    [0.271, 0.021]
    """
    free_at = max(now_s, free_at_s) + nbytes / link.bandwidth_bytes_per_s
    arrival = free_at + link.latency_s + (rto_s(link.latency_s) if lost else 0.0)
    return max(arrival, last_arrival_s), free_at


class FaultWindows:
    """The slowdown and network faults that have fired, as time windows to look up.

    A driver ``add``s each fault that ``FaultPlan.due`` hands it; queries at a time see the windows
    covering it. Overlapping slowdowns take the largest factor; overlapping degradations add their
    latencies, take the smallest bandwidth cap and lose independently (1 − Π(1 − p)).
    """

    def __init__(self):
        self.slowdowns: dict[str, list[Fault]] = {}
        self.networks: dict[str, list[Fault]] = {}
        self.partitions: dict[str, list[Fault]] = {}

    def add(self, fault: Fault) -> None:
        table = {FaultKind.SLOWDOWN: self.slowdowns, FaultKind.NETWORK: self.networks,
                 FaultKind.PARTITION: self.partitions}.get(fault.kind)
        if table is None:
            raise ValueError(f"a {fault.kind.value} fault is not a time window")
        table.setdefault(fault.target, []).append(fault)

    @staticmethod
    def _active(faults: Sequence[Fault], t: float) -> list[Fault]:
        return [f for f in faults if f.at_s <= t < f.end_s]

    def slowdown(self, learner: str, region: str, t: float) -> float:
        """Step-time factor of ``learner`` (in ``region``) for a step starting at ``t``."""
        active = (self._active(self.slowdowns.get(learner, ()), t)
                  + self._active(self.slowdowns.get(region, ()), t))
        return max([1.0] + [f.factor for f in active])

    def departure_s(self, region: str, t: float) -> float:
        """When a message handed to ``region``'s link at ``t`` can leave: after any partition."""
        windows = self.partitions.get(region, ())
        while True:
            active = self._active(windows, t)
            if not active:
                return t
            t = max(f.end_s for f in active)

    def link(self, region: str, t: float, base: Link) -> Link:
        active = self._active(self.networks.get(region, ()), t)
        latency = base.latency_s + sum(f.extra_latency_ms for f in active) / 1e3
        caps = [f.bandwidth_gbps * 1e9 / 8 for f in active if f.bandwidth_gbps is not None]
        delivered = 1.0 - base.loss_rate
        for f in active:
            delivered *= 1.0 - f.loss_rate
        return Link(latency, min([base.bandwidth_bytes_per_s] + caps), 1.0 - delivered)

    def arrival_s(self, region: str, t: float, nbytes: float, base: Link) -> float:
        """Arrival time of ``nbytes`` sent over ``region``'s link at ``t``: wait out a partition,
        then latency + bytes / bandwidth of the link as it is at departure."""
        depart = self.departure_s(region, t)
        link = self.link(region, depart, base)
        return depart + link.latency_s + nbytes / link.bandwidth_bytes_per_s
