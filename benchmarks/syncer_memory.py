"""Syncer memory: peak resident memory of one syncer core, in copies of the model, against the
number of learners M, with the service's defaults.

The core is built as the service builds it: a default ``JobConfig`` (only the model's size
differs), ``build.syncer_spec``, then the codec, outer optimizer and downlink as
``syncer/actor.py`` does. It is driven on a virtual clock through ``accept_push``,
``timed_decision``, ``merge`` and ``updates``, with real pushes in the job's uplink codec (nf2),
from M learners stepping at 1 s ± 10 % noise (so rounds split into partial merges and the
learners' downlink shadows part ways), each pushing fragment p every H steps at its offset,
adopting each reply (encoded nf2 updates, or full fragments) as it comes, until every
fragment's history is full and a few rounds more.

Each (N, M) runs in a fresh subprocess: peak RSS (``resource.getrusage ru_maxrss``) minus the
peak of an idle subprocess with the same imports, ÷ 4·N bytes, is "copies". The driver's own
data (two drift codes per fragment, reused) is small and the same for every M.

    python benchmarks/syncer_memory.py --quick     # N = 10M, 50M; M = 4, 16: ~3 min, 4 GB peak

Prints a table, then one JSON object as the last line (``copies_m4``, ``copies_m16``: at 50M);
writes ``syncer_memory.png`` and ``syncer_memory.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from _machine import command_line, ensure_islands_importable, format_table, machine_info  # noqa: E402


def _imports():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ensure_islands_importable()
    import jax  # noqa: F401
    import numpy as np  # noqa: F401

    from islands.orchestrator import build  # noqa: F401
    from islands.syncer import actor, codec, core, outer  # noqa: F401


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def build_core(num_params: int, seed: int = 0):
    """The default job's syncer core over a model of ``num_params`` float32 parameters (tensors
    of at most 1M values), built as the service builds it; returns (core, config, spec)."""
    import numpy as np

    from islands.orchestrator import build
    from islands.orchestrator.config import JobConfig
    from islands.syncer import codec as codec_lib
    from islands.syncer import outer as outer_lib
    from islands.syncer.actor import downlink_settings
    from islands.syncer.core import SyncerCore

    rng = np.random.default_rng(seed)
    per = max(1, min(1 << 20, num_params // 16))   # ≥ 16 tensors: P fragments of them
    template = {f"blocks/{i:03d}/w": 0.02 * rng.standard_normal(
        min(per, num_params - i * per), np.float32) for i in range(-(-num_params // per))}
    config = JobConfig()
    spec = build.syncer_spec(config, template, run_dir="/nonexistent")
    del template
    codec = codec_lib.make_codec(spec.codec_kind, block_size=spec.codec_block_size)
    core = SyncerCore(spec.fragments, spec.settings,
                      outer_lib.build(spec.outer_kind, **spec.outer_kwargs),
                      lambda codes: codec_lib.decode_tree(codec, codes),
                      downlink=downlink_settings(spec))
    spec.fragments.clear()   # the actor drops its spec's copy too (the core holds Θ)
    return core, config, spec, codec


def drive(num_params: int, learners: int, extra_rounds: int = 3, seed: int = 0) -> dict:
    """Runs the default core with ``learners`` learners until the history is full; returns the
    counts (merges, partial merges, full and encoded replies, distinct shadows)."""
    import heapq

    import jax
    import numpy as np

    from islands.syncer import codec as codec_lib
    from islands.syncer import downlink as downlink_lib
    from islands.syncer.validate import Push

    core, config, spec, codec = build_core(num_params, seed)
    rng = np.random.default_rng(seed + 1)
    P, H = config.syncer.fragments, config.syncer.sync_every_steps
    tokens = config.data.batch_size * config.model.seq_len
    # Two drifts per fragment in the uplink codec, reused by every learner (small: ~1/14 of fp32).
    codes = []
    for slot in core.slots:
        pair = []
        for _ in range(2):
            drift = {k: 1e-3 * rng.standard_normal(v.shape).astype(np.float32)
                     for k, v in slot.params.items()}
            pair.append(jax.device_get(codec_lib.encode_tree(codec, drift)))
            del drift
        codes.append(pair)
    names = [f"r:{m}" for m in range(learners)]
    for name in names:
        core.register(name, 0)
    live = frozenset(names)
    base = {(n, p): (downlink_lib.EXACT, 0) for n in names for p in range(P)}
    pushed_step = {(n, p): 0 for n in names for p in range(P)}
    # Events: (time, kind, name, step). Learner m's step k ends at Σ of its noisy step times.
    events, clock = [], {}
    for m, name in enumerate(names):
        clock[name] = float(rng.uniform(0, 0.5))
        heapq.heappush(events, (clock[name], 0, name, 1))
    rounds = config.syncer.history_versions + extra_rounds
    last_step = rounds * H
    wakeups: list = []      # (time, fragment): a decision to take again
    counts = {"merges": 0, "partial_merges": 0, "diff_replies": 0, "full_replies": 0,
              "max_shadows_per_fragment": 0}

    def decide(p: int, now: float) -> None:
        slot = core.slots[p]
        if not slot.round:
            return
        decision, _ = core.timed_decision(p, now, live, 1.1, 0.05)
        if decision.merge:
            result = core.merge(p, decision.reason.value, live_count=len(live))
            counts["merges"] += 1
            counts["partial_merges"] += len(result.learners) < len(live)
            for name, update in core.updates(result).items():
                if isinstance(update, downlink_lib.DiffUpdate):
                    base[(name, p)] = (update.to_id, update.version)
                    counts["diff_replies"] += 1
                else:
                    base[(name, p)] = (downlink_lib.EXACT, result.version)
                    counts["full_replies"] += 1
            ids = {s.shadow_id for (n, q), s in core.shadows.items() if q == p}
            counts["max_shadows_per_fragment"] = max(counts["max_shadows_per_fragment"],
                                                     len(ids))
        elif decision.wait_until_s is not None:
            heapq.heappush(wakeups, (decision.wait_until_s, p))

    while events:
        now, _, name, step = heapq.heappop(events)
        while wakeups and wakeups[0][0] <= now:
            t, p = heapq.heappop(wakeups)
            decide(p, t)
        p = next((q for q in range(P) if step % H == (q * H) // P), None)
        if p is not None:
            base_id, version = base[(name, p)]
            c_steps = step - pushed_step[(name, p)]
            push = Push(learner=name, fragment=p, codes=codes[p][step // H % 2],
                        base_version=version, epoch=core.epoch, c_tokens=c_steps * tokens,
                        c_steps=c_steps, step=step, tokens_done=step * tokens,
                        base_shadow=base_id, wire_bytes=0)
            verdict = core.accept_push(push, now)
            if not verdict.ok:
                raise RuntimeError(f"{name} fragment {p}: {verdict}")
            pushed_step[(name, p)] = step
            decide(p, now)
        if step < last_step:
            heapq.heappush(events, (now + max(0.5, 1.0 + 0.1 * rng.standard_normal()), 0,
                                    name, step + 1))
    for p in range(P):   # what is still open merges
        if core.slots[p].round:
            decide(p, float("inf"))
    counts["history_versions"] = min(len(s.history) for s in core.slots)
    counts["rules"] = {k: getattr(spec.settings, k).value for k in
                       ("outer_gradient", "round_step", "schedule_clock", "merge_rule")}
    counts["rules"].update(round_wait=spec.settings.round_wait, outer=spec.outer_kind,
                           outer_kwargs=spec.outer_kwargs, uplink=spec.codec_kind,
                           downlink=spec.downlink_kind, fragments=P, H=H,
                           max_shadows=core.downlink.max_shadows)
    return counts


def child(args) -> None:
    """One measurement in this (fresh) process; prints its JSON."""
    _imports()
    if args.idle:
        print(json.dumps({"peak_rss": peak_rss_bytes()}))
        return
    t0 = time.time()
    counts = drive(args.params, args.learners)
    print(json.dumps({"peak_rss": peak_rss_bytes(), "elapsed_s": time.time() - t0, **counts}))


def run_child(extra: list) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *extra],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {extra} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n in sorted({r["params"] for r in rows}):
        sel = [r for r in rows if r["params"] == n]
        ax.plot([r["learners"] for r in sel], [r["copies"] for r in sel], "o-",
                label=f"N = {n / 1e6:g}M")
    ax.axhline(20, color="grey", ls="--", lw=1, label="goal: ≤ 20 copies")
    ax.set_xlabel("learners M")
    ax.set_ylabel("peak RSS − idle, in copies of the model (4·N bytes)")
    ax.set_ylim(bottom=0)
    ax.set_title("syncer core memory with the service's defaults")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 10M, 50M; M = 4, 16")
    parser.add_argument("--sizes", default=None, help="comma list of model sizes (parameters)")
    parser.add_argument("--learners", default=None, help="comma list of M")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.learners = args.one
        child(args)
        return {}
    t0 = time.time()
    sizes = ([int(float(s)) for s in args.sizes.split(",")] if args.sizes
             else [10_000_000, 50_000_000])
    ms = [int(m) for m in args.learners.split(",")] if args.learners else [4, 16]
    idle = run_child(["--idle"])["peak_rss"]
    rows = []
    for n in sizes:
        for m in ms:
            r = run_child(["--params", str(n), "--one", str(m)])
            rules = r.pop("rules")
            rows.append({"params": n, "learners": m,
                         "copies": round((r["peak_rss"] - idle) / (4 * n), 2), **r})
            print(f"  N = {n:,d}, M = {m}: {rows[-1]['copies']} copies", file=sys.stderr,
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "syncer_memory.png")
    plot(rows, png)
    print(f"syncer memory · the service's defaults: {json.dumps(rules)}")
    print(format_table(rows, ["params", "learners", "copies", "merges", "partial_merges",
                              "diff_replies", "full_replies", "max_shadows_per_fragment",
                              "history_versions", "elapsed_s"]))
    big = max(sizes)
    at = {r["learners"]: r["copies"] for r in rows if r["params"] == big}
    result = {"benchmark": "syncer_memory", "rules": rules, "rows": rows,
              "idle_peak_rss": idle, "copies_params": big,
              **{f"copies_m{m}": at[m] for m in ms}, "png": png, "command": command_line(),
              "machine": machine_info(), "elapsed_s": round(time.time() - t0, 1)}
    with open(os.path.join(args.out, "syncer_memory.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
