"""Quality under asynchrony (issue 34): a fleet whose learners drift out of phase against one that
steps in lockstep, with today's merge and schedule rules and with the asynchrony-correct ones.

The harness of ``quality.py`` and ``mixed_fleet.py`` (4 learners, the tiny model, equal tokens,
the product's settings: P = 12, H = 24, τ = 2, int4 both ways; in-process, virtual clock, real
JAX; deterministic: a seed repeats to the digit). Three fleets:

* ``lockstep``: four equal learners without step-time noise (every round's pushes arrive
  together: ``quality.py``'s uniform fleet);
* ``noisy``: the same four with ±10 % step-time noise (their phases drift apart);
* ``mixed``: half the learners at 0.5× speed, ±10 % noise, trained for the virtual time in which
  the fleet processes the same token budget,

each at K = 1 (the product's quorum, with the grace window) and K = M, each with rule sets
(``--rules``):

* ``today``: g = Θ − (base + δ), an outer step per partial merge, schedule on each learner's
  own steps (the rules before issue 34);
* ``rebased``, ``round``, ``share``, ``fleet``: one change each (``syncer.outer_gradient:
  rebased``; ``syncer.round_step: per_round``; ``syncer.staleness_share: 1``;
  ``syncer.schedule_clock: fleet``);
* ``rebased_fleet``, ``round_fleet``, ``all`` (rebased + per_round + fleet): together;
* ``wait25``, ``wait50``, ``wait100``: ``all`` with the round-completion wait
  (``syncer.round_wait`` 0.25, 0.5, 1: a partial merge is held for the round's learners due
  within that share of a period; 0.5 is the default);
* ``defaults``: what JobConfig gives today (the chosen rules, once they won).

Plus data-parallel and synchronous one-fragment DiLoCo (P = 1, K = M, fp32, τ = 0), each with
``today`` and ``defaults``. Gaps: eval loss above the lockstep fleet with the same rules and K
(``gap_*``; where the lockstep fleet ran at K = 1 only, as in ``--quick``, against that: its
rounds merge whole at either K), above data-parallel, and above synchronous DiLoCo, as
fractions of the same seed's.

    python benchmarks/asynchrony.py --quick     # 240 steps, defaults only, 2 seeds: 5-12 min
    python benchmarks/asynchrony.py             # 1000 steps, today and defaults, 3 seeds
    python benchmarks/asynchrony.py --fleets noisy --quorums 1 --rules today rebased round \\
        fleet all --seeds 1 --name asynchrony_ablation     # one change at a time
    python benchmarks/asynchrony.py --model-size medium --fleets lockstep --quorums 1 \\
        --rules defaults --name asynchrony_medium         # the product row on a larger model

``--jobs N`` runs N trainings at once (separate processes). ``--ablation RULES`` adds those
rule sets on the noisy and the mixed fleet at K = 1, first seed only (``ablation_<fleet>_k1_
seed<S>``: {rules: loss}). Prints a table, then one JSON object as the last line; writes
``<name>.png`` and ``<name>.json``. Its headline keys (``HEADLINE_KEYS``, what BENCHMARKS.md
quotes): ``gap_<fleet>_k1`` / ``_km`` for the defaults (the 3-seed mean of eval loss over the
lockstep fleet's, minus 1), ``gap_<fleet>_k<K>_worst`` (the worst seed), and
``gap_<fleet>_k<K>_<rules>`` for every other rule set (``_today``: the earlier rules).

``benchmarks/results/asynchrony_1000.json`` is one run of ``REGENERATE`` (below).
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os

import _common as C
import numpy as np

RULES = {
    "today": dict(outer_gradient="pull", round_step="per_merge", staleness_share=0.0,
                  schedule_clock="learner", round_wait=0.0),
    "rebased": dict(outer_gradient="rebased", round_step="per_merge", staleness_share=0.0,
                    schedule_clock="learner", round_wait=0.0),
    "round": dict(outer_gradient="pull", round_step="per_round", staleness_share=0.0,
                  schedule_clock="learner", round_wait=0.0),
    "share": dict(outer_gradient="pull", round_step="per_merge", staleness_share=1.0,
                  schedule_clock="learner", round_wait=0.0),
    "fleet": dict(outer_gradient="pull", round_step="per_merge", staleness_share=0.0,
                  schedule_clock="fleet", round_wait=0.0),
    "rebased_fleet": dict(outer_gradient="rebased", round_step="per_merge",
                          staleness_share=0.0, schedule_clock="fleet", round_wait=0.0),
    "round_fleet": dict(outer_gradient="pull", round_step="per_round", staleness_share=0.0,
                        schedule_clock="fleet", round_wait=0.0),
    "rebased_round": dict(outer_gradient="rebased", round_step="per_round",
                          staleness_share=0.0, schedule_clock="learner", round_wait=0.0),
    "all": dict(outer_gradient="rebased", round_step="per_round", staleness_share=0.0,
                schedule_clock="fleet", round_wait=0.0),
    "all_share": dict(outer_gradient="rebased", round_step="per_round", staleness_share=1.0,
                      schedule_clock="fleet", round_wait=0.0),
    # round-completion wait (syncer.round_wait): the chosen rules, holding a partial merge for
    # the round's learners due within this share of a sync period
    "wait25": dict(outer_gradient="rebased", round_step="per_round", staleness_share=0.0,
                   schedule_clock="fleet", round_wait=0.25),
    "wait50": dict(outer_gradient="rebased", round_step="per_round", staleness_share=0.0,
                   schedule_clock="fleet", round_wait=0.5),
    "wait100": dict(outer_gradient="rebased", round_step="per_round", staleness_share=0.0,
                    schedule_clock="fleet", round_wait=1.0),
    "defaults": None,   # JobConfig's (quality.user_defaults)
}
FLEETS = {"lockstep": ([1.0, 1.0, 1.0, 1.0], 0.0), "noisy": ([1.0, 1.0, 1.0, 1.0], 0.1),
          "mixed": ([1.0, 0.5, 1.0, 0.5], 0.1)}
MODEL_SIZES = {   # --model-size: ModelConfig kwargs ({} is the tiny default, 119k parameters)
    "tiny": {},
    "medium": dict(d_model=128, n_layers=4, n_heads=4, d_ff=512),
}
_SETUPS: dict = {}
# The one command behind benchmarks/results/asynchrony_1000.{json,png}: every figure of
# BENCHMARKS.md's "Quality under asynchrony" section and the ablation of benchmarks/NOTES.md.
ABLATION = ["rebased", "round", "fleet", "rebased_fleet", "rebased_round", "all", "all_share",
            "wait25", "wait100"]
REGENERATE = ("python benchmarks/asynchrony.py --steps 1000 --seeds 3 --rules today defaults "
              "--ablation " + " ".join(ABLATION) + " --jobs 2 --name asynchrony_1000 "
              "--out benchmarks/results")
# What a consumer reads (tests/unit/test_asynchrony_bench.py checks a run has them).
HEADLINE_KEYS = ("gap_noisy_k1", "gap_mixed_k1", "gap_noisy_k1_worst", "gap_mixed_k1_worst",
                 "gap_noisy_k1_today", "gap_mixed_k1_today")


def run_one(job: dict) -> dict:
    """One training run (in a worker process with ``--jobs``): returns its final eval loss."""
    from islands.orchestrator import inprocess
    from quality import FRAGMENTS, SYNC_EVERY, user_defaults

    kind, seed, steps, m = job["kind"], job["seed"], job["steps"], 4
    ids = [f"{r}:{i}" for r in ("us-east", "eu-west") for i in range(2)]
    key = (job["model"], steps, seed)
    if key not in _SETUPS:   # one per model and seed: its jitted step compiles once
        _SETUPS[key] = C.make_setup(model_kwargs=MODEL_SIZES[job["model"]], num_learners=m,
                                    batch_size=8, total_steps=steps, seed=seed)
    setup = _SETUPS[key]
    every = max(steps // 10, 1)
    if kind == "dp":
        fleet = inprocess.Fleet([1.0] * m, step_time_s=1.0, latency_s=0.05,
                                bandwidth_bytes_per_s=1e9 / 8, seed=seed)
        rec = C.run_dp(setup, learner_ids=ids, fleet=fleet, steps=steps, eval_every_steps=every,
                       checkpoint_every_steps=10 ** 9)
        return {**job, "loss": rec.evals[-1][2], "params": setup.num_params}
    rules = RULES[job["rules"]]
    settings = {**user_defaults(m), **(rules or {})}
    speeds, noise = FLEETS[job["fleet"]]
    fleet = inprocess.Fleet(speeds, step_time_s=1.0, step_noise=noise, latency_s=0.05,
                            bandwidth_bytes_per_s=1e9 / 8, seed=seed)
    length = ({"steps": steps} if job["fleet"] != "mixed" else
              {"steps": 10 ** 9, "until_s": m * steps * fleet.step_time_s / sum(speeds)})
    if kind == "sync":
        settings.update(codec="none", downlink="none", min_learners=m, overlap_steps=0)
        fragments = 1
    else:
        settings.update(codec="int4", downlink="int4", overlap_steps=2,
                        min_learners=1 if job["k"] == 1 else m)
        fragments = FRAGMENTS
    rec = C.run_ours(setup, learner_ids=ids, fleet=fleet, num_fragments=fragments,
                     sync_every_steps=SYNC_EVERY, eval_every_steps=every, **settings, **length)
    staleness = [s for mg in rec.merges for s in mg.staleness]
    return {**job, "loss": rec.evals[-1][2], "merges": len(rec.merges),
            "mean_staleness": float(np.mean(staleness)) if staleness else 0.0,
            "joined": int(sum(getattr(mg, "joined", 0) for mg in rec.merges)),
            "evals": rec.evals, "params": setup.num_params}


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=None, help="default 3 (--quick: 2)")
    p.add_argument("--rules", nargs="+", default=None,
                   help=f"rule sets (default: today defaults; --quick: defaults): {list(RULES)}")
    p.add_argument("--fleets", nargs="+", default=None, choices=list(FLEETS))
    p.add_argument("--quorums", nargs="+", default=None, choices=["1", "M"],
                   help="K = 1 and/or K = M (default both; --quick: 1, and M for noisy)")
    p.add_argument("--no-references", action="store_true",
                   help="skip data-parallel and synchronous DiLoCo")
    p.add_argument("--model-size", default="tiny", choices=list(MODEL_SIZES))
    p.add_argument("--ablation", nargs="*", default=[], choices=list(RULES),
                   help="rule sets also run on the noisy and mixed fleets at K = 1, first seed")
    p.add_argument("--jobs", type=int, default=1, help="trainings at once (processes)")
    p.add_argument("--name", default="asynchrony")
    args = p.parse_args()
    watch = C.Stopwatch()
    steps, seeds, rules, fleets, jobs = plan(args)
    print(f"{len(jobs)} runs, {args.jobs} at once", flush=True)
    done = []
    if args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            for out in pool.map(run_one, jobs):
                done.append(out)
                _say(out, watch)
    else:
        for job in jobs:
            done.append(run_one(job))
            _say(done[-1], watch)
    result = summarize(done, seeds, rules, fleets, steps, args)
    result.update(runtime_s=watch(), machine=C.machine(),
                  png=plot(args.out, args.name, done, seeds[0], steps))
    C.finish(args.name, result, args.out)


def plan(args) -> tuple:
    """``(steps, seeds, rules, fleets, jobs)``: every training of the run, each once."""
    steps = args.steps or (240 if args.quick else 1000)
    rules = args.rules or (["defaults"] if args.quick else ["today", "defaults"])
    fleets = args.fleets or list(FLEETS)
    seeds = list(range(args.seed, args.seed + (args.seeds or (2 if args.quick else 3))))
    jobs = []
    for seed in seeds:
        base = {"seed": seed, "steps": steps, "model": args.model_size}
        if not args.no_references and not args.quick:
            jobs.append({**base, "kind": "dp", "fleet": "lockstep", "k": "M", "rules": "-"})
            for r in rules:
                jobs.append({**base, "kind": "sync", "fleet": "lockstep", "k": "M", "rules": r})
        for r in rules:
            for f in fleets:
                quorums = args.quorums or (["1", "M"] if not args.quick or f == "noisy"
                                           else ["1"])
                for k in quorums:
                    jobs.append({**base, "kind": "ours", "fleet": f, "k": 1 if k == "1" else "M",
                                 "rules": r})
    base = {"seed": seeds[0], "steps": steps, "model": args.model_size, "kind": "ours", "k": 1}
    for r in getattr(args, "ablation", None) or []:
        for f in ("noisy", "mixed"):
            job = {**base, "fleet": f, "rules": r}
            if job not in jobs:
                jobs.append(job)
    return steps, seeds, rules, fleets, jobs


def _say(out: dict, watch) -> None:
    print(f"seed {out['seed']} {out['kind']} {out['fleet']} K={out['k']} {out['rules']}: "
          f"{out['loss']:.4f} (merges {out.get('merges', '-')}, staleness "
          f"{out.get('mean_staleness', 0):.2f}, joined {out.get('joined', 0)}; {watch()} s)",
          flush=True)


def summarize(done, seeds, rules, fleets, steps, args) -> dict:
    loss = {}
    for out in done:
        loss[(out["kind"], out["fleet"], str(out["k"]), out["rules"], out["seed"])] = out["loss"]

    def gap(key, ref):
        g = [loss[key + (s,)] / loss[ref + (s,)] - 1 for s in seeds
             if key + (s,) in loss and ref + (s,) in loss]
        return (float(np.mean(g)), float(np.min(g)), float(np.max(g))) if g else None

    rows, out = [], {}
    for r in rules:
        for f in fleets:
            for k in ("1", "M"):
                key = ("ours", f, k, r)
                if key + (seeds[0],) not in loss:
                    continue
                row = {"fleet": f, "K": k, "rules": r,
                       "eval_loss": float(np.mean([loss[key + (s,)] for s in seeds])),
                       "per_seed": [loss.get(key + (s,)) for s in seeds]}
                lockstep = ("ours", "lockstep", k, r)
                if lockstep + (seeds[0],) not in loss:   # lockstep rounds merge whole: K = M
                    lockstep = ("ours", "lockstep", "1", r)   # merges as K = 1 does
                for name, ref in (("vs_lockstep", lockstep),
                                  ("vs_lockstep_today", ("ours", "lockstep", k, "today")),
                                  ("vs_dp", ("dp", "lockstep", "M", "-")),
                                  ("vs_sync", ("sync", "lockstep", "M", r))):
                    g = gap(key, ref)
                    if g is not None and ref != key:
                        row[name], row[name + "_min"], row[name + "_max"] = g
                rows.append(row)
                if "vs_lockstep" in row:
                    name = f"gap_{f}_k{'1' if k == '1' else 'm'}"
                    if r == "defaults":
                        out[name], out[name + "_worst"] = row["vs_lockstep"], row["vs_lockstep_max"]
                    else:
                        out[f"{name}_{r}"] = row["vs_lockstep"]
        key = ("sync", "lockstep", "M", r)
        if key + (seeds[0],) in loss:
            row = {"fleet": "sync DiLoCo (P=1, K=M, fp32, τ=0)", "K": "M", "rules": r,
                   "eval_loss": float(np.mean([loss[key + (s,)] for s in seeds])),
                   "per_seed": [loss.get(key + (s,)) for s in seeds]}
            g = gap(key, ("dp", "lockstep", "M", "-"))
            if g is not None:
                row["vs_dp"], row["vs_dp_min"], row["vs_dp_max"] = g
            rows.append(row)
    if ("dp", "lockstep", "M", "-", seeds[0]) in loss:
        rows.append({"fleet": "data-parallel", "K": "-", "rules": "-",
                     "eval_loss": float(np.mean([loss[("dp", "lockstep", "M", "-", s)]
                                                 for s in seeds]))})
    print(C.table(rows, ["fleet", "K", "rules", "eval_loss", "vs_lockstep", "vs_lockstep_today",
                         "vs_dp", "vs_sync"]))
    for r in rules:   # the product (lockstep, K = 1) against synchronous DiLoCo, per rule set
        g = gap(("ours", "lockstep", "1", r), ("sync", "lockstep", "M", r))
        if g is not None:
            out[f"product_vs_sync_{r}"] = g[0]
        g = gap(("ours", "lockstep", "1", r), ("dp", "lockstep", "M", "-"))
        if g is not None:
            out[f"product_vs_dp_{r}"] = g[0]
    for f in ("noisy", "mixed"):   # --ablation: every rule set run on this fleet at the first seed
        ablation = {o["rules"]: o["loss"] for o in done if o["kind"] == "ours"
                    and o["fleet"] == f and o["k"] == 1 and o["seed"] == seeds[0]}
        if getattr(args, "ablation", None) and ablation:
            out[f"ablation_{f}_k1_seed{seeds[0]}"] = ablation
    params = next((o["params"] for o in done if "params" in o), None)
    return {"benchmark": "asynchrony", "quick": args.quick, "steps_per_learner": steps,
            "seeds": seeds, "rules": rule_settings({o["rules"] for o in done}),
            "model_size": args.model_size,
            "model_params": params, "rows": rows,
            "runs": [{k: v for k, v in o.items() if k != "evals"} for o in done], **out}


def rule_settings(names) -> dict:
    """{rule set: its settings} of the rule sets run, ``defaults`` resolved to what JobConfig
    gave this run (so the file names the rules its figures ran with)."""
    from quality import user_defaults

    defaults = user_defaults(4)
    return {r: RULES[r] if RULES[r] is not None else {k: defaults[k] for k in RULES["today"]}
            for r in RULES if r in names}


def plot(out_dir, name, done, seed, steps) -> str:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = {"lockstep": "-", "noisy": "--", "mixed": ":"}
    colors = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown",
              "tab:gray", "tab:olive", "tab:cyan", "k", "tab:pink"]
    rule_color = {}
    for out in done:
        if out["seed"] != seed or "evals" not in out or out["kind"] != "ours":
            continue
        color = rule_color.setdefault(out["rules"], colors[len(rule_color) % len(colors)])
        ax.plot([t / 1e6 for _, t, _ in out["evals"]], [x for _, _, x in out["evals"]],
                ls=styles[out["fleet"]], color=color, lw=1.2 if out["k"] == 1 else 0.6,
                label=f"{out['fleet']} K={out['k']} {out['rules']}")
    ax.set_xlabel("tokens in the model (millions)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"Asynchrony: eval loss vs tokens (seed {seed}, {steps} steps; thin: K = M)")
    finals = [o["loss"] for o in done]
    if finals:
        ax.set_ylim(min(finals) - 0.1, min(finals) + 1.0)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return C.save_figure(fig, out_dir, f"{name}.png")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
