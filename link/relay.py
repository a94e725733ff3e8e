"""The region's end of the WAN: a local TCP relay its gRPC channel goes through.

Every byte the link moves (TLS records, HTTP/2 frames, keepalive pings: what a WAN would carry)
passes one of its sockets, so the link's wire bytes are counted here, per direction. The same
place applies the region's emulated WAN (``islands.faults``: latency, bandwidth, segment loss
and the chaos network faults) and partitions: while one is in force every relayed connection is
reset and new ones are refused, as a firewall dropping the route would look to gRPC (which then
reconnects with backoff once it ends).
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import threading
import time
from typing import Optional

from islands.faults import Fault, FaultWindows, Link, check_loss_rate, segment_arrival_s

log = logging.getLogger("islands.link")

READ_BYTES = 64 * 1024


class Relay:
    """Listens on 127.0.0.1 (an ephemeral port) and forwards each connection to ``upstream``.

    Args:
      upstream: (host, port) of the home's link server.
      region: the region whose faults apply (``islands.faults`` targets).
      latency_s, bandwidth_bytes_per_s: the emulated WAN (0 and inf: none).
      loss_rate: probability that a read (a segment) is lost, played as TCP's retransmission
        delay (``islands.faults.segment_arrival_s``); bytes are never dropped nor reordered.
      seed: the loss draws' seed: one ``random.Random`` per direction, shared by the
        direction's connections, so a run's losses repeat exactly.
    """

    def __init__(self, upstream: tuple[str, int], region: str, latency_s: float = 0.0,
                 bandwidth_bytes_per_s: float = float("inf"), loss_rate: float = 0.0,
                 seed: int = 0):
        self.upstream, self.region = upstream, region
        self.base = Link(latency_s, bandwidth_bytes_per_s,
                         check_loss_rate("loss_rate", loss_rate))
        self._rng = {d: random.Random(f"{seed}/{d}") for d in ("up", "down")}
        self.windows = FaultWindows()
        self.lock = threading.Lock()
        self.bytes_up = 0       # region -> home
        self.bytes_down = 0     # home -> region
        self.connections = 0
        self.resets = 0
        self.losses = 0         # segments played as lost (both directions)
        self._open: set = set()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name="islands-link-relay")
        self._thread.start()
        self._watch = threading.Thread(target=self._partition_watch, daemon=True,
                                       name="islands-link-partition")
        self._watch.start()

    # -- faults ---------------------------------------------------------------------------------
    def add_fault(self, fault: Fault) -> None:
        """A network fault or partition of this region (wall-clock ``at_s``)."""
        with self.lock:
            self.windows.add(fault)
        if self.partitioned():
            self._reset_all()

    def partitioned(self, now_s: Optional[float] = None) -> bool:
        now = time.time() if now_s is None else now_s
        with self.lock:
            return self.windows.departure_s(self.region, now) > now

    def counters(self) -> dict:
        with self.lock:
            return {"up": self.bytes_up, "down": self.bytes_down,
                    "connections": self.connections, "resets": self.resets,
                    "losses": self.losses}

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._reset_all()

    # -- plumbing -------------------------------------------------------------------------------
    def _reset_all(self) -> None:
        with self.lock:
            socks, self._open = list(self._open), set()
            self.resets += bool(socks)
        for s in socks:
            _hard_close(s)

    def _partition_watch(self) -> None:
        while not self._closed.wait(0.05):
            if self._open and self.partitioned():
                self._reset_all()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            if self.partitioned():
                _hard_close(down)
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=10)
                up.settimeout(None)
            except OSError as exc:
                log.info("link relay: home %s:%d unreachable: %s", *self.upstream, exc)
                _hard_close(down)
                continue
            for s in (up, down):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self._open |= {up, down}
                self.connections += 1
            self._pipe(down, up, "up")
            self._pipe(up, down, "down")

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        """A reader that stamps each read with its emulated arrival time and a writer that
        delivers it then; the link is busy for bytes / bandwidth per read (serialized), and a
        lost read holds itself and what follows back by one RTO (``segment_arrival_s``)."""
        q: "queue.Queue" = queue.Queue()
        free_at, last_arrival = [0.0], [0.0]
        rng = self._rng[direction]

        def read():
            while True:
                try:
                    data = src.recv(READ_BYTES)
                except OSError:
                    data = b""
                if not data:
                    q.put(None)
                    return
                now = time.time()
                with self.lock:
                    if direction == "up":
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
                    link = self.windows.link(self.region, now, self.base)
                    lost = rng.random() < link.loss_rate   # one draw per read, lossy or not
                    self.losses += lost
                last_arrival[0], free_at[0] = segment_arrival_s(
                    now, len(data), link, free_at[0], last_arrival[0], lost)
                q.put((last_arrival[0], data))

        def write():
            while True:
                item = q.get()
                if item is None:
                    break
                at_s, data = item
                wait = at_s - time.time()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            for s in (src, dst):
                with self.lock:
                    self._open.discard(s)
                _hard_close(s)

        for target in (read, write):
            threading.Thread(target=target, daemon=True, name=f"islands-relay-{direction}").start()


def _hard_close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
