"""Bandwidth: wire bytes per token of Decoupled DiLoCo (both directions) against the gradient
all-reduce of synchronous data-parallel at the same tokens, per codec pair and H, with the cost of
compression in eval loss (against the same configuration with both directions uncompressed).

4 learners (2 regions × 2) train the default tiny LM on the stdlib byte corpus in the in-process
harness (virtual clock, real JAX training on CPU), every run for the same steps per learner (equal
tokens). Bytes are exact counts:
* ours: every push's codec wire bytes (payload + block scales) plus every answer the syncer sends
  back (the merged fragment in fp32, or with an encoded downlink the codes of its difference to
  the learner's copy, syncer/downlink.py), over all learners, ÷ tokens processed;
* the baseline: what a ring all-reduce of fp32 gradients sends per learner per step,
  2(M−1)/M × 4 bytes × parameters, ÷ tokens per learner step (it receives as much again; that is not
  counted, while both of our directions are).
A codec is written ``kind`` or ``kind:block_size`` (``int2:128``); a row is ``up → down``.
The bandwidth each needs so that no step waits, at this machine's measured step time Δ: ours, one
fragment's push and reply within τ steps, ``(up_p + down_p) / (τΔ)`` for the largest fragment, and
no less than the sustained rate of each direction (every fragment once per H steps); the baseline,
the all-reduce within one step, ``ring bytes / Δ``.

    python benchmarks/bandwidth.py --quick     # 300 steps; H = 24 and 96
    python benchmarks/bandwidth.py             # 1 500 steps; H ∈ {8, 24, 96}
    python benchmarks/bandwidth.py --quick --pairs nf2:128/nf2:128 --hs 24 96   # chosen rows
    python benchmarks/bandwidth.py --task islands.tasks.flax_lm:task --pairs int4/none \
        nf2:64/nf2:256 --hs 24 96      # the Flax + Grain reference task instead of the LM

``--pairs`` replaces the rows with ``up/down`` pairs (the uncompressed reference is added first,
every H needs it); ``--hs`` chooses the H values.

Prints a table, then one JSON object as the last line; writes bandwidth.png and bandwidth.json.
"""

from __future__ import annotations

import time

import _common as C
import jax
import numpy as np

from islands.orchestrator import inprocess
from islands.studies import baseline
from islands.syncer import codec as codec_lib
from islands.syncer import fragments

GOAL_RATIO = {24: 250.0, 96: 1000.0}   # bytes per token below the ring all-reduce, by H
GOAL_GAP = 0.01                          # eval loss above the same run uncompressed
REFERENCE = ("none", "none")             # the uncompressed run each H is compared with
# (push codec, reply codec) per row; the reference first.
PAIRS = [REFERENCE, ("int4", "none"), ("int4", "int4"), ("int2:128", "int2:128"),
         ("int2:256", "int2:256"), ("nf2:128", "nf2:128"), ("nf2:64", "nf2:256")]
QUICK_PAIRS = {24: PAIRS, 96: [REFERENCE, ("int4", "int4"), ("int2:128", "int2:128"),
                               ("int2:256", "int2:256"), ("nf2:128", "nf2:128"),
                               ("nf2:64", "nf2:256")]}
REGIONS = ("us-east", "eu-west")
TAU = 2


def fragments_for(h: int, max_tensors: int) -> int:
    """P = H as in the paper where the model has enough tensors, else the most it allows."""
    return min(h, max_tensors)


def step_time_s(setup, reps: int = 30) -> float:
    """Median wall time of one bare train step on this machine (after compiling)."""
    params, state = setup.params, setup.optimizer.init(setup.params)
    batch = setup.batch_for(0, 0)
    params, state, loss = setup.train_step(params, state, batch)
    float(loss)
    times = []
    for k in range(reps):
        t0 = time.perf_counter()
        params, state, loss = setup.train_step(params, state, setup.batch_for(0, k + 1))
        float(loss)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def parse_codec(spec: str) -> tuple[str, int]:
    """``"int2:128"`` -> ("int2", 128); a kind alone takes the default block size."""
    kind, _, block = spec.partition(":")
    return kind, int(block) if block else codec_lib.DEFAULT_BLOCK_SIZE


def fragment_bytes(setup, plan, up_spec: str, down_spec: str) -> tuple[list[int], list[int]]:
    """Exact wire bytes of each fragment's push and (encoded or fp32) reply; sizes fix them."""
    up, down = [], []
    for p in range(plan.num_fragments):
        frag = {k: np.zeros(np.shape(v), np.float32)
                for k, v in fragments.extract(setup.params, plan, p).items()}
        sizes = []
        for spec in (up_spec, down_spec):
            codec = codec_lib.make_codec(*parse_codec(spec))
            sizes.append(codec_lib.tree_wire_bytes(codec_lib.to_numpy(
                codec_lib.encode_tree(codec, frag))))
        up.append(sizes[0])
        down.append(sizes[1])
    return up, down


def parse_pair(spec: str) -> tuple[str, str]:
    """``"nf2:128/int4"`` -> ("nf2:128", "int4"); each side must name a known codec."""
    up, sep, down = spec.partition("/")
    if not sep:
        raise ValueError(f"a pair is up/down, got {spec!r}")
    for side in (up, down):
        codec_lib.make_codec(*parse_codec(side))
    return up, down


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--pairs", nargs="+", default=None, metavar="UP/DOWN",
                   help="rows to run instead of the default ones, e.g. nf2:128/nf2:128 "
                        "(none/none, the reference, is always run first)")
    p.add_argument("--task", default=None, metavar="PATH",
                   help="train a Task instead of the default LM, e.g. islands.tasks.flax_lm:task "
                        "(the Flax + Grain reference task)")
    p.add_argument("--hs", nargs="+", type=int, default=None, metavar="H",
                   help="sync periods to run (default 24 96 with --quick, else 8 24 96)")
    args = p.parse_args()
    watch = C.Stopwatch()
    steps = args.steps or (300 if args.quick else 1500)
    hs = tuple(args.hs) if args.hs else ((24, 96) if args.quick else (8, 24, 96))
    if args.pairs:
        chosen = [parse_pair(s) for s in args.pairs]
        chosen = [REFERENCE] + [pair for pair in dict.fromkeys(chosen) if pair != REFERENCE]
        grid = [(up, down, h) for h in hs for up, down in chosen]
    else:
        grid = [(up, down, h) for h in hs for up, down in (QUICK_PAIRS.get(h, PAIRS)
                                                          if args.quick else PAIRS)]
    ids = [f"{r}:{i}" for r in REGIONS for i in range(2)]
    m = len(ids)
    setup = (C.task_setup(args.task, num_learners=m, total_steps=steps, seed=args.seed)
             if args.task else
             C.make_setup(model_kwargs={}, num_learners=m, batch_size=8, total_steps=steps,
                          seed=args.seed))
    n_tensors = len(jax.tree_util.tree_leaves(setup.params))
    fleet = inprocess.Fleet([1.0] * m, step_time_s=1.0, latency_s=0.05,
                            bandwidth_bytes_per_s=1e9 / 8, seed=args.seed)
    delta_s = step_time_s(setup)
    dp = C.run_dp(setup, learner_ids=ids, fleet=fleet, steps=steps,
                  checkpoint_every_steps=10 ** 9, eval_every_steps=max(steps // 10, 1))
    dp_loss = dp.evals[-1][2]
    ring = baseline.ring_allreduce_bytes(setup.num_params, m)
    dp_bpt = ring / setup.tokens_per_batch
    dp_need = ring / delta_s
    print(f"step time Δ = {delta_s * 1e3:.2f} ms; baseline {dp_bpt:.2f} B/token, "
          f"eval {dp_loss:.4f} ({watch()} s)", flush=True)

    rows, reference_loss = [], {}
    for up_spec, down_spec, h in grid:
        n_frag = fragments_for(h, n_tensors)
        (up_kind, up_block), (down_kind, down_block) = parse_codec(up_spec), parse_codec(down_spec)
        rec = C.run_ours(setup, learner_ids=ids, fleet=fleet, num_fragments=n_frag,
                         sync_every_steps=h, overlap_steps=TAU, codec=up_kind,
                         codec_block_size=up_block, downlink=down_kind,
                         downlink_block_size=down_block, steps=steps,
                         eval_every_steps=max(steps // 10, 1))
        loss = rec.evals[-1][2]
        if (up_spec, down_spec) == REFERENCE:
            reference_loss[h] = loss
        total = rec.wire_bytes_up + rec.wire_bytes_down
        bpt = total / rec.tokens_processed
        up, down = fragment_bytes(setup, fragments.partition(setup.params, n_frag), up_spec,
                                  down_spec)
        burst = max(u + d for u, d in zip(up, down)) / (TAU * delta_s)
        sustained = max(sum(up), sum(down)) / (h * delta_s)
        need = max(burst, sustained)
        rows.append({"codec": f"{up_spec} → {down_spec}", "up": up_spec, "down": down_spec,
                     "H": h, "P": n_frag, "bytes_per_token": bpt,
                     "bytes_per_token_ratio": dp_bpt / bpt,
                     "up_share": rec.wire_bytes_up / total, "eval_loss": loss,
                     "compression_loss_gap": (loss - reference_loss[h]) / reference_loss[h],
                     "eval_loss_gap": (loss - dp_loss) / dp_loss,
                     "need_gbps": need * 8 / 1e9, "need_ratio": dp_need / need,
                     "merges": len(rec.merges), "rejected": sum(rec.rejected.values()),
                     "wire_bytes_up": rec.wire_bytes_up, "wire_bytes_down": rec.wire_bytes_down,
                     "tokens": rec.tokens_processed,
                     "loss_curve": [(t, l) for _, t, l in rec.evals]})
        print(f"{up_spec} -> {down_spec} H={h} done ({watch()} s)", flush=True)
    cols = ["codec", "H", "P", "bytes_per_token", "bytes_per_token_ratio", "up_share",
            "eval_loss", "compression_loss_gap", "eval_loss_gap", "need_gbps", "need_ratio"]
    print(C.table([{"codec": "data-parallel", "H": 1, "P": "-", "bytes_per_token": dp_bpt,
                    "bytes_per_token_ratio": 1.0, "up_share": 0.5, "eval_loss": dp_loss,
                    "compression_loss_gap": 0.0, "eval_loss_gap": 0.0,
                    "need_gbps": dp_need * 8 / 1e9, "need_ratio": 1.0}] + rows, cols))

    def met(r) -> bool:
        return (r["H"] in GOAL_RATIO and r["bytes_per_token_ratio"] >= GOAL_RATIO[r["H"]]
                and r["compression_loss_gap"] <= GOAL_GAP)

    best = {h: max((r["bytes_per_token_ratio"] for r in rows
                    if r["H"] == h and r["compression_loss_gap"] <= GOAL_GAP), default=None)
            for h in hs}
    png = plot(args.out, rows, dp_bpt, dp_loss, dp_need, steps, delta_s * 1e3)
    result = {
        "benchmark": "bandwidth", "quick": args.quick, "steps_per_learner": steps, "learners": m,
        "rows": [{k: v for k, v in r.items() if k != "loss_curve"} for r in rows],
        "baseline": {"bytes_per_token": dp_bpt, "ring_bytes_per_learner_step": ring,
                     "eval_loss": dp_loss, "need_gbps": dp_need * 8 / 1e9,
                     "tokens": dp.tokens},
        "best_ratio_within_gap_by_h": best,
        "max_ratio": max(r["bytes_per_token_ratio"] for r in rows),
        "goals": {f"ratio_ge_{GOAL_RATIO[h]:.0f}_at_H{h}_gap_le_1pct": any(
            met(r) for r in rows if r["H"] == h) for h in hs if h in GOAL_RATIO},
        "step_time_ms": delta_s * 1e3, "overlap_steps": TAU,
        "model": {"task": setup.name, "params": setup.num_params, "tensors": n_tensors,
                  "tokens_per_batch": setup.tokens_per_batch},
        "runtime_s": watch(), "png": png, "machine": C.machine(),
    }
    C.finish("bandwidth", result, args.out)


def plot(out_dir, rows, dp_bpt, dp_loss, dp_need, steps, delta_ms) -> str:
    plt = C.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2),
                                   gridspec_kw={"width_ratios": [1.4, 1]})
    labels_in_order = list(dict.fromkeys(r["codec"] for r in rows))
    colors = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(labels_in_order)}
    markers = {8: "s", 24: "o", 96: "^"}
    for r in rows:
        ax1.scatter(r["bytes_per_token"], r["eval_loss"], s=60, color=colors[r["codec"]],
                    marker=markers.get(r["H"], "D"), zorder=3)
    # labels to the right, spread vertically so that close points stay readable
    ys = [r["eval_loss"] for r in rows] + [dp_loss]
    gap = 0.045 * (max(ys) - min(ys) + 1e-3)
    placed = []
    for r in sorted(rows, key=lambda r: r["eval_loss"]):
        y = max([r["eval_loss"]] + [q + gap for q in placed])
        placed.append(y)
        ax1.annotate(f"{r['codec']} H={r['H']}: {r['bytes_per_token_ratio']:.0f}× fewer, "
                     f"{100 * r['compression_loss_gap']:+.1f} % vs uncompressed",
                     (r["bytes_per_token"], r["eval_loss"]), xytext=(r["bytes_per_token"] * 2.2, y),
                     fontsize=7, va="center",
                     arrowprops=dict(arrowstyle="-", color="grey", lw=0.5))
    ax1.scatter([dp_bpt], [dp_loss], s=140, marker="*", color="black", zorder=3)
    ax1.annotate("data-parallel\n(fp32 ring all-reduce)", (dp_bpt, dp_loss),
                 textcoords="offset points", xytext=(-40, 10), fontsize=8, ha="right")
    for h, goal in GOAL_RATIO.items():
        ax1.axvline(dp_bpt / goal, color="grey", ls="--" if h == 24 else ":", lw=1,
                    label=f"{goal:.0f}× fewer bytes (goal at H = {h})")
    ax1.set_xscale("log")
    ax1.set_xlabel("wire bytes per token (log)")
    ax1.set_ylabel("held-out loss at equal tokens")
    ax1.set_title("Bytes vs eval loss per codec (color) and H (marker)")
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], ls="", marker="o", color=c, label=k) for k, c in colors.items()]
    handles += [Line2D([], [], ls="", marker=mk, color="grey", label=f"H = {h}")
                for h, mk in markers.items() if any(r["H"] == h for r in rows)]
    handles += ax1.get_legend_handles_labels()[0]
    ax1.legend(handles=handles, fontsize=7, loc="lower left", ncol=2)
    xlo = min([dp_bpt / max(GOAL_RATIO.values())] + [r["bytes_per_token"] for r in rows]) / 2
    ax1.set_xlim(xlo, dp_bpt * 12)
    labels = ["data-parallel"] + [f"{r['codec']} H={r['H']}" for r in rows]
    needs = [dp_need * 8 / 1e9] + [r["need_gbps"] for r in rows]
    ax2.barh(range(len(labels)), needs, color=["black"] + [colors[r["codec"]] for r in rows])
    ax2.set_yticks(range(len(labels)))
    ax2.set_yticklabels(labels, fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xscale("log")
    from matplotlib.ticker import NullFormatter
    ax2.xaxis.set_minor_formatter(NullFormatter())
    for y, v in enumerate(needs):
        ax2.text(v * 1.05, y, f"{v * 1e3:.2g} Mbit/s", va="center", fontsize=7)
    ax2.set_xlim(min(needs) / 1.5, max(needs) * 3)
    ax2.set_xlabel("Gbit/s per learner so that no step waits (log)")
    ax2.set_title(f"Bandwidth needed at this CPU's step time ({delta_ms:.1f} ms)")
    fig.suptitle(f"Bandwidth at equal tokens: 4 learners × {steps} steps, τ = {TAU}", fontsize=11)
    fig.tight_layout()
    return C.save_figure(fig, out_dir, "bandwidth.png")


if __name__ == "__main__":
    main()
