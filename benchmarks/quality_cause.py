"""Quality: what limits the product's gap to data-parallel, one change at a time.

``benchmarks/quality.py`` measures the product against data-parallel at equal tokens; the gap was
argued to come from the local batch (each learner's 8 rows, a quarter of data-parallel's averaged
32) or from the inner learning rate at that batch. This runs data-parallel and the product as
``quality.py`` does (same seeds, same setup, same defaults), and two product runs that each change
only one of those:

* ``local batch 32``: each learner trains on batches of 32 rows for a quarter of the steps (the
  same tokens; H stays 24 steps, so each sync carries 4× the tokens);
* ``inner lr ÷ 2``: the product with the inner AdamW's peak learning rate halved (its schedule's
  shape unchanged).

Neither of those closed the gap, so two more change what the first run pointed at instead:

* ``H = 12``: every fragment merged twice as often (H = 12 instead of 24; the 12 fragments then
  go out one per step), so the learners drift apart for half as long;
* ``inner lr × 2``: the inner AdamW's peak learning rate doubled.

    python benchmarks/quality_cause.py --steps 1000        # 3 seeds, every variant
    python benchmarks/quality_cause.py --steps 1000 --variants product h12 lr_double

Prints a table, then one JSON object as the last line; writes quality_cause.png and .json.
"""

from __future__ import annotations

import _common as C
import numpy as np

from islands.orchestrator import inprocess
from quality import FRAGMENTS, REGIONS, SYNC_EVERY, user_defaults

LR = 3e-3   # _common.make_setup's default inner peak learning rate


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=None,
                   help="which product runs (default: all): product batch32 lr_half h12 lr_double")
    args = p.parse_args()
    watch = C.Stopwatch()
    steps = args.steps or (240 if args.quick else 1000)
    ids = [f"{r}:{i}" for r in REGIONS for i in range(2)]
    m = len(ids)
    def product(sync_every: int) -> dict:   # the job defaults a user gets at this H
        return {**user_defaults(m, sync_every), "codec": "int4", "downlink": "int4",
                "min_learners": 1, "overlap_steps": 2}

    every = max(steps // 10, 1)
    variants = {  # key -> (label, batch, steps, lr, H)
        "product": ("product (batch 8)", 8, steps, LR, SYNC_EVERY),
        "batch32": ("product, local batch 32 (¼ of the steps)", 32, steps // 4, LR, SYNC_EVERY),
        "lr_half": ("product, inner lr ÷ 2", 8, steps, LR / 2, SYNC_EVERY),
        "h12": ("product, H = 12 (2× the merges)", 8, steps, LR, SYNC_EVERY // 2),
        "lr_double": ("product, inner lr × 2", 8, steps, 2 * LR, SYNC_EVERY),
    }
    unknown = set(args.variants or ()) - set(variants)
    if unknown:
        p.error(f"unknown --variants {sorted(unknown)}; choose from {sorted(variants)}")
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants}
    results: dict[str, dict[int, float]] = {}
    for seed in range(args.seed, args.seed + args.seeds):
        fleet = inprocess.Fleet([1.0] * m, step_time_s=1.0, latency_s=0.05,
                                bandwidth_bytes_per_s=1e9 / 8, seed=seed)
        setup = C.make_setup(model_kwargs={}, num_learners=m, batch_size=8, total_steps=steps,
                             seed=seed)
        dp = C.run_dp(setup, learner_ids=ids, fleet=fleet, steps=steps, eval_every_steps=every,
                      checkpoint_every_steps=10 ** 9)
        results.setdefault("dp", {})[seed] = dp.evals[-1][2]
        print(f"seed {seed}: data-parallel {dp.evals[-1][2]:.4f} ({watch()} s)", flush=True)
        for key, (label, batch, n, lr, sync_every) in variants.items():
            mine = C.make_setup(model_kwargs={}, num_learners=m, batch_size=batch,
                                total_steps=n, lr=lr, seed=seed)
            rec = C.run_ours(mine, learner_ids=ids, fleet=fleet, num_fragments=FRAGMENTS,
                             sync_every_steps=sync_every, eval_every_steps=max(n // 10, 1),
                             steps=n, **product(sync_every))
            results.setdefault(key, {})[seed] = rec.evals[-1][2]
            print(f"seed {seed}: {label} {rec.evals[-1][2]:.4f} ({watch()} s)", flush=True)
    rows = []
    for key, label in [("dp", "data-parallel (batch 4 × 8)")] + [
            (k, v[0]) for k, v in variants.items()]:
        gaps = [(results[key][s] - results["dp"][s]) / results["dp"][s] for s in results[key]]
        rows.append({"run": label, "eval_loss": float(np.mean(list(results[key].values()))),
                     "gap_vs_dp": float(np.mean(gaps)), "gap_min": float(np.min(gaps)),
                     "gap_max": float(np.max(gaps)), "seeds": len(gaps)})
    print(C.table(rows, ["run", "seeds", "eval_loss", "gap_vs_dp", "gap_min", "gap_max"]))
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([r["run"] for r in rows[1:]], [100 * r["gap_vs_dp"] for r in rows[1:]])
    ax.set_ylabel("eval loss above data-parallel (%)")
    ax.set_title(f"what limits the gap ({steps} steps, {args.seeds} seeds)")
    plt.setp(ax.get_xticklabels(), rotation=12, ha="right")
    fig.tight_layout()
    png = C.save_figure(fig, args.out, "quality_cause.png")
    C.finish("quality_cause", {"benchmark": "quality_cause", "steps": steps, "rows": rows,
                               "losses": {k: {str(s): v for s, v in r.items()}
                                          for k, r in results.items()},
                               "png": png, "runtime_s": watch(), "machine": C.machine()},
             args.out)


if __name__ == "__main__":
    main()
