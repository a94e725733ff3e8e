"""GPU benchmark in one command: the service on one GPU against the bare step, sharing, recovery.

Phases (each with its own time budget; the whole run ends within ``--budget-s``, 470 s by
default, so inside a device machine's 8-minute command):

  a. bare     the jitted train step alone (``overhead.py``'s bare loop in a subprocess with the
              learner's environment) of the ``gpu`` preset (GPT-2-small shape, 124M parameters)
              and of the ``mid`` preset (25M parameters) the service phases train;
  b. service  the same ``mid`` learner in the real service: ``islands run``'s job API
              (``orchestrator.job.run_job``) on an embedded Ray cluster that holds the GPU, one
              learner of a GPU region (``accelerator: gpu``, ``devices_per_host: 1``,
              ``run.dashboard: false``): service steps/s ÷ bare steps/s (goal ≥ 0.99). The
              service's rate is on the learner's own clock: its ``status()``'s ``step_at``
              (when it reached its step), polled over the window, from the first step seen to
              the last (not when the controller received heartbeats);
  c. GPU utilisation, sampled every 0.5 s over the whole run by ``nvidia-smi
              --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500``
              (a subprocess; no Python dependency), averaged per phase;
  d. each learner's reported backend (``devices`` of its status/heartbeat, read with .get:
              None where the learner does not report it);
  e. share    four learners on one GPU (``devices_per_host: 0.25``): each one's steps/s and
              their sum against the bare rate;
  f. kills    a learner killed (``chaos_kill``, as ``islands chaos kill``) in the four-learner
              job (no spare) and in a job of three learners and a warm spare
              (``health.spares: 1``): seconds from the kill to training again and to its first
              merged contribution (the controller's ``learner_recovered`` phases, as
              ``recovery.py`` reads them);
  g. syncer   the syncer killed in the four-learner job: seconds to the syncer back up and to
              merges resuming.

GPT-2 itself runs bare only: the controller builds the model, warms the compile cache with one
train step, and evaluates, on the CPU with single-threaded XLA, which for GPT-2 takes minutes.

On a GPU machine (no Ray, pydantic or network there; ``bundle/`` carried, 64 MiB at most with
the working tree)::

    python benchmarks/gpu_bundle.py                  # here: builds bundle/ (ignored by git)
    # there, carrying bundle/:
    export PYTHONPATH="$(bash bundle/install.sh /tmp/islands-gpu)" && python benchmarks/gpu.py

``python benchmarks/gpu.py --dry-run`` (no GPU) builds the bundle, builds and validates every
job config the GPU run uses (``orchestrator.config.parse``, ``preflight``, and the capacity
check against a one-GPU node), and prints the plan; its last line is one JSON object with
``bundle_mib``. ``--accelerator cpu`` rehearses the phases with CPU learners (a check of the
machinery, not a GPU measurement).

Without the package installed (the GPU machine) the script maps ``islands.*`` to this checkout
as ``pyproject.toml``'s package-dir table says, on disk, so Ray's workers import it too.

Prints a table, then one JSON object as the last line; writes ``gpu.json`` and ``gpu.png``
to ``--out`` (``benchmarks/out``), and keeps each job's run dir (events, metrics, and
``gpu_step_samples.json``: the window's ``(step_at, step)`` samples behind its rates) under
``--out/runs/``, named in ``gpu.json`` (``run_dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# A local cluster for a benchmark binds loopback (read by Ray at import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

GOAL_RATIO = 0.99
DEFAULT_BUDGET_S = 470.0
GPU_MEMORY_GIB = 78.0        # an H100's, the smaller of the GPUs lent
REGION = "gpu"
SMI_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
             "--format=csv,noheader,nounits", "-lms", "500"]
DEVICE_COMMAND = ('python benchmarks/gpu_bundle.py   # here; then on the GPU machine, carrying '
                  'bundle/: export PYTHONPATH="$(bash bundle/install.sh /tmp/islands-gpu)" && '
                  'python benchmarks/gpu.py')


# -- islands without the package installed ---------------------------------------------------------
def package_dirs(repo: str = REPO_DIR) -> dict[str, str]:
    """``{package: folder}`` from pyproject.toml's ``[tool.setuptools.package-dir]``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: os.path.join(repo, folder) for name, folder in table.items()}


def make_islands_package(base: str, repo: str = REPO_DIR) -> str:
    """Lays out ``base/islands`` as the install would: the files of ``islands``' folder and one
    link per sub-package to its folder (``islands.learners`` → ``learners/``). Returns ``base``."""
    dirs = package_dirs(repo)
    root = os.path.join(base, "islands")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    for entry in os.listdir(dirs["islands"]):
        if entry != "__pycache__":
            os.symlink(os.path.join(dirs["islands"], entry), os.path.join(root, entry))
    for name, folder in dirs.items():
        if name == "islands":
            continue
        parts = name.split(".")
        if len(parts) != 2 or parts[0] != "islands":
            raise ValueError(f"pyproject package-dir {name!r}: only islands.<name> is mapped")
        os.symlink(folder, os.path.join(root, parts[1]))
    return base


def ensure_islands(force: bool = False) -> Optional[str]:
    """Makes ``import islands.*`` work in this process and in every process it starts (Ray's
    workers included: ``PYTHONPATH``) when the package is not installed; returns the folder put on
    the path, or None when the installed package is used."""
    import importlib.util

    if not force:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec("islands.orchestrator") is not None:
                return None
    import hashlib

    tag = hashlib.sha256(REPO_DIR.encode()).hexdigest()[:12]
    base = os.path.join(tempfile.gettempdir(), f"islands-src-{os.getuid()}-{tag}")
    make_islands_package(base)
    for name in [m for m in sys.modules if m == "islands" or m.startswith("islands.")]:
        del sys.modules[name]
    sys.path.insert(0, base)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [base] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    importlib.invalidate_caches()
    return base


# -- small pure helpers ---------------------------------------------------------------------------
def parse_smi_line(line: str) -> Optional[tuple[float, float]]:
    """``(utilization %, memory used MiB)`` of one ``nvidia-smi --query-gpu=utilization.gpu,
    memory.used --format=csv,noheader,nounits`` line, or None (blank, ``[N/A]``, a message).

    >>> parse_smi_line("87, 40321"), parse_smi_line(" 0 , 3 \\n")
    ((87.0, 40321.0), (0.0, 3.0))
    >>> parse_smi_line("[N/A], 1200"), parse_smi_line(""), parse_smi_line("No devices were found")
    (None, None, None)
    """
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != 2:
        return None
    try:
        return float(parts[0]), float(parts[1])
    except ValueError:
        return None


def util_stats(samples: list[tuple[float, float, float]], start: float, end: float) -> dict:
    """Mean and max utilisation and the most memory of the samples ``(t, util, MiB)`` in
    ``[start, end]``.

    >>> util_stats([(0.0, 10, 100), (1.0, 90, 300), (2.0, 50, 200), (9.0, 0, 0)], 0.5, 2.5)
    {'samples': 2, 'util_mean': 70.0, 'util_max': 90.0, 'memory_max_mib': 300.0}
    """
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return {"samples": 0, "util_mean": None, "util_max": None, "memory_max_mib": None}
    return {"samples": len(inside), "util_mean": statistics.fmean(s[1] for s in inside),
            "util_max": float(max(s[1] for s in inside)),
            "memory_max_mib": float(max(s[2] for s in inside))}


def backend_of(row: Optional[dict]) -> Optional[str]:
    """The backend a learner reports (``devices.backend`` of its status or snapshot row), or None.

    >>> backend_of({"devices": {"backend": "gpu", "kind": "NVIDIA H100"}}), backend_of({})
    ('gpu', None)
    >>> backend_of(None), backend_of({"devices": None})
    (None, None)
    """
    devices = (row or {}).get("devices") or {}
    return devices.get("backend") if isinstance(devices, dict) else None


def window_rate(series: list[tuple[float, int]], start: float, end: float) -> Optional[float]:
    """Steps/s of a ``(t, step)`` series between the first sample at or after ``start`` and the
    last at or before ``end``.

    >>> window_rate([(0.0, 0), (1.0, 10), (2.0, 30), (3.0, 40)], 0.5, 3.0)
    15.0
    """
    inside = [(t, s) for t, s in series if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def own_clock_rate(samples: list[tuple[Optional[float], int]]) -> Optional[float]:
    """Steps/s from a learner's own ``(step_at, step)`` samples (its ``status()``: the time on
    its clock when it reached ``step``), polled over the window: from the first step seen to the
    last, so both ends are step boundaries and the polling period does not enter the rate.

    >>> own_clock_rate([(10.0, 100), (10.0, 100), (10.4, 104), (12.0, 120)])
    10.0
    >>> own_clock_rate([(None, 0), (5.0, 50)]), own_clock_rate([(5.0, 50), (5.0, 50)])
    (None, None)
    """
    points = [(t, s) for t, s in samples if t is not None]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def job_run_dir(out_dir: str, name: str) -> str:
    """A new run dir for job ``name`` under ``out_dir/runs``; kept after the run (its events and
    metrics are what the figures can be audited against), never reused or removed."""
    root = os.path.join(out_dir, "runs")
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-", dir=root)


class Budget:
    """The run's deadline and each phase's share of what is left."""

    def __init__(self, total_s: float, clock=time.monotonic):
        self.clock, self.t0, self.total_s = clock, clock(), total_s

    def left(self) -> float:
        return self.total_s - (self.clock() - self.t0)

    def allows(self, need_s: float) -> bool:
        """Whether a phase that needs ``need_s`` still fits.

        >>> b = Budget(100.0, clock=lambda: 0.0)
        >>> b.allows(90.0), b.allows(120.0)
        (True, False)
        """
        return self.left() >= need_s


# -- presets and job configs ----------------------------------------------------------------------
def presets() -> dict:
    """overhead.py's presets and ``mid``: 25M parameters, a GPU step long enough that the service's
    per-step work is small beside it, a CPU step short enough for the controller's warm-up."""
    import overhead

    mid = overhead.Preset(dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, d_ff=2048,
                               seq_len=256), batch_size=16, fragments=16, sync_every_steps=16,
                          steps=200, quick_steps=100)
    return {**overhead.PRESETS, "mid": mid}


@dataclass(frozen=True)
class JobSpec:
    """One job of the run: its learners, their GPU share and warm spares."""

    name: str
    learners: int
    devices_per_host: float
    spares: int = 0


JOBS = (JobSpec("service", 1, 1.0), JobSpec("share4", 4, 0.25),
        JobSpec("spare", 3, 0.25, spares=1))


def job_dict(spec: JobSpec, preset, accelerator: str = "gpu", run_dir: Optional[str] = None
             ) -> dict:
    """The JobConfig mapping of one job (validated by ``orchestrator.config.parse``)."""
    region: dict = {"learners": spec.learners}
    if accelerator == "gpu":
        region.update(accelerator="gpu", devices_per_host=spec.devices_per_host)
    return {
        "name": f"bench-gpu-{spec.name}",
        "model": dict(preset.model),
        "data": {"max_bytes": 300_000, "batch_size": preset.batch_size, "eval_batches": 1},
        # Eval runs on the controller's CPU: once at the start and once at the end.
        "learner": {"min_step_time_s": 0.0, "eval_every_s": 3600.0},
        "syncer": {"fragments": preset.fragments, "sync_every_steps": preset.sync_every_steps,
                   "overlap_steps": 2},
        "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
        "compression": {"type": "int4"},
        "regions": {REGION: region},
        "health": {"heartbeat_s": 0.25, "timeout_s": 15.0, "spares": spec.spares,
                   "restart": {"backoff_initial_s": 0.1, "backoff_multiplier": 1.0,
                               "max_crash_restarts": None}},
        "metrics": {"enabled": False},
        "console": {"enabled": False},       # aiohttp is not in the bundle
        "run": {"dashboard": False, "duration_s": 1.0, "progress_every_s": 5.0,
                **({"run_dir": run_dir} if run_dir else {})},
    }


def validate(raw: dict, gpus: float = 1.0, cpus: float = 16.0,
             memory_limit_bytes: Optional[int] = None) -> Any:
    """The JobConfig of ``raw`` (a wrong key or value raises ConfigError naming it), preflighted
    (a learner's memory against ``memory_limit_bytes``), and placed on a simulated node of
    ``gpus`` GPUs and ``cpus`` CPUs (CapacityError naming the region)."""
    from islands.orchestrator.config import parse
    from islands.orchestrator.job import CapacityError, capacity_problem
    from islands.orchestrator.preflight import preflight

    config = parse(raw)
    preflight(config, memory_limit_bytes=memory_limit_bytes)
    resources = {"CPU": cpus, "GPU": gpus, **config.region_resources()}
    problem = capacity_problem(config, resources,
                               [{"Alive": True, "NodeID": "sim", "Resources": resources}])
    if problem:
        raise CapacityError(problem)
    return config


# -- the learner's environment, the bare loop ----------------------------------------------------
def learner_env(accelerator: str, devices_per_host: float, cache_dir: str) -> dict:
    """The variables a learner of this region runs with (the project's ``process_env``), for the
    bare loop's subprocess; {name: None} entries are removed. Without the project's own
    definition there is nothing to compare against: a failed import is an error naming it, not
    a stand-in environment."""
    try:
        from islands.orchestrator.accelerators import learner_devices
        from islands.orchestrator.runtime import Role, process_env
    except ImportError as exc:
        raise ImportError(f"gpu.py: the learner's environment comes from islands.orchestrator "
                          f"(accelerators.learner_devices, runtime.process_env), which does not "
                          f"import: {exc}") from exc
    devices = learner_devices(accelerator, devices_per_host if accelerator == "gpu" else None)
    return process_env(Role.LEARNER, devices, cache_dir)


def child_env(env: dict) -> dict:
    out = dict(os.environ)
    for k, v in env.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


def bare_worker(preset_name: str, seconds: float) -> dict:
    """``overhead.bare_worker`` on this script's presets (run in a subprocess)."""
    import overhead

    overhead.PRESETS.update(presets())
    return overhead.bare_worker(preset_name, seconds, warmup_steps=10)


def run_bare(preset_name: str, seconds: float, env: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--bare-worker", preset_name,
           "--bare-seconds", str(seconds)]
    t0 = time.time()
    out = subprocess.run(cmd, env=child_env(env), capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"bare loop {preset_name} failed: {out.stderr.strip()[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(preset=preset_name, wall_s=round(time.time() - t0, 1))
    return result


def probe_backend(env: dict, timeout_s: float = 120.0) -> dict:
    """What JAX sees with a learner's environment, in a subprocess (this process never opens the
    GPU: the learners get all of it)."""
    code = ("import json, jax; d = jax.devices(); print(json.dumps({'backend': "
            "jax.default_backend(), 'kind': d[0].device_kind, 'count': len(d), "
            "'platform': d[0].platform, 'jax': jax.__version__}))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(env), capture_output=True,
                         text=True, timeout=timeout_s)
    if out.returncode != 0:
        lines = [x.strip() for x in out.stderr.splitlines() if x.strip()]
        return {"backend": None, "error": (lines[-1] if lines else f"exit {out.returncode}")[-300:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- GPU utilisation ------------------------------------------------------------------------------
class SmiSampler:
    """``nvidia-smi ... -lms 500`` in a subprocess; each line timestamped on arrival."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self.proc = None
        self.error: Optional[str] = None

    def start(self) -> "SmiSampler":
        if shutil.which(SMI_QUERY[0]) is None:
            self.error = "nvidia-smi not found"
            return self
        self.proc = subprocess.Popen(SMI_QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True, name="nvidia-smi").start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            parsed = parse_smi_line(line)
            if parsed is not None:
                self.samples.append((time.time(), *parsed))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=5)


# -- watching a job -------------------------------------------------------------------------------
def learner_devices_reported(controller, learners: list[str], snap: dict) -> dict:
    """{learner: its ``devices`` report} from the snapshot's row, else the learner's status."""
    import ray

    from islands.orchestrator.controller import NAMESPACE
    from islands.orchestrator.runtime import learner_actor_name

    out = {}
    for name in learners:
        row = (snap.get("learners") or {}).get(name) or {}
        devices = row.get("devices")
        if devices is None:
            with contextlib.suppress(Exception):
                actor = ray.get_actor(row.get("actor") or learner_actor_name(name),
                                      namespace=NAMESPACE)
                devices = (ray.get(actor.status.remote(), timeout=10) or {}).get("devices")
        out[name] = devices
    return out


def events_after(recorder, index: int, kind: str) -> list[dict]:
    return [e for e in recorder.events[index:] if e.get("event") == kind]


def kill_learner(controller, recorder, victim: str, timeout_s: float, before_s: float,
                 spares: int = 0) -> dict:
    """Kills ``victim`` once every learner trains (and ``spares`` spares are ready), waits for its
    ``learner_recovered`` event; the phases as ``recovery.analyse`` reads them."""
    import ray

    import recovery

    def steady(snap):
        ready = sum(1 for x in (snap.get("spares") or {}).values() if x.get("state") == "ready")
        return recovery.all_training(snap) and ready >= spares

    recorder.wait_for(steady, timeout_s, f"all learners training and {spares} spares ready")
    index = len(recorder.events)
    t_kill = time.time()
    ray.get(controller.chaos_kill.remote(victim, "ray_kill"), timeout=30)
    event = recorder.wait_for(lambda _: recorder.recovered(victim, index), timeout_s,
                              f"{victim} to recover")
    recorder.wait_for(lambda _: all(p and p[-1][0] > event["t"] + 0.3
                                    for p in recorder.series.values()), 15,
                      "heartbeats after the recovery")
    row = recovery.analyse({"kill": 1, "victim": victim, "mode": "ray_kill", "event": event,
                            "victim_timings": recorder.timings.get(victim)},
                           recorder.series, before_s)
    promoted = events_after(recorder, index, "spare_promoted")
    row.update(spares=spares, spare_promoted=bool(promoted), kill_t=t_kill,
               kill_to_training_s=row["training_again_s"], kill_to_first_merge_s=row["total_s"])
    return row


def kill_syncer(controller, recorder, timeout_s: float) -> dict:
    """Kills the syncer; seconds to its restart (``syncer_started``) and to the first merge after
    it (the syncer's merge counter rising past its value at the restart)."""
    import ray

    index = len(recorder.events)
    t_kill = time.time()
    ray.get(controller.chaos_kill.remote("syncer"), timeout=30)
    started = recorder.wait_for(lambda _: next(iter(events_after(recorder, index,
                                                                 "syncer_started")), None),
                                timeout_s, "the syncer to restart")
    base = recorder.poll()["syncer"].get("merges") or 0
    recorder.wait_for(lambda snap: (snap["syncer"].get("merges") or 0) > base, timeout_s,
                      "merges after the syncer's restart")
    t_merge = time.time()
    failed = next(iter(events_after(recorder, index, "syncer_failed")), None)
    return {"detect_s": None if failed is None else failed["t"] - t_kill,
            "syncer_up_s": started["t"] - t_kill, "merges_resumed_s": t_merge - t_kill,
            "restored_from": started.get("restored_from"), "kill_t": t_kill}


@dataclass
class JobRun:
    """What a job's measurement leaves: its numbers, the series, its errors."""

    name: str
    result: dict = field(default_factory=dict)
    series: dict = field(default_factory=dict)
    error: Optional[str] = None
    window: tuple = (None, None)


def run_service_job(spec: JobSpec, preset, accelerator: str, work, timeout_s: float,
                    cache_dir: str, out_dir: str) -> JobRun:
    """Runs one job through ``run_job`` (the ``islands run`` path: preflight, embedded cluster,
    capacity check, controller) and ``work(controller, recorder, run)`` once it started. Its run
    dir stays under ``out_dir/runs``."""
    import ray

    import recovery
    from islands.orchestrator.config import parse
    from islands.orchestrator.job import run_job

    run = JobRun(spec.name)
    run_dir = job_run_dir(out_dir, spec.name)
    run.result["run_dir"] = run_dir
    # The learners' compile cache is the bare loop's: the same step is a cache hit.
    cache_link = os.path.join(run_dir, "jax_cache")
    os.symlink(cache_dir, cache_link)
    config = parse(job_dict(spec, preset, accelerator, run_dir))
    t0 = time.time()

    def on_started(controller):
        run.result["cluster_gpus"] = ray.cluster_resources().get("GPU", 0.0)
        recorder = recovery.Recorder(controller)
        deadline = t0 + timeout_s
        recorder.wait_for(lambda s: recovery.all_training(s)
                          and len(s["learners"]) == spec.learners,
                          max(10.0, deadline - time.time()), f"{spec.learners} learners training")
        run.result["start_to_training_s"] = round(time.time() - t0, 1)
        try:
            work(controller, recorder, run, deadline)
        finally:
            run.series = recorder.series
            snap = recorder.last_snapshot
            run.result["devices"] = learner_devices_reported(controller, sorted(snap["learners"]),
                                                             snap)
            run.result["backends"] = {n: backend_of({"devices": d})
                                      for n, d in run.result["devices"].items()}

    try:
        summary = run_job(config, duration_s=0.1, run_dir=run_dir, quiet=True,
                          on_started=on_started)
        run.result["job_s"] = round(time.time() - t0, 1)
        run.result["merges"] = summary.get("merges")
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {str(exc)[:800]}"
        tail = _events_tail(run_dir)
        if tail:
            run.error += " | last events: " + tail
    finally:
        # The run dir is kept; only the link this function made to the shared compile cache
        # (removed at the end of the run) goes.
        if os.path.islink(cache_link):
            os.unlink(cache_link)
    return run


def _events_tail(run_dir: str, n: int = 6) -> str:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        lines = f.read().splitlines()[-n:]
    return " ; ".join(line[:300] for line in lines)


def learner_handles(snap: dict, learners: list[str]) -> dict:
    """{learner: its incarnation's Ray actor} (the actor a spare was promoted into included)."""
    import ray

    from islands.orchestrator.controller import NAMESPACE
    from islands.orchestrator.runtime import learner_actor_name

    rows = snap.get("learners") or {}
    return {n: ray.get_actor((rows.get(n) or {}).get("actor") or learner_actor_name(n),
                             namespace=NAMESPACE) for n in learners}


def measure_rates(recorder, learners: list[str], warmup_s: float, seconds: float) -> dict:
    """Each learner's steps/s over a window of ``seconds`` after ``warmup_s``, on the learner's
    own clock: its ``status()`` polled every 0.25 s gives ``(step_at, step)``, the time it
    reached that step, so the rate runs from a step's end to a later step's end
    (``own_clock_rate``). The controller's receipt of heartbeats (which beat every 0.25 s and
    are polled as often) would add up to half a second of jitter at each end of the window.
    Returns the rates, the samples, the window, and the receipt-based rates beside them."""
    import ray

    handles = learner_handles(recorder.last_snapshot, learners)
    t_end_warm = time.time() + warmup_s
    while time.time() < t_end_warm:
        recorder.poll()
        time.sleep(0.25)
    samples: dict = {n: [] for n in learners}
    start = time.time()
    while True:
        statuses = ray.get([handles[n].status.remote() for n in learners], timeout=30)
        for n, st in zip(learners, statuses):
            samples[n].append((st.get("step_at"), int(st["step"])))
        recorder.poll()
        if time.time() - start >= seconds:
            break
        time.sleep(0.25)
    end = time.time()
    return {"window": (start, end), "rates": {n: own_clock_rate(samples[n]) for n in learners},
            "samples": samples,
            "rates_by_receipt": {n: window_rate(recorder.series.get(n, []), start, end)
                                 for n in learners}}


def save_samples(run: JobRun, measured: dict) -> None:
    """The window's ``(step_at, step)`` samples into the job's run dir, for an audit."""
    path = os.path.join(run.result["run_dir"], "gpu_step_samples.json")
    with open(path, "w") as f:
        json.dump({"window": measured["window"], "samples": measured["samples"],
                   "rates": measured["rates"],
                   "rates_by_receipt": measured["rates_by_receipt"]}, f)
    run.result["step_samples"] = path


# -- phases ---------------------------------------------------------------------------------------
def service_work(seconds: float, warmup_s: float):
    def work(controller, recorder, run: JobRun, deadline: float):
        m = measure_rates(recorder, [f"{REGION}:0"], warmup_s, seconds)
        run.window = m["window"]
        save_samples(run, m)
        run.result["service_steps_per_s"] = m["rates"][f"{REGION}:0"]
        run.result["service_steps_per_s_by_receipt"] = m["rates_by_receipt"][f"{REGION}:0"]
        snap = recorder.last_snapshot
        run.result["learner_timings"] = snap["learners"][f"{REGION}:0"].get("timings")
    return work


def share_work(seconds: float, warmup_s: float, kill_timeout_s: float, do_kill: bool,
               do_syncer: bool):
    def work(controller, recorder, run: JobRun, deadline: float):
        learners = sorted(recorder.last_snapshot["learners"])
        m = measure_rates(recorder, learners, warmup_s, seconds)
        run.window = m["window"]
        save_samples(run, m)
        rates = m["rates"]
        run.result["rates"] = rates
        run.result["aggregate_steps_per_s"] = (sum(r for r in rates.values() if r)
                                               if any(rates.values()) else None)
        for what, wanted, go in (
                ("kill", do_kill, lambda: kill_learner(controller, recorder, f"{REGION}:1",
                                                       kill_timeout_s, before_s=min(seconds, 5.0))),
                ("syncer_kill", do_syncer, lambda: kill_syncer(controller, recorder,
                                                               kill_timeout_s))):
            if not wanted:
                continue
            if time.time() + kill_timeout_s >= deadline:
                run.result.setdefault("skipped", []).append(f"{what}: budget")
                continue
            run.result[what] = go()
    return work


def spare_work(kill_timeout_s: float):
    def work(controller, recorder, run: JobRun, deadline: float):
        t0 = time.time()
        while time.time() - t0 < 3.0:   # a little steady training before the kill
            recorder.poll()
            time.sleep(0.25)
        run.window = (t0, time.time())
        run.result["kill"] = kill_learner(controller, recorder, f"{REGION}:0", kill_timeout_s,
                                          before_s=3.0, spares=1)
    return work


# -- plot and report -----------------------------------------------------------------------------
def plot(result: dict, util: list, t0: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    bars = [(f"bare {p['preset']}", p.get("steps_per_s"), "#4c72b0")
            for p in result["bare"].values() if p.get("steps_per_s")]
    svc = result.get("service") or {}
    if svc.get("service_steps_per_s"):
        bars.append((f"service {result['service_preset']}", svc["service_steps_per_s"], "#dd8452"))
    share = result.get("share4") or {}
    if share.get("aggregate_steps_per_s"):
        bars.append(("4 learners, 1 GPU (sum)", share["aggregate_steps_per_s"], "#55a868"))
    if bars:
        ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
        for i, b in enumerate(bars):
            ax.annotate(f"{b[1]:.1f}", (i, b[1]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("steps / s")
    ratio = result.get("ratio")
    ax.set_title("step rate" + (f": service ÷ bare = {ratio:.3f} (goal ≥ {GOAL_RATIO})"
                                if ratio else ""))
    ax = axes[0][1]
    if util:
        ax.plot([u[0] - t0 for u in util], [u[1] for u in util], lw=1, label="utilisation %")
        ax2 = ax.twinx()
        ax2.plot([u[0] - t0 for u in util], [u[2] / 1024 for u in util], lw=1, color="#c44e52",
                 label="memory GiB")
        ax2.set_ylabel("GiB used")
    for i, (name, (a, b)) in enumerate(sorted(result.get("phase_windows", {}).items(),
                                              key=lambda kv: kv[1][0])):
        measured = name.endswith("(measured)")
        ax.axvspan(a - t0, b - t0, alpha=0.25 if measured else 0.06,
                   color="#55a868" if measured else "#4c72b0")
        if not measured:
            ax.annotate(name, (a - t0, 103 if i % 2 else 96), fontsize=7)
    ax.set_ylim(0, 110)
    ax.set_xlabel("s since start")
    ax.set_title("GPU utilisation (nvidia-smi, 0.5 s)" if util else "no nvidia-smi samples")
    ax = axes[1][0]
    rates = share.get("rates") or {}
    if rates:
        names = sorted(rates)
        ax.bar(range(len(names)), [rates[n] or 0 for n in names], color="#55a868")
        ax.set_xticks(range(len(names)), names)
        bare = result["bare"].get(result["service_preset"], {}).get("steps_per_s")
        if bare:
            ax.axhline(bare / 4, ls=":", color="black", label=f"bare ÷ 4 = {bare / 4:.1f}")
            ax.legend(fontsize=8)
    ax.set_ylabel("steps / s")
    ax.set_title("four learners sharing one GPU (devices_per_host 0.25)")
    ax = axes[1][1]
    rows = []
    for label, kill in (("kill, no spare", share.get("kill")),
                        ("kill, warm spare", (result.get("spare") or {}).get("kill"))):
        if kill:
            rows.append((label, kill["kill_to_training_s"], kill["kill_to_first_merge_s"]))
    sk = share.get("syncer_kill")
    if sk:
        rows.append(("syncer kill", sk["syncer_up_s"], sk["merges_resumed_s"]))
    if rows:
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[1] for r in rows], width=0.4,
               label="kill → training (syncer: → up)")
        ax.bar([i + 0.2 for i in x], [r[2] for r in rows], width=0.4,
               label="kill → first merged contribution (syncer: → merges)")
        ax.set_xticks(list(x), [r[0] for r in rows])
        ax.legend(fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("recovery")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(result: dict) -> None:
    from _machine import format_table

    rows = [{"what": f"bare {name}", "steps_per_s": b.get("steps_per_s"),
             "note": f"{b.get('backend')}, {b.get('steps')} steps"}
            for name, b in result["bare"].items()]
    svc = result.get("service") or {}
    rows.append({"what": f"service {result['service_preset']}",
                 "steps_per_s": svc.get("service_steps_per_s"),
                 "note": f"ratio {result.get('ratio')}, backends {svc.get('backends')}"})
    share = result.get("share4") or {}
    rows.append({"what": "4 learners / 1 GPU", "steps_per_s": share.get("aggregate_steps_per_s"),
                 "note": f"per learner {share.get('rates')}"})
    for label, kill in (("kill, no spare", share.get("kill")),
                        ("kill, warm spare", (result.get("spare") or {}).get("kill"))):
        if kill:
            rows.append({"what": label, "seconds": kill["kill_to_first_merge_s"],
                         "note": f"to training {kill['kill_to_training_s']:.2f} s"})
    if share.get("syncer_kill"):
        sk = share["syncer_kill"]
        rows.append({"what": "syncer kill", "seconds": sk["merges_resumed_s"],
                     "note": f"syncer up after {sk['syncer_up_s']:.2f} s"})
    print(format_table(rows, ["what", "steps_per_s", "seconds", "note"]))
    for name, u in (result.get("utilisation") or {}).items():
        print(f"GPU utilisation {name}: {u}")
    for name, err in (result.get("errors") or {}).items():
        print(f"error in {name}: {err}")


# -- main -----------------------------------------------------------------------------------------
def dry_run(args) -> dict:
    import gpu_bundle

    try:
        manifest = gpu_bundle.build_bundle(args.bundle_dir,
                                           say=lambda *a: print(*a, flush=True))
    except gpu_bundle.BundleError as exc:
        print(f"gpu.py --dry-run: {exc}", file=sys.stderr)
        raise SystemExit(2)
    table = presets()
    configs = []
    for spec in JOBS:
        raw = job_dict(spec, table[args.model], args.accelerator)
        # A learner's memory: its share of the smallest GPU lent (an H100's ~78 GiB).
        validate(raw, memory_limit_bytes=int(GPU_MEMORY_GIB * 2 ** 30 * spec.devices_per_host))
        configs.append(raw["name"])
        print(f"validated {raw['name']}: {spec.learners} learners × "
              f"{spec.devices_per_host:g} GPU, {spec.spares} spares, preset {args.model}")
    print("would run: " + "; ".join(plan(args)))
    print("device command: " + DEVICE_COMMAND)
    return {"benchmark": "gpu", "dry_run": True, "bundle": os.path.join(
                args.bundle_dir, gpu_bundle.ARCHIVE_NAME),
            "bundle_mib": manifest["bundle_mib"], "bundle_reused": manifest["reused"],
            "bundle_limit_mib": gpu_bundle.LIMIT_MIB,
            "dists": {d["name"]: d["version"] for d in manifest["dists"]},
            "configs": configs, "presets": {"bare": ["gpu", args.model], "service": args.model},
            "plan": plan(args), "device_command": DEVICE_COMMAND}


def plan(args) -> list[str]:
    return [f"bare gpu {args.bare_seconds:g}s", f"bare {args.model} {args.bare_seconds:g}s",
            f"service 1×{args.model} {args.service_seconds:g}s",
            f"share4 4×0.25 GPU {args.share_seconds:g}s + kill (no spare) + syncer kill",
            "spare: 3×0.25 GPU + 1 spare, kill"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: build the bundle, validate every job config, print the plan")
    p.add_argument("--model", default="mid", help="the service phases' preset (default mid)")
    p.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: rehearse the phases with CPU learners (not a GPU measurement)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    p.add_argument("--bare-seconds", type=float, default=15.0)
    p.add_argument("--service-seconds", type=float, default=30.0)
    p.add_argument("--share-seconds", type=float, default=15.0)
    p.add_argument("--skip", default="", help="comma list of phases to leave out: "
                   "bare-gpu,service,share4,kill,syncer,spare")
    p.add_argument("--bundle-dir", default=os.path.join(REPO_DIR, "bundle"))
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    p.add_argument("--bare-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ensure_islands()
    if args.bare_worker:
        print(json.dumps(bare_worker(args.bare_worker, args.bare_seconds)))
        return {}
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        result = dry_run(args)
        print(json.dumps(result), flush=True)
        return result
    return run_all(args)


def run_all(args) -> dict:
    t_start = time.time()
    budget = Budget(args.budget_s)
    skip = {s for s in args.skip.split(",") if s}
    gpu = args.accelerator == "gpu"
    cache_dir = tempfile.mkdtemp(prefix="islands-gpu-jax-cache-")
    try:
        env1 = learner_env(args.accelerator, 1.0, cache_dir)
    except ImportError as exc:   # named, one line; nothing runs with another environment
        print(exc, file=sys.stderr)
        shutil.rmtree(cache_dir, ignore_errors=True)
        raise SystemExit(5)
    probe = probe_backend(env1)
    if gpu and probe.get("backend") != "gpu":
        why = f" ({probe['error']})" if probe.get("error") else ""
        print(f"gpu.py: no GPU: JAX with a GPU learner's environment (JAX_PLATFORMS="
              f"{env1.get('JAX_PLATFORMS')}) found backend {probe.get('backend')!r}{why}; on a "
              "machine without one run --dry-run", file=sys.stderr)
        shutil.rmtree(cache_dir, ignore_errors=True)   # made by this run, still empty
        raise SystemExit(3)
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        print(f"gpu.py: Ray is not importable ({exc}): on a GPU machine run "
              'export PYTHONPATH="$(bash bundle/install.sh /tmp/islands-gpu)" first',
              file=sys.stderr)
        shutil.rmtree(cache_dir, ignore_errors=True)
        raise SystemExit(4)
    # This process stays off the GPU: the learners get all of it.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    table = presets()
    sampler = SmiSampler().start() if gpu else SmiSampler()
    t0 = time.time()
    windows: dict = {}
    errors: dict = {}
    result: dict = {"benchmark": "gpu", "dry_run": False, "accelerator": args.accelerator,
                    "service_preset": args.model, "probe": probe, "bare": {},
                    "goal_ratio": GOAL_RATIO}

    def phase(name: str, need_s: float, fn):
        if name in skip:
            result.setdefault("skipped", {})[name] = "--skip"
            return None
        if not budget.allows(need_s):
            result.setdefault("skipped", {})[name] = f"budget: {budget.left():.0f}s left"
            print(f"gpu.py: skipping {name}: {budget.left():.0f}s left, it needs {need_s:.0f}s",
                  flush=True)
            return None
        a = time.time()
        print(f"gpu.py: {name} ({budget.left():.0f}s left)", flush=True)
        try:
            return fn()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc)[:800]}"
            print(f"gpu.py: {name} failed: {errors[name]}", flush=True)
            return None
        finally:
            windows.setdefault(name, (a, time.time()))

    try:
        for name in (["gpu"] if "bare-gpu" not in skip and gpu else []) + [args.model]:
            r = phase(f"bare-{name}", 40.0 + args.bare_seconds,
                      lambda name=name: run_bare(name, args.bare_seconds, env1,
                                                 timeout_s=min(240.0, budget.left() - 60)))
            if r:
                result["bare"][name] = r
        specs = {s.name: s for s in JOBS}

        def job(spec_name: str, work, need: float):
            def go():
                run = run_service_job(specs[spec_name], table[args.model], args.accelerator,
                                      work, timeout_s=min(need + 60.0, budget.left() - 10),
                                      cache_dir=cache_dir, out_dir=args.out)
                if run.window[0] is not None:
                    windows[f"{spec_name} (measured)"] = run.window
                if run.error:
                    errors[spec_name] = run.error
                result[spec_name] = {**run.result, "error": run.error}
                return run
            return phase(spec_name, need, go)

        job("service", service_work(args.service_seconds, warmup_s=5.0),
            60.0 + args.service_seconds)
        job("share4", share_work(args.share_seconds, 5.0, kill_timeout_s=45.0,
                                 do_kill="kill" not in skip, do_syncer="syncer" not in skip),
            100.0 + args.share_seconds)
        job("spare", spare_work(kill_timeout_s=45.0), 80.0)
    finally:
        sampler.stop()
    bare = (result["bare"].get(args.model) or {}).get("steps_per_s")
    svc = (result.get("service") or {}).get("service_steps_per_s")
    result["ratio"] = round(svc / bare, 4) if bare and svc else None
    result["meets_goal"] = None if result["ratio"] is None else result["ratio"] >= GOAL_RATIO
    share = result.get("share4") or {}
    if bare and share.get("aggregate_steps_per_s"):
        share["aggregate_over_bare"] = round(share["aggregate_steps_per_s"] / bare, 4)
    result["utilisation"] = {name: util_stats(sampler.samples, a, b)
                             for name, (a, b) in windows.items()}
    result["utilisation_run"] = util_stats(sampler.samples, t0, time.time())
    result["nvidia_smi"] = {"samples": len(sampler.samples), "error": sampler.error,
                            "query": shlex.join(SMI_QUERY)}
    result["backends"] = {job: (result.get(job) or {}).get("backends")
                          for job in ("service", "share4", "spare")}
    result["phase_windows"] = windows
    result["errors"] = errors
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "gpu.png")
    try:
        plot(result, sampler.samples, t0, png)
    except Exception as exc:   # a plot must not lose the numbers
        errors["plot"] = repr(exc)
        png = None
    from _machine import command_line, machine_info

    result.update(png=png, command=command_line(), machine=machine_info(),
                  elapsed_s=round(time.time() - t_start, 1),
                  phase_windows={k: [round(a - t0, 1), round(b - t0, 1)]
                                 for k, (a, b) in windows.items()})
    shutil.rmtree(cache_dir, ignore_errors=True)
    print_report(result)
    line = json.dumps(result, default=str)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    if errors:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
