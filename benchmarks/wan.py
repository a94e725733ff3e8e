"""WAN realism: how far the region's link bandwidth can fall before the flat link falls behind,
and whether ``link.premerge`` still keeps up there; plus one lossy, far link (50 ms, 1 % loss).

L = 4 learners of one region train the tiny byte LM (real JAX steps, the job's default codecs:
nf2:64 pushes with error feedback and nf2:256 encoded replies, or ``--replies fp32``; P = 2, H = 8, τ = 2; steps padded to 200 ms) and push
through a real ``LinkClient`` (with its ``PreMerger`` for pre-merge) over the region's relay,
which caps its bandwidth (each direction), adds latency and plays segment loss as TCP
retransmission delays (``islands.faults.segment_arrival_s``), to a real link server and a home
backed by a real ``SyncerCore`` (weighted mean, K = L): the set-up of ``benchmarks/premerge.py``,
whose home it reuses. The caps sweep down from none until both modes fell behind (or the list
ends).

Per run: **merged tokens/s**, the tokens of the pushes whose merged reply arrived while the
learners trained, per second of training (a token counts once per fragment it is merged in, as
the link counts them; a learner does not push a fragment again until its last push of it is
answered, so a link that cannot carry the offered bytes shows up as rounds that merge later and
less often, and as tokens still unmerged when training ends); **merged share**, the same tokens
over those trained (P × L × steps × tokens per batch): the rate with the training pace divided
out; **WAN bytes per merged token** (both directions, counted on the relay's socket;
registrations excluded); **round latency** (a push's call to its reply, median). A mode "keeps
up" at a cap while its merged tokens/s stays at or above 90 % of its own uncapped rate, compared
per token trained (the merged share): on a shared CPU the training pace itself differs from run
to run.

    python benchmarks/wan.py [--quick] [--replies nf2|fp32]

``--replies fp32`` (whole merged fragments back, ``downlink_compression: none``) is the setting of
the first figures; the default is the job's: nf2 both ways (``wan_nf2.{json,png}``).
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import threading
import time
from functools import lru_cache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import finish, machine, note_rules, parser, pyplot, save_figure, table  # noqa: E402
from premerge import ROUND_TIMEOUT_S, register_cores, take_replies  # noqa: E402

from islands.studies.lockstep import CoreHome  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

LEARNERS, P, H, TAU, BATCH = 4, 2, 8, 2, 8
KEEPS_UP = 0.9   # of the mode's own uncapped merged tokens/s
# Each inner step padded to 200 ms (premerge.py: 50 ms): four learner threads on two shared
# cores then keep one pace with CPU to spare, so the link, not the CPU, sets the merge rate.
STEP_S = 0.2


@lru_cache(maxsize=None)
def _setup(steps: int, seed: int):
    """The model, data and jitted steps, built once (every run starts from the same params)."""
    from islands.learners import data, inner, model
    from islands.syncer import fragments

    cfg = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32)
    params = model.init_params(cfg, jax.random.PRNGKey(seed))
    corpus = data.load_stdlib_corpus(max_bytes=400_000)
    samplers = [data.ShardSampler(corpus.train, BATCH, cfg.seq_len, i, LEARNERS)
                for i in range(LEARNERS)]
    opt = inner.inner_optimizer(lr=3e-3, warmup_steps=20, total_steps=steps)
    train_step = inner.make_train_step(cfg, opt)
    jax.block_until_ready(train_step(params, opt.init(params), samplers[0].batch_at(0)))
    return cfg, params, fragments.partition(params, P), samplers, opt, train_step


def run(premerge: bool, steps: int, seed: int, bandwidth_mbps=None, latency_ms: float = 0.0,
        loss_rate: float = 0.0, stop_at=None, replies: str = "nf2") -> dict:
    """One run of L learners over the relay's emulated WAN (to step ``stop_at``: a warm-up);
    its row. ``replies``: "nf2", the job's encoded downlink (nf2:256 against per-learner
    shadows), or "fp32" (whole merged fragments)."""
    from islands.learners.loop import LearnerLoop
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.server import ServerSettings, serve
    from islands.orchestrator.config import JobConfig
    from islands.faults import Fault
    from islands.syncer import codec as C
    from islands.syncer import downlink as downlink_lib
    from islands.syncer import fragments, outer
    from islands.syncer.core import SyncerCore, SyncerSettings
    from islands.syncer.merge import MergeRule
    from islands.learners import model

    cfg, params, plan, samplers, opt, train_step = _setup(steps, seed)
    config = JobConfig.model_validate({
        "regions": {"far": {"learners": LEARNERS, "remote": True}},
        "syncer": {"fragments": P, "sync_every_steps": H, "overlap_steps": TAU,
                   "merge_rule": "mean"},
        "link": {"port": 0, "premerge": premerge, "premerge_window_s": 5.0}})
    codec = C.make_codec(config.compression.type, config.compression.block_size)
    down = config.downlink_compression
    downlink = downlink_lib.DownlinkSettings(
        C.make_codec(down.type, block_size=down.block_size) if replies == "nf2" else None)
    core = SyncerCore([fragments.extract(params, plan, p) for p in range(P)],
                      SyncerSettings(min_learners=LEARNERS, overlap_steps=TAU,
                                     merge_rule=MergeRule.MEAN), outer.build(),
                      lambda c: C.decode_tree(codec, c), is_embedding=model.is_embedding_path,
                      downlink=downlink)
    note_rules(core.settings)   # the service's asynchrony rules (K = M: every round whole)
    server, port = serve(CoreHome(core, ROUND_TIMEOUT_S), config.model_dump_json(),
                         ServerSettings(port=0, token="bench"))
    client = LinkClient(ClientSettings(
        home=f"127.0.0.1:{port}", region="far", token="bench", tls=False, report_every_s=3600,
        latency_ms=latency_ms, loss_rate=loss_rate, loss_seed=seed))
    latencies: list[float] = []
    merged_at: list[tuple[float, int]] = []   # (reply time, the push's tokens)
    lock = threading.Lock()
    try:
        client.hello()
        names = [f"far:{i}" for i in range(LEARNERS)]
        cores = register_cores(client, names, params, opt, plan, codec, TAU)
        if bandwidth_mbps is not None:   # after the registrations (full fragments, uncounted)
            client.link_fault(Fault(time.time(), "network", "far", duration_s=1e6,
                                    bandwidth_gbps=bandwidth_mbps / 1e3))
        trained = threading.Barrier(LEARNERS + 1)

        def learner(i: int) -> None:
            lc = cores[i]
            loop = LearnerLoop(lc, train_step, lambda k: samplers[i].batch_at(k),
                               BATCH * cfg.seq_len, P, H)
            replies: queue.Queue = queue.Queue()
            senders = []

            def send(push):
                t0 = time.perf_counter()
                reply = client.push(push)
                t1 = time.perf_counter()
                with lock:
                    latencies.append(t1 - t0)
                    if reply.status == "merged":
                        merged_at.append((t1, push.c_tokens))
                replies.put((push, reply))

            while lc.step < (stop_at or steps):
                take_replies(lc, replies)
                loop.adopt()
                t0 = time.perf_counter()
                float(loop.train(loop.batch()))
                pad = STEP_S - (time.perf_counter() - t0)   # one pace, as premerge.py
                if pad > 0:
                    time.sleep(pad)
                loop.record(time.perf_counter() - t0)
                for plan_ in loop.pushes(0):
                    t = threading.Thread(target=send, args=(plan_.on_host().push,))
                    t.start()
                    senders.append(t)
            trained.wait()
            for t in senders:
                t.join()
            client.forget(names[i], 0, "finished")

        if client.premerger is not None:   # compile the region's encode before timing
            for p in range(P):
                zeros = {k: np.zeros_like(np.asarray(v)) for k, v in
                         fragments.extract(params, plan, p).items()}
                client.premerger.encoder.encode(p, zeros)
        start = client.relay.counters()
        t_start = time.perf_counter()
        threads = [threading.Thread(target=learner, args=(i,)) for i in range(LEARNERS)]
        for t in threads:
            t.start()
        trained.wait()
        train_s = time.perf_counter() - t_start
        t_end = t_start + train_s
        for t in threads:
            t.join()
        counters = client.relay.counters()
        counts = dict(client.counts)
    finally:
        client.close()
        server.stop(0)
    in_window = sum(tok for t, tok in merged_at if t <= t_end)
    # A token is merged once per fragment (P of them), as the link counts merged tokens (and
    # benchmarks/premerge.py its bytes per merged token).
    trained_tokens = P * LEARNERS * (stop_at or steps) * BATCH * cfg.seq_len
    merged = counts.get("merged_tokens", 0)
    wan_bytes = (counters["up"] - start["up"]) + (counters["down"] - start["down"])
    return {"mode": "premerge" if premerge else "flat",
            "cap_mbps": bandwidth_mbps, "latency_ms": latency_ms, "loss_rate": loss_rate,
            "merged_tok_per_s": in_window / train_s,
            "merged_share": in_window / trained_tokens, "merged_tokens": merged,
            "merges_per_s": sum(1 for t, _ in merged_at if t <= t_end) / train_s / LEARNERS,
            "wan_B_per_token": wan_bytes / max(merged, 1),
            "round_ms": 1e3 * statistics.median(latencies) if latencies else None,
            "wan_pushes": counts.get("wan_pushes", 0), "merges": int(sum(core.versions)),
            "losses": counters["losses"], "train_s": train_s}


def keeps_up(row: dict, uncapped: dict) -> bool:
    """Merged tokens/s at or above ``KEEPS_UP`` of the mode's own uncapped rate, both per token
    trained: on a shared CPU the training pace itself varies between runs, and the link's
    share of the gap is the tokens it has not merged by the end of training."""
    return row["merged_share"] >= KEEPS_UP * uncapped["merged_share"]


def plot(rows: list, out_dir: str, name: str = "wan", replies: str = "nf2") -> str:
    """wan.png: each mode's merged tokens/s (per token trained) ÷ its uncapped one, and its
    round latency, against the cap."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    caps = sorted({r["cap_mbps"] for r in rows if r["cap_mbps"] is not None})
    for mode, marker in (("flat", "o"), ("premerge", "s")):
        ref = next(r for r in rows if r["mode"] == mode and r["cap_mbps"] is None
                   and r["loss_rate"] == 0)["merged_share"]
        sel = [r for r in rows if r["mode"] == mode and r["loss_rate"] == 0
               and r["cap_mbps"] is not None]
        ax1.plot([r["cap_mbps"] for r in sel], [r["merged_share"] / ref for r in sel],
                 marker=marker, label=mode)
        ax2.plot([r["cap_mbps"] for r in sel], [r["round_ms"] for r in sel], marker=marker,
                 label=mode)
    ax1.axhline(KEEPS_UP, color="grey", ls="--", lw=1)
    ax1.set_ylabel("merged tokens/s ÷ own uncapped\n(per token trained)")
    ax2.set_ylabel("round latency, ms (median)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(caps, [f"{c:g}" for c in caps])
        ax.set_xlabel("relay bandwidth cap, Mbit/s (each direction)")
        ax.legend()
    fig.suptitle(f"L = {LEARNERS} learners in one region: flat link vs pre-merge under a cap "
                 f"(nf2 pushes, {replies} replies)")
    fig.tight_layout()
    return save_figure(fig, out_dir, f"{name}.png")


# Caps swept, Mbit/s: fp32 replies carry ~7x the bytes of nf2 ones, so their sweep sits higher.
CAPS = {("nf2", False): [0.2, 0.1, 0.075, 0.05, 0.035, 0.025, 0.0125],
        ("nf2", True): [0.1, 0.025],
        ("fp32", False): [2.0, 1.0, 0.75, 0.5, 0.375, 0.25, 0.125],
        ("fp32", True): [1.0, 0.25]}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--replies", choices=("nf2", "fp32"), default="nf2",
                   help="nf2: the job's encoded downlink (default); fp32: whole fragments")
    args = p.parse_args()
    steps = 32 if args.quick else 120
    caps = CAPS[(args.replies, args.quick)]
    _setup(steps, args.seed)
    for mode in (False, True):   # compiles the learners' and the region's encodes
        run(mode, steps, args.seed, stop_at=2 * H, replies=args.replies)
    rows, uncapped, behind = [], {}, {}
    for mode in (False, True):
        row = run(mode, steps, args.seed, replies=args.replies)
        row["keeps_up"] = True
        uncapped[row["mode"]] = row
        rows.append(row)
        print(table([row], list(row)), flush=True)
    for cap in caps:
        for mode in (False, True):
            name = "premerge" if mode else "flat"
            row = run(mode, steps, args.seed, bandwidth_mbps=cap, replies=args.replies)
            row["keeps_up"] = keeps_up(row, uncapped[name])
            if not row["keeps_up"]:
                behind.setdefault(name, cap)
            rows.append(row)
            print(table([row], list(row)), flush=True)
        if len(behind) == 2:
            break
    lossy = [run(mode, steps, args.seed, latency_ms=50.0, loss_rate=0.01, replies=args.replies)
             for mode in (False, True)]
    for row in lossy:
        row["keeps_up"] = keeps_up(row, uncapped[row["mode"]])
    rows += lossy
    columns = ["mode", "cap_mbps", "latency_ms", "loss_rate", "merged_tok_per_s",
               "merged_share", "keeps_up", "merges_per_s", "wan_B_per_token", "round_ms",
               "wan_pushes", "merges", "losses", "train_s"]
    print(table(rows, columns))
    # The cap where flat first falls behind, and whether pre-merge keeps up there.
    flat_behind = behind.get("flat")
    pm_there = next((r for r in rows if r["mode"] == "premerge"
                     and r["cap_mbps"] == flat_behind and r["loss_rate"] == 0), None)
    verdict = {"flat_falls_behind_at_mbps": flat_behind,
               "premerge_keeps_up_there": None if pm_there is None else pm_there["keeps_up"],
               "premerge_falls_behind_at_mbps": behind.get("premerge")}
    print(verdict)

    name = "wan" if args.replies == "fp32" else "wan_nf2"
    plot(rows, args.out, name, args.replies)
    finish(name, {"benchmark": "wan", "replies": args.replies, "quick": args.quick,
                  "steps": steps, "learners": LEARNERS, "keeps_up_threshold": KEEPS_UP,
                  "verdict": verdict, "rows": rows, "machine": machine()}, args.out)


if __name__ == "__main__":
    main()
