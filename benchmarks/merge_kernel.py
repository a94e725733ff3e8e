"""The syncer's merge + outer step against ``np.copyto``, side by side in one process (issue 25).

One fragment of N parameters, a round of M = 4 outer gradients merged by RDA (the default rule)
or the weighted mean and stepped by Nesterov, the syncer's path: each gradient folded into the
round's running sums as its push is accepted (``syncer/fused.py:GradSum.fold``: one axpy per sum,
2 sums with RDA), then one step from the sums (``step_sums``: blocks of 256K values, each
stepped in cache; 7 passes with RDA, 5 with the mean). The copy baseline is ``np.copyto`` of
the same M fragments (M reads and M writes: 2M passes). The ratio is merged bytes per second
over copied bytes per second, i.e. copy time ÷ (fold + merge) time; each repetition times the
merge and the copy back to back, so load on the machine hits both alike. Goal: ≥ 0.5 at 10M
and 30M parameters. (``results/merge_kernel_issue25.json`` was measured on the list merge that
the running sums replaced.)

BLAS runs single-threaded, as in the syncer actor (``orchestrator/runtime.py:process_env``
sets ``OMP_NUM_THREADS=1``, which OpenBLAS follows): ``--blas-threads N`` sets
``OPENBLAS_NUM_THREADS`` for this process instead (it must be set before numpy loads, so the
option re-executes the script with it).

    python benchmarks/merge_kernel.py --quick      # 10M and 30M, 7 repetitions
    python benchmarks/merge_kernel.py --sizes 1000000,10000000,30000000 --reps 15

Prints a table, then one JSON object as the last line; writes merge_kernel.{json,png} to --out.
"""

from __future__ import annotations

import os
import statistics
import sys
import time


def _blas_threads(argv) -> str:
    """The BLAS thread count asked for (``--blas-threads N``; default 1, the syncer's)."""
    for i, arg in enumerate(argv):
        if arg == "--blas-threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--blas-threads="):
            return arg.split("=", 1)[1]
    return "1"


if os.environ.get("OPENBLAS_NUM_THREADS") != _blas_threads(sys.argv[1:]):  # before numpy loads
    os.environ["OPENBLAS_NUM_THREADS"] = _blas_threads(sys.argv[1:])
    os.execv(sys.executable, [sys.executable] + sys.argv)

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

from islands.syncer import fused, outer  # noqa: E402

GOAL = 0.5


def time_one(size: int, learners: int, rule: str, reps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal(size).astype(np.float32)}
    grads = [{"w": 0.01 * rng.standard_normal(size).astype(np.float32)}
             for _ in range(learners)]
    norms = [{"w": float(np.linalg.norm(g["w"]))} for g in grads]
    weights = [float(i + 1) for i in range(learners)]
    optimizer = outer.build("nesterov", lr=0.7, momentum=0.9)
    state = optimizer.init(params)
    pool = fused.BufferPool()
    rda = frozenset({"w"}) if rule == "rda" else frozenset()
    dst = [np.empty(size, np.float32) for _ in range(learners)]
    merge_s, copy_s = [], []
    for rep in range(reps + 1):                  # the first of each is a warm-up
        t0 = time.perf_counter()
        sums = fused.GradSum(rda)
        for g, n, w in zip(grads, norms, weights):
            sums.fold(g, n, w, 1.0, pool)
        new_params, new_state, finite, _ = fused.step_sums(optimizer, [sums], 1.0, params,
                                                           state, pool)
        sums.release(pool)
        t1 = time.perf_counter()
        for g, d in zip(grads, dst):
            np.copyto(d, g["w"])
        t2 = time.perf_counter()
        assert finite
        params, state = new_params, new_state    # each step reads the last one's momentum
        if rep:
            merge_s.append(t1 - t0)
            copy_s.append(t2 - t1)
    ratios = [c / m for c, m in zip(copy_s, merge_s)]
    gb = learners * size * 4 / 1e9
    return {"size": size, "learners": learners, "rule": rule,
            "merge_ms": 1e3 * statistics.median(merge_s), "copy_ms": 1e3 * statistics.median(copy_s),
            "merge_gb_per_s": gb / statistics.median(merge_s),
            "copy_gb_per_s": gb / statistics.median(copy_s),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "meets_goal": statistics.median(ratios) >= GOAL,
            # passes over memory (one = N float32 values read or written): the folds (2 for
            # the first push, 3 for each next, per sum) and step_sums
            "merge_passes": (2 if rule == "rda" else 1) * (3 * learners - 1)
                            + (7 if rule == "rda" else 5),
            "copy_passes": 2 * learners}


def plot(rows: list[dict], out_dir: str) -> None:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['size'] / 1e6:g}M {r['rule']}" for r in rows]
    ax.bar(labels, [r["ratio_median"] for r in rows], color="#4c72b0")
    ax.errorbar(labels, [r["ratio_median"] for r in rows],
                yerr=[[r["ratio_median"] - r["ratio_min"] for r in rows],
                      [r["ratio_max"] - r["ratio_median"] for r in rows]],
                fmt="none", color="black", capsize=3)
    ax.axhline(GOAL, color="black", ls=":", label=f"goal ≥ {GOAL}")
    ax.set_ylabel("merge + Nesterov step ÷ np.copyto")
    ax.set_title("syncer merge of 4 outer gradients against a copy of them")
    ax.legend()
    C.save_figure(fig, out_dir, "merge_kernel.png")


def main(argv=None) -> dict:
    p = C.parser(__doc__)
    p.add_argument("--sizes", default=None, help="comma list of fragment sizes")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--blas-threads", default="1",
                   help="OPENBLAS_NUM_THREADS (default 1: the syncer actor's single thread)")
    args = p.parse_args(argv)
    sizes = ([int(x) for x in args.sizes.split(",")] if args.sizes
             else [10_000_000, 30_000_000] if args.quick else [1_000_000, 10_000_000, 30_000_000])
    reps = args.reps or (7 if args.quick else 15)
    watch = C.Stopwatch()
    rows = [time_one(size, args.learners, rule, reps) for size in sizes for rule in ("rda", "mean")]
    print(C.table(rows, ["size", "rule", "merge_ms", "copy_ms", "merge_gb_per_s",
                         "copy_gb_per_s", "ratio_median", "ratio_min", "meets_goal"]))
    result = {"benchmark": "merge_kernel", "goal": GOAL, "rows": rows,
              "reps": reps, "blas_threads": os.environ["OPENBLAS_NUM_THREADS"], "wall_s": watch(), "machine": C.machine(),
              "load_average": os.getloadavg()}
    plot(rows, args.out)
    C.finish("merge_kernel", result, args.out)
    return result


if __name__ == "__main__":
    main()
