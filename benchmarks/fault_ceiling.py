"""The most goodput a seeded fault plan leaves, however fast the recovery (issue 35, part 1).

The README demo (``deploy/examples/local.yaml``: 2 regions × 2 learners) for ``--duration``
seconds under ``chaos: {seed, mtbf_s, repair_s, region_mtbf_s}`` with ``--spares`` warm spares
per region. For each seed it replays the plan ``islands run`` fires (``build.chaos_plan``) and
charges every failure the least it can cost:

  a learner kill     ``--promote-s``: the fastest recovery measured from a ready spare (failure
                     → the learner training again, 0.6 s), as if a ready spare were always there;
  a region loss      the repair (``repair_s``) plus ``--promote-s`` for each of its live
                     learners: its spares go with its nodes, as the chaos's region loss takes
                     them. ``--spares-survive`` charges only ``--promote-s`` for as many victims as
                     the region has spares (the chaos before it took spares).

A learner that is down is not failed again (the drivers skip such a fault). The ceiling on the
faulted run's goodput as a fraction of the fault-free run's is 1 − lost ÷ (learners × duration):
every lost learner-second is a second of a slot that applies nothing.

    python benchmarks/fault_ceiling.py                  # seeds 0-199, the demo's faults
    python benchmarks/fault_ceiling.py --spares-survive

Prints a table, then one JSON object as the last line; writes fault-ceiling.png and
fault_ceiling.json to ``--out``.
"""

from __future__ import annotations

import os
import statistics

import _common as C
import yaml

from islands.orchestrator import build
from islands.orchestrator.chaos import FaultKind
from islands.orchestrator.config import parse

DEMO = os.path.join(os.path.dirname(C.BENCH_DIR), "deploy", "examples", "local.yaml")
GOAL = 0.97


def demo_config(seed: int, duration_s: float, mtbf_s: float, repair_s: float,
                region_mtbf_s: float, spares: int):
    raw = yaml.safe_load(open(DEMO))
    raw["chaos"] = {"seed": seed, "mtbf_s": mtbf_s, "repair_s": repair_s,
                    "region_mtbf_s": region_mtbf_s}
    raw["run"]["duration_s"] = duration_s
    raw["health"]["spares"] = spares
    return parse(raw)


def least_lost_s(faults, regions: dict, spares: int, promote_s: float,
                 spares_survive: bool) -> tuple[float, dict]:
    """Learner-seconds the plan's failures cost at the least, and how many of each kind hit.

    >>> from islands.faults import Fault
    >>> plan = [Fault(1.0, FaultKind.KILL, "a:0", 5.0),
    ...         Fault(1.2, FaultKind.KILL, "a:0", 5.0),          # still down: not failed again
    ...         Fault(10.0, FaultKind.REGION_LOSS, "a", 5.0)]     # 2 live: 1 spare, 1 repair
    >>> least_lost_s(plan, {"a": ["a:0", "a:1"]}, 1, 0.5, False)    # the spare died too
    (11.5, {'kills': 1, 'region_victims': 2})
    >>> least_lost_s(plan, {"a": ["a:0", "a:1"]}, 1, 0.5, True)[0]
    6.5
    """
    down_until: dict[str, float] = {}
    lost, hits = 0.0, {"kills": 0, "region_victims": 0}
    for fault in sorted(faults, key=lambda f: f.at_s):
        t = fault.at_s
        if fault.kind in (FaultKind.KILL, FaultKind.EXIT):
            if down_until.get(fault.target, -1.0) > t:
                continue
            lost += promote_s
            down_until[fault.target] = t + promote_s
            hits["kills"] += 1
        elif fault.kind == FaultKind.REGION_LOSS:
            victims = [name for name in regions[fault.target] if down_until.get(name, -1.0) <= t]
            for k, name in enumerate(victims):
                cost = promote_s if (k < spares and spares_survive) else fault.duration_s + promote_s
                lost += cost
                down_until[name] = t + cost
            hits["region_victims"] += len(victims)
    return lost, hits


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--mtbf", type=float, default=60.0)
    p.add_argument("--repair", type=float, default=5.0)
    p.add_argument("--region-mtbf", type=float, default=240.0)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--promote-s", type=float, default=0.6)
    p.add_argument("--spares-survive", action="store_true")
    args = p.parse_args()

    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        config = demo_config(seed, args.duration, args.mtbf, args.repair, args.region_mtbf,
                             args.spares)
        regions = {name: [f"{name}:{i}" for i in range(r.learners)]
                   for name, r in config.regions.items()}
        slots = sum(len(v) for v in regions.values())
        lost, hits = least_lost_s(build.chaos_plan(config).faults, regions, args.spares,
                                  args.promote_s, args.spares_survive)
        rows.append({"seed": seed, **hits, "lost_s": lost,
                     "ceiling": 1.0 - lost / (slots * args.duration)})
    ceilings = [r["ceiling"] for r in rows]
    print(C.table(rows[:10], ["seed", "kills", "region_victims", "lost_s", "ceiling"]))
    summary = {
        "seeds": len(rows), "seed_0": rows[0], "mean_ceiling": statistics.fmean(ceilings),
        "median_ceiling": statistics.median(ceilings), "min_ceiling": min(ceilings),
        "share_of_seeds_at_or_above_goal": sum(c >= GOAL for c in ceilings) / len(ceilings),
        "goal": GOAL}
    print(f"ceiling over {len(rows)} seeds: mean {summary['mean_ceiling']:.3f}, median "
          f"{summary['median_ceiling']:.3f}; {summary['share_of_seeds_at_or_above_goal']:.0%} "
          f"of seeds leave room for {GOAL}; seed {args.seed}: {rows[0]['ceiling']:.3f}")
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.hist(ceilings, bins=30, color="tab:blue")
    ax.axvline(GOAL, color="tab:red", linestyle="--", label=f"goal {GOAL}")
    ax.set_xlabel("ceiling on goodput ÷ fault-free goodput")
    ax.set_ylabel("seeds")
    ax.set_title(f"demo, {args.duration:.0f} s, MTBF {args.mtbf:.0f} s, region MTBF "
                 f"{args.region_mtbf:.0f} s, {args.spares} spare/region"
                 + (" (spares survive)" if args.spares_survive else ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    tag = "-spares-survive" if args.spares_survive else ""
    C.save_figure(fig, args.out, f"fault-ceiling{tag}.png")
    C.finish(f"fault_ceiling{tag.replace('-', '_')}",
             {"machine": C.machine(), "args": vars(args), **summary, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
