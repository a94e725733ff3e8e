"""Quality at equal tokens: where Decoupled DiLoCo's gap to synchronous data-parallel comes from.

4 learners (2 regions × 2) train the default tiny LM on the stdlib byte corpus in the in-process
harness (virtual clock, real JAX training on CPU), no failures. The token budget is M × steps
batches of 8: data-parallel takes ``steps`` steps with the M gradients averaged (batch 32); every
Decoupled DiLoCo run trains each learner for ``steps`` steps (batch 8). Eval loss is the held-out
loss of the global Θ. The decomposition adds one difference at a time, so each one's cost shows:

1. data-parallel;
2. synchronous DiLoCo: one fragment (P = 1), K = M, fp32 both ways, τ = 0 (local training);
3. streaming: P = 12 fragments, staggered (streaming);
4. + τ = 2 overlap (overlap);
5. + int4 both ways: the pushes and the syncer's answers (compression);
6. + K = 1 + grace: the product configuration (decoupling).

Every DiLoCo row uses the job defaults a user gets from JobConfig (outer optimizer by the rule of
``syncer/outer.py`` for this H and M, overlap handling, merge rule, grace window). Two more rows:
the product with the defaults before this rule (Nesterov 0.7 / 0.9, overlapped steps overwritten),
and the product on a mixed fleet (half the learners at 0.5× speed, ±10 % step-time noise), trained
for the virtual time in which the fleet processes the same token budget (``mixed_vs_uniform``
compares its loss with the uniform fleet's at equal tokens).

The end points (data-parallel, streaming, product, mixed) run for every seed; the intermediate
rows for the first seed only. Gaps are fractions of the data-parallel loss of the same seed; the
JSON gives the mean and the spread (min, max) over seeds.

    python benchmarks/quality.py --quick       # 240 steps per learner, 3 seeds, ~8–12 min here
    python benchmarks/quality.py               # 600 steps per learner, 3 seeds, ~20 min here
    python benchmarks/quality.py --steps 1500  # longer (about an hour here with 3 seeds)

The full length was 1 500 steps when the benchmark had 5 single-seed runs; with 3 seeds for the
end points (16 runs) it is 600 steps, so that it fits a working session on 2 cores.

Prints a table, then one JSON object as the last line (``dp_loss``, ``product_loss``,
``product_gap``, ``streaming_gap``, ``decoupling_gap``, ``mixed_vs_uniform``, ...); writes
quality.png and quality.json.
"""

from __future__ import annotations

import _common as C
import numpy as np

from islands.orchestrator import build, inprocess
from islands.orchestrator.config import JobConfig
from islands.syncer import outer as outer_lib

GOAL_PRODUCT_GAP = 0.02      # product vs data-parallel
GOAL_DECOUPLING_GAP = 0.01   # product vs synchronous streaming
GOAL_MIXED = 0.01            # mixed fleet vs uniform, per token
REGIONS = ("us-east", "eu-west")
FRAGMENTS, SYNC_EVERY = 12, 24


def user_defaults(num_learners: int, sync_every: int = SYNC_EVERY) -> dict:
    """run_ours settings from the JobConfig defaults for this benchmark's H (or ``sync_every``)
    and M."""
    config = JobConfig.model_validate({
        "name": "quality", "regions": {r: {"learners": num_learners // len(REGIONS)}
                                       for r in REGIONS},
        "syncer": {"fragments": FRAGMENTS, "sync_every_steps": sync_every}})
    options = build.syncer_options(config, "/tmp/unused")
    kind, kwargs = options["outer_kind"], dict(options["outer_kwargs"])
    return dict(outer_kind=kind, outer_kwargs=kwargs,
                carry_overlap=config.learner.overlap == "carry",
                merge_alpha=config.learner.merge_alpha, merge_rule=config.syncer.merge_rule,
                grace_gamma=config.quorum.grace_gamma, grace_cap_s=config.quorum.grace_cap_s,
                outer_gradient=config.syncer.outer_gradient,
                round_step=config.syncer.round_step,
                staleness_share=config.syncer.staleness_share,
                schedule_clock=config.syncer.schedule_clock,
                round_wait=config.syncer.round_wait)


def decomposition(m: int, defaults: dict) -> list[tuple[str, str, dict, bool]]:
    """(key, label, run_ours settings, every seed?) for each DiLoCo row."""
    fp32 = dict(codec="none", downlink="none")
    int4 = dict(codec="int4", downlink="int4")
    old = dict(outer_kind="nesterov", outer_kwargs=dict(lr=outer_lib.DILOCO_OUTER_LR,
                                                        momentum=outer_lib.DILOCO_OUTER_MOMENTUM),
               carry_overlap=False, merge_alpha=0.0)
    return [
        ("sync", "synchronous DiLoCo (P=1, K=M, fp32, τ=0)",
         {**defaults, **fp32, "num_fragments": 1, "min_learners": m, "overlap_steps": 0}, False),
        ("streaming", f"streaming (P={FRAGMENTS}, K=M, fp32, τ=0)",
         {**defaults, **fp32, "min_learners": m, "overlap_steps": 0}, True),
        ("overlap", "+ overlap τ=2", {**defaults, **fp32, "min_learners": m, "overlap_steps": 2},
         False),
        ("int4", "+ int4 both ways", {**defaults, **int4, "min_learners": m, "overlap_steps": 2},
         False),
        ("product", "+ K=1 + grace (product)",
         {**defaults, **int4, "min_learners": 1, "overlap_steps": 2}, True),
        ("product_old", "product, old defaults (Nesterov 0.7/0.9, overwrite)",
         {**defaults, **int4, **old, "min_learners": 1, "overlap_steps": 2}, False),
        ("mixed", "product, mixed fleet (½ at 0.5×)",
         {**defaults, **int4, "min_learners": 1, "overlap_steps": 2, "mixed": True}, True),
    ]


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=3, help="seeds for the end points")
    args = p.parse_args()
    watch = C.Stopwatch()
    steps = args.steps or (240 if args.quick else 600)
    ids = [f"{r}:{i}" for r in REGIONS for i in range(2)]
    m = len(ids)
    defaults = user_defaults(m)
    rows_spec = decomposition(m, defaults)
    every = max(steps // 10, 1)
    seeds = [args.seed + k for k in range(args.seeds)]
    results: dict[str, dict[int, dict]] = {}   # key -> seed -> {loss, evals, ...}
    for seed in seeds:
        setup = C.make_setup(model_kwargs={}, num_learners=m, batch_size=8, total_steps=steps,
                             seed=seed)
        uniform = inprocess.Fleet([1.0] * m, step_time_s=1.0, latency_s=0.05,
                                  bandwidth_bytes_per_s=1e9 / 8, seed=seed)
        mixed = inprocess.Fleet([1.0, 0.5] * (m // 2), step_time_s=1.0, step_noise=0.1,
                                latency_s=0.05, bandwidth_bytes_per_s=1e9 / 8, seed=seed)
        dp = C.run_dp(setup, learner_ids=ids, fleet=uniform, steps=steps, eval_every_steps=every,
                      checkpoint_every_steps=10 ** 9)
        results.setdefault("dp", {})[seed] = {"loss": dp.evals[-1][2], "evals": dp.evals,
                                              "tokens": dp.tokens}
        print(f"seed {seed}: data-parallel {dp.evals[-1][2]:.4f} ({watch()} s)", flush=True)
        for key, label, kw, every_seed in rows_spec:
            if not every_seed and seed != seeds[0]:
                continue
            kw = dict(kw)
            fleet = mixed if kw.pop("mixed", False) else uniform
            if fleet is mixed:   # trains for the time in which the fleet processes the budget
                kw.update(until_s=m * steps * mixed.step_time_s / sum(mixed.speed_factors),
                          steps=10 ** 9)
            else:
                kw["steps"] = steps
            rec = C.run_ours(setup, learner_ids=ids, fleet=fleet, num_fragments=kw.pop(
                "num_fragments", FRAGMENTS), sync_every_steps=SYNC_EVERY,
                eval_every_steps=every, **kw)
            results.setdefault(key, {})[seed] = {
                "loss": rec.evals[-1][2], "evals": rec.evals, "tokens": rec.tokens_processed,
                "goodput": rec.goodput, "merges": len(rec.merges),
                "mean_merge_size": float(np.mean([len(mg.learners) for mg in rec.merges]))}
            print(f"seed {seed}: {label} {rec.evals[-1][2]:.4f} ({watch()} s)", flush=True)

    def gaps(key, against="dp"):
        return [(results[key][s]["loss"] - results[against][s]["loss"])
                / results[against][s]["loss"] for s in results[key] if s in results[against]]

    def spread(values):
        return {"mean": float(np.mean(values)), "min": float(np.min(values)),
                "max": float(np.max(values)), "n": len(values)}

    labels = {"dp": "data-parallel", **{k: label for k, label, _, _ in rows_spec}}
    rows = []
    for key in ["dp"] + [k for k, _, _, _ in rows_spec]:
        losses = [r["loss"] for r in results[key].values()]
        g = gaps(key)
        rows.append({"run": labels[key], "seeds": len(losses), "eval_loss": float(np.mean(losses)),
                     "gap_vs_dp": float(np.mean(g)), "gap_min": float(np.min(g)),
                     "gap_max": float(np.max(g)),
                     "goodput": float(np.mean([r.get("goodput", 1.0)
                                               for r in results[key].values()]))})
    print(C.table(rows, ["run", "seeds", "eval_loss", "gap_vs_dp", "gap_min", "gap_max",
                         "goodput"]))
    product_gap = spread(gaps("product"))
    streaming_gap = spread(gaps("streaming"))
    decoupling_gap = spread(gaps("product", against="streaming"))
    # per token: the mixed fleet's loss against the uniform fleet's at the same token budget
    mixed_vs_uniform = spread(gaps("mixed", against="product"))
    mean_loss = lambda key: float(np.mean([r["loss"] for r in results[key].values()]))  # noqa
    png = plot(args.out, results, labels, steps)
    result = {
        "benchmark": "quality", "quick": args.quick, "steps_per_learner": steps,
        "learners": m, "seeds": seeds,
        "dp_loss": mean_loss("dp"), "product_loss": mean_loss("product"),
        "streaming_loss": mean_loss("streaming"),
        "product_gap": product_gap["mean"], "streaming_gap": streaming_gap["mean"],
        "decoupling_gap": decoupling_gap["mean"], "mixed_vs_uniform": mixed_vs_uniform["mean"],
        "spread": {"product_gap": product_gap, "streaming_gap": streaming_gap,
                   "decoupling_gap": decoupling_gap, "mixed_vs_uniform": mixed_vs_uniform},
        "rows": rows,
        "goals": {"product_within_2pct_of_dp": product_gap["mean"] <= GOAL_PRODUCT_GAP,
                  "product_within_1pct_of_streaming": decoupling_gap["mean"] <= GOAL_DECOUPLING_GAP,
                  "mixed_within_1pct_of_uniform": mixed_vs_uniform["mean"] <= GOAL_MIXED},
        "defaults": {k: v for k, v in defaults.items()},
        "settings": {"fragments": FRAGMENTS, "sync_every_steps": SYNC_EVERY, "batch_size": 8,
                     "mixed_speeds": [1.0, 0.5] * (m // 2), "step_noise": 0.1,
                     "inner": "adamw lr 3e-3, warmup 20, cosine to lr/10 at the last step"},
        "runtime_s": watch(), "png": png, "machine": C.machine(),
    }
    C.finish("quality", result, args.out)


def plot(out_dir, results, labels, steps) -> str:
    plt = C.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"dp": "k", "sync": "tab:gray", "streaming": "tab:blue", "overlap": "tab:cyan",
              "int4": "tab:green", "product": "tab:red", "product_old": "tab:brown",
              "mixed": "tab:purple"}
    seed0 = min(results["dp"])
    finals = []
    for key, by_seed in results.items():
        evals = by_seed[seed0]["evals"]
        xs = [t / 1e6 for _, t, _ in evals]
        ys = [loss for _, _, loss in evals]
        finals.append(ys[-1])
        style = dict(color=colors.get(key, "tab:olive"), lw=2 if key in ("dp", "product") else 1.3,
                     marker="o", ms=2.5, ls="--" if key in ("product_old", "mixed") else "-")
        for ax in (ax1, ax2):
            ax.plot(xs, ys, label=labels[key], **style)
    ax1.set_xlabel("tokens in the model (millions)")
    ax1.set_ylabel("held-out loss (nats/byte)")
    ax1.set_title(f"Eval loss vs tokens (seed {seed0})")
    ax1.legend(fontsize=7.5)
    lo, hi = min(finals), max(finals)
    ax2.set_ylim(lo - 0.15 * (hi - lo + 0.02), hi + 0.5 * (hi - lo + 0.02))
    xmax = max(t for _, t, _ in results["dp"][seed0]["evals"]) / 1e6
    ax2.set_xlim(xmax / 2, xmax * 1.02)
    ax2.set_xlabel("tokens in the model (millions)")
    ax2.set_title("Second half, zoomed")
    fig.suptitle(f"Where the gap to data-parallel comes from (4 learners, 4 × {steps} batches "
                 "of 8, no failures)", fontsize=11)
    fig.tight_layout()
    return C.save_figure(fig, out_dir, "quality.png")


if __name__ == "__main__":
    main()
