"""In-process driver: M learners and the syncer in one process, on a virtual clock.

Deterministic discrete-event simulation of the Decoupled DiLoCo data path, built from exactly the
core objects the Ray actors wrap (``LearnerCore``, ``SyncerCore``). It is the engine for the fast
tests, the quality benchmark and the in-process demo. A learner never waits here either: it keeps
stepping while its pushes travel, and adopts a reply at a step boundary.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from islands.learners.core import LearnerCore
from islands.syncer import fragments as fragments_lib
from islands.syncer.core import MergeResult, SyncerCore
from islands.syncer.fragments import FragmentPlan

# Event priorities at equal times: pushes leave before the syncer decides, the syncer answers
# before learners start their next step (so zero latency means "answered at this boundary").
_STEP_DONE, _ARRIVE, _CHECK, _REPLY, _STEP_START = range(5)


@dataclass(frozen=True)
class Fleet:
    """Speeds and links of the simulated learners.

    Attributes:
      speed_factors: one per learner; step time = step_time_s / speed.
      step_time_s: nominal seconds per inner step.
      step_noise: relative step-time noise, uniform in [−noise, +noise], seeded.
      latency_s: one-way latency of every message.
      bandwidth_bytes_per_s: link bandwidth (inf = instantaneous transfer).
      seed: seed of the noise.
    """

    speed_factors: Sequence[float]
    step_time_s: float = 1.0
    step_noise: float = 0.0
    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = math.inf
    seed: int = 0

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass
class RunRecord:
    """What an in-process run produced."""

    global_params: Any
    learner_params: list[Any]
    merges: list[MergeResult] = field(default_factory=list)
    evals: list[tuple[float, int, float]] = field(default_factory=list)  # (time_s, tokens, loss)
    train_losses: list[list[float]] = field(default_factory=list)
    rejected: dict = field(default_factory=dict)
    wire_bytes_up: int = 0
    wire_bytes_down: int = 0
    tokens_processed: int = 0
    end_time_s: float = 0.0
    steps: list[int] = field(default_factory=list)


def run_inprocess(
    *,
    learners: list[LearnerCore],
    syncer: SyncerCore,
    train_step: Callable[[Any, Any, Any], tuple[Any, Any, Any]],
    batch_for: Callable[[int, int], Any],
    tokens_per_batch: int,
    fleet: Fleet,
    num_fragments: int,
    sync_every_steps: int,
    steps: int,
    evaluate: Optional[Callable[[Any], float]] = None,
    eval_every_steps: int = 0,
    assemble: Optional[Callable[[dict], Any]] = None,
) -> RunRecord:
    """Runs every learner for ``steps`` inner steps and returns the final state.

    Args:
      learners: one LearnerCore per learner, already registered with ``syncer``.
      syncer: the syncer core.
      train_step: ``(params, opt_state, batch) -> (params, opt_state, loss)``.
      batch_for: ``(learner_index, batch_index) -> batch``; batch index = learner step.
      tokens_per_batch: tokens in one batch (counters and weights).
      fleet: speeds and links.
      num_fragments, sync_every_steps: P and H.
      steps: inner steps per learner.
      evaluate: loss of a full parameter tree (the global model is evaluated).
      eval_every_steps: evaluate after every this many steps of learner 0 (0 = only start and end).
      assemble: flat ``{path: array}`` -> parameter tree, for ``evaluate``.
    """
    rng = np.random.default_rng(fleet.seed)
    events: list = []
    seq = itertools.count()
    record = RunRecord(global_params=None, learner_params=[],
                       train_losses=[[] for _ in learners])
    live = frozenset(learner.learner for learner in learners)
    index_of = {learner.learner: i for i, learner in enumerate(learners)}

    def schedule(time_s: float, priority: int, kind: str, payload: Any) -> None:
        heapq.heappush(events, (time_s, priority, next(seq), kind, payload))

    def step_time(i: int) -> float:
        noise = rng.uniform(-fleet.step_noise, fleet.step_noise) if fleet.step_noise else 0.0
        return fleet.step_time_s / fleet.speed_factors[i] * (1.0 + noise)

    def global_tree() -> Any:
        return assemble(syncer.params_flat()) if assemble else syncer.params_flat()

    def tokens_applied() -> int:
        return sum(entry.applied_tokens for entry in syncer.ledger.values())

    def maybe_eval(now_s: float) -> None:
        if evaluate is not None:
            record.evals.append((now_s, tokens_applied(), float(evaluate(global_tree()))))

    slowest_step_s = max(fleet.step_time_s / s for s in fleet.speed_factors)
    maybe_eval(0.0)
    for i in range(len(learners)):
        schedule(0.0, _STEP_START, "start", i)

    while events:
        now, _, _, kind, payload = heapq.heappop(events)
        if kind == "start":
            i = payload
            learner = learners[i]
            learner.adopt_ready()
            if learner.step >= steps:
                continue
            batch = batch_for(i, learner.step)
            learner.params, learner.opt_state, loss = train_step(
                learner.params, learner.opt_state, batch)
            record.train_losses[i].append(float(loss))
            dt = step_time(i)
            learner.record_step(tokens_per_batch, dt)
            record.tokens_processed += tokens_per_batch
            schedule(now + dt, _STEP_DONE, "done", i)
        elif kind == "done":
            i = payload
            learner = learners[i]
            for p in learner.due(num_fragments, sync_every_steps):
                plan = learner.make_push(p, syncer.epoch)
                record.wire_bytes_up += plan.wire_bytes
                schedule(now + fleet.transfer_s(plan.wire_bytes), _ARRIVE, "arrive", plan.push)
            if i == 0 and eval_every_steps and learner.step % eval_every_steps == 0:
                maybe_eval(now)
            schedule(now, _STEP_START, "start", i)
        elif kind == "arrive":
            push = payload
            verdict = syncer.accept_push(push, now)
            if not verdict.ok:
                record.rejected[verdict.reason] = record.rejected.get(verdict.reason, 0) + 1
                current, version = syncer.fragment(push.fragment) if (
                    0 <= push.fragment < len(syncer.slots)) else (None, None)
                learners[index_of[push.learner]].push_refused(push.fragment, current, version)
                continue
            schedule(now, _CHECK, "check", push.fragment)
        elif kind == "check":
            p = payload
            slot = syncer.slots[p]
            if not slot.round:
                continue
            quorum_s = (slot.quorum_reached_at_s or now) - (slot.round_opened_at_s or now)
            grace = syncer.grace_s(slowest_step_s, quorum_s, 2 * fleet.latency_s)
            decision = syncer.decide(p, now, live, grace)
            if decision.merge:
                result = syncer.merge(p, decision.reason.value, live_count=len(live))
                record.merges.append(result)
                nbytes = sum(int(np.asarray(v).nbytes) for v in result.params.values())
                for name in result.learners:
                    record.wire_bytes_down += nbytes
                    schedule(now + fleet.transfer_s(nbytes), _REPLY, "reply",
                             (index_of[name], p, result.params, result.version))
            elif decision.wait_until_s is not None:
                schedule(decision.wait_until_s, _CHECK, "check", p)
        elif kind == "reply":
            i, p, fragment, version = payload
            learners[i].offer_reply(p, fragment, version)
        record.end_time_s = now

    maybe_eval(record.end_time_s)
    record.global_params = global_tree()
    record.learner_params = [learner.params for learner in learners]
    record.steps = [learner.step for learner in learners]
    return record


def assemble_like(template: Any) -> Callable[[dict], Any]:
    """Returns ``flat {path: array} -> tree`` shaped like ``template``."""
    import jax

    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    paths = [fragments_lib.path_to_str(path) for path, _ in leaves_with_paths]

    def assemble(flat: dict) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [flat[p] for p in paths])

    return assemble


def build_syncer_and_learners(*, params: Any, opt_init: Callable[[Any], Any], plan: FragmentPlan,
                              settings, outer_optimizer, error_feedback_factory: Callable[[], Any],
                              decode, wire_bytes, learner_ids: Sequence[str], merge_alpha: float,
                              is_embedding=lambda path: False) -> tuple[SyncerCore, list[LearnerCore]]:
    """A syncer holding ``params`` and learners registered with it, all starting from ``params``."""
    fragments = [fragments_lib.extract(params, plan, p) for p in range(plan.num_fragments)]
    syncer = SyncerCore(fragments, settings, outer_optimizer, decode, is_embedding)
    cores = []
    for learner_id in learner_ids:
        _, frags = syncer.register(learner_id, 0)
        cores.append(LearnerCore(learner_id, params, opt_init(params), plan,
                                 [v for _, v in frags], error_feedback_factory(), wire_bytes,
                                 decode, overlap_steps=settings.overlap_steps,
                                 merge_alpha=merge_alpha))
    return syncer, cores
