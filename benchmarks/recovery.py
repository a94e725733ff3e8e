"""Recovery: per-phase seconds for a killed learner, and the survivors' step rate meanwhile.

Goal (issue "Chaos engineering and benchmarks"): detect + restart + restore + first contribution
< 5 s in total on this machine, and the survivors' step rate during the outage ÷ before it ≥ 0.98.

A real local Ray cluster runs the service exactly as ``tests/integration/test_service.py`` does
(a ``Controller`` actor started with ``controller.start``): a tiny model, 2 regions × 2 learners.
Once every learner trains, the benchmark kills one learner at a time (``chaos_kill``, round robin
over the learners so the restart backoff stays at its first step), and waits for the
controller's ``learner_recovered`` event, whose phases are (docs/architecture.md#failures-and-reintegration):

  detect              the kill → the monitor sees the actor dead
  restart             → the new incarnation is launched (includes the restart policy's backoff)
  restore             → the new learner has its fragments and inner state (process start, imports,
                        corpus, model, register with the syncer, a peer's optimizer state)
  first contribution  → the syncer's ledger shows a merge that includes its work

The survivors' step counters come from the controller's snapshots (each learner's step at its
last heartbeat, timed by the heartbeat's arrival) and are interpolated at the window edges: the
rate in ``[kill − before_s, kill]`` against the rate in ``[kill, recovered]``. Learners pad each
step to ``min_step_time_s``, standing in for accelerator hosts of their own: on a shared 2-core
machine unpadded learners would measure only how the cores are shared. (The learner pads only up
to the end of its train step; pushes and bookkeeping come on top, so CPU contention still shows.)

    python benchmarks/recovery.py --quick          # 3 kills (ray_kill), ~2–3 min
    python benchmarks/recovery.py --quick --spares 1   # the same with a warm spare per region
                                                   # (each kill waits for a ready spare)
    python benchmarks/recovery.py --quick --no-prestart  # restarts in new processes only
    python benchmarks/recovery.py                  # 4 × ray_kill + 4 × exit

Prints a table, then one JSON object as the last line; writes ``recovery.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# A local cluster for a benchmark binds loopback (read by Ray at import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

GOAL_TOTAL_S = 5.0
GOAL_SURVIVOR_RATIO = 0.98
PHASES = ("detect_s", "restart_s", "restore_s", "first_contribution_s")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
from _machine import command_line, end_service, format_table, machine_info  # noqa: E402


def job_dict(min_step_time_s: float, heartbeat_s: float, backoff_s: float,
             spares: int = 0, prestart: bool = True) -> dict:
    """The JobConfig mapping: tiny model, 2 regions × 2 learners, K = 1, a constant backoff."""
    return {
        "name": "bench-recovery",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
        "data": {"max_bytes": 300_000, "batch_size": 4, "eval_batches": 2},
        # Eval runs on the controller; every 60 s keeps it out of most measurement windows.
        "learner": {"min_step_time_s": min_step_time_s, "eval_every_s": 60.0},
        "syncer": {"fragments": 2, "sync_every_steps": 4, "overlap_steps": 1},
        "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
        "compression": {"type": "int4"},
        "regions": {"a": {"learners": 2}, "b": {"learners": 2}},
        "health": {"heartbeat_s": heartbeat_s, "timeout_s": 8.0, "spares": spares,
                   "prestart_restarts": prestart,
                   "restart": {"backoff_initial_s": backoff_s, "backoff_multiplier": 1.0,
                               "max_crash_restarts": None}},
        "metrics": {"enabled": False},
    }


# -- small pure helpers ------------------------------------------------------------------------
def interpolate(series: list[tuple[float, int]], t: float) -> Optional[float]:
    """The step counter at time ``t``, linear between the samples around it (None outside them).

    >>> interpolate([(0.0, 0), (1.0, 10), (3.0, 30)], 2.0)
    20.0
    """
    times = [s[0] for s in series]
    i = bisect.bisect_left(times, t)
    if i < len(series) and times[i] == t:
        return float(series[i][1])
    if i == 0 or i == len(series):
        return None
    (t0, s0), (t1, s1) = series[i - 1], series[i]
    return s0 + (s1 - s0) * (t - t0) / (t1 - t0)


def window_rate(series: list[tuple[float, int]], start_s: float, end_s: float) -> Optional[float]:
    """Steps per second between ``start_s`` and ``end_s``, from the interpolated counter.

    >>> window_rate([(0.0, 0), (2.0, 20), (4.0, 30)], 1.0, 3.0)
    7.5
    """
    a, b = interpolate(series, start_s), interpolate(series, end_s)
    if a is None or b is None or end_s <= start_s:
        return None
    return (b - a) / (end_s - start_s)


def survivor_ratio(before: dict[str, float], during: dict[str, float]) -> Optional[float]:
    """Σ survivors' rate during the outage ÷ Σ their rate before it.

    >>> survivor_ratio({"a": 10.0, "b": 10.0}, {"a": 9.0, "b": 10.6})
    0.98
    """
    names = [n for n in before if n in during and before[n] and during[n] is not None]
    if not names:
        return None
    return round(sum(during[n] for n in names) / sum(before[n] for n in names), 10)


def rolling_rates(series: list[tuple[float, int]], span_s: float, gap_s: float = 2.0
                  ) -> list[tuple[float, float]]:
    """(midpoint, steps/s) over consecutive spans of at least ``span_s``. Where the learner was
    gone (no heartbeat for ``gap_s``) or restarted (the counter went back) the series is broken
    with a NaN rate, so a plot shows a gap instead of a made-up rate.

    >>> rolling_rates([(0.0, 0), (0.5, 5), (1.0, 10), (2.0, 20), (6.0, 18), (7.0, 28)], 1.0)
    [(0.5, 10.0), (1.5, 10.0), (4.0, nan), (6.5, 10.0)]
    """
    out, i = [], 0
    for j in range(1, len(series)):
        (t_prev, s_prev), (t1, s1) = series[j - 1], series[j]
        if t1 - t_prev > gap_s or s1 < s_prev:
            out.append(((t_prev + t1) / 2, float("nan")))
            i = j
            continue
        t0, s0 = series[i]
        if t1 - t0 >= span_s:
            out.append(((t0 + t1) / 2, (s1 - s0) / (t1 - t0)))
            i = j
    return out


def stats(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "max": None, "min": None}
    return {"median": statistics.median(values), "max": max(values), "min": min(values)}


# -- watching the job ----------------------------------------------------------------------------
@dataclass
class Recorder:
    """Polls the controller: per learner ``(heartbeat time, step)`` series, incarnations, events."""

    controller: Any
    series: dict = field(default_factory=dict)      # learner -> [(t, step)]
    states: dict = field(default_factory=dict)      # learner -> current state
    timings: dict = field(default_factory=dict)     # learner -> last reported timings
    events: list = field(default_factory=list)
    event_index: int = 0
    last_snapshot: dict = field(default_factory=dict)

    def poll(self) -> dict:
        import ray

        snap = ray.get(self.controller.snapshot.remote(), timeout=30)
        evs, self.event_index = ray.get(self.controller.events_since.remote(self.event_index),
                                        timeout=30)
        self.events.extend(evs)
        for name, learner in snap["learners"].items():
            self.states[name] = learner["state"]
            self.timings[name] = learner.get("timings")
            if learner["last_heartbeat_s"] is None:
                continue
            beat_t = snap["t"] - learner["last_heartbeat_s"]
            points = self.series.setdefault(name, [])
            if not points or beat_t > points[-1][0] + 1e-6:
                points.append((beat_t, int(learner["step"])))
        self.last_snapshot = snap
        return snap

    def wait_for(self, predicate, timeout_s: float, what: str, every_s: float = 0.1):
        """Polls real state until ``predicate(snapshot)`` is truthy; raises naming ``what``."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = predicate(self.poll())
            if value:
                return value
            time.sleep(every_s)
        raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}; states "
                           f"{self.states}")

    def recovered(self, learner: str, after_index: int) -> Optional[dict]:
        return next((e for e in self.events[after_index:]
                     if e["event"] == "learner_recovered" and e["learner"] == learner), None)


def all_training(snap: dict) -> bool:
    return all(l["state"] == "training" for l in snap["learners"].values())


def run_kills(controller, modes: list[str], before_s: float, learners: list[str],
              recorder: Recorder, spares: int = 0) -> list[dict]:
    """Kills one learner per entry of ``modes`` and returns each recovery with its windows."""
    import ray

    kills = []
    steady_since = time.time()
    for i, mode in enumerate(modes):
        victim = learners[i % len(learners)]
        # Steady state: every learner training for a full "before" window, outside any outage.
        def steady(snap):  # noqa: E306
            nonlocal steady_since
            ready = sum(1 for x in (snap.get("spares") or {}).values() if x["state"] == "ready")
            if not all_training(snap) or ready < spares * 2:   # 2 regions
                steady_since = time.time()
                return False
            return time.time() - steady_since >= before_s + 1.0
        recorder.wait_for(steady, 180, f"{before_s:.0f}s of steady training before kill {i + 1}")
        index = len(recorder.events)
        ray.get(controller.chaos_kill.remote(victim, mode), timeout=30)
        event = recorder.wait_for(lambda _: recorder.recovered(victim, index), 180,
                                  f"{victim} to recover ({mode})")
        # Poll a little past the recovery so the "during" window's end has a sample after it.
        recorder.wait_for(lambda snap: all(points[-1][0] > event["t"] + 0.5
                                           for points in recorder.series.values()),
                          30, "heartbeats after the recovery")
        steady_since = time.time()
        kills.append({"kill": i + 1, "victim": victim, "mode": mode, "event": event,
                      "victim_timings": recorder.timings.get(victim)})
    return kills


def analyse(kill: dict, series: dict, before_s: float) -> dict:
    """Phases, windows and survivors' rates of one kill."""
    event = kill["event"]
    recovered_t = event["t"]
    failed_t = recovered_t - event["total_s"]
    survivors = [n for n in series if n != kill["victim"]]
    before = {n: window_rate(series[n], failed_t - before_s, failed_t) for n in survivors}
    during = {n: window_rate(series[n], failed_t, recovered_t) for n in survivors}
    timings = kill.get("victim_timings") or {}
    # What the restore phase held: the new process's start up to LearnerUnit.__init__ and run()
    # (spawn), then the learner's own setup (corpus, model, register, peer state).
    setup_s = (timings.get("restart_s") or 0.0) + (timings.get("restore_s") or 0.0)
    return {"kill": kill["kill"], "victim": kill["victim"], "mode": kill["mode"],
            **{p: event[p] for p in PHASES}, "total_s": event["total_s"],
            # kill -> training again (a step of the new incarnation), before its first merge
            "training_again_s": event["total_s"] - event["first_contribution_s"],
            "spawn_s": max(event["restore_s"] - setup_s, 0.0) if timings else None,
            "setup_s": setup_s if timings else None,
            "survivors_ratio": survivor_ratio(before, during),
            "survivor_rates_before": before, "survivor_rates_during": during,
            "victim_timings": timings, "failed_t": failed_t, "recovered_t": recovered_t}


# -- plot -----------------------------------------------------------------------------------------
def plot(rows: list[dict], series: dict, t0: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(13, 11))
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 0.8], width_ratios=[1.6, 1])
    ax = fig.add_subplot(grid[0, 0])
    colors = {"detect_s": "#c44e52", "restart_s": "#dd8452", "restore_s": "#4c72b0",
              "first_contribution_s": "#55a868"}
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r[phase] for r in rows]
        ax.bar(x, values, bottom=bottom, color=colors[phase],
               label=f"{phase[:-2].replace('_', ' ')} (median {statistics.median(values):.2f} s)")
        bottom = [b + v for b, v in zip(bottom, values)]
    for xi, r in zip(x, rows):
        ax.annotate(f"{r['total_s']:.2f}", (xi, r["total_s"]), ha="center", va="bottom", fontsize=8)
    ax.axhline(GOAL_TOTAL_S, color="black", ls=":", lw=1.2, label=f"goal < {GOAL_TOTAL_S:.0f} s")
    ax.set_xticks(x, [f"{r['kill']}: {r['victim']}\n{r['mode']}" for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_ylim(0, max(max(bottom), GOAL_TOTAL_S) * 1.35)
    ax.set_title("recovery phases per kill")
    ax.legend(fontsize=8, ncol=2, loc="upper left")

    ax = fig.add_subplot(grid[0, 1])
    ratios = [r["survivors_ratio"] or 0.0 for r in rows]
    ax.bar(x, ratios, color="#8172b2")
    for xi, v in zip(x, ratios):
        ax.annotate(f"{v:.3f}", (xi, v), ha="center", va="bottom", fontsize=8)
    ax.axhline(GOAL_SURVIVOR_RATIO, color="black", ls=":", lw=1.2,
               label=f"goal ≥ {GOAL_SURVIVOR_RATIO}")
    ax.set_xticks(x, [str(r["kill"]) for r in rows])
    ax.set_xlabel("kill")
    ax.set_ylim(min(0.8, min(ratios) - 0.05), 1.08)
    ax.set_title("survivors' steps/s: outage ÷ before")
    ax.legend(fontsize=8, loc="lower right")

    ax = fig.add_subplot(grid[1, :])
    rate_ax = fig.add_subplot(grid[2, :], sharex=ax)
    for name in sorted(series):
        points = series[name]
        line, = ax.plot([t - t0 for t, _ in points], [s for _, s in points], lw=1.2, label=name)
        rates = rolling_rates(points, span_s=1.0)
        rate_ax.plot([t - t0 for t, _ in rates], [r for _, r in rates], lw=1,
                     color=line.get_color())
    for axis in (ax, rate_ax):
        for r in rows:
            axis.axvspan(r["failed_t"] - t0, r["recovered_t"] - t0, color="#c44e52", alpha=0.12)
            axis.axvline(r["failed_t"] - t0, color="#c44e52", lw=1, ls="--")
            axis.axvline(r["recovered_t"] - t0, color="#55a868", lw=1, ls="--")
    for r in rows:
        ax.annotate(f" kill {r['kill']}: {r['victim']}", (r["failed_t"] - t0, 0.02),
                    xycoords=("data", "axes fraction"), va="bottom", ha="left", fontsize=8,
                    color="#c44e52")
    ax.plot([], [], color="#c44e52", ls="--", label="kill")
    ax.plot([], [], color="#55a868", ls="--", label="recovered (first contribution)")
    ax.set_ylabel("learner step (at heartbeat)")
    ax.set_title("step counters; shaded: outage (a restarted learner resumes at its last applied "
                 "step)")
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    rate_ax.set_xlabel("seconds since the first learner trained")
    rate_ax.set_ylabel("steps / s (≥1 s spans)")
    rate_ax.set_title("step rate of every learner between heartbeats")
    positive = [r for points in series.values() for _, r in rolling_rates(points, 1.0)
                if r == r]
    if positive:
        top = statistics.median(positive)
        rate_ax.set_ylim(top * 0.5, top * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------
def run(modes: list[str], before_s: float, min_step_time_s: float, heartbeat_s: float,
        backoff_s: float, spares: int = 0,
        prestart: bool = True) -> tuple[list[dict], dict, float, dict]:
    import ray

    from islands.orchestrator.config import JobConfig
    from islands.orchestrator.controller import NAMESPACE, Controller, controller_options

    raw = job_dict(min_step_time_s, heartbeat_s, backoff_s, spares, prestart)
    config = JobConfig.model_validate(raw)
    run_dir = tempfile.mkdtemp(prefix="islands-recovery-")
    # address="local": always a fresh cluster of our own, even when another one runs here.
    ray.init(address="local", num_cpus=4, resources=config.region_resources(),
             namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    controller = None
    try:
        controller = ray.remote(Controller).options(**controller_options(run_dir)).remote(
            config, run_dir)
        ray.get(controller.start.remote(), timeout=300)
        recorder = Recorder(controller)
        recorder.wait_for(lambda snap: all_training(snap) and len(snap["learners"]) == 4, 300,
                          "4 learners training")
        t0 = min(points[0][0] for points in recorder.series.values())
        recorder.wait_for(lambda snap: (snap["syncer"]["merges"] or 0) >= 4, 60, "first merges")
        kills = run_kills(controller, modes, before_s, sorted(config.learner_ids()), recorder,
                          spares)
        return kills, recorder.series, t0, raw
    finally:
        end_service(controller, run_dir)   # its run dir: syncer snapshots and the JAX cache


def print_report(rows: list[dict], summary: dict) -> None:
    columns = ["kill", "victim", "mode", *PHASES, "total_s", "spawn_s", "setup_s",
               "survivors_ratio"]
    print(format_table(rows, columns))
    for name in ("median", "max"):
        print(f"{name:>6}: " + "  ".join(f"{p} {summary['phases'][p][name]:.3f}"
                                          for p in (*PHASES, "total_s")))
    s = summary
    print(f"kill -> training again: median {s['phases']['training_again_s']['median']:.3f} s; "
          f"kill -> first merged contribution: median {s['phases']['total_s']['median']:.3f} s")
    print(f"total: median {s['phases']['total_s']['median']:.2f} s, max "
          f"{s['phases']['total_s']['max']:.2f} s (goal < {GOAL_TOTAL_S:.0f} s: "
          f"{'met' if s['meets_total_goal'] else 'missed'}); survivors' ratio median "
          f"{s['survivors_ratio']['median']:.3f}, min {s['survivors_ratio']['min']:.3f} "
          f"(goal ≥ {GOAL_SURVIVOR_RATIO}: {'met' if s['meets_survivor_goal'] else 'missed'})")
    print("restore = spawn (new worker process, imports, actor init) + setup (corpus, model, "
          "register, peer state), from the restarted learner's own timings")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 ray_kill kills, 5 s windows")
    parser.add_argument("--kills", type=int, default=None, help="kills per mode")
    parser.add_argument("--modes", default=None, help="comma list of ray_kill, exit")
    parser.add_argument("--before-s", type=float, default=None, help="steady window before a kill")
    parser.add_argument("--min-step-time-s", type=float, default=0.1)
    parser.add_argument("--heartbeat-s", type=float, default=0.25)
    parser.add_argument("--backoff-s", type=float, default=0.1, help="restart backoff (constant)")
    parser.add_argument("--spares", type=int, default=0, help="warm spares per region")
    parser.add_argument("--no-prestart", action="store_true",
                        help="health.prestart_restarts: false (a restart starts a new process)")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    modes_list = (args.modes.split(",") if args.modes
                  else ["ray_kill"] if args.quick else ["ray_kill", "exit"])
    kills_per_mode = args.kills or (3 if args.quick else 4)
    modes = [m for m in modes_list for _ in range(kills_per_mode)]
    before_s = args.before_s or (5.0 if args.quick else 10.0)
    kills, series, t0, raw = run(modes, before_s, args.min_step_time_s, args.heartbeat_s,
                                 args.backoff_s, args.spares, not args.no_prestart)
    rows = [analyse(k, series, before_s) for k in kills]
    phases = {p: stats([r[p] for r in rows])
              for p in (*PHASES, "training_again_s", "total_s", "spawn_s", "setup_s")}
    ratios = stats([r["survivors_ratio"] for r in rows])
    summary = {"phases": phases, "survivors_ratio": ratios,
               "meets_total_goal": phases["total_s"]["max"] < GOAL_TOTAL_S,
               "meets_survivor_goal": (ratios["min"] or 0.0) >= GOAL_SURVIVOR_RATIO}
    os.makedirs(args.out, exist_ok=True)
    suffix = (f"-spares{args.spares}" if args.spares else "") + (
        "-noprestart" if args.no_prestart else "")
    png = os.path.join(args.out, f"recovery{suffix}.png")
    plot(rows, series, t0, png)
    print_report(rows, summary)
    result = {"benchmark": "recovery", "goal_total_s": GOAL_TOTAL_S,
              "goal_survivors_ratio": GOAL_SURVIVOR_RATIO, **summary,
              "kills": [{k: v for k, v in r.items() if k not in ("failed_t", "recovered_t")}
                        for r in rows],
              "before_window_s": before_s, "job": raw, "png": png, "command": command_line(),
              "machine": machine_info(), "elapsed_s": round(time.time() - t_start, 1)}
    with open(os.path.join(args.out, f"recovery{suffix}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
