"""Overhead: a learner's inner-step throughput in the service ÷ the same jitted step in a bare loop.

Goal: ratio ≥ 0.97 (issue "Chaos engineering and benchmarks").

Two modes:

* ``--mode ray`` (default on CPU): a one-learner job in the real Ray service (min_step_time_s 0, so
  the learner steps as fast as it can; its step counter is read from the controller's snapshots,
  timed by the learner's own heartbeat clock) against the bare loop ``batch → train_step →
  float(loss)`` on the same model, batch stream and corpus. The learner runs with the controller's
  single-thread XLA environment of a CPU learner (``runtime.process_env``), so the bare loop runs in a subprocess
  started with exactly those environment variables, once before the service starts and once after
  it stops (never at the same time: the machine has 2 cores).
* ``--mode inprocess``: no Ray at all (``ray`` is never imported; the GPU machine has none). The
  learner loop is driven in this process with the same per-step work ``LearnerUnit`` does around
  its train step — offer/adopt replies, the batch, the step, ``LearnerCore.make_push`` of each due
  fragment (drift, error-feedback encode with the codec, device→host copy, relative error) and
  ``record_step`` — against an in-process ``SyncerCore`` that accepts, merges and replies. The
  syncer's own time is taken off the learner's clock (in the service it is another process); the
  Ray send and heartbeat are not included. Bare and service loops alternate in the same process.

Both loops wait for the loss each step (``float(loss)``), as the learner does.

    python benchmarks/overhead.py --quick
    python benchmarks/overhead.py --task flax        # the Flax + Grain task (docs/tasks.md)
    python benchmarks/overhead.py --mode inprocess --model tiny --quick
    JAX_PLATFORMS=cuda python benchmarks/overhead.py --mode inprocess --model gpu --steps 100

Prints a table, then one JSON object as the last line; writes ``overhead_<mode>_<model>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

# A local cluster for a benchmark binds loopback (read by Ray at import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

GOAL_RATIO = 0.97
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
from _machine import (command_line, end_service, ensure_islands_importable,  # noqa: E402
                      format_table, machine_info)


@dataclass(frozen=True)
class Preset:
    """A model and its sync settings. ``steps`` is the default per measured run (inprocess)."""

    model: dict
    batch_size: int
    fragments: int
    sync_every_steps: int
    steps: int
    quick_steps: int


PRESETS = {
    # JobConfig's default model (119,104 parameters), its P = 4, H = 8.
    "tiny": Preset(dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, seq_len=64),
                   batch_size=8, fragments=4, sync_every_steps=8, steps=600, quick_steps=300),
    # 0.84M parameters: a CPU step long enough that per-step bookkeeping is small beside it.
    "small": Preset(dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512,
                         seq_len=128), batch_size=8, fragments=8, sync_every_steps=8, steps=200,
                    quick_steps=100),
    # GPT-2-small shape (124M parameters, docs/architecture.md#learners-on-accelerators's H100 measurement), P = H = 24 (the paper).
    "gpu": Preset(dict(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                       seq_len=1024), batch_size=16, fragments=24, sync_every_steps=24,
                  steps=100, quick_steps=50),
}


# --task: what the learner trains. The Flax task takes the tiny preset's sizes (--model is ignored).
TASKS = {
    "bytelm": None,   # the built-in byte LM with the --model preset
    "flax": {"path": "islands.tasks.flax_lm:task",
             "args": dict(max_bytes=300_000, batch_size=8, eval_batches=2, seq_len=64,
                          d_model=64, n_layers=2, n_heads=4, d_ff=256)},
}


# -- small pure helpers ------------------------------------------------------------------------
def ratio(service_steps_per_s: float, bare_steps_per_s: float) -> float:
    """Service throughput ÷ bare throughput (1.0 = no overhead).

    >>> ratio(97.0, 100.0)
    0.97
    """
    return service_steps_per_s / bare_steps_per_s


def overhead_ms(service_steps_per_s: float, bare_steps_per_s: float) -> float:
    """Extra wall time per step: ``1/service − 1/bare``, in ms.

    >>> round(overhead_ms(50.0, 100.0), 3)
    10.0
    """
    return 1e3 * (1.0 / service_steps_per_s - 1.0 / bare_steps_per_s)


def cpu_ratio(runs: list[dict]) -> dict:
    """Bare CPU ms per step ÷ the learner's (all its threads): the overhead in CPU time, which
    other load on a shared machine disturbs much less than wall time.

    >>> cpu_ratio([{"loop": "bare", "cpu_ms_per_step": 9.0}, {"loop": "service",
    ...            "cpu_ms_per_step": 10.0}])["cpu_ratio"]
    0.9
    """
    bare = [r["cpu_ms_per_step"] for r in runs if r["loop"] == "bare" and r.get("cpu_ms_per_step")]
    service = [r["cpu_ms_per_step"] for r in runs
               if r["loop"] == "service" and r.get("cpu_ms_per_step")]
    if not bare or not service:
        return {"cpu_ratio": None}
    b, s = statistics.fmean(bare), statistics.fmean(service)
    return {"cpu_ratio": b / s, "bare_cpu_ms_per_step": b, "service_cpu_ms_per_step": s}


def rate_from_samples(samples: list[tuple[float, int]]) -> Optional[float]:
    """Steps per second between the first and last ``(time_s, step)`` sample.

    >>> rate_from_samples([(0.0, 0), (1.0, 40), (2.0, 100)])
    50.0
    """
    if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
        return None
    return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])


# -- the training pieces shared by both loops ----------------------------------------------------
def training_spec(preset: Preset, task: str = "bytelm"):
    """The TrainingSpec a job with this preset (and task) gives its learners (300 kB of stdlib)."""
    from islands.learners.unit import TrainingSpec

    named = TASKS[task]
    extra = {} if named is None else {"task_path": named["path"], "task_args": named["args"]}
    return TrainingSpec(model=preset.model, batch_size=preset.batch_size, max_bytes=300_000,
                        fragments=preset.fragments, sync_every_steps=preset.sync_every_steps,
                        overlap_steps=2, **extra)


def batch_stream(spec, corpus: str):
    """(task, its shard-0-of-1 TaskStream): the built-in task reads ``train_bytes``."""
    from islands.learners.task import TaskStream
    from islands.learners.unit import build_task, is_builtin

    task = build_task(spec, train_bytes(spec, corpus) if is_builtin(spec) else None)
    return task, TaskStream(task, 0, 1)


def train_bytes(spec, corpus: str):
    """The bytes the sampler draws from: the stdlib corpus (what the service uses) or synthetic
    bytes (no file reads; the same on every machine)."""
    from islands.learners import data
    from islands.learners.unit import load_corpus

    if corpus == "synthetic":
        return data.synthetic_corpus(2_000_000, seed=0).train
    return load_corpus(spec).train


def bare_loop(train_step, params, opt_state, sampler, steps: int, start: int = 0):
    """``steps`` bare steps; returns (params, opt_state, seconds)."""
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        params, opt_state, loss = train_step(params, opt_state, sampler.batch_at(i))
        float(loss)
    return params, opt_state, time.perf_counter() - t0


# -- mode inprocess -------------------------------------------------------------------------------
@dataclass
class PhaseTimes:
    """Seconds per phase of the learner loop; the syncer's apart (not on the learner's clock)."""

    adopt: float = 0.0
    batch: float = 0.0
    step: float = 0.0
    push: float = 0.0
    book: float = 0.0
    syncer: float = 0.0
    total: float = 0.0
    cpu: float = 0.0          # process CPU seconds (all threads), syncer's included
    syncer_cpu: float = 0.0
    steps: int = 0
    pushes: int = 0
    adopted: int = 0
    merges: int = 0

    def learner_s(self) -> float:
        return self.total - self.syncer


class InprocessLearner:
    """The learner loop of ``LearnerUnit._run`` without Ray: a LearnerCore, a SyncerCore in this
    process standing in for the syncer actor, replies offered at the next step boundary."""

    def __init__(self, spec, params, optimizer, train_step, sampler):
        import numpy as np

        from islands.learners.core import LearnerCore
        from islands.learners.unit import make_error_feedback
        from islands.syncer import codec as codec_lib
        from islands.syncer import fragments as fragments_lib
        from islands.syncer import outer as outer_lib
        from islands.syncer.core import SyncerCore, SyncerSettings

        self.spec = spec
        self.train_step = train_step
        self.sampler = sampler
        self.lock = threading.Lock()
        plan = fragments_lib.partition(params, spec.fragments)
        codec, ef = make_error_feedback(spec)
        frags = [{k: np.asarray(v, np.float32)
                  for k, v in fragments_lib.extract(params, plan, p).items()}
                 for p in range(plan.num_fragments)]
        decode = lambda codes: codec_lib.decode_tree(codec, codes)  # noqa: E731
        self.syncer = SyncerCore(frags, SyncerSettings(overlap_steps=spec.overlap_steps),
                                 outer_lib.build("nesterov"), decode,
                                 is_embedding=lambda path: path.startswith("embed/"))
        epoch, registered = self.syncer.register("bench:0", 0)
        self.epoch = epoch
        self.core = LearnerCore("bench:0", params, optimizer.init(params), plan,
                                [v for _, v in registered], ef, codec_lib.tree_wire_bytes, decode,
                                overlap_steps=spec.overlap_steps, merge_alpha=spec.merge_alpha,
                                carry_overlap=spec.carry_overlap)
        self.arrived: list = []  # (p, fragment, version)
        self.stats = {"step": 0, "loss": None, "pushes": 0, "adopted": 0, "wire_bytes_up": 0}

    def run(self, steps: int) -> PhaseTimes:
        times = PhaseTimes()
        core, spec = self.core, self.spec
        from islands.learners.loop import LearnerLoop

        loop = LearnerLoop(core, self.train_step, self.sampler.batch_at,
                           self.sampler.tokens_per_batch, spec.fragments, spec.sync_every_steps)
        t_run, cpu_run = time.perf_counter(), time.process_time()
        for _ in range(steps):
            t0 = time.perf_counter()
            for p, fragment, version in self.arrived:
                core.offer_reply(p, fragment, version)
            self.arrived = []
            with self.lock:
                adopted = loop.adopt()
            t1 = time.perf_counter()
            batch = loop.batch()
            t2 = time.perf_counter()
            loss = loop.train(batch)
            loop.prefetch(core.step + 1)   # as the learner does: while the step runs
            loss = float(loss)
            t3 = time.perf_counter()
            syncer_s = 0.0
            with self.lock:
                loop.record(t3 - t0)
            t4 = time.perf_counter()
            for plan in loop.pushes(self.epoch):
                # The Ray learner's sender thread does this off the step's path; here it is
                # counted as push time (an upper bound on what the learner pays).
                plan = plan.on_host()
                self.stats["pushes"] += 1
                self.stats["wire_bytes_up"] += plan.wire_bytes
                syncer_s += self._syncer_round(plan.push, times)
                times.pushes += 1
            with self.lock:
                self.stats.update(step=core.step, loss=loss,
                                  adopted=self.stats["adopted"] + len(adopted))
            t5 = time.perf_counter()
            times.adopt += t1 - t0
            times.batch += t2 - t1
            times.step += t3 - t2
            times.book += t4 - t3
            times.push += (t5 - t4) - syncer_s
            times.syncer += syncer_s
            times.adopted += len(adopted)
            times.steps += 1
        times.total = time.perf_counter() - t_run
        times.cpu = time.process_time() - cpu_run
        return times

    def _syncer_round(self, push, times: PhaseTimes) -> float:
        """The syncer's side of one push (another process in the service): accept, merge, reply."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        verdict = self.syncer.accept_push(push, time.monotonic())
        if verdict.ok:
            result = self.syncer.merge(push.fragment, "all_live_in", live_count=1)
            times.merges += 1
            self.arrived.append((result.fragment, result.params, result.version))
        else:
            current, version = self.syncer.fragment(push.fragment)
            self.core.push_refused(push.fragment, current, version)
        times.syncer_cpu += time.process_time() - cpu0
        return time.perf_counter() - t0


def _build(spec, task=None):
    from islands.learners.unit import build_training

    return build_training(spec, task=task)


def _build_abstract(spec):
    from islands.learners.unit import build_training

    return build_training(spec, abstract=True)


def jax_leaves(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def run_inprocess(preset_name: str, steps: int, chunk: int, corpus: str) -> dict:
    """Alternates chunks of ``chunk`` bare steps and ``chunk`` service-loop steps until each loop
    has run ``steps``: load changes on a shared machine then hit both loops alike."""
    import jax

    from islands.syncer.core import SyncerSettings

    preset = PRESETS[preset_name]
    spec = training_spec(preset)
    task, sampler = batch_stream(spec, corpus)
    _, params, optimizer, train_step = _build(spec, task)
    num_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    learner = InprocessLearner(spec, params, optimizer, train_step, sampler)
    bare_params, bare_opt = params, optimizer.init(params)
    # Warm up: compile the step, every fragment's encode and the syncer's decode (each fragment
    # pushed and adopted at least once), and the bare loop's first steps.
    t_warm = time.perf_counter()
    learner.run(max(2 * spec.sync_every_steps, spec.fragments) + spec.overlap_steps + 2)
    bare_params, bare_opt, _ = bare_loop(train_step, bare_params, bare_opt, sampler, 3)
    warmup_s = time.perf_counter() - t_warm
    chunks = []
    bare_step, service = 3, PhaseTimes()
    bare_cpu_s = 0.0
    for _ in range(max(1, steps // chunk)):
        cpu0 = time.process_time()
        bare_params, bare_opt, bare_s = bare_loop(train_step, bare_params, bare_opt, sampler,
                                                  chunk, start=bare_step)
        bare_cpu_s += time.process_time() - cpu0
        bare_step += chunk
        times = learner.run(chunk)
        for name in ("adopt", "batch", "step", "push", "book", "syncer", "total", "cpu",
                     "syncer_cpu", "steps",
                     "pushes", "adopted", "merges"):
            setattr(service, name, getattr(service, name) + getattr(times, name))
        chunks.append({"bare_steps_per_s": chunk / bare_s,
                       "service_steps_per_s": chunk / times.learner_s()})
    bare_total_s = sum(chunk / c["bare_steps_per_s"] for c in chunks)
    bare_rate = len(chunks) * chunk / bare_total_s
    service_rate = service.steps / service.learner_s()
    runs = [{"run": "bare loop", "loop": "bare", "steps": len(chunks) * chunk,
             "seconds": bare_total_s, "steps_per_s": bare_rate,
             "cpu_ms_per_step": 1e3 * bare_cpu_s / (len(chunks) * chunk)},
            {"run": "service loop", "loop": "service", "steps": service.steps,
             "seconds": service.learner_s(), "steps_per_s": service_rate,
             "cpu_ms_per_step": 1e3 * (service.cpu - service.syncer_cpu) / service.steps,
             **{f"{k}_ms": 1e3 * getattr(service, k) / service.steps
                for k in ("adopt", "batch", "step", "push", "book", "syncer")},
             "pushes": service.pushes, "adopted": service.adopted, "merges": service.merges}]
    chunk_ratios = [c["service_steps_per_s"] / c["bare_steps_per_s"] for c in chunks]
    assert "ray" not in sys.modules, "inprocess mode must not import ray"
    return {"mode": "inprocess", "model": preset_name, "model_config": preset.model,
            "batch_size": preset.batch_size, "num_params": num_params,
            "fragments": spec.fragments, "sync_every_steps": spec.sync_every_steps,
            "overlap_steps": spec.overlap_steps, "codec": spec.codec_kind, "corpus": corpus,
            # the service's merge rules (one learner: every round whole)
            "syncer_rules": SyncerSettings(overlap_steps=spec.overlap_steps).rules(),
            "steps_per_loop": len(chunks) * chunk, "chunk_steps": chunk, "warmup_s": warmup_s,
            "runs": runs, "chunks": chunks, "median_chunk_ratio": statistics.median(chunk_ratios),
            "bare_steps_per_s": bare_rate, "service_steps_per_s": service_rate,
            "ratio": ratio(service_rate, bare_rate),
            "overhead_ms_per_step": overhead_ms(service_rate, bare_rate),
            "bare_step_ms": 1e3 / bare_rate,
            "learner_loop": "LearnerCore + in-process SyncerCore, alternating chunks with the "
                            "bare loop; syncer time excluded; no Ray send or heartbeat"}


# -- mode ray -------------------------------------------------------------------------------------
def bare_worker(preset_name: str, duration_s: float, warmup_steps: int,
                task_name: str = "bytelm") -> dict:
    """The bare loop alone, for ``--bare-worker`` (run in a subprocess with the learner's env):
    the task's jitted step on its shard-0 batches, nothing else."""
    import jax

    preset = PRESETS[preset_name]
    spec = training_spec(preset, task_name)
    task, sampler = batch_stream(spec, "stdlib")
    _, params, optimizer, train_step = _build(spec, task)
    opt_state = optimizer.init(params)
    params, opt_state, _ = bare_loop(train_step, params, opt_state, sampler, warmup_steps)
    step, t0, cpu0 = warmup_steps, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < duration_s:
        params, opt_state, _ = bare_loop(train_step, params, opt_state, sampler, 10, start=step)
        step += 10
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    steps = step - warmup_steps
    return {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds,
            "cpu_ms_per_step": 1e3 * cpu_s / steps,
            "xla_flags": os.environ.get("XLA_FLAGS"), "backend": jax.default_backend()}


def run_bare_subprocess(preset_name: str, duration_s: float, env_vars: dict,
                        task_name: str = "bytelm") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--bare-worker", "--model", preset_name,
           "--duration", str(duration_s), "--task", task_name]
    env = {**os.environ, **env_vars}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                         timeout=duration_s + 300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def job_dict(preset: Preset, heartbeat_s: float, task_name: str = "bytelm",
             snapshot_every_merges: Optional[int] = None) -> dict:
    named = TASKS[task_name]
    return {
        "name": "bench-overhead",
        **({} if named is None else {"task": named}),
        "model": preset.model,
        "data": {"max_bytes": 300_000, "batch_size": preset.batch_size, "eval_batches": 2},
        "learner": {"min_step_time_s": 0.0, "eval_every_s": 3600.0},
        "syncer": {"fragments": preset.fragments, "sync_every_steps": preset.sync_every_steps,
                   "overlap_steps": 2,
                   **({} if snapshot_every_merges is None
                      else {"snapshot_every_merges": snapshot_every_merges})},
        "quorum": {"min_learners": 1},
        "compression": {"type": "int4"},
        "regions": {"a": {"learners": 1}},
        "health": {"heartbeat_s": heartbeat_s, "timeout_s": 30.0},
        "metrics": {"enabled": False},
    }


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def service_rate_ray(preset_name: str, duration_s: float, warmup_s: float, run_dir: str,
                     task_name: str = "bytelm", snapshot_every_merges: Optional[int] = None) -> dict:
    """Runs the one-learner job and returns its steady steps/s from heartbeat samples."""
    import ray

    from islands.orchestrator.config import JobConfig
    from islands.orchestrator.controller import NAMESPACE, Controller, controller_options

    preset = PRESETS[preset_name]
    config = JobConfig.model_validate(job_dict(preset, heartbeat_s=0.5, task_name=task_name,
                                               snapshot_every_merges=snapshot_every_merges))
    # address="local": always a fresh cluster of our own, even when another one runs here.
    ray.init(address="local", num_cpus=2, resources={"region:a": 1}, namespace=NAMESPACE,
             include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    controller = None
    try:
        controller = ray.remote(Controller).options(**controller_options(run_dir)).remote(
            config, run_dir)
        ray.get(controller.start.remote(), timeout=300)
        snap = lambda: ray.get(controller.snapshot.remote())  # noqa: E731
        wait_for(lambda: snap()["learners"]["a:0"]["state"] == "training", 300, "the learner")
        t_training = time.time()
        samples: list[tuple[float, int]] = []   # (learner's beat time, step)

        def sample() -> dict:
            s = snap()
            learner = s["learners"]["a:0"]
            if learner["last_heartbeat_s"] is not None:
                beat_t = s["t"] - learner["last_heartbeat_s"]
                if not samples or beat_t > samples[-1][0] + 1e-6:
                    samples.append((beat_t, int(learner["step"])))
            return s

        while time.time() - t_training < warmup_s:
            sample()
            time.sleep(0.25)
        pids = actor_pids()
        cpu_before = cpu_seconds(pids)
        start = len(samples)
        t0 = time.time()
        while time.time() - t0 < duration_s:
            last = sample()
            time.sleep(0.25)
        cpu_after = cpu_seconds(pids)
        window = samples[max(0, start - 1):]
        learner = last["learners"]["a:0"]
        steps = window[-1][1] - window[0][1]
        cpu_ms = {name: 1e3 * (cpu_after[name] - cpu_before[name]) / max(steps, 1)
                  for name in cpu_before if name in cpu_after}
        return {"steps_per_s": rate_from_samples(window), "samples": window,
                "seconds": window[-1][0] - window[0][0], "steps": steps,
                "cpu_ms_per_step": cpu_ms.get("LearnerUnit"), "cpu_ms_per_step_by_actor": cpu_ms,
                "restarts": learner["restarts"], "merges": last["syncer"]["merges"],
                "step_time_ema_s": learner["step_time_s"], "timings": learner["timings"]}
    finally:
        end_service(controller)


def actor_pids() -> dict[str, int]:
    """{actor class: pid} of the islands actors of the cluster this driver started: its worker
    processes are descendants of this process (Ray titles them ``ray::<Class>...``)."""
    import psutil

    out = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(child.cmdline())
            for name in ("LearnerUnit", "Syncer", "Controller"):
                if title.startswith(f"ray::{name}"):
                    out[name] = child.pid
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each named process (all its threads)."""
    import psutil

    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
    return out


def run_ray(preset_name: str, duration_s: float, warmup_s: float,
            task_name: str = "bytelm", snapshot_every_merges: Optional[int] = None) -> dict:
    from islands.orchestrator.runtime import Role, process_env, ray_env_vars

    run_dir = tempfile.mkdtemp(prefix="islands-overhead-")
    # The bare loop runs with a CPU learner's own environment (runtime.process_env).
    env_vars = ray_env_vars(process_env(Role.LEARNER, jax_cache_dir=os.path.join(run_dir,
                                                                                 "jax_cache")))
    runs = []
    try:
        bare_before = run_bare_subprocess(preset_name, duration_s, env_vars, task_name)
        runs.append({"run": "bare (before)", "loop": "bare", **_drop(bare_before, "xla_flags")})
        service = service_rate_ray(preset_name, duration_s, warmup_s, run_dir, task_name,
                                   snapshot_every_merges)
        runs.append({"run": "service", "loop": "service",
                     **_drop(service, "samples", "timings", "cpu_ms_per_step_by_actor")})
        bare_after = run_bare_subprocess(preset_name, duration_s, env_vars, task_name)
        runs.append({"run": "bare (after)", "loop": "bare", **_drop(bare_after, "xla_flags")})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # syncer snapshots and the JAX cache
    bare_rate = statistics.fmean([bare_before["steps_per_s"], bare_after["steps_per_s"]])
    service_rate = service["steps_per_s"]
    preset = PRESETS[preset_name]
    _, template, _, _ = _build_abstract(training_spec(preset, task_name))
    return {"mode": "ray", "model": preset_name, "task": task_name,
            "model_config": preset.model if TASKS[task_name] is None else TASKS[task_name],
            "num_params": sum(int(x.size) for x in jax_leaves(template)),
            "batch_size": preset.batch_size, "fragments": preset.fragments,
            "sync_every_steps": preset.sync_every_steps, "codec": "int4",
            "snapshot_every_merges": snapshot_every_merges, "duration_s": duration_s, "warmup_s": warmup_s, "runs": runs,
            "service_samples": service["samples"],
            "cpu_ms_per_step_by_actor": service["cpu_ms_per_step_by_actor"],
            "learner_timings": service["timings"],
            "bare_steps_per_s": bare_rate, "service_steps_per_s": service_rate,
            "ratio": ratio(service_rate, bare_rate),
            "overhead_ms_per_step": overhead_ms(service_rate, bare_rate),
            "bare_step_ms": 1e3 / bare_rate, "bare_env": env_vars,
            "learner_loop": "real LearnerUnit in a 1-learner Ray job (syncer, controller alive); "
                            "bare loop in a subprocess with the learner's env vars, before and "
                            "after the service run"}


def _drop(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# -- plot -----------------------------------------------------------------------------------------
def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    title = (f"{result['mode']} · {result['model']}: ratio {result['ratio']:.3f} "
             f"({result['overhead_ms_per_step']:+.2f} ms/step)")
    if result.get("cpu_ratio"):
        title += f"; CPU-time ratio {result['cpu_ratio']:.3f}"
    if result["mode"] == "inprocess":
        chunks = result["chunks"]
        x = range(1, len(chunks) + 1)
        ax.plot(x, [c["bare_steps_per_s"] for c in chunks], "o-", ms=3, color="#4c72b0",
                label=f"bare: {result['bare_steps_per_s']:.1f} steps/s overall")
        ax.plot(x, [c["service_steps_per_s"] for c in chunks], "o-", ms=3, color="#dd8452",
                label=f"service loop: {result['service_steps_per_s']:.1f} steps/s overall")
        ax.set_xlabel(f"chunk ({result['chunk_steps']} steps each, bare then service)")
        ax.set_ylim(0, None)
    else:
        colors = ["#4c72b0" if r["loop"] == "bare" else "#dd8452" for r in runs]
        bars = ax.bar(range(len(runs)), [r["steps_per_s"] for r in runs], color=colors)
        ax.set_xticks(range(len(runs)), [r["run"] for r in runs])
        for bar, r in zip(bars, runs):
            ax.annotate(f"{r['steps_per_s']:.1f}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.axhline(result["bare_steps_per_s"], color="#4c72b0", ls="--", lw=1,
                   label=f"bare (mean): {result['bare_steps_per_s']:.1f} steps/s")
    ax.axhline(GOAL_RATIO * result["bare_steps_per_s"], color="green", ls=":", lw=1.5,
               label=f"goal: {GOAL_RATIO} × bare")
    ax.set_ylabel("inner steps / s")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    ax = axes[1]
    if result["mode"] == "inprocess":
        service = [r for r in runs if r["loop"] == "service"]
        phases = ["step", "adopt", "batch", "push", "book"]
        labels = {"step": "train step (+wait)", "adopt": "offer/adopt replies", "batch": "batch",
                  "push": "make_push (drift, encode, copy)", "book": "record_step, stats"}
        values = [statistics.fmean(r[f"{p}_ms"] for r in service) for p in phases]
        bottom = 0.0
        for p, v in zip(phases, values):
            ax.bar([0], [v], bottom=bottom, label=f"{labels[p]}: {v:.3f} ms")
            bottom += v
        ax.bar([1], [result["bare_step_ms"]], color="#8c8c8c", label=f"bare step: "
               f"{result['bare_step_ms']:.3f} ms")
        syncer_ms = statistics.fmean(r["syncer_ms"] for r in service)
        ax.set_xticks([0, 1], ["service learner loop", "bare loop"])
        ax.set_ylabel("ms per inner step")
        ax.set_title(f"where the learner's time goes (syncer, off-clock: {syncer_ms:.2f} ms/step)")
        ax.legend(fontsize=8, loc="upper right")
        ax.set_ylim(0, bottom * 1.45)
    else:
        samples = result["service_samples"]
        t0 = samples[0][0]
        ax.plot([t - t0 for t, _ in samples], [s - samples[0][1] for _, s in samples], "o-", ms=3,
                label=f"service: {result['service_steps_per_s']:.1f} steps/s")
        span = samples[-1][0] - t0
        ax.plot([0, span], [0, span * result["bare_steps_per_s"]], "--", color="#4c72b0",
                label=f"bare: {result['bare_steps_per_s']:.1f} steps/s")
        ax.set_xlabel("s (learner heartbeat clock)")
        ax.set_ylabel("steps since window start")
        ax.set_title("learner step counter in the measured window")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(result: dict) -> None:
    print(f"overhead · mode {result['mode']} · model {result['model']} "
          f"({result.get('num_params', '?')} params, batch {result['batch_size']}, "
          f"P={result['fragments']}, H={result['sync_every_steps']})")
    print(f"loop: {result['learner_loop']}")
    columns = ["run", "steps", "seconds", "steps_per_s", "cpu_ms_per_step"]
    if result["mode"] == "inprocess":
        columns += ["step_ms", "adopt_ms", "batch_ms", "push_ms", "book_ms", "syncer_ms"]
    print(format_table(result["runs"], columns))
    if "median_chunk_ratio" in result:
        print(f"median ratio over {len(result['chunks'])} chunk pairs: "
              f"{result['median_chunk_ratio']:.4f}")
    if result.get("cpu_ratio") is not None:
        print(f"CPU time per step (less sensitive to other load on a shared machine): bare "
              f"{result['bare_cpu_ms_per_step']:.3f} ms, learner "
              f"{result['service_cpu_ms_per_step']:.3f} ms -> bare/learner = "
              f"{result['cpu_ratio']:.4f}")
    if result.get("cpu_ms_per_step_by_actor"):
        print("CPU ms per learner step by actor: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(result["cpu_ms_per_step_by_actor"].items())))
    verdict = "meets" if result["ratio"] >= GOAL_RATIO else "misses"
    print(f"ratio = service {result['service_steps_per_s']:.2f} ÷ bare "
          f"{result['bare_steps_per_s']:.2f} steps/s = {result['ratio']:.4f} ({verdict} goal "
          f"≥ {GOAL_RATIO}); overhead {result['overhead_ms_per_step']:+.3f} ms per step "
          f"(bare step {result['bare_step_ms']:.3f} ms)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["ray", "inprocess"], default=None,
                        help="ray (default on CPU) or inprocess (default elsewhere; no ray)")
    parser.add_argument("--model", choices=sorted(PRESETS), default=None,
                        help="tiny (CPU default) or gpu (default on an accelerator)")
    parser.add_argument("--steps", type=int, default=None, help="inprocess: steps per measured run")
    parser.add_argument("--chunk", type=int, default=None,
                        help="inprocess: steps per alternating bare/service chunk")
    parser.add_argument("--duration", type=float, default=None, help="ray: seconds per measurement")
    parser.add_argument("--corpus", choices=["synthetic", "stdlib"], default="synthetic",
                        help="inprocess: batch source")
    parser.add_argument("--task", choices=sorted(TASKS), default="bytelm",
                        help="ray: what the learner trains (flax: the Flax + Grain task)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--snapshot-every-merges", type=int, default=None,
                        help="ray: the job's syncer.snapshot_every_merges (default: the config's)")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    ensure_islands_importable()
    if args.bare_worker:
        result = bare_worker(args.model or "tiny", args.duration or 20.0, warmup_steps=20,
                             task_name=args.task)
        print(json.dumps(result))
        return result
    t_start = time.time()
    import jax

    on_cpu = jax.default_backend() == "cpu"
    mode = args.mode or ("ray" if on_cpu else "inprocess")
    model = args.model or ("tiny" if on_cpu else "gpu")
    if mode == "ray":
        duration = args.duration or (20.0 if args.quick else 60.0)
        result = run_ray(model, duration, warmup_s=5.0 if args.quick else 10.0,
                         task_name=args.task, snapshot_every_merges=args.snapshot_every_merges)
    else:
        preset = PRESETS[model]
        steps = args.steps or (preset.quick_steps if args.quick else preset.steps)
        chunk = args.chunk or max(1, min(20, steps // 10))
        result = run_inprocess(model, steps, chunk, args.corpus)
    if on_cpu:  # on an accelerator the bare loop's host thread mostly waits: no CPU comparison
        result.update(cpu_ratio(result["runs"]))
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, f"overhead_{mode}_{model}"
                       + ("" if args.task == "bytelm" else f"_{args.task}") + ".png")
    plot(result, png)
    result.pop("service_samples", None)
    result.update(goal_ratio=GOAL_RATIO, meets_goal=result["ratio"] >= GOAL_RATIO, png=png,
                  command=command_line(), machine=machine_info(),
                  elapsed_s=round(time.time() - t_start, 1))
    print_report(result)
    with open(png[:-4] + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
