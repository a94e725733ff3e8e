"""CPU-seconds per learner start, phase by phase, in the real Ray service (issue 35, part 1).

On a few shared cores a learner's start is paid in CPU taken from the learners that train. A
local Ray cluster (``--num-cpus``, default 2) runs one region of ``--learners`` learners of the
tiny model (the recovery benchmark's), each step padded to ``--min-step-s`` (standing in for an
accelerator host of its own, so the survivors' step rate shows the CPU a start takes from
them). Once they train, it kills one learner at a time (``chaos_kill``, round robin) and reads
the new incarnation's process CPU-seconds per phase (``LearnerUnit.timings["cpu_*"]``: all
threads of the learner's process, ``time.process_time``):

  boot          the Ray worker process until the learner's module loads (interpreter, Ray, the
                core worker's connection)
  load          importing the learner's module (numpy, the islands modules), the actor's class
  init          ``LearnerUnit.__init__``
  import        JAX, optax, the task's modules
  devices       the device check (JAX's backend)
  corpus, model the corpus from the object store, the task and the abstract model built
  warm_step,    a spare only: the train step and push encoders compiled on placeholder values
  warm_pushes   (or loaded from the persistent compilation cache)
  data ... first_step   the restore (``LearnerUnit._run``): data, register, the peer's state,
                placement, the push encoders, the first train step (traced and compiled, or
                loaded from the cache, then run)

``start`` is what the start cost from the moment it was asked for: the whole process for a new
one, from ``run`` for a promoted spare (whose preparation, ``prepare``, came before, at low
priority). With ``--spares`` the benchmark waits for a ready spare before each kill and then
for the replacement spare's preparation, and reports the survivors' steps/s during it. The
survivors' steps/s in [kill, the new incarnation's first step] (at least 1 s) are divided by
their rate in the ``--before-s`` steady window before the kill. ``--burst`` kills two learners,
the second once the first trains again (a spare's replacement is then still preparing: with
``health.spare_wait_s`` the second waits for it, with 0 it starts a new process).

    python benchmarks/start_cost.py --kills 4 --no-prestart         # new processes (~2 min)
    python benchmarks/start_cost.py --kills 4                       # prestarted restarts
    python benchmarks/start_cost.py --kills 3 --spares 1            # promoted spares
    python benchmarks/start_cost.py --kills 4 --spares 1 --burst --spare-wait-s 0

Prints a table, then one JSON object as the last line; writes ``start-cost<tag>.png`` to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from _machine import command_line, end_service, format_table, machine_info  # noqa: E402

# In the order a new process pays them.
PHASES = ("boot", "load", "init", "import", "devices", "corpus", "model", "warm_step",
          "warm_pushes", "data", "register", "peer_state", "place", "compile_pushes",
          "first_step")
PREPARE = ("boot", "load", "init", "import", "devices", "corpus", "model", "warm_step",
           "warm_pushes")


def job_dict(learners: int, min_step_s: float, spares: int,
             spare_wait_s: Optional[float] = None, prestart: bool = True,
             backoff_s: float = 0.1) -> dict:
    health = {"heartbeat_s": 0.25, "timeout_s": 30.0, "spares": spares,
              "restart": {"backoff_initial_s": backoff_s, "backoff_multiplier": 1.0,
                          "max_crash_restarts": None}}
    if spare_wait_s is not None:
        health["spare_wait_s"] = spare_wait_s
    if not prestart:
        health["prestart_restarts"] = False
    return {
        "name": "bench-start-cost",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
        "data": {"max_bytes": 300_000, "batch_size": 4, "eval_batches": 1},
        "learner": {"min_step_time_s": min_step_s, "eval_every_s": 3600.0},
        "syncer": {"fragments": 2, "sync_every_steps": 4, "overlap_steps": 1},
        "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
        "compression": {"type": "int4"},
        "regions": {"a": {"learners": learners}},
        "health": health,
        "metrics": {"enabled": False},
        "console": {"enabled": False},
    }


def cpu_row(timings: dict) -> dict:
    """A start's CPU-seconds by phase (None: the phase did not run in this process)."""
    return {p: timings.get(f"cpu_{p}_s") for p in PHASES}


def loadavg() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(args) -> dict:
    import ray

    import recovery
    from islands.orchestrator.config import JobConfig
    from islands.orchestrator.controller import NAMESPACE, Controller, controller_options

    raw = job_dict(args.learners, args.min_step_s, args.spares, args.spare_wait_s,
                   not args.no_prestart, args.backoff_s)
    config = JobConfig.model_validate(raw)
    run_dir = tempfile.mkdtemp(prefix="islands-start-cost-")
    ray.init(address="local", num_cpus=args.num_cpus, resources=config.region_resources(),
             namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    controller = None
    out: dict = {"job": raw, "load_before": loadavg()}
    try:
        controller = ray.remote(Controller).options(**controller_options(run_dir)).remote(
            config, run_dir)
        ray.get(controller.start.remote(), timeout=900)
        rec = recovery.Recorder(controller)
        learners = sorted(config.learner_ids())
        rec.wait_for(lambda snap: all(
            snap["learners"][n]["state"] == "training"
            and "cpu_start_s" in (rec.timings.get(n) or {}) for n in learners), 600,
            "every learner's first step")
        out["initial"] = {n: cpu_row(rec.timings[n]) | {"start": rec.timings[n]["cpu_start_s"]}
                          for n in learners}
        rows = []

        def steady(snap):
            spares = snap.get("spares") or {}
            ready = sum(1 for x in spares.values() if x["state"] == "ready")
            if not recovery.all_training(snap) or ready < args.spares:
                ready_since[0] = time.time()
                return False
            return time.time() - ready_since[0] >= args.before_s

        def kill(i: int, victim: str) -> dict:
            """Kills ``victim`` now; its new incarnation's start, and the survivors meanwhile."""
            snap = rec.poll()
            incarnation = snap["learners"][victim]["incarnation"]
            index = len(rec.events)
            load = loadavg()
            t_kill = time.time()
            ray.get(controller.chaos_kill.remote(victim, "ray_kill"), timeout=30)
            rec.wait_for(lambda snap: (snap["learners"][victim]["incarnation"] > incarnation
                                       and (rec.timings.get(victim) or {}).get("ready_at", 0)
                                       > t_kill and "cpu_start_s" in rec.timings[victim]),
                         600, f"{victim}'s new incarnation's first step")
            timings = rec.timings[victim]
            t_first = timings["ready_at"] + timings["first_step_s"]
            promoted = [e for e in rec.events[index:] if e["event"] == "spare_promoted"
                        and e["learner"] == victim]
            return {"kill": i + 1, "victim": victim, "spare": bool(promoted),
                    "load1": load[0] if load else None, "t_kill": t_kill, "t_first": t_first,
                    "index": index, "kill_to_first_step_s": round(t_first - t_kill, 3),
                    "start": round(timings["cpu_start_s"], 3),
                    **{p: (round(v, 3) if v is not None else None)
                       for p, v in cpu_row(timings).items()},
                    # a prepared process's preparation, paid before (at low priority)
                    "prepare": (round(sum(timings.get(f"cpu_{p}_s") or 0.0
                                          for p in PREPARE), 3) if promoted else None)}

        def survivors(row: dict, start_s: float, end_s: float) -> float:
            """The survivors' steps/s in [start_s, end_s] ÷ in the steady window before the
            kill (``--before-s``)."""
            names = [n for n in learners if n != row["victim"]]
            rec.wait_for(lambda _: all(rec.series[n][-1][0] > end_s + 0.5 for n in names), 60,
                         "beats after the window")
            before = {n: recovery.window_rate(rec.series[n], row["t_kill"] - args.before_s,
                                              row["t_kill"]) for n in names}
            during = {n: recovery.window_rate(rec.series[n], start_s, end_s) for n in names}
            return recovery.survivor_ratio(before, during)

        i = 0
        while i < args.kills:
            ready_since = [time.time()]
            rec.wait_for(steady, 600, f"steady training and ready spares before kill {i + 1}")
            # --burst: a second learner killed as soon as the first trains again (its
            # replacement spare, if any, is still preparing).
            victims = [learners[(i + k) % len(learners)]
                       for k in range(2 if args.burst else 1)][:args.kills - i]
            batch = [kill(i + k, v) for k, v in enumerate(victims)]
            for row in batch:
                row["survivors_ratio"] = survivors(row, row["t_kill"],
                                                   max(row["t_first"], row["t_kill"] + 1.0))
            last = batch[-1]
            if args.spares and not args.burst:
                # The replacement spare's preparation: the survivors' pace while it runs.
                launched = rec.wait_for(lambda _: next(
                    (e for e in rec.events[last["index"]:] if e["event"] == "spare_launched"),
                    None), 120, "the replacement spare's launch")
                ready = rec.wait_for(lambda _: next(
                    (e for e in rec.events[last["index"]:] if e["event"] == "spare_ready"
                     and e["spare"] == launched["spare"]), None), 300, "it to be ready")
                last["replacement_wall_s"] = round(ready["t"] - launched["t"], 3)
                last["replacement_survivors_ratio"] = survivors(last, launched["t"], ready["t"])
            rows += batch
            i += len(batch)
        out["kills"] = [{k: v for k, v in r.items() if k not in ("t_kill", "t_first", "index")}
                        for r in rows]
        out["load_after"] = loadavg()
        return out
    finally:
        end_service(controller, run_dir)


def median(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["kills"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    cmap = plt.get_cmap("tab20")
    ax = axes[0]
    bottom = [0.0] * len(rows)
    for j, phase in enumerate(PHASES):
        values = [r.get(phase) or 0.0 for r in rows]
        if not any(values):
            continue
        ax.bar(range(len(rows)), values, bottom=bottom, color=cmap(j), label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    starts = [r["start"] for r in rows]
    ax.plot(range(len(rows)), starts, "k_", ms=30, label="start (from the ask)")
    ax.set_xticks(range(len(rows)),
                  [f"{r['kill']}: {r['victim']}{' (spare)' if r['spare'] else ''}" for r in rows])
    ax.set_ylabel("process CPU-seconds")
    ax.set_title(f"CPU per learner start by phase{result.get('tag_title', '')}")
    ax.legend(fontsize=7, ncol=3)
    ax = axes[1]
    ratios = [r["survivors_ratio"] or 0.0 for r in rows]
    ax.bar(range(len(rows)), ratios, color="#8172b2")
    ax.set_ylim(min(0.5, min(ratios) - 0.05), 1.1)
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_title("survivors' steps/s: kill→first step ÷ before")
    ax.set_xticks(range(len(rows)), [str(r["kill"]) for r in rows])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--learners", type=int, default=3)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--spares", type=int, default=0, help="health.spares")
    p.add_argument("--spare-wait-s", type=float, default=None, help="health.spare_wait_s")
    p.add_argument("--backoff-s", type=float, default=0.1,
                   help="the restart backoff (constant): what a restart waits before it is due")
    p.add_argument("--no-prestart", action="store_true",
                   help="health.prestart_restarts: false (a restart starts a new process)")
    p.add_argument("--burst", action="store_true",
                   help="kill learners two at a time, the second as the first trains again")
    p.add_argument("--min-step-s", type=float, default=0.1)
    p.add_argument("--before-s", type=float, default=4.0,
                   help="steady training (and ready spares) before each kill")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    args = p.parse_args(argv)
    t0 = time.time()
    result = {"benchmark": "start_cost", **run(args)}
    rows = result["kills"]
    result["median"] = {k: median(rows, k) for k in
                        ("start", "prepare", *PHASES, "kill_to_first_step_s",
                                  "survivors_ratio", "replacement_wall_s",
                                  "replacement_survivors_ratio")}
    os.makedirs(args.out, exist_ok=True)
    stem = f"start-cost{'-' + args.tag if args.tag else ''}"
    result["tag_title"] = f" ({args.tag})" if args.tag else ""
    png = os.path.join(args.out, stem + ".png")
    plot(result, png)
    print(format_table(rows, ["kill", "victim", "spare", "load1", "start", "prepare", *PHASES,
                              "kill_to_first_step_s", "survivors_ratio",
                              "replacement_wall_s", "replacement_survivors_ratio"]))
    print("median: " + "  ".join(f"{k} {v}" for k, v in result["median"].items()
                                 if v is not None))
    result.update(png=png, command=command_line(), machine=machine_info(),
                  elapsed_s=round(time.time() - t0, 1))
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
