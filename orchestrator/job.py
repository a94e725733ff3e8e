"""``islands run``: start (or join) a Ray cluster, start the controller, watch, and write the run dir.

Run dir: ``summary.json``, ``events.jsonl`` (every membership change, failure, restart, merge and
refusal, timestamped), ``metrics.jsonl`` (periodic snapshots).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Optional

from .controller import CONTROLLER_NAME, NAMESPACE, Controller, controller_options

log = logging.getLogger("islands.job")


def start_ray(config, address: Optional[str]) -> bool:
    """Joins ``address`` (or $RAY_ADDRESS); otherwise starts an embedded local cluster whose custom
    resources are the config's regions. Returns True when this process started the cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    learners_cpu = 0.25 * sum(max(r.learners, r.max_learners or 0)
                              for r in config.regions.values())
    context = ray.init(address="local",
                       num_cpus=max(os.cpu_count() or 1, int(learners_cpu + 1.5)),
                       resources=config.region_resources(), namespace=NAMESPACE,
                       include_dashboard=config.run.dashboard, dashboard_host="127.0.0.1",
                       log_to_driver=False, _node_ip_address="127.0.0.1")
    if config.run.dashboard and getattr(context, "dashboard_url", None):
        print(f"islands: Ray dashboard at http://{context.dashboard_url} (actors islands:*, "
              "metrics islands_*)", flush=True)
    _write_embedded_address(context.address_info["gcs_address"])
    return True


def embedded_address_file() -> str:
    """Where a running embedded cluster's address is kept, so `islands status` and friends in
    another shell find it (Ray's own "auto" only knows clusters started by `ray start`)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), "islands", "embedded_cluster_address")


def embedded_address() -> Optional[str]:
    try:
        with open(embedded_address_file()) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _write_embedded_address(address: str) -> None:
    path = embedded_address_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(address)


def _forget_embedded_address() -> None:
    try:
        os.remove(embedded_address_file())
    except OSError:
        pass


def check_capacity(config) -> None:
    """A learner asking for a region no node has would wait forever: say which region is short."""
    import ray

    total = ray.cluster_resources()
    short = []
    for name, region in config.regions.items():
        have = total.get(f"region:{name}", 0.0)
        if have < region.learners:
            short.append(f"region {name!r} needs {region.learners} 'region:{name}' resources, "
                         f"the cluster has {have:g}")
    if short:
        raise RuntimeError("; ".join(short) + ". Start nodes with e.g. ray start --resources="
                           + json.dumps({f"region:{n}": r.learners for n, r in config.regions.items()}))


def progress_line(snap: dict) -> str:
    gp = snap["goodput"]["goodput"]
    tl = snap.get("train_loss")
    el = snap.get("eval_loss")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    line = (f"[{snap['elapsed_s']:7.1f}s] merges {snap['syncer'].get('merges') or 0:5d}  "
            f"tokens applied {snap['tokens']['applied']:>9,d}  train {fmt(tl)}  eval {fmt(el)}  "
            f"goodput {gp:.3f}  learners {snap['alive']}/{snap['total']}")
    if snap.get("paused_reason"):
        line += f"  PAUSED: {snap['paused_reason']}"
    return line


class RunDir:
    """Appends events and metric snapshots as JSON lines; writes the summary at the end."""

    def __init__(self, path: str, log_format: str = "text"):
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.events = open(os.path.join(path, "events.jsonl"), "a")
        self.metrics = open(os.path.join(path, "metrics.jsonl"), "a")
        self.log_format = log_format
        self.event_index = 0

    def add_events(self, events: list[dict]) -> None:
        for event in events:
            line = json.dumps(event, default=str)
            self.events.write(line + "\n")
            if self.log_format == "json":
                print(line, file=sys.stderr, flush=True)
            else:
                fields = " ".join(f"{k}={v}" for k, v in event.items()
                                  if k not in ("t", "event", "elapsed_s"))
                print(f"  event {event['elapsed_s']:7.1f}s {event['event']} {fields}",
                      file=sys.stderr, flush=True)
        self.events.flush()

    def add_snapshot(self, snap: dict) -> None:
        self.metrics.write(json.dumps(snap, default=str) + "\n")
        self.metrics.flush()

    def write_summary(self, summary: dict) -> str:
        path = os.path.join(self.path, "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        return path

    def close(self) -> None:
        self.events.close()
        self.metrics.close()


def run_job(config, duration_s: Optional[float] = None, run_dir: Optional[str] = None,
            address: Optional[str] = None, log_format: str = "text", quiet: bool = False,
            on_started=None) -> dict:
    """Runs a job to its duration (or Ctrl+C) and returns the summary."""
    import ray

    duration_s = duration_s if duration_s is not None else config.run.duration_s
    run_dir = run_dir or config.run.run_dir.format(name=config.name)
    started_cluster = start_ray(config, address)
    out = RunDir(run_dir, log_format)
    controller = None
    summary: dict = {}
    try:
        check_capacity(config)
        controller = ray.remote(Controller).options(
            **controller_options(os.path.abspath(run_dir))).remote(config, os.path.abspath(run_dir))
        ray.get(controller.start.remote())
        metrics_port = _serve_metrics(controller, config)
        if not quiet:
            print(f"islands: job {config.name!r} running for {duration_s:.0f}s, run dir {run_dir}"
                  + (f", metrics on :{metrics_port}/metrics" if metrics_port else ""), flush=True)
        if on_started is not None:
            on_started(controller)
        t0 = time.time()
        next_snap = 0.0
        while time.time() - t0 < duration_s:
            events, out.event_index = ray.get(controller.events_since.remote(out.event_index))
            out.add_events(events)
            if time.time() >= next_snap:
                snap = ray.get(controller.snapshot.remote())
                out.add_snapshot(snap)
                if not quiet:
                    print(progress_line(snap), flush=True)
                next_snap = time.time() + max(config.run.progress_every_s, 1.0)
            time.sleep(min(0.25, max(0.0, duration_s - (time.time() - t0))))
    except KeyboardInterrupt:
        print("islands: interrupted, stopping cleanly", flush=True)
    finally:
        if controller is not None:
            try:
                summary = ray.get(controller.shutdown.remote(), timeout=120)
                events, out.event_index = ray.get(controller.events_since.remote(out.event_index))
                out.add_events(events)
                out.add_snapshot(ray.get(controller.snapshot.remote()))
            except Exception as exc:  # a broken controller must not hide the run dir
                log.error("controller shutdown failed: %s", exc)
            summary["duration_s"] = summary.get("duration_s")
            path = out.write_summary(summary)
            if not quiet:
                print(f"islands: summary written to {path}", flush=True)
            _kill_job_actors(controller)
        out.close()
        if started_cluster:
            _forget_embedded_address()
            ray.shutdown()
    return summary


def _serve_metrics(controller, config) -> Optional[int]:
    import ray

    if not config.metrics.enabled:
        return None
    try:
        return ray.get(controller.serve_metrics.remote(config.metrics.port))
    except Exception as exc:  # metrics must never stop training
        log.warning("metrics endpoint not started: %s", exc)
        return None


def _kill_job_actors(controller) -> None:
    import ray

    from ray.util.state import list_actors

    try:
        actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    except Exception:
        actors = []
    for actor in actors:
        name = getattr(actor, "name", "") or ""
        if name.startswith("islands:") and name != CONTROLLER_NAME:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except Exception:
                pass
    try:
        ray.kill(controller)
    except Exception:
        pass
