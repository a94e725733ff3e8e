"""Units: a learner unit of 2 processes (2 hosts, one device each, jax.distributed over gloo)
against one process of 2 devices, on the same global batch.

Both run ``benchmarks/mesh.py``'s ``Unit`` (the learner's layout, meshed train step and pushes
against an in-process syncer) over the unit's 2 devices. In the 2-process unit every step's
gradient all-reduce crosses processes through gloo (TCP on loopback here; the network between
hosts on a cluster), which is the cost a multi-host unit adds. The two layouts alternate in
rounds (a fresh run of each per round) so they share the machine's state; each round reports
the median of its timed steps, and the figure is the median over rounds.

    python benchmarks/units.py --quick

Prints a table, then one JSON object as the last line; writes units.png and units.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

WORKER = "ISLANDS_UNITS_WORKER"


def worker(args: dict) -> None:
    """One process of a layout: joins the unit when it has several, times ``steps`` steps."""
    if args["processes"] > 1:
        from islands.learners.gang import join_unit

        join_unit(args["coordinator"], args["processes"], args["process"])
    import jax
    import numpy as np

    from mesh import TINY, Unit

    from islands.learners.unit import TrainingSpec

    spec = TrainingSpec(model=TINY if args["quick"] else {}, batch_size=args["batch_size"],
                        max_bytes=300_000, fragments=2, sync_every_steps=4, overlap_steps=1,
                        carry_overlap=True, seed=args["seed"])
    unit = Unit(spec, jax.devices())
    for _ in range(5):
        unit.step(timed=False)
    for _ in range(args["steps"]):
        unit.step(timed=True)
    if jax.process_index() == 0:
        print(json.dumps({"median_step_s": float(np.median(unit.step_s))}))


def run_layout(processes: int, args, steps: int) -> float:
    """The median step of one fresh run of a layout (2 devices in all)."""
    from islands.learners.gang import free_port

    env = {**os.environ, WORKER: "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={2 // processes}"}
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps(
        {"processes": processes, "process": i, "coordinator": coordinator, "steps": steps,
         "quick": args.quick, "batch_size": args.batch_size, "seed": args.seed})],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(processes)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"a {processes}-process run failed: {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])["median_step_s"]


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    watch_s = time.perf_counter()
    rounds = args.rounds or (3 if args.quick else 5)
    steps = args.steps or (60 if args.quick else 200)
    times = {1: [], 2: []}
    for _ in range(rounds):   # alternate, so both layouts see the same machine
        for processes in (1, 2):
            times[processes].append(run_layout(processes, args, steps))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = [{"layout": f"{n} process(es) × {2 // n} device(s)", "processes": n,
             "median_step_s": median(times[n]), "steps_per_s": 1.0 / median(times[n]),
             "rate_vs_1_process": median(times[1]) / median(times[n]),
             "per_round_step_s": times[n]} for n in (1, 2)]
    print(C.table([{k: v for k, v in r.items() if k != "per_round_step_s"} for r in rows],
                  ["layout", "median_step_s", "steps_per_s", "rate_vs_1_process"]))
    png = plot(args.out, rows)
    result = {"rows": rows, "rounds": rounds, "timed_steps": steps,
              "batch_size": args.batch_size, "model": "tiny" if args.quick else "default",
              "note": "both layouts use 2 CPU devices on this machine's cores; the 2-process "
                      "unit's all-reduce goes through gloo over loopback",
              "runtime_s": time.perf_counter() - watch_s, "png": png, "machine": C.machine()}
    C.finish("units", result, args.out)


def plot(out_dir: str, rows: list) -> str:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["layout"] for r in rows], [r["rate_vs_1_process"] for r in rows])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("step rate ÷ 1-process step rate")
    ax.set_title("a 2-host unit (gloo) vs one process, same global batch")
    fig.tight_layout()
    return C.save_figure(fig, out_dir, "units.png")


if __name__ == "__main__":
    if os.environ.get(WORKER):
        worker(json.loads(sys.argv[1]))
    else:
        main()
