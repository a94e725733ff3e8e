"""Regional pre-merge (``link.premerge``) against the flat link: WAN bytes per merged token, eval
loss and the latency a round's push waits for its reply, at L = 2 and 4 learners in one region.

One process, real parts: L learner threads train the tiny byte LM (real JAX steps, the job's
default codecs both ways — nf2:64 pushes with error feedback, nf2:256 encoded replies against
per-learner shadows — or ``--codecs int4-fp32``: int4 pushes, fp32 replies; P = 2, H = 8,
τ = 2) and push through a real ``LinkClient`` (the region's stand-in for the syncer, with its ``PreMerger`` when pre-merge is on) over a real link server
(gRPC, chunked streams, the byte-counting relay) to a home backed by a real ``SyncerCore``
(weighted mean, K = L: a round merges when every live learner is in, or 2 s after its first
push; the home checks drifts against the learners' lr schedule, as a job's syncer does). Steps
are padded to 50 ms (``learner.min_step_time_s``) so the threads keep one pace.

Lockstep (the default): each learner adopts every reply exactly τ steps after its push, waiting
for it there if it is late, so every round holds every learner and a seed's run repeats to the
last digit (flat and pre-merge alike), and the eval-loss gap of a seed is pre-merge's own, not
the threads' timing. ``--free-running`` adopts a reply at the first step ≥ τ that finds it
arrived (the learners' rule; which step that is, and so which pushes share a round, depends on
the machine's load): there the same seed's flat runs alone differ by 3–5 %, so compare
pre-merge there only against ``--reruns`` of both modes.
Reports are off (the link's periodic heartbeats are not pushes), so the bytes are the push
path's: the learners' pushes up and the merged fragments down, counted on the relay's socket.
"Round latency" is a push's call until its reply, median; pre-merge adds the wait for the
region's other learners (the flat round waits for them at home instead) and the region's decode,
mean and re-encode.

    python benchmarks/premerge.py [--quick] [--codecs nf2|int4-fp32] [--repeats N]
                                  [--sizes L ...] [--free-running] [--reruns N]
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import finish, machine, note_rules, parser, pyplot, save_figure, table  # noqa: E402

from islands.studies.lockstep import CoreHome  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROUND_TIMEOUT_S = 2.0
PREMERGE_WINDOW_S = 5.0
# Lockstep: every learner pushes every round, so the round timeout and the region's window only
# ever fire when a loaded machine stalls a thread (then the run's merges differ); they stay as a
# guard against a hang.
LOCKSTEP_TIMEOUT_S = 60.0
STEP_S = 0.05   # each learner's inner step, padded (learner.min_step_time_s)


def register_cores(client, names, params, opt, plan, codec, tau: int) -> list:
    """Registers each learner over the link and builds its ``LearnerCore`` (error feedback on
    the pushes' codec, no merge blend)."""
    from islands.learners.core import LearnerCore
    from islands.syncer import codec as C

    cores = []
    for name in names:
        reg = client.register(name, 0)
        cores.append(LearnerCore(name, params, opt.init(params), plan, reg["versions"],
                                 C.error_feedback(codec), C.tree_wire_bytes,
                                 lambda c: C.decode_tree(codec, c), overlap_steps=tau,
                                 merge_alpha=0.0))
    return cores


def take_replies(lc, replies: "queue.Queue", lockstep: bool = False) -> None:
    """Hands the learner core every reply that arrived: a merged one (a full fragment or an
    encoded update) is offered for adoption, a refusal re-bases or keeps the drift.
    ``lockstep``: first waits for every reply due for adoption at this step (its push τ steps
    back), so each reply is adopted exactly τ steps after its push, whatever the threads' timing
    (see ``waiting_for_reply``)."""
    while True:
        if lockstep and waiting_for_reply(lc) and replies.empty():
            item = replies.get(timeout=2 * LOCKSTEP_TIMEOUT_S)   # never hangs a run
        elif not replies.empty():
            item = replies.get()
        else:
            return
        push, reply = item
        if reply.status == "merged":
            lc.offer_reply(push.fragment, reply.update if reply.update is not None
                           else reply.params, reply.version)
        else:
            lc.refused(push.fragment, reply.reason or reply.status.value, reply.params,
                       reply.version)


def waiting_for_reply(lc) -> bool:
    """A push of ``lc`` is due for adoption at this step (τ steps old) and unanswered."""
    return any(t.in_flight_since_step is not None and t.reply is None
               and lc.step >= t.in_flight_since_step + lc.overlap_steps for t in lc.tracks)


# Codecs, as (push codec, its block, downlink codec or None for fp32 replies, its block).
CODECS = {"nf2": ("nf2", 64, "nf2", 256),      # the job's defaults
          "int4-fp32": ("int4", 64, None, 0)}  # the first figures' setting


def _run(learners: int, premerge: bool, steps: int, seed: int, codecs: str = "nf2",
         lockstep: bool = True, shard_shift: int = 0) -> dict:
    from islands.learners import data, inner, model
    from islands.learners.loop import LearnerLoop
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.server import ServerSettings, serve
    from islands.orchestrator.config import JobConfig
    from islands.syncer import codec as C
    from islands.syncer import downlink as downlink_lib
    from islands.syncer import fragments, outer
    from islands.syncer.core import SyncerCore, SyncerSettings
    from islands.syncer.merge import MergeRule

    cfg = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32)
    batch, P, H, tau = 8, 2, 8, 2
    params = model.init_params(cfg, jax.random.PRNGKey(seed))
    plan = fragments.partition(params, P)
    corpus = data.load_stdlib_corpus(max_bytes=400_000)
    samplers = [data.ShardSampler(corpus.train, batch, cfg.seq_len, i, learners)
                for i in range(learners)]
    lr, warmup = 3e-3, 20
    opt = inner.inner_optimizer(lr=lr, warmup_steps=warmup, total_steps=steps)
    train_step = inner.make_train_step(cfg, opt)
    evaluate = inner.make_eval_fn(cfg)
    eval_set = data.eval_batches(corpus.eval, batch, cfg.seq_len, 4)
    up_kind, up_block, down_kind, down_block = CODECS[codecs]
    codec = C.make_codec(up_kind, block_size=up_block)
    down = downlink_lib.DownlinkSettings(
        C.make_codec(down_kind, block_size=down_block) if down_kind else None)
    core = SyncerCore([fragments.extract(params, plan, p) for p in range(P)],
                      SyncerSettings(min_learners=learners, overlap_steps=tau,
                                     merge_rule=MergeRule.MEAN,
                                     # What a job's syncer checks drifts against (build.py):
                                     # without it the outlier test compares raw norms across
                                     # the warmup and refuses pushes a job would take.
                                     inner_schedule=(lr, warmup, steps, inner.END_LR_FRACTION),
                                     tokens_per_step=batch * cfg.seq_len), outer.build(),
                      lambda c: C.decode_tree(codec, c), is_embedding=model.is_embedding_path,
                      downlink=down)
    note_rules(core.settings)   # the service's asynchrony rules (K = M: every round whole)
    home = CoreHome(core, LOCKSTEP_TIMEOUT_S if lockstep else ROUND_TIMEOUT_S)
    config = JobConfig.model_validate({
        "regions": {"far": {"learners": learners, "remote": True}},
        "syncer": {"fragments": P, "sync_every_steps": H, "overlap_steps": tau,
                   "merge_rule": "mean"},
        "compression": {"type": up_kind, "block_size": up_block},   # the region's re-encode
        "link": {"port": 0, "premerge": premerge, "premerge_window_s":
                     LOCKSTEP_TIMEOUT_S if lockstep else PREMERGE_WINDOW_S}})
    server, port = serve(home, config.model_dump_json(), ServerSettings(port=0, token="bench"))
    client = LinkClient(ClientSettings(home=f"127.0.0.1:{port}", region="far", token="bench",
                                       tls=False, report_every_s=3600))
    latencies: list[float] = []
    lock = threading.Lock()
    try:
        client.hello()
        names = [f"far:{i}" for i in range(learners)]
        cores = register_cores(client, names, params, opt, plan, codec, tau)

        def learner(i: int) -> None:
            lc = cores[i]
            sampler = samplers[(i + shard_shift) % learners]
            loop = LearnerLoop(lc, train_step, lambda k: sampler.batch_at(k),
                               batch * cfg.seq_len, P, H)
            replies: queue.Queue = queue.Queue()
            senders = []

            def send(push):
                t0 = time.perf_counter()
                reply = client.push(push)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                replies.put((push, reply))

            while lc.step < steps:
                take_replies(lc, replies, lockstep)
                loop.adopt()
                t0 = time.perf_counter()
                float(loop.train(loop.batch()))
                # Padded to STEP_S, as learner.min_step_time_s does: the threads share one
                # interpreter, and unpaced one would run ahead of the others (real learners of
                # one region run at one speed).
                pad = STEP_S - (time.perf_counter() - t0)
                if pad > 0:
                    time.sleep(pad)
                loop.record(time.perf_counter() - t0)
                for plan_ in loop.pushes(0):
                    t = threading.Thread(target=send, args=(plan_.on_host().push,))
                    t.start()
                    senders.append(t)
            for t in senders:
                t.join()
            client.forget(names[i], 0, "finished")

        if client.premerger is not None:   # compile the region's re-encode before timing
            for p in range(P):
                zeros = {k: np.zeros_like(np.asarray(v)) for k, v in
                         fragments.extract(params, plan, p).items()}
                client.premerger.encoder.encode(p, zeros)
        start = client.relay.counters()   # registrations (full fragments down) not counted
        t_start = time.perf_counter()
        threads = [threading.Thread(target=learner, args=(i,)) for i in range(learners)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall_s = time.perf_counter() - t_start
        counters = client.relay.counters()
        counts = dict(client.counts)
        final = fragments.assembler(params)(core.params_flat())
        loss = float(evaluate(final, eval_set))
    finally:
        client.close()
        server.stop(0)
    merged = counts.get("merged_tokens", 0)
    return {"learners": learners, "mode": "premerge" if premerge else "flat", "codecs": codecs,
            "lockstep": lockstep, "shard_shift": shard_shift,
            "wan_pushes": counts.get("wan_pushes", 0), "merged_tokens": merged,
            "up_B_per_token": (counters["up"] - start["up"]) / max(merged, 1),
            "down_B_per_token": (counters["down"] - start["down"]) / max(merged, 1),
            "eval_loss": loss, "round_ms": 1e3 * statistics.median(latencies),
            "merges": int(sum(core.versions)), "wall_s": wall_s,
            "refusals": sum(core.rejected.values()),
            "refused_by": {r.value: n for r, n in core.rejected.items()},
            "group_refusals": sum(1 for r in core.refusals if r["learner"].endswith(":premerge")),
            **{k: v for k, v in (client.premerger.counts.items() if client.premerger else ())},
            "premerge": (dict(client.premerger.counts) if client.premerger else None)}


# Per run: what it merged and refused (home) and how the region's rounds closed.
RUN_COLUMNS = ["seed", "rerun", "learners", "mode", "wan_pushes", "merged_tokens",
               "up_B_per_token", "down_B_per_token", "eval_loss", "round_ms", "merges",
               "refusals", "group_refusals", "fallbacks", "window_closes", "split_rounds",
               "alone"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--codecs", choices=sorted(CODECS), default="nf2",
                   help="nf2: the job's defaults, nf2:64 pushes and nf2:256 replies (encoded "
                        "downlink); int4-fp32: int4 pushes and fp32 replies")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each setting, seeds seed, seed+1, ...")
    p.add_argument("--reruns", type=int, default=1,
                   help="runs of each mode on the same seed: the harness's own spread (with "
                        "--free-running the threads' timing decides which step adopts a reply "
                        "and which pushes share a round; lockstep runs repeat exactly)")
    p.add_argument("--free-running", action="store_true",
                   help="adopt each reply at the first step at least τ after its push that "
                        "finds it arrived (the learners' own rule, timing dependent) instead of "
                        "waiting for it at exactly τ (the default: a seed's run is repeatable)")
    p.add_argument("--shard-shift", type=int, default=0,
                   help="with --reruns: rerun r gives learner i the data shard (i + r·shift) mod "
                        "L (the same data, learners renamed: the merge is the same sum in "
                        "another order, so the reruns measure how far float rounding alone "
                        "moves a run)")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4],
                   help="learners per region to run (L)")
    args = p.parse_args()
    steps = 96 if args.quick else 240
    runs = []
    for seed in range(args.seed, args.seed + args.repeats):
        for learners in args.sizes:
            for rerun in range(args.reruns):
                flat, pm = (_run(learners, mode, steps, seed, args.codecs,
                                 not args.free_running, (rerun * args.shard_shift) % learners)
                            for mode in (False, True))
                for row in (flat, pm):
                    row["seed"], row["rerun"] = seed, rerun
                pm["up_vs_flat"] = pm["up_B_per_token"] / flat["up_B_per_token"]
                pm["down_vs_flat"] = pm["down_B_per_token"] / flat["down_B_per_token"]
                pm["loss_vs_flat"] = pm["eval_loss"] / flat["eval_loss"] - 1.0
                pm["added_round_ms"] = pm["round_ms"] - flat["round_ms"]
                runs += [flat, pm]
                print(table([flat, pm], RUN_COLUMNS), flush=True)
                print("refused by reason:", flat["refused_by"], pm["refused_by"], flush=True)
    print(table(runs, ["seed", "rerun", "learners", "mode", "wan_pushes", "up_vs_flat",
                       "down_vs_flat", "eval_loss", "loss_vs_flat", "round_ms", "merges",
                       "refusals", "window_closes", "split_rounds", "fallbacks", "wall_s"]))
    # Per setting, the mean over the runs (what the figures and BENCHMARKS.md quote), and the
    # spread of the per-seed gap: the "within 1 % on the same seeds" is per seed.
    rows = []
    for learners in args.sizes:
        for mode in ("flat", "premerge"):
            sel = [r for r in runs if r["learners"] == learners and r["mode"] == mode]
            row = {"learners": learners, "mode": mode, "runs": len(sel)}
            for key in ("up_B_per_token", "down_B_per_token", "eval_loss", "round_ms",
                        "up_vs_flat", "down_vs_flat", "loss_vs_flat", "added_round_ms"):
                if key in sel[0]:
                    row[key] = statistics.mean(r[key] for r in sel)
            if mode == "premerge":
                gaps = [r["loss_vs_flat"] for r in sel]
                row.update(gap_median=statistics.median(gaps), gap_min=min(gaps),
                           gap_max=max(gaps), within_1pct=sum(abs(g) <= 0.01 for g in gaps))
            rows.append(row)
    if len(runs) > 2:
        print(table(rows, ["learners", "mode", "runs", "up_B_per_token", "up_vs_flat",
                           "down_B_per_token", "down_vs_flat", "eval_loss", "loss_vs_flat",
                           "gap_median", "gap_min", "gap_max", "within_1pct", "round_ms",
                           "added_round_ms"]))
    # The noise floor: the same seed and mode run again (--reruns). Lockstep runs repeat to the
    # last digit; free-running ones move by a few per cent, as much as the premerge gap.
    spread = []
    if args.reruns > 1:
        for seed in range(args.seed, args.seed + args.repeats):
            for learners in args.sizes:
                for mode in ("flat", "premerge"):
                    losses = [r["eval_loss"] for r in runs if (r["seed"], r["learners"],
                                                               r["mode"]) == (seed, learners, mode)]
                    spread.append({"seed": seed, "learners": learners, "mode": mode,
                                   "reruns": len(losses), "loss_min": min(losses),
                                   "loss_max": max(losses),
                                   "spread": max(losses) / min(losses) - 1.0})
        print(table(spread, ["seed", "learners", "mode", "reruns", "loss_min", "loss_max",
                             "spread"]))
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = np.arange(len(args.sizes))
    for k, mode in enumerate(("flat", "premerge")):
        sel = [r for r in rows if r["mode"] == mode]
        ax1.bar(x + (k - 0.5) * 0.4, [r["up_B_per_token"] for r in sel], 0.4, label=mode)
        ax2.bar(x + (k - 0.5) * 0.4, [r["eval_loss"] for r in sel], 0.4, label=mode)
    for ax, label in ((ax1, "WAN bytes up per merged token"), (ax2, "final eval loss")):
        ax.set_xticks(x, [f"L = {n}" for n in args.sizes])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"Regional pre-merge vs flat link (tiny byte LM, {args.codecs})")
    fig.tight_layout()
    suffix = "" if args.codecs == "int4-fp32" else f"_{args.codecs}"
    if args.sizes != [2, 4] or args.seed != 0:
        suffix += f"_L{'-'.join(map(str, args.sizes))}_seed{args.seed}"
    if args.free_running:
        suffix += "_free"
    save_figure(fig, args.out, f"premerge{suffix}.png")
    finish(f"premerge{suffix}", {"benchmark": "premerge", "codecs": args.codecs,
                                 "quick": args.quick, "steps": steps, "runs": runs,
                                 "rows": rows, "spread": spread,
                                 "lockstep": not args.free_running, "machine": machine()},
           args.out)


if __name__ == "__main__":
    main()
