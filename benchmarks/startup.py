"""Start-up and warm-spare takeover, phase by phase, in the real Ray service (issue 32, point 5).

A local Ray cluster runs one region of 2 learners and ``health.spares: 1`` (K = 1) of the
``--model`` preset (``mid``: benchmarks/gpu.py's 25.4M-parameter byte LM; ``tiny``: the
recovery benchmark's model), with a small batch so CPU steps take a second at most. It reports

  start-up   the controller's start (build the task and Θ, warm the compilation cache, start
             the syncer, launch), then per learner: its prepare (devices, corpus, model; the
             step and push encoders are loaded from the cache on their first use) and its
             restore (data opened at its resume step, registration with the syncer (Θ),
             placement, the push encoders), its first step, and the job start → first step;
  takeover   a learner killed (``chaos_kill``, round robin) once the spare is ready: the
             controller's ``learner_recovered`` phases (detect, promote, restore, first merged
             contribution) and the promoted spare's own (``LearnerUnit.timings``): promote →
             ``run``, data, register (Θ), the peer's inner optimizer state (Adam's two moments
             through Ray), placement, push encoders, first step.

    python benchmarks/startup.py --model mid --kills 2      # ~4 min on 2 cores
    python benchmarks/startup.py --model tiny --kills 2

Prints a table, then one JSON object as the last line; writes ``startup-<model>.png`` and
``startup-<model>.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from _machine import command_line, end_service, format_table, machine_info  # noqa: E402

GOAL_TAKEOVER_S = 1.5     # kill -> the promoted spare trains again (issue 32, on a GPU)
# The promoted spare's restore, in the order ``LearnerUnit._run`` does it.
TAKEOVER = ("restart_s", "prepare_wait_s", "data_s", "register_s", "peer_state_s", "place_s",
            "compile_pushes_s")
STARTUP = ("devices_s", "corpus_s", "model_s", "prepare_wait_s", "data_s", "register_s",
           "place_s", "compile_pushes_s", "first_step_s")

MODELS = {
    # benchmarks/gpu.py's ``mid`` preset (25.4M parameters), one sequence per batch.
    "mid": dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, d_ff=2048, seq_len=256),
    "tiny": dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32),
}


def job_dict(model: str, batch_size: int, fragments: int, heartbeat_s: float) -> dict:
    return {
        "name": f"bench-startup-{model}",
        "model": dict(MODELS[model]),
        "data": {"max_bytes": 300_000, "batch_size": batch_size, "eval_batches": 1},
        "learner": {"min_step_time_s": 0.0, "eval_every_s": 3600.0},
        "syncer": {"fragments": fragments, "sync_every_steps": fragments, "overlap_steps": 2},
        "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
        "compression": {"type": "int4"},
        "regions": {"a": {"learners": 2}},
        "health": {"heartbeat_s": heartbeat_s, "timeout_s": 60.0, "spares": 1,
                   "restart": {"backoff_initial_s": 0.1, "backoff_multiplier": 1.0,
                               "max_crash_restarts": None}},
        "metrics": {"enabled": False},
        "console": {"enabled": False},
    }


def _num(x):
    return None if x is None else round(float(x), 3)


def learner_startup(timings: dict, t_call: float) -> dict:
    """One learner's start-up phases from its own timings (cumulative ones made durations)."""
    row = {"devices_s": timings.get("devices_s"),
           "corpus_s": (timings.get("corpus_s") or 0) - (timings.get("devices_s") or 0),
           "model_s": (timings.get("model_s") or 0) - (timings.get("corpus_s") or 0)}
    row.update({k: timings.get(k) for k in STARTUP[3:]})
    ready, first = timings.get("ready_at"), timings.get("first_step_s")
    row["job_start_to_first_step_s"] = (ready + first - t_call) if ready and first else None
    return {k: _num(v) for k, v in row.items()}


def takeover_row(kill: int, victim: str, event: dict, timings: dict, step_time_s) -> dict:
    """The phases of one takeover: the controller's and the promoted spare's."""
    row = {"kill": kill, "victim": victim, "detect_s": event["detect_s"],
           "promote_s": event["restart_s"]}
    row.update({k: timings.get(k) for k in TAKEOVER})
    row["first_step_s"] = timings.get("first_step_s")
    row["steady_step_s"] = step_time_s
    row["kill_to_training_s"] = event["total_s"] - event["first_contribution_s"]
    row["kill_to_first_step_s"] = row["kill_to_training_s"] + (row["first_step_s"] or 0.0)
    row["first_contribution_s"] = event["first_contribution_s"]
    row["kill_to_first_merge_s"] = event["total_s"]
    return {k: (_num(v) if isinstance(v, float) else v) for k, v in row.items()}


def run(args) -> dict:
    import ray

    sys.path.insert(0, BENCH_DIR)
    import recovery
    from islands.orchestrator.config import JobConfig
    from islands.orchestrator.controller import NAMESPACE, Controller, controller_options

    raw = job_dict(args.model, args.batch_size, args.fragments, args.heartbeat_s)
    config = JobConfig.model_validate(raw)
    run_dir = tempfile.mkdtemp(prefix="islands-startup-")
    ray.init(address="local", num_cpus=4, resources=config.region_resources(),
             namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    controller = None
    out: dict = {"job": raw}
    try:
        controller = ray.remote(Controller).options(**controller_options(run_dir)).remote(
            config, run_dir)
        t_call = time.time()
        ray.get(controller.start.remote(), timeout=900)
        out["controller_start_s"] = time.time() - t_call
        rec = recovery.Recorder(controller)
        learners = sorted(config.learner_ids())

        def trained(name):
            return lambda snap: (snap["learners"][name]["state"] == "training"
                                 and "first_step_s" in (rec.timings.get(name) or {}))
        for name in learners:
            rec.wait_for(trained(name), 900, f"{name}'s first step")
        started = next(e for e in rec.events if e["event"] == "job_started")
        out["controller_phases"] = started.get("start_phases")
        out["num_params"] = started.get("num_params")
        out["startup"] = {n: learner_startup(rec.timings[n], t_call) for n in learners}
        rows = []
        for i in range(args.kills):
            victim = learners[i % len(learners)]

            def steady(snap):
                spares = snap.get("spares") or {}
                return (recovery.all_training(snap) and any(
                    x["state"] == "ready" for x in spares.values()))
            rec.wait_for(steady, 900, f"a ready spare before kill {i + 1}")
            spare_ready = [e for e in rec.events if e["event"] == "spare_ready"][-1]
            time.sleep(args.before_s)
            snap = rec.poll()
            step_time = snap["learners"][victim].get("step_time_s")
            incarnation = snap["learners"][victim]["incarnation"]
            index = len(rec.events)
            ray.get(controller.chaos_kill.remote(victim, "ray_kill"), timeout=30)
            event = rec.wait_for(lambda _: rec.recovered(victim, index), 600,
                                 f"{victim} to recover")
            rec.wait_for(lambda snap: (snap["learners"][victim]["incarnation"] > incarnation
                                       and "first_step_s" in (rec.timings.get(victim) or {})),
                         60, f"{victim}'s new timings")
            promoted = [e for e in rec.events[index:] if e["event"] == "spare_promoted"]
            row = takeover_row(i + 1, victim, event, rec.timings[victim], step_time)
            row["spare"] = bool(promoted)
            row["spare_prepare_s"] = _num(spare_ready.get("prepare_s"))
            rows.append(row)
        out["takeovers"] = rows
        return out
    finally:
        end_service(controller, run_dir)


def summarise(rows: list[dict]) -> dict:
    keys = ["detect_s", "promote_s", *TAKEOVER, "first_step_s", "kill_to_training_s",
            "kill_to_first_step_s", "kill_to_first_merge_s"]
    return {k: _num(statistics.median([r[k] for r in rows if r.get(k) is not None]))
            for k in keys if any(r.get(k) is not None for r in rows)}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    cmap = plt.get_cmap("tab20")
    ax = axes[0]
    rows = result["takeovers"]
    parts = ["detect_s", "promote_s", *TAKEOVER, "first_step_s"]
    bottom = [0.0] * len(rows)
    for j, part in enumerate(parts):
        values = [r.get(part) or 0.0 for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, color=cmap(j), label=part[:-2])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), [f"kill {r['kill']}: {r['victim']}" for r in rows])
    ax.set_ylabel("seconds")
    ax.set_title(f"warm-spare takeover, {result['model']} ({result.get('num_params') or 0:,} "
                 "params): kill → first step done")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    names = sorted(result["startup"])
    cparts = ["build_task_s", "warm_cache_s", "syncer_s", "launch_s"]
    cphases = result.get("controller_phases") or {}
    left = 0.0
    for j, part in enumerate(cparts):
        v = cphases.get(part) or 0.0
        ax.barh(["controller"], [v], left=[left], color=cmap(j + 10), label=f"controller {part[:-2]}")
        left += v
    for n in names:
        s = result["startup"][n]
        ax.barh([n], [s.get("job_start_to_first_step_s") or 0.0], color="#4c72b0")
    ax.set_xlabel("seconds from the controller's start call")
    ax.set_title("start-up: controller phases, and each learner's first step done")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mid", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--fragments", type=int, default=16)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--before-s", type=float, default=3.0, help="steady training before a kill")
    p.add_argument("--heartbeat-s", type=float, default=0.25)
    p.add_argument("--tag", default="", help="suffix of the output files")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    args = p.parse_args(argv)
    t0 = time.time()
    result = {"benchmark": "startup", "model": args.model, **run(args)}
    result["takeover_median"] = summarise(result["takeovers"])
    result["goal_takeover_s"] = GOAL_TAKEOVER_S
    os.makedirs(args.out, exist_ok=True)
    stem = f"startup-{args.model}{'-' + args.tag if args.tag else ''}"
    png = os.path.join(args.out, stem + ".png")
    plot(result, png)
    print(f"controller start {result['controller_start_s']:.2f} s: "
          + ", ".join(f"{k} {v:.2f}" for k, v in (result.get("controller_phases") or {}).items()))
    print(format_table([{"learner": n, **s} for n, s in sorted(result["startup"].items())],
                       ["learner", *STARTUP, "job_start_to_first_step_s"]))
    print(format_table(result["takeovers"],
                       ["kill", "victim", "spare", "detect_s", "promote_s", *TAKEOVER,
                        "first_step_s", "steady_step_s", "kill_to_training_s",
                        "kill_to_first_step_s", "kill_to_first_merge_s", "spare_prepare_s"]))
    print("median: " + "  ".join(f"{k} {v}" for k, v in result["takeover_median"].items()))
    result.update(png=png, command=command_line(), machine=machine_info(),
                  elapsed_s=round(time.time() - t0, 1))
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
