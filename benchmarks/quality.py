"""Quality at equal tokens: Decoupled DiLoCo against synchronous data-parallel, no failures; and a
mixed fleet (half the learners at 0.5× speed, ±10 % step-time noise) with K = M, K = 1 and
K = 1 + grace.

4 learners (2 regions × 2) train the default tiny LM on the stdlib byte corpus in the in-process
harness (virtual clock, real JAX training on CPU). The token budget is M × steps batches: the
data-parallel baseline takes ``steps`` steps with the M gradients averaged (its loss does not depend
on the fleet's speeds, only its clock does); the uniform Decoupled DiLoCo run trains every learner
for ``steps`` steps; the mixed-fleet runs train for the virtual time in which the fleet processes
the same budget (M·steps / Σ speeds seconds), so fast learners contribute more tokens, as they
would in a real mixed fleet (a fixed step count per learner would leave the fast ones finished
and a K = M quorum waiting for them forever). Eval loss is the held-out loss of the global Θ.
In full runs (or with --ablation) one more uniform run with the outer optimizer replaced by
sgd(1.0) (plain averaging) shows how much of the gap the outer Nesterov momentum accounts for over
a short run (an ablation, not the configuration under test).

    python benchmarks/quality.py --quick       # 240 steps per learner, no ablation
    python benchmarks/quality.py               # 1 500 steps per learner

Prints a table, then one JSON object as the last line; writes quality.png and quality.json.
"""

from __future__ import annotations

import argparse

import _common as C
import numpy as np

from islands.orchestrator import baseline, inprocess

GOAL_GAP = 0.01
REGIONS = ("us-east", "eu-west")


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--fragments", type=int, default=12)
    p.add_argument("--sync-every", type=int, default=24)
    p.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=None,
                   help="add the outer sgd(1.0) run (default: on for full runs, off for --quick)")
    args = p.parse_args()
    watch = C.Stopwatch()
    steps = args.steps or (240 if args.quick else 1500)
    ids = [f"{r}:{i}" for r in REGIONS for i in range(2)]
    m = len(ids)
    setup = C.make_setup(model_kwargs={}, num_learners=m, batch_size=8, total_steps=steps,
                         seed=args.seed)
    every = max(steps // 10, 1)
    uniform = inprocess.Fleet([1.0] * m, step_time_s=1.0, latency_s=0.05,
                              bandwidth_bytes_per_s=1e9 / 8, seed=args.seed)
    mixed = inprocess.Fleet([1.0, 0.5] * (m // 2), step_time_s=1.0, step_noise=0.1,
                            latency_s=0.05, bandwidth_bytes_per_s=1e9 / 8, seed=args.seed)
    common = dict(learner_ids=ids, num_fragments=args.fragments,
                  sync_every_steps=args.sync_every, overlap_steps=2, codec="int4", steps=steps,
                  eval_every_steps=every)
    budget = m * steps * setup.tokens_per_batch
    runs = {}
    dp = C.run_dp(setup, learner_ids=ids, fleet=uniform, steps=steps, eval_every_steps=every,
                  checkpoint_every_steps=10 ** 9)
    dp_mixed_tl = baseline.simulate_timeline(learner_ids=ids, fleet=mixed,
                                             num_params=setup.num_params,
                                             checkpoint_every_steps=10 ** 9, steps=steps)
    print(f"data-parallel done ({watch()} s)", flush=True)
    mixed_until_s = m * steps * mixed.step_time_s / sum(mixed.speed_factors)
    configs = [
        ("uniform, K=1 + grace", uniform, dict(min_learners=1)),
        ("mixed, K=M", mixed, dict(min_learners=m, until_s=mixed_until_s)),
        ("mixed, K=1", mixed, dict(min_learners=1, grace_gamma=0.0, until_s=mixed_until_s)),
        ("mixed, K=1 + grace", mixed, dict(min_learners=1, until_s=mixed_until_s)),
    ]
    if args.ablation if args.ablation is not None else not args.quick:
        configs.insert(1, ("uniform, outer sgd(1.0) [ablation]", uniform,
                           dict(min_learners=1, outer_kind="sgd")))
    for name, fleet, kw in configs:
        if "until_s" in kw:  # the mixed fleet trains for a time, not a step count
            kw = {**kw, "steps": 10 ** 9}
        runs[name] = C.run_ours(setup, fleet=fleet, **{**common, **kw})
        print(f"{name} done ({watch()} s)", flush=True)

    dp_loss = dp.evals[-1][2]
    rows = [{"run": "data-parallel", "eval_loss": dp_loss, "gap": 0.0,
             "tokens": dp.tokens, "goodput": dp.goodput, "virtual_s": dp.timeline.end_s,
             "virtual_s_mixed": dp_mixed_tl.end_s, "merges": 0}]
    for name, rec in runs.items():
        loss = rec.evals[-1][2]
        rows.append({"run": name, "eval_loss": loss, "gap": (loss - dp_loss) / dp_loss,
                     "tokens": rec.tokens_processed,
                     "tokens_vs_budget": rec.tokens_processed / budget,
                     "steps": "/".join(str(k) for k in rec.steps), "goodput": rec.goodput,
                     "virtual_s": rec.end_time_s, "merges": len(rec.merges),
                     "mean_merge_size": float(np.mean([len(mg.learners) for mg in rec.merges])),
                     "mean_staleness": float(np.mean([s for mg in rec.merges
                                                      for s in mg.staleness]))})
    print(C.table(rows, ["run", "eval_loss", "gap", "tokens_vs_budget", "steps", "goodput",
                         "virtual_s", "merges", "mean_merge_size", "mean_staleness"]))
    png = plot(args.out, dp, runs, steps)
    by = {r["run"]: r for r in rows}
    km, k1g = by["mixed, K=M"]["eval_loss"], by["mixed, K=1 + grace"]["eval_loss"]
    result = {
        "benchmark": "quality", "quick": args.quick, "steps_per_learner": steps,
        "learners": m, "baseline_eval_loss": dp_loss, "token_budget": budget,
        "mixed_until_s": mixed_until_s,
        "runs": [{k: v for k, v in r.items()} for r in rows],
        "gap_uniform": by["uniform, K=1 + grace"]["gap"],
        "gap_mixed_k1_grace_vs_km": (k1g - km) / km,
        "goals": {
            "uniform_within_1pct_of_baseline": abs(by["uniform, K=1 + grace"]["gap"]) <= GOAL_GAP
            or by["uniform, K=1 + grace"]["gap"] <= 0,
            "k1_grace_matches_km_within_1pct": (k1g - km) / km <= GOAL_GAP,
            "k1_grace_goodput_near_1": by["mixed, K=1 + grace"]["goodput"] >= 0.95,
        },
        "settings": {"fragments": args.fragments, "sync_every_steps": args.sync_every,
                     "overlap_steps": 2, "codec": "int4", "merge": "rda",
                     "outer": "nesterov lr 0.7 momentum 0.9", "grace_gamma": 0.5,
                     "grace_cap_s": 5.0, "mixed_speeds": list(mixed.speed_factors),
                     "step_noise": 0.1, "batch_size": 8, "seq_len": setup.cfg.seq_len,
                     "inner": "adamw lr 3e-3, warmup 20, cosine to lr/10 at the last step"},
        "model": {"params": setup.num_params, "d_model": setup.cfg.d_model,
                  "n_layers": setup.cfg.n_layers},
        "runtime_s": watch(), "png": png, "machine": C.machine(),
    }
    C.finish("quality", result, args.out)


def plot(out_dir, dp, runs, steps) -> str:
    plt = C.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    tok = [t / 1e6 for _, t, _ in dp.evals]
    for ax in (ax1, ax2):
        ax.plot(tok, [l for _, _, l in dp.evals], "k-o", ms=3, lw=2, label="data-parallel")
    styles = {"uniform, K=1 + grace": ("tab:blue", "-"), "mixed, K=M": ("tab:green", "--"),
              "uniform, outer sgd(1.0) [ablation]": ("tab:gray", "-"),
              "mixed, K=1": ("tab:orange", ":"), "mixed, K=1 + grace": ("tab:purple", "-.")}
    for name, rec in runs.items():
        color, ls = styles[name]
        xs = [t / 1e6 for _, t, _ in rec.evals]
        ys = [l for _, _, l in rec.evals]
        for ax in (ax1, ax2):
            ax.plot(xs, ys, color=color, ls=ls, marker="o", ms=3, lw=1.6,
                    label=f"DiLoCo {name} (goodput {rec.goodput:.2f})")
    ax1.set_xlabel("tokens in the model (millions)")
    ax1.set_ylabel("held-out loss (nats/byte)")
    ax1.set_title("Eval loss of the global model vs tokens")
    ax1.legend(fontsize=8)
    finals = [l for _, _, l in dp.evals[-1:]] + [rec.evals[-1][2] for rec in runs.values()]
    lo, hi = min(finals), max(finals)
    ax2.set_ylim(lo - 0.1 * (hi - lo + 0.05), hi + 0.6 * (hi - lo + 0.05))
    half = max(t for t in tok) / 2
    ax2.set_xlim(half, max(tok) * 1.02)
    ax2.set_xlabel("tokens in the model (millions)")
    ax2.set_title("Second half, zoomed")
    fig.suptitle(f"Quality at equal tokens (4 learners, budget 4 × {steps} batches), no failures; "
                 "mixed = speeds 1, 0.5, 1, 0.5 with ±10 % noise", fontsize=11)
    fig.tight_layout()
    return C.save_figure(fig, out_dir, "quality.png")


if __name__ == "__main__":
    main()
