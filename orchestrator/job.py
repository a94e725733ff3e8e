"""``islands run``: start (or join) a Ray cluster, start the controller, watch, and write the run dir.

Run dir: ``summary.json``, ``events.jsonl`` (every membership change, failure, restart, merge and
refusal, timestamped), ``metrics.jsonl`` (periodic snapshots). A new job never reuses (or deletes)
a run dir that holds an earlier run: ``resume`` continues it, ``force`` writes to a new
subdirectory of it (:func:`prepare_run_dir`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import sys
import tempfile
import time
from typing import Callable, Optional

from .controller import CONTROLLER_NAME, NAMESPACE, Controller, controller_options
from .runtime import (NOT_INSTALLED, ON_HEAD, Role, Terminated, cpu_runtime_env,
                      hold_sigterm, restore_sigterm, sigterm_interrupts)

log = logging.getLogger("islands.job")


def start_ray(config, address: Optional[str]) -> bool:
    """Joins ``address`` (or $RAY_ADDRESS); otherwise starts an embedded local cluster whose custom
    resources are the config's regions. Returns True when this process started the cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        problem = probe_address(address)
        if problem:
            raise ConnectionError(problem)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    learners_cpu = 0.25 * sum(max(r.learners, r.max_learners or 0)
                              for r in config.regions.values())
    if config.run.dashboard:
        missing = dashboard_dependency_error()
        if missing is not None:
            from .config import ConfigError

            raise ConfigError(f"run.dashboard: true starts Ray's dashboard, whose packages are "
                              f"not installed here ({missing}); set run.dashboard: false or "
                              "pip install 'ray[default]'")
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


def dashboard_dependency_error() -> Optional[str]:
    """Why Ray's dashboard cannot start in this environment (its packages are missing), or None."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def islands_state_dir() -> str:
    """A per-user directory for small runtime files: ``$XDG_RUNTIME_DIR/islands`` when that is set
    (tmpfs, mode 0700, per login), else ``$XDG_CACHE_HOME/islands`` or ``~/.cache/islands``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "islands")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "islands")


def embedded_address_file() -> str:
    """Where a running embedded cluster's address is kept, so `islands status` and friends in
    another shell find it (Ray's own "auto" only knows clusters started by `ray start`). It lives
    in :func:`islands_state_dir` (0700), not a shared temp dir another user could write."""
    return os.path.join(islands_state_dir(), "embedded_cluster_address")


def _private_file_problem(st: os.stat_result, what: str, path: str, mask: int) -> Optional[str]:
    """Why a file or directory may not be trusted (not ours, or open to group/other), or None."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and st.st_uid != uid:
        return f"{what} {path} is owned by uid {st.st_uid}, not this user ({uid})"
    if stat.S_IMODE(st.st_mode) & mask:
        return (f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}: group or others may "
                "change it")
    return None


def embedded_address() -> Optional[str]:
    """The embedded cluster's address, or None. A file that is not this user's alone (another
    owner, a link, or group/other permissions) is ignored with a warning: it could point this
    client at someone else's cluster."""
    path = embedded_address_file()
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        log.warning("ignoring %s: not a regular file", path)
        return None
    problem = _private_file_problem(st, "address file", path, 0o077)
    if problem:
        log.warning("ignoring the embedded cluster address: %s", problem)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _write_embedded_address(address: str) -> None:
    path = embedded_address_file()
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{directory} is not a directory")
        problem = _private_file_problem(st, "directory", directory, 0)
        if problem:
            raise OSError(problem)
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(directory, 0o700)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".address-")  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(address)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:  # only `islands status` from another shell needs it
        log.warning("could not record the embedded cluster's address in %s: %s", path, exc)


def _forget_embedded_address() -> None:
    try:
        os.remove(embedded_address_file())
    except OSError:
        pass


def probe_address(address: str, timeout_s: float = 5.0) -> Optional[str]:
    """A TCP connect to a ``host:port`` Ray address (``ray://`` too); returns why it failed, or
    None when something answers or the address names no port ("auto", "local")."""
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        return (f"no Ray cluster answers at {address!r} ({reason} within {timeout_s:g}s); is the "
                "address right and the cluster up?")


def metrics_host(config, embedded: bool, node_ip: Optional[str] = None) -> str:
    """The address ``/metrics`` binds: ``metrics.host`` when set; 127.0.0.1 for an embedded
    cluster (this machine's alone); on a real cluster the controller node's address (``node_ip``,
    else this node's), never every interface unless the config asks for 0.0.0.0.

    >>> from islands.orchestrator.config import parse
    >>> metrics_host(parse({}), embedded=True), metrics_host(parse({}), False, "10.0.0.5")
    ('127.0.0.1', '10.0.0.5')
    """
    if config.metrics.host:
        return config.metrics.host
    if embedded:
        return "127.0.0.1"
    if node_ip:
        return node_ip
    import ray

    return ray.util.get_node_ip_address()


class RunDirError(ValueError):
    """A run dir that a new job must not use as it is; nothing in it was changed."""


RUN_FILES = ("events.jsonl", "metrics.jsonl", "summary.json")


def earlier_run(path: str) -> list[str]:
    """What in ``path`` shows an earlier run: its run files and ``syncer/`` snapshots."""
    from islands.syncer.state import snapshot_steps

    found = [name for name in RUN_FILES if os.path.exists(os.path.join(path, name))]
    if snapshot_steps(os.path.join(path, "syncer")):
        found.append("syncer/ snapshots")
    return found


def prepare_run_dir(path: str, resume: bool = False, force: bool = False) -> str:
    """The directory a job writes to; it never deletes or empties anything.

    A run dir that holds no earlier run (absent, empty, or only other files) is used as it is. One
    that does is refused, unless ``resume`` (continue that run: append to its logs, restore the
    syncer from its newest snapshot) or ``force`` (start a new run in a new subdirectory
    ``<path>/<YYYYmmdd-HHMMSS>``, returned).

    Raises:
      RunDirError: naming the path, what it holds and the flags.
    """
    if resume and force:
        raise RunDirError("--resume continues the run in a run dir, --force starts a new one "
                          "beside it: pass one of them, not both")
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"run dir {path!r} exists and is not a directory")
    _check_writable(path)
    found = earlier_run(path) if os.path.isdir(path) else []
    if resume:
        if not found:
            raise RunDirError(f"--resume: run dir {path!r} holds no earlier run to continue "
                              f"(no {', '.join(RUN_FILES)} or syncer/ snapshots)")
        return path
    if not found:
        return path
    if not force:
        raise RunDirError(f"run dir {path!r} already holds a run ({', '.join(found)}); a new job "
                          "never overwrites it. Pass --resume to continue that run, --force to "
                          "start a new run in a subdirectory of it, or choose another --run-dir")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        candidate = os.path.join(path, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.makedirs(candidate)
            return candidate
        except FileExistsError:
            continue
    raise RunDirError(f"run dir {path!r}: no free subdirectory named {stamp}-N")


def _check_writable(path: str) -> None:
    """The run dir can be created and written (a read-only mount, no permission): say so now,
    in one line, rather than as a traceback once the job started. Only a probe file of its own
    is created and removed; nothing of the user's is touched."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".islands-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RunDirError(f"run dir {path!r} cannot be created or written: "
                          f"{exc.strerror or exc} (choose another --run-dir, or fix its "
                          "permissions or mount)") from None


def resumable(path: str) -> bool:
    """Whether ``path`` holds a run ``--resume`` can continue (``--resume-or-start``)."""
    return os.path.isdir(path) and bool(earlier_run(path))


def check_snapshot_dir(config, run_dir: str, resume: bool) -> None:
    """A new job whose syncer snapshot directory already holds snapshots is refused before Ray
    starts (the syncer would refuse it anyway, and nothing there is deleted)."""
    from islands.syncer.state import snapshot_directory, snapshot_steps

    directory = snapshot_directory(config.syncer.checkpoint_dir, run_dir, config.name)
    steps = snapshot_steps(directory)
    if steps and not resume:
        raise RunDirError(f"syncer.checkpoint_dir: {directory!r} already holds snapshots of a job "
                          f"named {config.name!r} (steps {', '.join(steps)}); pass --resume to "
                          "continue it, or change the job's name or syncer.checkpoint_dir")


class CapacityError(RuntimeError):
    """The cluster cannot hold the job's regions (at once on an embedded cluster, or after
    ``health.placement_timeout_s`` on one the job joined); the message names the region."""


def capacity_problem(config, total: dict, nodes: list) -> Optional[str]:
    """Which regions the cluster cannot hold yet (``region:<name>`` units, then the GPUs or TPU
    chips on the nodes that carry the region), or None. ``total``: ``ray.cluster_resources()``;
    ``nodes``: ``ray.nodes()``."""
    from .accelerators import region_shortage

    short, devices_short = [], []
    for name, region in config.regions.items():
        if region.remote:  # its nodes are in its own cluster
            continue
        have = total.get(f"region:{name}", 0.0)
        spares = config.spares_of(name)   # a warm spare holds a learner's resources
        hosts = region.devices().hosts    # one region unit per host of a learner
        need = (region.learners + spares) * hosts
        if have < need:
            of = f" ({region.learners} learners + {spares} spares)" if spares else ""
            of += f" ({region.learners} learners × {hosts} hosts)" if hosts > 1 else ""
            short.append(f"region {name!r} needs {need} 'region:{name}' resources{of}, "
                         f"the cluster has {have:g}")
            continue
        problem = region_shortage(name, need, region.devices(), nodes)
        if problem:
            devices_short.append(problem)
    if short:
        return ("; ".join(short + devices_short) + ". Start nodes with e.g. ray start "
                "--resources=" + json.dumps({k: v for k, v in config.region_resources().items()
                                            if v}))
    if devices_short:
        return ("; ".join(devices_short) + ". Add nodes with those devices and the region's "
                "resource, or ask for fewer learners or devices_per_host")
    return None


def check_capacity(config) -> None:
    """A learner asking for a region, or for devices, that no node has would wait forever:
    raise now, saying which region is short."""
    import ray

    problem = capacity_problem(config, ray.cluster_resources(), ray.nodes())
    if problem:
        raise CapacityError(problem)


def wait_for_capacity(config, timeout_s: float, read=None, sleep=time.sleep,
                      clock=time.monotonic, say=print, poll_s: float = 2.0,
                      progress_every_s: float = 10.0) -> None:
    """Waits until the cluster holds every region's learners, for at most ``timeout_s``
    (``health.placement_timeout_s``), saying which region it waits for every
    ``progress_every_s``. On Kubernetes the job is submitted once the head is up, while worker
    pods (TPU slices above all) may still be provisioning: they join meanwhile.

    Raises:
      CapacityError: still short at the deadline; the message names the region.
    """
    if read is None:
        import ray

        read = lambda: (ray.cluster_resources(), ray.nodes())  # noqa: E731
    start = clock()
    said = None
    while True:
        problem = capacity_problem(config, *read())
        if problem is None:
            if said is not None:
                say(f"islands: the cluster holds every region after {clock() - start:.0f}s",
                    flush=True)
            return
        waited = clock() - start
        if waited >= timeout_s:
            raise CapacityError(f"{problem} (waited {waited:.0f}s for nodes to join: "
                               "health.placement_timeout_s)")
        if said is None or waited - said >= progress_every_s:
            say(f"islands: waiting for capacity ({waited:.0f}s of {timeout_s:.0f}s): {problem}",
                flush=True)
            said = waited
        sleep(min(poll_s, max(timeout_s - waited, 0.0)))


def progress_line(snap: dict) -> str:
    gp = snap["goodput"]["goodput"]
    tl = snap.get("train_loss")
    el = snap.get("eval_loss")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    line = (f"[{snap['elapsed_s']:7.1f}s] merges {snap['syncer'].get('merges') or 0:5d}  "
            f"tokens applied {snap['tokens']['applied']:>9,.0f}  train {fmt(tl)}  eval {fmt(el)}  "
            f"goodput {gp:.3f}  learners {snap['alive']}/{snap['total']}")
    if snap.get("paused_reason"):
        line += f"  PAUSED: {snap['paused_reason']}"
    return line


def strict_json(value, indent=None) -> str:
    """JSON without NaN or Infinity literals (they are not JSON): non-finite floats become null;
    numpy floats are converted like floats."""
    from .snapshot import finite

    return json.dumps(finite(value), default=str, indent=indent, allow_nan=False)


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
            line = strict_json(event)
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
        self.metrics.write(strict_json(snap) + "\n")
        self.metrics.flush()

    def write_summary(self, summary: dict) -> str:
        """Writes ``summary.json`` atomically; a summary already there (a resumed run) is kept as
        ``summary.<n>.json`` rather than overwritten."""
        path = os.path.join(self.path, "summary.json")
        if os.path.exists(path):
            n = 1
            while os.path.exists(os.path.join(self.path, f"summary.{n}.json")):
                n += 1
            os.replace(path, os.path.join(self.path, f"summary.{n}.json"))
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(strict_json(summary, indent=2))
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        self.events.close()
        self.metrics.close()


def run_job(config, duration_s: Optional[float] = None, run_dir: Optional[str] = None,
            address: Optional[str] = None, log_format: str = "text", quiet: bool = False,
            on_started=None, resume: bool = False, force: bool = False,
            resume_or_start: bool = False,
            until: Optional[Callable[[dict], bool]] = None,
            sigterm_stops: bool = False) -> dict:
    """Runs a job to its duration (or Ctrl+C) and returns the summary.

    ``until``, if given, ends the job early, as its duration would, once it returns true for
    the controller's snapshot (asked at most twice a second): a caller that waits for an event
    (a restart, N merges) stops then instead of running a fixed length; the duration stays the
    cap.

    ``sigterm_stops`` (the CLI's ``islands run``, the process a pod or a RayJob stops): once Ray
    is up, SIGTERM stops the job as Ctrl+C does, with its summary and export (if the controller
    had started), and a further one during that is ignored. The summary's ``stopped_by`` says
    ``"sigterm"``, ``"interrupt"`` or None (it ran its course). A library caller keeps its own
    handling of SIGTERM.

    Before Ray starts: :func:`preflight` checks the config against the built model and corpus,
    and :func:`prepare_run_dir` refuses a run dir holding an earlier run unless ``resume`` (the
    controller restores the syncer from its newest snapshot) or ``force`` (a new subdirectory).

    Raises:
      ConfigError, RunDirError, ConnectionError: before anything started.
    """
    import ray

    from .preflight import preflight

    duration_s = duration_s if duration_s is not None else config.run.duration_s
    requested = run_dir or config.run.run_dir.format(name=config.name)
    preflight(config)
    if resume_or_start:   # an unattended restart (a RayJob retry): continue if there is a run
        resume = resumable(requested)
        if not quiet:
            print(f"islands: {'resuming the run in' if resume else 'starting a new run in'} "
                  f"{requested}", flush=True)
    run_dir = prepare_run_dir(requested, resume=resume, force=force)
    check_snapshot_dir(config, run_dir, resume)
    if run_dir != requested and not quiet:
        print(f"islands: {requested} holds an earlier run; this run writes to {run_dir}",
              flush=True)
    from .export import write_job_file

    write_job_file(run_dir, config)  # `islands export RUN_DIR` rebuilds the task from it
    started_cluster = start_ray(config, address)
    out = RunDir(run_dir, log_format)
    controller = None
    summary: dict = {}
    # `islands run` (a pod's, a RayJob's process): SIGTERM stops the job as Ctrl+C does.
    previous_term = sigterm_interrupts() if sigterm_stops else NOT_INSTALLED
    stopped_by = None   # the job ran its duration (or its ``until``)
    try:
        if started_cluster:   # the embedded cluster is what it is: nothing joins later
            check_capacity(config)
        else:
            wait_for_capacity(config, config.health.placement_timeout_s,
                              say=(lambda *a, **k: None) if quiet else print)
        controller = ray.remote(Controller).options(
            **controller_options(os.path.abspath(run_dir))).remote(
                config, os.path.abspath(run_dir), resume=resume)
        ray.get(controller.start.remote())
        metrics_port = _serve_metrics(controller, config, embedded=started_cluster)
        console = _serve_console(controller, config, os.path.abspath(run_dir))
        if console and not quiet:
            print(f"islands: console at {console[0]} (actions need the token from "
                  f"{console[1]})", flush=True)
        link_address = _serve_link(config, os.path.abspath(run_dir))
        if link_address and not quiet:
            print(f"islands: link on {link_address} (regions "
                  f"{sorted(n for n, r in config.regions.items() if r.remote)} join there)",
                  flush=True)
        if not quiet:
            print(f"islands: job {config.name!r} running for {duration_s:.0f}s, run dir {run_dir}"
                  + (f", metrics on :{metrics_port}/metrics" if metrics_port else ""), flush=True)
        if on_started is not None:
            on_started(controller)
        t0 = time.time()
        next_snap = next_progress = next_until = 0.0
        while time.time() - t0 < duration_s:
            events, out.event_index = ray.get(controller.events_since.remote(out.event_index))
            out.add_events(events)
            now = time.time()
            if now >= next_snap or (not quiet and now >= next_progress):
                snap = ray.get(controller.snapshot.remote())
                if now >= next_snap:  # a metrics.jsonl row every metrics.snapshot_every_s
                    out.add_snapshot(snap)
                    next_snap = now + config.metrics.snapshot_every_s
                if not quiet and now >= next_progress:
                    print(progress_line(snap), flush=True)
                    next_progress = now + config.run.progress_every_s
            if until is not None and now >= next_until:
                next_until = now + 0.5
                if until(ray.get(controller.snapshot.remote())):
                    break
            time.sleep(min(0.25, max(0.0, duration_s - (time.time() - t0))))
    except KeyboardInterrupt as stop:
        stopped_by = "sigterm" if isinstance(stop, Terminated) else "interrupt"
        print(f"islands: {'SIGTERM' if stopped_by == 'sigterm' else 'interrupted'}, stopping "
              "cleanly", flush=True)
    finally:
        hold_sigterm(previous_term)
        try:
            if controller is not None:
                try:
                    summary = ray.get(controller.shutdown.remote(), timeout=120)
                    events, out.event_index = ray.get(controller.events_since.remote(out.event_index))
                    out.add_events(events)
                    out.add_snapshot(ray.get(controller.snapshot.remote()))
                except Exception as exc:  # a broken controller must not hide the run dir
                    log.error("controller shutdown failed: %s", exc)
                summary["duration_s"] = summary.get("duration_s")
                summary["stopped_by"] = stopped_by
                path = out.write_summary(summary)
                if not quiet:
                    print(f"islands: summary written to {path}", flush=True)
                _end_link(config)
                _kill_job_actors(controller)
                exported = _auto_export(run_dir)
                if exported:
                    summary["export_dir"] = exported
                    if not quiet:
                        print(f"islands: global parameters exported to {exported}/params (orbax)",
                              flush=True)
            out.close()
            if started_cluster:
                _forget_embedded_address()
                ray.shutdown()
        finally:  # restored even if a step of the stop raised
            restore_sigterm(previous_term)
    summary["stopped_by"] = stopped_by   # also where it stopped before the controller started
    return summary


def _auto_export(run_dir: str) -> Optional[str]:
    """The job's end: the newest snapshot's global parameters to ``RUN_DIR/export`` (a resumed
    run's next export goes to ``export.1``, …; nothing is overwritten). Never fails the job."""
    from .export import EXPORT_DIR, export_run

    out = os.path.join(run_dir, EXPORT_DIR)
    n = 0
    while os.path.exists(os.path.join(out if n == 0 else f"{out}.{n}", "params")):
        n += 1
    try:
        return export_run(run_dir, out if n == 0 else f"{out}.{n}")
    except Exception as exc:
        log.warning("export of %s failed: %s", run_dir, exc)
        return None


def _serve_metrics(controller, config, embedded: bool = False) -> Optional[int]:
    import ray

    if not config.metrics.enabled:
        return None
    try:
        node_ip = None if embedded or config.metrics.host else _actor_node_ip(controller)
        host = metrics_host(config, embedded, node_ip)
        return ray.get(controller.serve_metrics.remote(config.metrics.port, host))
    except Exception as exc:  # metrics must never stop training
        log.warning("metrics endpoint not started: %s", exc)
        return None


def _serve_console(controller, config, run_dir: str) -> Optional[tuple[str, str]]:
    """Starts the operator console (``console.enabled``); its URL and where its token is.
    Never stops training: a console that cannot start is a warning."""
    import ray

    from .console import resolve_token

    if not config.console.enabled:
        return None
    try:
        token, source = resolve_token(config.console.token_file, run_dir)
        port = ray.get(controller.serve_console.remote(
            config.console.port, config.console.host, token, config.console.allow_chaos))
    except Exception as exc:
        log.warning("console not started: %s", exc)
        return None
    host = config.console.host
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/", source


def _serve_link(config, run_dir: Optional[str] = None) -> Optional[str]:
    """Starts the link server (``islands:link``) when ``link.port`` is set; its bound address.

    Ray restarts it when its process dies (``LINK_SERVER_MAX_RESTARTS``; calls made meanwhile
    wait for it): it binds the same port again and answers retried pushes from its reply journal
    in ``RUN_DIR/link`` (``link/server.py: LinkServer``, ``ReplyJournal``).

    Raises:
      ValueError: no token (``link.token_file`` or $ISLANDS_LINK_TOKEN).
    """
    import uuid

    import ray

    if config.link.port is None:
        return None
    from islands.link.security import read_token
    from islands.link.server import (LINK_DIR, LINK_SERVER_MAX_RESTARTS, LINK_SERVER_NAME,
                                     LinkServer)

    from . import build

    settings = build.link_server_settings(config, read_token(config.link.token_file))
    paths, owned = build.fragment_layout(config)
    server = ray.remote(LinkServer).options(
        name=LINK_SERVER_NAME, namespace=NAMESPACE, num_cpus=0.1, max_concurrency=4,
        resources=dict(ON_HEAD), lifetime="detached", max_restarts=LINK_SERVER_MAX_RESTARTS,
        max_task_retries=-1,
        runtime_env=cpu_runtime_env(Role.LINK_SERVER)).remote(
            config.model_dump_json(), settings, paths, owned,
            state_dir=os.path.join(run_dir, LINK_DIR) if run_dir else None,
            start_id=uuid.uuid4().hex)
    return ray.get(server.address.remote(), timeout=60)


def _end_link(config) -> None:
    """Tells the regions' agents the job ended (in the reply to their next report), so they stop
    their learners and leave instead of waiting out ``link.agent_home_timeout_s``."""
    import ray

    if config.link.port is None:
        return
    from islands.link.server import LINK_SERVER_NAME

    try:
        told = ray.get(ray.get_actor(LINK_SERVER_NAME, namespace=NAMESPACE).end.remote(3.0),
                       timeout=15)
        log.info("link: told regions %s that the job ended", told)
    except Exception as exc:  # the agents leave after their home timeout instead
        log.warning("link: could not tell the regions the job ended: %r", exc)


def _actor_node_ip(actor) -> Optional[str]:
    """The address of the node an actor runs on (None if Ray's state API cannot tell)."""
    import ray

    try:
        from ray.util.state import get_actor

        node_id = get_actor(actor._actor_id.hex()).node_id
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return node.get("NodeManagerAddress")
    except Exception as exc:
        log.debug("controller node lookup failed: %s", exc)
    return None


def _kill_job_actors(controller) -> None:
    """Ends every actor of the job (the syncer and learners are detached: they outlive their
    creator by design). Named-actor listing needs no dashboard, unlike Ray's state API."""
    import ray

    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE]
    except Exception:
        names = []
    for name in names:
        if name.startswith("islands:") and name != CONTROLLER_NAME:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except Exception:
                pass
    try:
        ray.kill(controller)
    except Exception:
        pass
