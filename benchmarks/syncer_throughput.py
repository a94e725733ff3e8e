"""Syncer throughput: merges/s and bytes merged/s against a numpy copy of the same bytes, and the
most learners one syncer sustains on this machine.

The pure ``SyncerCore`` (no Ray) with the job's codec (nf2 by default) and the service's rules
(``build.syncer_options`` of a default JobConfig, printed with the tables): one round is M learners' ``accept_push`` (decode the drift, validate, reconstruct
``θ_m = Θ(base) + δ``) and one ``merge`` (RDA per tensor + the outer Nesterov step). Fragments of
1M, 10M and 100M float32 parameters (``--quick``: 1M, 10M, 30M), made of ≤ 4M-element tensors.
The ceiling is ``np.copyto`` of the same M·4·n bytes (payload bytes; memory traffic is twice that).
JAX runs with the syncer actor's environment (single-thread XLA, ``runtime.process_env``).

Most learners sustained: one syncer is one event loop, so it keeps up while the work arriving per
second fits in a second. A learner pushes r = P / (H·ξ_step) fragments of N/P parameters per
second; with the measured per-push cost c_push, merge cost c_merge(L) = a + b·L (fit from rounds
of 1 and M learners) and c_reply (one fragment copy per reply, estimated by the memcpy rate):

  worst case, every push merged alone (K = 1, learners out of phase):
      L_max = ⌊ 1 / (r · (c_push + a + b + c_reply)) ⌋
  best case, one merge per fragment round with all L in (learners in phase):
      L_max = ⌊ (1/r − a) / (c_push + b + c_reply) ⌋

Syncer shards (``syncer.shards = S``): each shard is its own actor (process) merging its own
fragments, so S shards run S merge loops at once. ``--shards 1,2`` measures that here: S worker
processes, each a ``SyncerCore`` over one fragment of ``--shard-params`` parameters, run their
rounds at the same time after a barrier; merged GB/s is all the shards' fp32 bytes merged over
the wall time, against S processes doing ``np.copyto`` of the same bytes. The model for larger S:

    G(S) = min(S·g₁, ρ·B)     g₁: one shard's merged GB/s (pushes and merges); B: the machine's
                              copy bandwidth with every core copying; ρ: one shard's merge +
                              outer step ÷ copy ratio (its memory-bound part)

and the largest model one job sustains at P = H with learners at ξ_step per step: the costs of a
push, a merge and a reply are linear in the fragment's size N/P (per parameter: κ_push, κ_a,
κ_b, κ_reply from the measured rows), and each shard serves P/S fragments, so with L learners
each push merged alone (worst case) a shard keeps up while

    L · (P/S)/(H·ξ) · (N/P) · (κ_push + κ_a + κ_b + κ_reply) ≤ 1
    ⇒ N_max = S·H·ξ / (L·(κ_push + κ_a + κ_b + κ_reply))

(best case, one merge per round of L: N_max = S·H·ξ / (κ_a + L·(κ_push + κ_b + κ_reply))).

    python benchmarks/syncer_throughput.py --quick          # ~2 min, 2.7 GB peak
    python benchmarks/syncer_throughput.py                  # 1M, 10M, 100M: ~3 min, 9 GB peak

Prints tables, then one JSON object as the last line; writes ``syncer_throughput.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
from _machine import ensure_islands_importable, machine_info, command_line, format_table  # noqa: E402
MAX_TENSOR_ELEMS = 4 * 1024 * 1024  # ≈ a 2048 × 2048 matrix; larger fragments hold several


def use_syncer_env() -> dict:
    """The syncer actor's thread settings (before jax is imported): single-thread XLA and OpenMP."""
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
           "OMP_NUM_THREADS": "1"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in env}


# -- small pure helpers ------------------------------------------------------------------------
def tensor_shapes(num_params: int, max_elems: int = MAX_TENSOR_ELEMS, cols: int = 1024
                  ) -> list[tuple[int, ...]]:
    """Shapes of the tensors of a fragment of ``num_params``: full ``(rows, cols)`` matrices of at
    most ``max_elems``, then the remainder (a matrix and a vector).

    >>> tensor_shapes(10_000, max_elems=4096, cols=1024)
    [(4, 1024), (4, 1024), (1, 1024), (784,)]
    """
    rows_per = max(1, max_elems // cols)
    shapes, left = [], num_params
    while left >= rows_per * cols:
        shapes.append((rows_per, cols))
        left -= rows_per * cols
    if left >= cols:
        shapes.append((left // cols, cols))
        left -= (left // cols) * cols
    if left:
        shapes.append((left,))
    return shapes


def merge_cost_fit(merge_1_s: float, merge_m_s: float, m: int) -> tuple[float, float]:
    """``c_merge(L) = a + b·L`` through rounds of 1 and m learners; returns (a, b).

    >>> merge_cost_fit(0.3, 0.9, 4)
    (0.1, 0.2)
    """
    b = max((merge_m_s - merge_1_s) / (m - 1), 0.0) if m > 1 else 0.0
    return round(merge_1_s - b, 12), round(b, 12)


def pushes_per_s(fragments: int, sync_every_steps: int, step_s: float) -> float:
    """r = P / (H·ξ_step): fragments one learner pushes per second.

    >>> round(pushes_per_s(24, 24, 0.072), 3)
    13.889
    """
    return fragments / (sync_every_steps * step_s)


def max_learners(r: float, c_push: float, a: float, b: float, c_reply: float) -> dict:
    """Most learners one syncer keeps up with (utilisation ≤ 1), worst and best case.

    >>> max_learners(10.0, 0.001, 0.002, 0.001, 0.0)
    {'worst': 25, 'best': 49}
    """
    worst = math.floor(1.0 / (r * (c_push + a + b + c_reply)))
    best = math.floor((1.0 / r - a) / (c_push + b + c_reply))
    return {"worst": max(worst, 0), "best": max(best, 0)}


# -- measuring ---------------------------------------------------------------------------------
@dataclass
class Bench:
    """A syncer holding one fragment, and M learners' encoded pushes for it."""

    core: Any
    pushes: list
    nbytes: int       # float32 bytes of the fragment
    wire_bytes: int   # encoded bytes of one push


def service_rules() -> tuple:
    """(SyncerSettings, outer kind, outer kwargs) of a default JobConfig as the service builds
    them (``build.syncer_options``), with history 2 and quorum 1."""
    import dataclasses as dc

    from islands.orchestrator import build
    from islands.orchestrator.config import JobConfig

    options = build.syncer_options(JobConfig(), "/nonexistent")
    settings = dc.replace(options["settings"], min_learners=1, history_versions=2)
    return settings, options["outer_kind"], options["outer_kwargs"]


def rules_line() -> str:
    """The rules a run used, in words (printed with its tables)."""
    settings, kind, kwargs = service_rules()
    return (f"rules (the service's defaults): outer_gradient {settings.outer_gradient.value}, "
            f"round_step {settings.round_step.value}, merge_rule {settings.merge_rule.value}, "
            f"outer {kind} {kwargs}, history 2")


def build_bench(num_params: int, learners: int, codec_kind: str, seed: int = 0) -> Bench:
    import jax
    import numpy as np

    from islands.syncer import codec as codec_lib
    from islands.syncer import outer as outer_lib
    from islands.syncer.core import SyncerCore
    from islands.syncer.validate import Push

    rng = np.random.default_rng(seed)
    fragment = {f"blocks/{i}/w": (0.02 * rng.standard_normal(shape, np.float32))
                for i, shape in enumerate(tensor_shapes(num_params))}
    codec = codec_lib.make_codec(codec_kind)
    ef = codec_lib.error_feedback(codec)
    # The service's rules (build.syncer_settings of a default JobConfig, its outer optimizer by
    # the rule for its H), but history 2: each version kept is a full copy (8 of 100M: 3.2 GB).
    settings, outer_kind, outer_kwargs = service_rules()
    core = SyncerCore([fragment], settings, outer_lib.build(outer_kind, **outer_kwargs),
                      lambda codes: codec_lib.decode_tree(codec, codes))
    pushes = []
    # Counters the service accepts: whole steps of at most its tokens per step (a default job's).
    per_step = settings.tokens_per_step or 4096
    for m in range(learners):
        core.register(f"bench:{m}", 0)
        drift = {k: (1e-3 * rng.standard_normal(v.shape, np.float32)) for k, v in fragment.items()}
        codes, _ = ef.update(drift, ef.init(drift))
        codes = jax.device_get(codes)
        wire = codec_lib.tree_wire_bytes(codes)
        pushes.append(Push(learner=f"bench:{m}", fragment=0, codes=codes, base_version=0, epoch=0,
                           c_tokens=per_step * (m + 1), c_steps=m + 1, step=m + 1, wire_bytes=wire))
        del drift
    return Bench(core, pushes, num_params * 4, pushes[0].wire_bytes)


def one_round(bench: Bench, learners: int) -> tuple[float, float]:
    """``learners`` pushes, then the merge; returns (seconds for the pushes, seconds to merge)."""
    core = bench.core
    version = core.slots[0].version
    t0 = time.perf_counter()
    for push in bench.pushes[:learners]:
        verdict = core.accept_push(dataclasses.replace(push, base_version=version),
                                   time.monotonic())
        if not verdict.ok:
            raise RuntimeError(f"push refused: {verdict}")
    t1 = time.perf_counter()
    core.merge(0, "all_live_in", live_count=learners)
    return t1 - t0, time.perf_counter() - t1


def copy_seconds(nbytes: int, repeats: int) -> float:
    """Fastest seconds of ``np.copyto`` of ``nbytes`` (float32) into a warm destination."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_size(num_params: int, learners: int, rounds: int, codec_kind: str) -> dict:
    """One fragment size: M-learner rounds, 1-learner rounds, and the copy ceiling."""
    bench = build_bench(num_params, learners, codec_kind)
    one_round(bench, learners)  # warm: compiles the decode for these shapes
    one_round(bench, 1)
    # Rounds of M and of 1 learner alternate, so load from others on a shared machine hits both;
    # every figure comes from the fastest round (the least disturbed); the median is kept too.
    full, single = [], []
    for _ in range(rounds):
        full.append(one_round(bench, learners))
        single.append(one_round(bench, 1))
    push_s = min(p for p, _ in full) / learners
    merge_m_s = min(m for _, m in full)
    merge_1_s = min(m for _, m in single)
    round_s = min(p + m for p, m in full)
    round_median_s = statistics.median(p + m for p, m in full)
    a, b = merge_cost_fit(merge_1_s, merge_m_s, learners)
    nbytes = bench.nbytes
    wire = bench.wire_bytes
    del bench
    gc.collect()
    copy_s = copy_seconds(nbytes, repeats=max(3, rounds))
    merged_bytes = learners * nbytes
    return {"params": num_params, "learners": learners, "rounds": rounds,
            "fragment_mb": nbytes / 1e6, "wire_mb_per_push": wire / 1e6,
            "push_ms": 1e3 * push_s, "merge_ms": 1e3 * merge_m_s, "merge_1_ms": 1e3 * merge_1_s,
            "merge_a_ms": 1e3 * a, "merge_b_ms": 1e3 * b, "round_ms": 1e3 * round_s,
            "round_median_ms": 1e3 * round_median_s,
            "merges_per_s": 1.0 / round_s, "pushes_per_s": learners / round_s,
            "merged_gb_per_s": merged_bytes / round_s / 1e9,
            "copy_ms": 1e3 * copy_s * learners, "copy_gb_per_s": nbytes / copy_s / 1e9,
            "ratio_to_copy": (merged_bytes / round_s) / (nbytes / copy_s),
            # the merge + outer step alone (the pushes' decode and checks apart)
            "merge_ratio_to_copy": (merged_bytes / merge_m_s) / (nbytes / copy_s),
            "wire_gb_per_s": learners * wire / round_s / 1e9}


def tiny_step_s(steps: int = 60) -> tuple[float, int]:
    """Measured step time of JobConfig's default model here (single-thread XLA), and its size."""
    import jax
    import numpy as np

    from islands.learners import data
    from islands.learners.task import TaskStream
    from islands.learners.unit import TrainingSpec, build_task, build_training

    spec = TrainingSpec(model=dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                                   seq_len=64), batch_size=8)
    task = build_task(spec, data.synthetic_corpus(200_000).train)
    _, params, optimizer, train_step = build_training(spec, task=task)
    sampler = TaskStream(task, 0, 1)
    opt_state = optimizer.init(params)
    for i in range(5):
        params, opt_state, loss = train_step(params, opt_state, sampler.batch_at(i))
        float(loss)
    t0 = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss = train_step(params, opt_state, sampler.batch_at(i))
        float(loss)
    n = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))
    return (time.perf_counter() - t0) / steps, n


def sustained(name: str, model_params: int, fragments: int, step_s: float, learners: int,
              rounds: int, codec_kind: str, measured: Optional[dict] = None) -> dict:
    """Most learners for one scenario (P = H = ``fragments``), measured at its own fragment size."""
    frag = max(1, model_params // fragments)
    m = measured or measure_size(frag, learners, rounds, codec_kind)
    r = pushes_per_s(fragments, fragments, step_s)
    c_push, a, b = m["push_ms"] / 1e3, m["merge_a_ms"] / 1e3, m["merge_b_ms"] / 1e3
    c_reply = frag * 4 / (m["copy_gb_per_s"] * 1e9)
    limits = max_learners(r, c_push, a, b, c_reply)
    return {"scenario": name, "model_params": model_params, "P=H": fragments,
            "step_ms": 1e3 * step_s, "fragment_params": frag, "pushes_per_s_per_learner": r,
            "push_ms": m["push_ms"], "merge_a_ms": m["merge_a_ms"], "merge_b_ms": m["merge_b_ms"],
            "reply_ms": 1e3 * c_reply,
            "utilisation_1_learner": r * (c_push + a + b + c_reply),
            "max_learners_worst": limits["worst"],
            "max_learners_best": limits["best"]}


# -- syncer shards ----------------------------------------------------------------------------
def largest_model(kappa_s: dict, fragments: int, sync_every_steps: int, step_s: float,
                  learners: int, shards: int) -> dict:
    """N_max, the most parameters one job's S shards keep up with (see the module docstring).

    ``kappa_s``: seconds per fragment parameter of ``push``, ``merge_a``, ``merge_b``, ``reply``.
    Shards beyond P own no fragment (S is capped at P).

    >>> k = {"push": 1e-9, "merge_a": 1e-9, "merge_b": 1e-9, "reply": 1e-9}
    >>> largest_model(k, 24, 24, 0.072, 1, 1)["worst"] / 1e6   # 24·0.072 / 4e-9
    432.0
    >>> largest_model(k, 24, 24, 0.072, 1, 8)["worst"] / 1e6
    3456.0
    >>> largest_model(k, 24, 24, 0.072, 4, 1)["best"] / 1e6    # 1.728 / (1e-9 + 4·3e-9)
    132.923077
    """
    s = min(shards, fragments)
    budget_s = s * sync_every_steps * step_s
    per_push = kappa_s["push"] + kappa_s["merge_b"] + kappa_s["reply"]
    worst = budget_s / (learners * (per_push + kappa_s["merge_a"]))
    best = budget_s / (kappa_s["merge_a"] + learners * per_push)
    return {"worst": round(worst, 0 if worst > 1e6 else 6), "best": round(best, 0 if best > 1e6 else 6)}


def _shard_worker(args) -> dict:
    """One shard in its own process: build, warm up, wait at the barrier, run timed rounds."""
    num_params, learners, rounds, codec_kind, barrier, copy_only = args
    use_syncer_env()
    ensure_islands_importable()
    import numpy as np

    nbytes = num_params * 4
    if copy_only:
        src = np.ones(num_params, np.float32)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        copies = max(rounds * learners, int(4e9 // nbytes))   # ≥ 4 GB: long enough to time
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(copies):
            np.copyto(dst, src)
        t1 = time.perf_counter()
        return {"t0": t0, "t1": t1, "bytes": copies * nbytes, "merge_s": 0.0}
    bench = build_bench(num_params, learners, codec_kind)
    one_round(bench, learners)   # warm
    barrier.wait()
    t0, merge_s = time.perf_counter(), 0.0
    for _ in range(rounds):
        merge_s += one_round(bench, learners)[1]
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "bytes": rounds * learners * nbytes, "merge_s": merge_s}


def _spin(n: int) -> float:
    t0, x = time.perf_counter(), 0
    for i in range(n):
        x += i
    return time.perf_counter() - t0


def cpu_parallelism(processes: int, n: int = 5_000_000) -> float:
    """How many cores ``processes`` CPU-bound processes get at once here right now: their total
    work over the wall time, in units of one process alone (2.0: two free cores; about 1.0 on a
    machine whose cores other work holds)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    alone = min(_spin(n) for _ in range(2))   # this process on its own
    with ctx.Pool(processes) as pool:
        pool.map(_spin, [1000] * processes)   # the workers are up before the clock starts
        t0 = time.perf_counter()
        pool.map(_spin, [n] * processes)
        wall = time.perf_counter() - t0
    return processes * alone / wall


def measure_shards(shards: int, num_params: int, learners: int, rounds: int,
                   codec_kind: str) -> dict:
    """S shard processes at once: merged GB/s over the wall time, and S processes' copy rate."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")   # JAX is not fork-safe
    out = {"shards": shards, "fragment_params": num_params, "learners": learners,
           "rounds": rounds}
    for copy_only in (False, True):
        with ctx.Manager() as manager:
            barrier = manager.Barrier(shards)
            with ctx.Pool(shards) as pool:
                parts = pool.map(_shard_worker, [(num_params, learners, rounds, codec_kind,
                                                  barrier, copy_only)] * shards)
        # perf_counter is CLOCK_MONOTONIC on Linux: comparable across processes.
        wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
        gbps = sum(p["bytes"] for p in parts) / wall / 1e9
        if copy_only:
            out["copy_gb_per_s"] = gbps
        else:
            out["merged_gb_per_s"] = gbps
            out["merge_only_gb_per_s"] = sum(p["bytes"] / p["merge_s"] for p in parts) / 1e9
            out["wall_s"] = wall
    out["cores_available"] = cpu_parallelism(shards)
    out["ratio_to_copy"] = out["merged_gb_per_s"] / out["copy_gb_per_s"]
    out["merge_ratio_to_copy"] = out["merge_only_gb_per_s"] / out["copy_gb_per_s"]
    return out


def shard_model(g1_gbps: float, rho: float, copy_gbps: float, targets=(1, 2, 4, 8, 16)
                ) -> list[dict]:
    """G(S) = min(S·g₁, ρ·B): S shards on S free cores, until their memory traffic fills the
    machine's all-core copy bandwidth B (a merge moves about 1/ρ times a copy's bytes per merged
    byte, ρ = the merge's measured ratio to copy).

    >>> [round(r["model_gb_per_s"], 2) for r in shard_model(0.5, 0.1, 20.0, (1, 2, 8))]
    [0.5, 1.0, 2.0]
    """
    return [{"shards": s, "linear_gb_per_s": s * g1_gbps,
             "model_gb_per_s": min(s * g1_gbps, rho * copy_gbps),
             "bound": "cores" if s * g1_gbps <= rho * copy_gbps else "memory bandwidth"}
            for s in targets]


# -- plot -----------------------------------------------------------------------------------------
def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["params"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    ax.plot(sizes, [r["copy_gb_per_s"] for r in rows], "s--", color="black",
            label="np.copyto of the same bytes (ceiling)")
    ax.plot(sizes, [r["merged_gb_per_s"] for r in rows], "o-", color="#4c72b0",
            label=f"syncer: fp32 bytes merged / s ({rows[0]['learners']} learners per round)")
    ax.plot(sizes, [r["wire_gb_per_s"] for r in rows], "^-", color="#dd8452",
            label="syncer: encoded (wire) bytes accepted / s")
    for r in rows:
        ax.annotate(f"{r['ratio_to_copy']:.1%} of copy\n{r['merges_per_s']:.3g} merges/s",
                    (r["params"], r["merged_gb_per_s"]), textcoords="offset points",
                    xytext=(0, -26), ha="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("fragment size (parameters)")
    ax.set_ylabel("GB / s")
    lo = min(min(r["wire_gb_per_s"] for r in rows), min(r["merged_gb_per_s"] for r in rows))
    ax.set_ylim(lo / 4, max(r["copy_gb_per_s"] for r in rows) * 3)
    ax.set_xlim(min(sizes) / 2, max(sizes) * 2)
    ax.set_title("syncer merge throughput vs the memory-copy ceiling")
    ax.legend(fontsize=8, loc="upper right")
    ax = axes[1]
    def per(key: str) -> list[float]:  # ms per fragment → ns per parameter
        return [1e6 * r[key] / r["params"] for r in rows]

    ax.plot(sizes, per("push_ms"), "o-",
            label="accept_push (decode, check, θ = base + δ), per push")
    ax.plot(sizes, per("merge_ms"), "o-",
            label=f"merge + outer step, round of {rows[0]['learners']} learners")
    ax.plot(sizes, per("merge_1_ms"), "o-", label="merge + outer step, round of 1 learner")
    ax.plot(sizes, [1e6 * r["copy_ms"] / r["learners"] / r["params"] for r in rows], "s--",
            color="black", label="np.copyto of one fragment")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("fragment size (parameters)")
    ax.set_ylabel("ns per parameter")
    ax.set_title("cost per parameter, by part (fastest round)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M, 10M, 30M")
    parser.add_argument("--sizes", default=None, help="comma list of fragment sizes (parameters)")
    parser.add_argument("--learners", type=int, default=4, help="M: pushes per merge round")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per size")
    from islands.syncer.codec_kinds import KINDS   # JAX-free

    parser.add_argument("--codec", default="nf2", choices=list(KINDS),
                        help="the pushes' codec (default: the job's, nf2)")
    parser.add_argument("--step-time-s", type=float, default=None,
                        help="tiny scenario's step time (default: measured here)")
    parser.add_argument("--fragments", type=int, default=4, help="P = H of the tiny scenario")
    parser.add_argument("--shards", default="1,2",
                        help="syncer shards S to measure at once (comma list; '' skips)")
    parser.add_argument("--shard-params", type=int, default=10_000_000,
                        help="fragment size of each shard in the shard measurement")
    parser.add_argument("--model-copy-gbps", type=float, default=100.0,
                        help="all-core np.copyto GB/s of the machine the S model assumes "
                             "(a server socket; this machine's is measured)")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "out"))
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    env = use_syncer_env()
    ensure_islands_importable()
    sizes = ([int(float(s)) for s in args.sizes.split(",")] if args.sizes
             else [1_000_000, 10_000_000, 30_000_000] if args.quick
             else [1_000_000, 10_000_000, 100_000_000])
    rows = []
    for size in sizes:
        rounds = args.rounds or max(3, min(10, int(2e7 // size)))
        rows.append(measure_size(size, args.learners, rounds, args.codec))
        print(f"  measured {size:,d} parameters", file=sys.stderr, flush=True)
    step_s, tiny_params = ((args.step_time_s, 119_104) if args.step_time_s
                           else tiny_step_s())
    scenarios = [
        sustained("tiny CPU model, step measured here", tiny_params, args.fragments, step_s,
                  args.learners, 10, args.codec),
        sustained("124M model, 72 ms H100 step (docs/architecture.md#learners-on-accelerators)", 124_000_000, 24, 0.072,
                  args.learners, 3, args.codec),
    ]
    shard_rows = []
    for shards in [int(x) for x in args.shards.split(",") if x.strip()]:
        shard_rows.append(measure_shards(shards, args.shard_params, args.learners,
                                         args.rounds or 8, args.codec))
        print(f"  measured {shards} shard(s) at once", file=sys.stderr, flush=True)
    # The model: one shard's measured rate and ratio at --shard-params, and a machine's copy
    # bandwidth (this one's, measured with the most shards; and a server's, assumed).
    models = {}
    one = next((r for r in shard_rows if r["shards"] == 1), None)
    if one is not None:
        here = max(r["copy_gb_per_s"] for r in shard_rows)
        for label, copy_gbps in ((f"this machine ({here:.3g} GB/s copy)", here),
                                 (f"{args.model_copy_gbps:g} GB/s copy", args.model_copy_gbps)):
            # ρ: the merge's own ratio (its in-place passes are memory-bound; the pushes' int4
            # decode is compute-bound and adds little traffic), so the cap is the bytes a
            # machine's memory can carry for merges.
            models[label] = shard_model(one["merged_gb_per_s"], one["merge_ratio_to_copy"],
                                        copy_gbps)
    # The largest model at P = H = 24, 72 ms per step, from the per-parameter costs measured at
    # the 124M scenario's own fragment size (124M / 24; costs are linear in the fragment size).
    big = scenarios[1]
    kappa = {"push": big["push_ms"], "merge_a": big["merge_a_ms"], "merge_b": big["merge_b_ms"],
             "reply": big["reply_ms"]}
    kappa = {k: v / 1e3 / big["fragment_params"] for k, v in kappa.items()}
    largest = [{"shards": s, "learners": l, **{f"n_max_{k}": v for k, v in
                largest_model(kappa, 24, 24, 0.072, l, s).items()}}
               for s in (1, 8) for l in (1, 4, 8)]
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "syncer_throughput.png")
    plot(rows, png)
    print(f"syncer throughput · codec {args.codec} · {args.learners} learners per round · "
          f"thread env {env}")
    print(rules_line())
    print(format_table(rows, ["params", "fragment_mb", "push_ms", "merge_ms", "round_ms",
                              "merges_per_s", "merged_gb_per_s", "copy_gb_per_s", "ratio_to_copy",
                              "merge_ratio_to_copy",
                              "wire_gb_per_s"]))
    print("\nmost learners one syncer sustains (utilisation ≤ 1 on one event loop):")
    print("  r = P/(H·ξ_step);  c_merge(L) = a + b·L;  c_reply = 4·N/P bytes ÷ copy rate")
    print("  worst (each push merged alone): L_max = ⌊1 / (r·(c_push + a + b + c_reply))⌋")
    print("  best (one merge per round of L): L_max = ⌊(1/r − a) / (c_push + b + c_reply)⌋")
    print("  utilisation_1_learner = r·(c_push + a + b + c_reply): above 1, the syncer falls "
          "behind even one learner when each push is merged alone")
    print(format_table(scenarios, ["scenario", "P=H", "step_ms", "fragment_params",
                                   "pushes_per_s_per_learner", "push_ms", "merge_a_ms",
                                   "merge_b_ms", "reply_ms", "utilisation_1_learner",
                                   "max_learners_worst",
                                   "max_learners_best"]))
    if shard_rows:
        print(f"\nsyncer shards at once ({args.shard_params:,d}-parameter fragment each, "
              f"{args.learners} learners per round; copy = as many processes doing np.copyto):")
        print(format_table(shard_rows, ["shards", "cores_available", "merged_gb_per_s",
                                        "merge_only_gb_per_s",
                                        "copy_gb_per_s", "ratio_to_copy",
                                        "merge_ratio_to_copy", "wall_s"]))
        for label, model in models.items():
            print(f"model G(S) = min(S·g₁, ρ·B), B = {label}:")
            print(format_table(model, ["shards", "linear_gb_per_s", "model_gb_per_s", "bound"]))
    print(f"\nlargest model sustained at P = H = 24, 72 ms per step (costs per parameter at "
          f"{big['fragment_params']:,d}-parameter fragments; worst: each push merged alone, best: one "
          "merge per round of L; S shards on S free cores):")
    print(format_table(largest, ["shards", "learners", "n_max_worst", "n_max_best"]))
    result = {"benchmark": "syncer_throughput", "codec": args.codec, "learners": args.learners,
              "rules": rules_line(),
              "sizes": rows, "sustained": scenarios, "shards": shard_rows,
              "shard_model": models, "largest_model": largest, "kappa_s_per_param": kappa,
              "thread_env": env, "png": png,
              "ray_confirmation": "not run (pure core only)",
              # the service's merge rules (islands.defaults), but 2 versions of history
              "syncer_rules": "the service's defaults, history_versions 2", "command": command_line(),
              "machine": machine_info(), "elapsed_s": round(time.time() - t_start, 1)}
    with open(os.path.join(args.out, "syncer_throughput.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
