"""Regional pre-merge against the flat link with the timing taken out
(``islands.studies.lockstep``): one region's L learners step in lockstep, so every round holds
every learner both ways, over a real gRPC link to a real ``SyncerCore``; nf2 both ways (the job's
defaults). Per seed: the flat run, the pre-merged run, and the flat run again from initial
parameters perturbed by 1e-6 (``--floor``) — how far this small model's final loss moves on its
own, the floor under which one seed cannot tell pre-merge from flat. The runs are deterministic:
the same command gives the same losses on the same machine.

    python benchmarks/premerge_lockstep.py [--quick] [--seeds N] [--sizes 2 4] [--floor]
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import finish, machine, parser, pyplot, save_figure, table  # noqa: E402

from islands.studies.lockstep import train_region  # noqa: E402

PERTURBATION = 1e-6


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, default=8, help="seeds seed, seed+1, ...")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4],
                   help="learners per region to run (L)")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--floor", action="store_true",
                   help="also the flat run from initial parameters perturbed by 1e-6")
    args = p.parse_args()
    steps, seeds = (48, min(args.seeds, 2)) if args.quick else (args.steps, args.seeds)
    runs = []
    for learners in args.sizes:
        for seed in range(args.seed, args.seed + seeds):
            flat = train_region(learners, False, seed, steps=steps)
            pm = train_region(learners, True, seed, steps=steps)
            row = {"learners": learners, "seed": seed, "flat_loss": flat["loss"],
                   "premerge_loss": pm["loss"], "premerge_vs_flat": pm["loss"] / flat["loss"] - 1,
                   "up_vs_flat": pm["up"] / flat["up"], "down_vs_flat": pm["down"] / flat["down"],
                   "flat_up_B_per_token": flat["up"], "premerge_up_B_per_token": pm["up"],
                   "groups": pm["premerge"]["groups"], "merges": pm["merges"]}
            if args.floor:
                moved = train_region(learners, False, seed, steps=steps, init_noise=PERTURBATION)
                row["perturbed_flat_loss"] = moved["loss"]
                row["perturbed_vs_flat"] = moved["loss"] / flat["loss"] - 1
            runs.append(row)
            print(table([row], list(row)), flush=True)
    columns = ["learners", "seed", "flat_loss", "premerge_loss", "premerge_vs_flat",
               "perturbed_vs_flat", "up_vs_flat", "down_vs_flat"]
    print(table(runs, columns))
    summary = []
    for learners in args.sizes:
        sel = [r for r in runs if r["learners"] == learners]
        row = {"learners": learners, "seeds": len(sel)}
        for key in ("premerge_vs_flat", "perturbed_vs_flat", "up_vs_flat", "down_vs_flat"):
            if key in sel[0]:
                values = [r[key] for r in sel]
                row[f"{key}_mean"] = statistics.mean(values)
                row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
        summary.append(row)
    print(table(summary, list(summary[0])))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for k, learners in enumerate(args.sizes):
        sel = [r for r in runs if r["learners"] == learners]
        ax.scatter([k - 0.1] * len(sel), [100 * r["premerge_vs_flat"] for r in sel],
                   label="pre-merge vs flat" if k == 0 else None, color="C0")
        if args.floor:
            ax.scatter([k + 0.1] * len(sel), [100 * r["perturbed_vs_flat"] for r in sel],
                       label="flat, init + 1e-6 noise, vs flat" if k == 0 else None, color="C1")
    ax.axhline(0, color="gray", lw=0.5)
    for bound in (-1, 1):
        ax.axhline(bound, color="gray", lw=0.5, ls=":")
    ax.set_xticks(range(len(args.sizes)), [f"L = {n}" for n in args.sizes])
    ax.set_ylabel("final eval loss vs flat (%)")
    ax.legend(fontsize=8)
    fig.suptitle(f"Pre-merge in lockstep, nf2 both ways, {steps} steps, {seeds} seeds")
    fig.tight_layout()
    name = "premerge_lockstep" + ("_quick" if args.quick else "")
    save_figure(fig, args.out, f"{name}.png")
    finish(name, {"benchmark": "premerge_lockstep", "steps": steps, "runs": runs,
                  "summary": summary, "machine": machine()}, args.out)


if __name__ == "__main__":
    main()
