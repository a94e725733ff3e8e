"""Shared pieces of the goodput, bandwidth and quality benchmarks: argparse, the machine record,
the model/data setup, one Decoupled DiLoCo run and one data-parallel run in the in-process
(virtual clock, real JAX training on CPU) harness, the table and the final JSON line."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from islands import CARRY_OVERLAP, defaults  # noqa: E402
from islands.learners import data, inner, model  # noqa: E402
from islands.orchestrator import inprocess  # noqa: E402
from islands.studies import baseline  # noqa: E402
from islands.orchestrator.chaos import FaultPlan, RestartCosts  # noqa: E402
from islands.syncer import codec as codec_lib  # noqa: E402
from islands.syncer import downlink as downlink_lib  # noqa: E402
from islands.syncer import fragments, outer  # noqa: E402
from islands.syncer.core import SyncerSettings  # noqa: E402
from islands.syncer import merge as merge_lib  # noqa: E402
from islands.syncer.merge import MergeRule  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(BENCH_DIR, "out")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run, < 5 min on 2 CPU cores")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the PNG and JSON")
    p.add_argument("--seed", type=int, default=0)
    return p


def machine() -> dict:
    return {"command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
            "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "numpy": np.__version__}


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[j]) for row in cells]) for j, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if not math.isfinite(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


# The syncer rules this process's runs merged under (``note_rules``), named in ``finish``'s output.
RULES_RUN: list = []


def note_rules(settings) -> None:
    """Notes a run's ``SyncerSettings`` rules for ``finish`` to name."""
    rules = settings.rules()
    if rules not in RULES_RUN:
        RULES_RUN.append(rules)


def finish(name: str, result: dict, out_dir: str) -> None:
    """Writes ``<out>/<name>.json`` and prints the JSON object as the last line of stdout; with
    ``syncer_rules``: the merge rules its runs used (the service's unless a run said otherwise)."""
    if RULES_RUN and "syncer_rules" not in result:
        result = {**result, "syncer_rules": RULES_RUN[0] if len(RULES_RUN) == 1 else RULES_RUN}
    os.makedirs(out_dir, exist_ok=True)
    line = json.dumps(_clean(result), sort_keys=False)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        f.write(line + "\n")
    sys.stdout.flush()
    print(line, flush=True)


def save_figure(fig, out_dir: str, name: str) -> str:
    """Writes ``fig`` as ``out_dir/name`` (110 dpi), closes it, returns the path."""
    plt = pyplot()

    path = os.path.join(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- model, data and the two systems ---------------------------------------------------------------
@dataclass
class Setup:
    """One model on the stdlib byte corpus, sharded over ``num_learners``."""

    cfg: model.ModelConfig
    params: Any
    optimizer: Any
    train_step: Callable
    loss_fn: Callable
    samplers: list
    tokens_per_batch: int
    evaluate: Callable[[Any], float]
    num_params: int
    schedule: tuple = ()   # the inner lr schedule, as the syncer checks drifts against it
    is_embedding: Callable[[str], bool] = model.is_embedding_path   # the merge's hint
    name: str = "bytelm"

    def batch_for(self, i: int, k: int):
        return self.samplers[i].batch_at(k)


_CORPUS: dict = {}


def make_setup(*, model_kwargs: dict, num_learners: int, batch_size: int, total_steps: int,
               lr: float = 3e-3, warmup_steps: int = 20, max_bytes: int = 2_000_000,
               eval_batches: int = 8, seed: int = 0) -> Setup:
    cfg = model.ModelConfig(**model_kwargs)
    params = jax.jit(model.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(seed))
    if max_bytes not in _CORPUS:
        _CORPUS[max_bytes] = data.load_stdlib_corpus(max_bytes=max_bytes)
    corpus = _CORPUS[max_bytes]
    optimizer = inner.inner_optimizer(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    samplers = [data.ShardSampler(corpus.train, batch_size, cfg.seq_len, i, num_learners,
                                  seed=seed) for i in range(num_learners)]
    eval_fn = inner.make_eval_fn(cfg)
    eval_set = data.eval_batches(corpus.eval, 16, cfg.seq_len, eval_batches)
    return Setup(cfg=cfg, params=params, optimizer=optimizer,
                 train_step=inner.make_train_step(cfg, optimizer),
                 loss_fn=lambda p, b: model.loss_fn(p, b, cfg), samplers=samplers,
                 tokens_per_batch=samplers[0].tokens_per_batch,
                 evaluate=lambda p: eval_fn(p, eval_set), num_params=model.num_params(params),
                 schedule=(lr, warmup_steps, total_steps, inner.END_LR_FRACTION))


def task_setup(task_path: str, *, num_learners: int, total_steps: int, lr: float = 3e-3,
               warmup_steps: int = 20, seed: int = 0, args: Optional[dict] = None) -> Setup:
    """A :class:`Setup` from a user's Task (``learners/task.py``), e.g.
    ``islands.tasks.flax_lm:task`` (the Flax + Grain reference task): the task's own init,
    loss, Grain batches (shard i of ``num_learners`` through a ``TaskStream``), eval batches
    and merge hint, with the project's inner AdamW unless the task brings its own optimizer.
    Batches are ``Step`` s (index + batch), as the learner loop hands them to a task's step."""
    from islands.learners import task as task_lib

    task = task_lib.load_task(task_path, {**(args or {}), "seed": seed})
    optimizer = task.optimizer or inner.inner_optimizer(lr=lr, warmup_steps=warmup_steps,
                                                        total_steps=total_steps)
    params = jax.jit(task.init_params)(jax.random.PRNGKey(seed))
    streams = [task_lib.TaskStream(task, i, num_learners) for i in range(num_learners)]
    evaluate, eval_set = task_lib.make_eval_fn(task), list(task.eval_batches())
    loss = task_lib.scalar_loss(task)
    return Setup(   # samplers: TaskStreams, whose batch_at is a ShardSampler's
        cfg=None, params=params, optimizer=optimizer,
        train_step=task_lib.make_train_step(task, optimizer, seed),
        loss_fn=lambda p, step: loss(p, step.batch, task_lib.step_rng(seed, step.index)),
        samplers=streams, tokens_per_batch=int(task.tokens(streams[0].batch_at(0).batch)),
        evaluate=lambda p: evaluate(p, eval_set),
        num_params=int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))),
        schedule=(lr, warmup_steps, total_steps, inner.END_LR_FRACTION),
        is_embedding=task.is_embedding, name=task_path)


def run_ours(setup: Setup, *, learner_ids: Sequence[str], fleet: inprocess.Fleet,
             num_fragments: int, sync_every_steps: int, overlap_steps: int = 2,
             min_learners: int = 1, grace_gamma: float = 0.5, grace_cap_s: float = 5.0,
             codec: str = "int4", outer_kind: str = "nesterov",
             outer_kwargs: Optional[dict] = None, merge_rule: str = "rda",
             steps: int = 10 ** 9,
             until_s: Optional[float] = None,
             faults: Optional[FaultPlan] = None, restart: RestartCosts = RestartCosts(),
             eval_every_steps: int = 0, codec_block_size: int = codec_lib.DEFAULT_BLOCK_SIZE,
             downlink: str = "none",
             downlink_block_size: int = codec_lib.DEFAULT_BLOCK_SIZE,
             merge_alpha: float = 0.0, carry_overlap: bool = CARRY_OVERLAP,
             staleness_discount: float = 0.0, outer_gradient: str = defaults.OUTER_GRADIENT,
             round_step: str = defaults.ROUND_STEP, staleness_share: float = defaults.STALENESS_SHARE,
             schedule_clock: str = defaults.SCHEDULE_CLOCK,
             round_wait: float = defaults.ROUND_WAIT) -> inprocess.RunRecord:
    """Decoupled DiLoCo in the in-process driver (docs/architecture.md#the-algorithm defaults: RDA merge, outer Nesterov
    0.7/0.9, α = 0, error feedback; ``outer_kind="sgd"`` is sgd(1.0), plain averaging;
    ``outer_kwargs`` sets the outer optimizer's lr and momentum). ``codec`` encodes the pushes,
    ``downlink`` the syncer's answers ("none": the merged fragment in fp32). The asynchrony
    rules are the service's unless given (``finish`` names those that ran)."""
    c = codec_lib.make_codec(codec, block_size=codec_block_size)
    down = downlink_lib.DownlinkSettings(
        None if downlink == "none" else codec_lib.make_codec(downlink,
                                                             block_size=downlink_block_size))
    settings = SyncerSettings(min_learners=min_learners, overlap_steps=overlap_steps,
                              grace_gamma=grace_gamma, grace_cap_s=grace_cap_s,
                              merge_rule=MergeRule(merge_rule),
                              staleness_discount=staleness_discount,
                              outer_gradient=merge_lib.OuterGradientRule(outer_gradient),
                              round_step=merge_lib.RoundStep(round_step),
                              staleness_share=staleness_share,
                              schedule_clock=merge_lib.ScheduleClock(schedule_clock),
                              round_wait=round_wait,
                              inner_schedule=setup.schedule or None,
                              tokens_per_step=setup.tokens_per_batch)
    note_rules(settings)
    syncer, learners = inprocess.build_syncer_and_learners(
        params=setup.params, opt_init=setup.optimizer.init,
        plan=fragments.partition(setup.params, num_fragments), settings=settings,
        outer_optimizer=(outer.build(outer_kind, **outer_kwargs) if outer_kwargs is not None
                         else outer.build() if outer_kind == "nesterov"
                         else outer.build(outer_kind, lr=1.0, momentum=0.0)),
        error_feedback_factory=lambda: codec_lib.error_feedback(c),
        decode=lambda codes: codec_lib.decode_tree(c, codes),
        wire_bytes=codec_lib.tree_wire_bytes, learner_ids=list(learner_ids),
        merge_alpha=merge_alpha, carry_overlap=carry_overlap,
        is_embedding=setup.is_embedding, downlink=down)
    record = inprocess.run_inprocess(
        learners=learners, syncer=syncer, train_step=setup.train_step,
        batch_for=setup.batch_for, tokens_per_batch=setup.tokens_per_batch, fleet=fleet,
        num_fragments=num_fragments, sync_every_steps=sync_every_steps, steps=steps,
        until_s=until_s, evaluate=setup.evaluate, eval_every_steps=eval_every_steps,
        assemble=inprocess.assemble_like(setup.params), faults=faults, restart=restart,
        opt_init=setup.optimizer.init)
    record.syncer = syncer
    return record


_SYNC_STEPS: dict = {}


def run_dp(setup: Setup, *, learner_ids: Sequence[str], fleet: inprocess.Fleet,
           checkpoint_every_steps: int = 100, steps: Optional[int] = None,
           until_s: Optional[float] = None, faults: Optional[FaultPlan] = None,
           restart: RestartCosts = RestartCosts(),
           eval_every_steps: int = 0) -> baseline.BaselineRecord:
    """Synchronous data-parallel on the same model, shards and inner optimizer."""
    key = id(setup)
    if key not in _SYNC_STEPS:
        _SYNC_STEPS[key] = baseline.make_sync_step(setup.loss_fn, setup.optimizer)
    return baseline.run_baseline(
        params=setup.params, optimizer=setup.optimizer, loss_fn=setup.loss_fn,
        batch_for=setup.batch_for, tokens_per_batch=setup.tokens_per_batch, fleet=fleet,
        learner_ids=learner_ids, checkpoint_every_steps=checkpoint_every_steps, steps=steps,
        until_s=until_s, faults=faults, restart=restart, evaluate=setup.evaluate,
        eval_every_steps=eval_every_steps, sync_step=_SYNC_STEPS[key])


class Stopwatch:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return round(time.time() - self.t0, 1)
