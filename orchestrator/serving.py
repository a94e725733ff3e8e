"""What the controller serves from its actor: Prometheus ``/metrics`` (``metrics.py``), the same
values mirrored into ``ray.util.metrics`` for the Ray dashboard, and the operator console
(``console.py``). Each starts once, on the first ask, and stops with the job.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

log = logging.getLogger("islands.controller")


def console_url(host: str, port: int) -> str:
    """The console's address (an IPv6 host in brackets).

    >>> console_url("127.0.0.1", 8265), console_url("::1", 80)
    ('http://127.0.0.1:8265/', 'http://[::1]:80/')
    """
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


class Serving:
    """The controller's servers: ``snapshot`` is its metrics row, ``emit`` its event log."""

    def __init__(self, snapshot: Callable[[], dict], emit: Callable[..., None]):
        self.snapshot, self.emit = snapshot, emit
        self.metrics_server: Any = None
        self.metrics_port: Optional[int] = None
        self.ray_metrics: Any = None          # metrics.RayMetricsMirror, once serving metrics
        self.console: Any = None              # console.ConsoleServer, once served
        self.console_host: Optional[str] = None

    def serve_metrics(self, port: int, host: str) -> int:
        from . import metrics

        if self.metrics_server is None:
            self.metrics_server, self.metrics_port = metrics.serve(self.snapshot, port, host)
            try:
                self.ray_metrics = metrics.RayMetricsMirror()
            except Exception as exc:  # the Ray mirror is a convenience; Prometheus is the contract
                log.warning("ray.util.metrics mirror not started: %s", exc)
        return self.metrics_port

    def serve_console(self, controller: Any, port: int, host: str, token: str,
                      allow_chaos: bool) -> int:
        from .console import ConsoleServer

        if self.console is None:
            server = ConsoleServer(controller, token, allow_chaos)
            server.start(host, port)
            self.console, self.console_host = server, host
        return self.console.port

    def console_url(self) -> Optional[str]:
        return None if self.console is None else console_url(self.console_host, self.console.port)

    def mirror_ray_metrics(self) -> None:
        """The Ray dashboard's copy of the metrics: a failure here must never stop the owner."""
        if self.ray_metrics is None:
            return
        try:
            self.ray_metrics.update(self.snapshot())
        except Exception as exc:
            self.ray_metrics = None
            self.emit("metrics_mirror_stopped", error=repr(exc)[:300])

    def stop(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        if self.console is not None:
            self.console.stop()
            self.console = None
