"""Quality: why a mixed fleet trails a uniform one at equal tokens, one argued cause at a time.

``benchmarks/quality.py --steps 1000`` found the product on a mixed fleet (half the learners at
0.5× speed, ±10 % step-time noise) **+8.7 % per token** behind the same product on a uniform
fleet (it was +0.1 % at 240 steps). Each variant here runs the product on both fleets, same
seeds, same token budget (the mixed fleet trains for the virtual time in which it processes
M × steps batches, as ``quality.py`` does), and changes one thing on both:

* ``base``: as ``quality.py`` (each learner samples its own contiguous 1/M of the corpus; the
  inner AdamW's cosine runs to lr/10 at ``steps`` of the learner's *own* steps);
* ``noisy_uniform``: the uniform fleet gets the mixed fleet's ±10 % step-time noise (in
  ``base`` it has none, so its learners push in lockstep and every merge holds all four):
  what asynchrony alone costs, at one speed;
* ``whole_corpus``: every learner samples the whole train split (its own seed): no shard is
  seen less because its learner is slow (the data skew);
* ``constant_lr``: the inner learning rate constant after warmup: a slow learner's rate no
  longer lags the fast ones' (at the end a slow learner is 2/3 of the way down its cosine, a
  fast one has sat at lr/10 for a third of the run: the schedule skew);
* ``staleness_discount``: ``syncer.staleness_discount: 1`` (weight × 1/(1 + staleness)), a
  product setting: a slow learner's stale push weighs less in a merge it shares;
* ``drift_only``: **a counterfactual, not a product setting**: the syncer applies each push's
  own drift (g = −δ) instead of pulling Θ towards the learner's model (g = Θ − (base + δ),
  the product's rule). A stale push then no longer undoes the merges since its base;
* ``drift_only_constant_lr``: the two changes together.

With ``--dp``, data-parallel also runs per seed with each inner schedule (cosine, constant), as
the reference for the uniform fleet's gap.

    python benchmarks/mixed_fleet.py                       # 1000 steps, 3 seeds, every variant
    python benchmarks/mixed_fleet.py --variants base constant_lr --dp
    # four equal learners with ±10 % noise only, K = M (every merge waits for all):
    python benchmarks/mixed_fleet.py --variants base --fleets uniform --uniform-noise 0.1 \
        --quorum-all --name mixed_fleet_noisy_k_all

Prints a table, then one JSON object as the last line; writes mixed_fleet.png and .json.
"""

from __future__ import annotations

import contextlib

import _common as C
import numpy as np

from islands.learners import data
from islands.orchestrator import inprocess
from islands.syncer import fused
from quality import FRAGMENTS, REGIONS, SYNC_EVERY, user_defaults

VARIANTS = {
    "base": "as quality.py",
    "noisy_uniform": "the uniform fleet with the same ±10 % noise",
    "whole_corpus": "every learner samples the whole corpus",
    "constant_lr": "inner lr constant after warmup",
    "staleness_discount": "staleness_discount 1",
    "drift_only": "counterfactual: g = −δ",
    "drift_only_constant_lr": "counterfactual g = −δ, and constant inner lr",
}
CONSTANT = 10 ** 9   # a cosine this long is flat over any run here


def _drift_only(params, base, drift, pool=None):
    """g = −δ per tensor, with its norm (the signature of ``fused.outer_gradient``)."""
    del params, base
    grads = {path: -np.asarray(d, np.float32) for path, d in drift.items()}
    return grads, {path: float(np.linalg.norm(g)) for path, g in grads.items()}


@contextlib.contextmanager
def outer_gradient_rule(variant: str):
    """Swaps the syncer's outer-gradient rule for the ``drift_only`` counterfactual, and back."""
    original = fused.outer_gradient
    if variant.startswith("drift_only"):
        fused.outer_gradient = _drift_only
    try:
        yield
    finally:
        fused.outer_gradient = original


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help=f"which variants (default: all): {' '.join(VARIANTS)}")
    p.add_argument("--dp", action="store_true",
                   help="also data-parallel per seed with the cosine and the constant inner lr")
    p.add_argument("--fleets", nargs="+", default=["uniform", "mixed"],
                   choices=["uniform", "mixed"], help="which fleets to run (default: both)")
    p.add_argument("--uniform-noise", type=float, default=0.0,
                   help="the uniform fleet's step-time noise in every variant (default 0)")
    p.add_argument("--quorum-all", action="store_true",
                   help="K = M (min_learners = every learner) instead of the product's K = 1")
    p.add_argument("--name", default="mixed_fleet", help="JSON and PNG file name")
    args = p.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown --variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    watch = C.Stopwatch()
    steps = args.steps or (240 if args.quick else 1000)
    ids = [f"{r}:{i}" for r in REGIONS for i in range(2)]
    m = len(ids)
    product = {**user_defaults(m), "codec": "int4", "downlink": "int4",
               "min_learners": m if args.quorum_all else 1, "overlap_steps": 2}
    speeds = {"uniform": [1.0] * m, "mixed": [1.0, 0.5] * (m // 2)}
    seeds = list(range(args.seed, args.seed + args.seeds))
    results: dict = {}          # variant -> fleet -> seed -> {loss, tokens, evals}
    setups = []                 # kept alive: run_dp caches its compiled step by id(setup)
    for seed in seeds:
        for variant in args.variants + (["dp"] if args.dp else []):
            for schedule in (("cosine", "constant") if variant == "dp" else (None,)):
                constant = schedule == "constant" or variant.endswith("constant_lr")
                setup = C.make_setup(model_kwargs={}, num_learners=m, batch_size=8,
                                     total_steps=CONSTANT if constant else steps, seed=seed)
                setups.append(setup)
                if variant == "whole_corpus":
                    train = setup.samplers[0].train_bytes
                    setup.samplers = [data.ShardSampler(train, 8, setup.cfg.seq_len, 0, 1,
                                                        seed=seed * 16 + i + 1)
                                      for i in range(m)]
                if variant == "dp":
                    fleet = inprocess.Fleet(speeds["uniform"], step_time_s=1.0, latency_s=0.05,
                                            bandwidth_bytes_per_s=1e9 / 8, seed=seed)
                    rec = C.run_dp(setup, learner_ids=ids, fleet=fleet, steps=steps,
                                   eval_every_steps=max(steps // 10, 1),
                                   checkpoint_every_steps=10 ** 9)
                    results.setdefault("dp", {}).setdefault(schedule, {})[seed] = {
                        "loss": rec.evals[-1][2], "tokens": rec.tokens, "evals": rec.evals}
                    print(f"seed {seed} data-parallel, {schedule} lr: {rec.evals[-1][2]:.4f} "
                          f"({watch()} s)", flush=True)
                    continue
                for name in args.fleets:
                    if variant == "noisy_uniform" and name == "mixed" and seed in results.get(
                            "base", {}).get("mixed", {}):   # the same run as base's
                        results.setdefault(variant, {}).setdefault(name, {})[seed] = (
                            results["base"][name][seed])
                        continue
                    fleet = inprocess.Fleet(speeds[name], step_time_s=1.0,
                                            step_noise=(0.1 if name == "mixed"
                                                        or variant == "noisy_uniform"
                                                        else args.uniform_noise),
                                            latency_s=0.05, bandwidth_bytes_per_s=1e9 / 8,
                                            seed=seed)
                    length = ({"steps": steps} if name == "uniform" else
                              {"steps": 10 ** 9,   # the time in which it processes the budget
                               "until_s": m * steps * fleet.step_time_s / sum(speeds[name])})
                    settings = dict(product)
                    if variant == "staleness_discount":
                        settings["staleness_discount"] = 1.0
                    with outer_gradient_rule(variant):
                        rec = C.run_ours(setup, learner_ids=ids, fleet=fleet,
                                         num_fragments=FRAGMENTS, sync_every_steps=SYNC_EVERY,
                                         eval_every_steps=max(steps // 10, 1),
                                         **settings, **length)
                    staleness = [s for mg in rec.merges for s in mg.staleness]
                    results.setdefault(variant, {}).setdefault(name, {})[seed] = {
                        "loss": rec.evals[-1][2], "tokens": rec.tokens_processed,
                        "evals": rec.evals, "merges": len(rec.merges),
                        "mean_staleness": float(np.mean(staleness)) if staleness else 0.0}
                    print(f"seed {seed} {variant} {name}: {rec.evals[-1][2]:.4f} "
                          f"(merges {len(rec.merges)}, mean staleness "
                          f"{results[variant][name][seed]['mean_staleness']:.2f}; {watch()} s)",
                          flush=True)

    rows = []
    for variant in args.variants:
        by = results[variant]
        row = {"variant": variant, "what": VARIANTS[variant]}
        for name in by:
            row[name] = float(np.mean([by[name][s]["loss"] for s in seeds]))
        if len(by) == 2:
            gaps = [by["mixed"][s]["loss"] / by["uniform"][s]["loss"] - 1 for s in seeds]
            row.update({"mixed_vs_uniform": float(np.mean(gaps)), "min": float(np.min(gaps)),
                        "max": float(np.max(gaps)), "per_seed": [float(g) for g in gaps]})
        rows.append(row)
    print(C.table(rows, ["variant", "what", "uniform", "mixed", "mixed_vs_uniform", "min",
                         "max"]))
    dp = {}
    if args.dp:
        for schedule, by_seed in results["dp"].items():
            dp[schedule] = float(np.mean([r["loss"] for r in by_seed.values()]))
        print("data-parallel:", {k: round(v, 4) for k, v in dp.items()})
    png = plot(args.out, args.name, rows, results, seeds[0], steps)
    C.finish(args.name, {
        "benchmark": "mixed_fleet", "steps_per_learner": steps, "learners": m, "seeds": seeds,
        "rows": rows, "dp_loss": dp, "speeds": speeds, "step_noise_mixed": 0.1,
        "step_noise_uniform": args.uniform_noise, "min_learners": product["min_learners"],
        "losses": {v: {f: {str(s): r["loss"] for s, r in by_seed.items()}
                       for f, by_seed in by.items()} for v, by in results.items()},
        "detail": {v: {f: {str(s): {k: x for k, x in r.items() if k != "evals"}
                           for s, r in by_seed.items()}
                       for f, by_seed in by.items()} for v, by in results.items()},
        "png": png, "runtime_s": watch(), "machine": C.machine()}, args.out)


def plot(out_dir, name, rows, results, seed, steps) -> str:
    plt = C.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    gap_rows = [r for r in rows if "mixed_vs_uniform" in r]
    if gap_rows:
        means = [100 * r["mixed_vs_uniform"] for r in gap_rows]
        lo = [100 * (r["mixed_vs_uniform"] - r["min"]) for r in gap_rows]
        hi = [100 * (r["max"] - r["mixed_vs_uniform"]) for r in gap_rows]
        ax1.bar([r["variant"] for r in gap_rows], means, yerr=[lo, hi], capsize=4,
                color="tab:purple")
        ax1.axhline(1.0, color="k", ls=":", lw=1, label="goal: within 1 %")
        ax1.set_ylabel("mixed fleet's eval loss above the uniform one's (%)")
        ax1.set_title(f"per token, {steps} steps (mean, min–max over seeds)")
        ax1.legend(fontsize=8)
    else:   # one fleet: its mean eval loss per variant
        fleet = next(f for f in ("uniform", "mixed") if f in rows[0])
        ax1.bar([r["variant"] for r in rows], [r[fleet] for r in rows], color="tab:purple")
        ax1.set_ylabel(f"{fleet} fleet's eval loss (mean over seeds)")
        ax1.set_title(f"{steps} steps")
    plt.setp(ax1.get_xticklabels(), rotation=12, ha="right")
    for row, color in zip(rows, ["tab:red", "tab:brown", "tab:green", "tab:blue",
                                        "tab:orange", "tab:gray", "tab:olive"]):
        for fleet, ls in (("uniform", "-"), ("mixed", "--")):
            if fleet not in results[row["variant"]]:
                continue
            evals = results[row["variant"]][fleet][seed]["evals"]
            ax2.plot([t / 1e6 for _, t, _ in evals], [loss for _, _, loss in evals], ls=ls,
                     color=color, lw=1.3, label=f"{row['variant']}, {fleet}")
    ax2.set_ylim(1.5, 3.0)
    ax2.set_xlabel("tokens in the model (millions)")
    ax2.set_ylabel("held-out loss (nats/byte)")
    ax2.set_title(f"eval loss vs tokens (seed {seed}; dashed: mixed)")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return C.save_figure(fig, out_dir, f"{name}.png")


if __name__ == "__main__":
    main()
