"""Scale: goodput of data-parallel and Decoupled DiLoCo at 150k–2.4M chips (docs/operations.md#scale-simulator simulator).

The failure model (chip MTBI, slice repair time, spare pool, reschedule delay) is pinned to public
figures; only the times no report gives (restart pause, checkpoint interval, elastic
reconfiguration) are calibrated, on the paper's two data-parallel rows. Decoupled DiLoCo for
M = 2, 4, 8, 16 is then predicted with the same times on the same seeded failure traces. The model
is described in ``islands.studies.simulate``.

    python benchmarks/scale.py --quick                # 6 000 slice failures per run, one seed
    python benchmarks/scale.py                        # 20 000 failures per run, two seeds
    python benchmarks/scale.py --sensitivity          # + every assumption x0.5 and x2

Prints the table (and with --sensitivity how every DiLoCo cell moves), then one JSON object as the
last line; writes scale.png (and scale_sensitivity.png) and scale.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from islands.studies import simulate as sim  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
LABELS = {"dp": "data-parallel", "dp_elastic": "data-parallel, elastic"}


def plot(study: sim.Study, path: str) -> None:
    """Goodput vs chips: a line per system, the paper's data-parallel targets as markers."""
    chips = list(study.table)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, system in enumerate(next(iter(study.table.values()))):
        label = LABELS.get(system, system.replace("diloco_", "Decoupled DiLoCo, M = "))
        line, = ax.plot(chips, [100 * study.table[c][system] for c in chips], marker=".",
                        label=label, linestyle="-" if system in LABELS else "--")
        if system in sim.PAPER_TARGETS:
            ax.scatter(chips, [100 * t for t in sim.PAPER_TARGETS[system]], marker="x", s=60,
                       color=line.get_color(), zorder=3,
                       label=f"paper Table 1 ({LABELS[system]})")
    tm = study.calibration.timings
    ax.set_xscale("log")
    ax.set_xticks(chips, [f"{c / 1e6:g}M" if c >= 1e6 else f"{c // 1000}k" for c in chips])
    ax.minorticks_off()
    ax.set_xlabel("chips (MTBI 1 year per chip, "
                  f"{study.config.slice_chips}-chip slices)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    fm = study.config.failure
    ax.set_title(f"pinned: repair {fm.repair_mean_s / 3600:.2f} h, reschedule {fm.reschedule_s:.0f} s; "
                 f"calibrated: restart {tm.restart_s:.0f} s, reconfig {tm.reconfig_s:.1f} s; "
                 f"fit rmse {study.calibration.rmse_pp:.2f} pp", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sensitivity(rows, path: str) -> None:
    """One panel per M: each assumption's x0.5 and x2 move of the DiLoCo cell, per chip count."""
    chips = list(rows[0].delta_pp)
    systems = list(rows[0].delta_pp[chips[0]])
    fig, axes = plt.subplots(1, len(systems), figsize=(3.2 * len(systems), 4.2), sharey=True)
    names = list(dict.fromkeys(r.assumption for r in rows))
    for ax, system in zip(axes, systems):
        for i, name in enumerate(names):
            for r in (r for r in rows if r.assumption == name):
                ax.plot(chips, [r.delta_pp[c][system] for c in chips], marker=".",
                        color=f"C{i}", linestyle="-" if r.factor < 1 else "--",
                        label=f"{name} x{r.factor:g}")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xscale("log")
        ax.set_xticks(chips, [f"{c / 1e6:g}M" if c >= 1e6 else f"{c // 1000}k" for c in chips])
        ax.minorticks_off()
        ax.set_title(system.replace("diloco_", "Decoupled DiLoCo, M = "), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput move (pp)")
    axes[-1].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_arguments(parser)
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for scale.png and scale.json")
    args = parser.parse_args(argv)
    try:
        config = sim.config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    t0 = time.perf_counter()
    study = sim.run_study(config)
    os.makedirs(args.out, exist_ok=True)
    png, record_path = os.path.join(args.out, "scale.png"), os.path.join(args.out, "scale.json")
    plot(study, png)
    record = {**sim.study_json(study), "quick": bool(args.quick), "png": png}
    rows = sim.sensitivity(study) if args.sensitivity else []
    if rows:
        record["sensitivity"] = sim.sensitivity_json(rows)
        record["sensitivity_png"] = os.path.join(args.out, "scale_sensitivity.png")
        plot_sensitivity(rows, record["sensitivity_png"])
        record["elapsed_s"] = round(time.perf_counter() - t0, 2)
    with open(record_path, "w") as f:
        json.dump(record, f, indent=2)
    print(sim.format_table(study))
    if rows:
        print(sim.format_sensitivity(rows))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
