"""Synchronous data-parallel baseline in the same harness: same model, data, learners, fault plan.

Classic semantics (docs/architecture.md#goodput): at every step each of the M learners computes the gradient of its
own batch (``batch_for(m, step)``, the same shards as Decoupled DiLoCo), the gradients are averaged
(an exact all-reduce, in process) and one shared inner-optimizer step is taken. A step lasts as
long as the slowest learner plus the ring all-reduce. Any learner loss stops everyone until the
learner is back (detect + repair + restart, ``chaos.RestartCosts``), then everyone rolls back to the
last checkpoint (every ``checkpoint_every_steps`` steps), losing the steps since.

How it runs: the timeline (``simulate_timeline``) is computed first, on the virtual clock and
without training. Data order is deterministic and a checkpoint holds params and optimizer state,
so a rolled-back step recomputes exactly what it computed before; ``run_baseline`` therefore trains
the no-failure trajectory once, up to the final step the timeline reaches, and maps it onto the
failure timeline (step k's result exists from the end of the attempt of step k that was kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from islands.orchestrator.chaos import (LEARNER_LOSS_KINDS, Fault, FaultKind, FaultPlan,
                                        FaultWindows, RestartCosts)
from islands.orchestrator.inprocess import Fleet, series_from_intervals

FP32_BYTES = 4


def ring_allreduce_bytes(num_params: int, num_learners: int,
                         bytes_per_param: float = FP32_BYTES) -> float:
    """Bytes one learner sends in one ring all-reduce: ``2(M−1)/M · bytes_per_param · params``.

    Reduce-scatter then all-gather, each M − 1 rounds of a 1/M chunk; it receives as many.

    >>> ring_allreduce_bytes(1000, 4)
    6000.0
    """
    if num_learners < 1:
        raise ValueError(f"num_learners must be >= 1, got {num_learners}")
    return 2.0 * (num_learners - 1) / num_learners * bytes_per_param * num_params


def make_sync_step(loss_fn: Callable[[Any, Any], jax.Array],
                   optimizer: optax.GradientTransformation):
    """A jitted ``sync_step(params, opt_state, batches) -> (params, opt_state, mean loss)``.

    ``batches`` is a sequence of M per-learner batches of equal shapes: the M gradients are
    computed separately (vmap over learners), averaged leaf by leaf — the all-reduce — and one
    ``optimizer`` step is applied to the average.
    """

    grad_fn = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0))

    @jax.jit
    def step(params, opt_state, stacked):
        losses_M, grads_M = grad_fn(params, stacked)
        grads = jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), grads_M)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(losses_M)

    def sync_step(params, opt_state, batches: Sequence[Any]):
        stacked = jax.tree_util.tree_map(lambda *b: jnp.stack([jnp.asarray(x) for x in b]),
                                         *batches)
        return step(params, opt_state, stacked)

    return sync_step


@dataclass(frozen=True)
class StepAttempt:
    """One attempt of global step ``step`` on ``[start_s, end_s)``; ``kept`` = never rolled back.

    An attempt cut short by a failure has ``completed`` False (its all-reduce never happened).
    """

    step: int
    start_s: float
    end_s: float
    completed: bool = True
    kept: bool = False


@dataclass
class Timeline:
    """The baseline's run on the virtual clock, before any training."""

    num_learners: int
    attempts: list[StepAttempt] = field(default_factory=list)
    outages: list[tuple[float, float, tuple[str, ...]]] = field(default_factory=list)
    rollbacks: list[tuple[float, int, int]] = field(default_factory=list)  # (time, from, to)
    checkpoints: list[tuple[float, int]] = field(default_factory=list)
    faults_fired: list[Fault] = field(default_factory=list)
    faults_skipped: list[tuple[Fault, str]] = field(default_factory=list)
    end_s: float = 0.0
    final_step: int = 0
    allreduce_bytes_per_learner: float = 0.0

    @property
    def kept(self) -> list[StepAttempt]:
        return [a for a in self.attempts if a.kept]

    @property
    def useful_s(self) -> float:
        """Kept step time per learner (× M gives the fleet's useful seconds)."""
        return sum(a.end_s - a.start_s for a in self.kept)

    @property
    def goodput(self) -> float:
        """(kept steps × their step time × M) ÷ (allocated wall time × M)."""
        return self.useful_s / self.end_s if self.end_s > 0 else 0.0

    @property
    def completed_steps(self) -> int:
        return sum(a.completed for a in self.attempts)

    @property
    def wire_bytes(self) -> float:
        """Bytes all learners sent: one ring all-reduce per completed attempt (rolled back too)."""
        return self.completed_steps * self.num_learners * self.allreduce_bytes_per_learner

    def step_end_s(self, step: int) -> float:
        """When the kept attempt of ``step`` ended (0 for step 0)."""
        if step == 0:
            return 0.0
        for a in self.attempts:
            if a.kept and a.step == step:
                return a.end_s
        raise KeyError(f"step {step} has no kept attempt")

    def goodput_series(self, bin_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return series_from_intervals([(a.start_s, a.end_s) for a in self.kept], [self.end_s],
                                     bin_s)


def allreduce_s(windows: FaultWindows, fleet: Fleet, regions: Sequence[str], t: float,
                nbytes: float, num_learners: int) -> float:
    """Duration of a ring all-reduce started at ``t``, waiting out any partition first.

    α-β model: ``2(M−1)`` rounds, each paying the largest latency of the regions, plus the bytes
    one learner sends over the slowest region's bandwidth.
    """
    if num_learners == 1:
        return 0.0
    depart = t
    for region in sorted(set(regions)):
        depart = max(depart, windows.departure_s(region, depart))
    links = [windows.link(region, depart, fleet.link) for region in sorted(set(regions))]
    latency = max(link.latency_s for link in links)
    bandwidth = min(link.bandwidth_bytes_per_s for link in links)
    return (depart - t) + 2 * (num_learners - 1) * latency + nbytes / bandwidth


def simulate_timeline(*, learner_ids: Sequence[str], fleet: Fleet, num_params: int,
                      checkpoint_every_steps: int, steps: Optional[int] = None,
                      until_s: Optional[float] = None, faults: Optional[FaultPlan] = None,
                      restart: RestartCosts = RestartCosts(),
                      checkpoint_s: float = 0.0) -> Timeline:
    """The synchronous data-parallel run under ``faults``, on the virtual clock (no training).

    Step k starts when step k − 1 ends and lasts ``max_m(step time of m) + all-reduce``; step
    times use the fleet's speeds, per-learner noise streams (as in ``inprocess``) and slowdowns.
    A learner loss during a step aborts it; everyone waits until every lost learner is back
    (faults that hit an idle learner meanwhile extend the wait; one for a learner still down is
    skipped), then the job resumes from the last checkpoint. A checkpoint is taken after every
    ``checkpoint_every_steps``-th step and costs ``checkpoint_s``. Syncer kills do not apply.

    Args:
      learner_ids: the M learners (fault targets).
      fleet: speeds, noise, regions and links (as in ``inprocess.run_inprocess``).
      num_params: parameters in the model (all-reduce bytes).
      checkpoint_every_steps: the checkpoint interval, in steps.
      steps: stop after this many kept steps; or ``until_s``: no step starts at or after it.
      faults: the fault plan, replayed from its start (``reset()``); None: no faults.
      restart: detection and restart times (the same as for Decoupled DiLoCo).
      checkpoint_s: time a checkpoint takes (not useful time).

    Raises:
      ValueError: bad intervals, no stopping rule, or a fault naming an unknown learner or region.
    """
    if steps is None and until_s is None:
        raise ValueError("give steps or until_s (or both)")
    if checkpoint_every_steps < 1:
        raise ValueError(f"checkpoint_every_steps must be >= 1, got {checkpoint_every_steps}")
    ids = list(learner_ids)
    m = len(ids)
    if len(fleet.speed_factors) != m:
        raise ValueError(f"fleet.speed_factors has {len(fleet.speed_factors)} entries for {m} "
                         "learners")
    regions = [fleet.region_of(i, name) for i, name in enumerate(ids)]
    plan = faults if faults is not None else FaultPlan()
    for fault in plan.faults:
        known = (fault.target in ids if fault.kind in (FaultKind.KILL, FaultKind.EXIT)
                 else True if fault.kind == FaultKind.SYNCER_KILL
                 else fault.target in ids or fault.target in regions
                 if fault.kind == FaultKind.SLOWDOWN else fault.target in regions)
        if not known:
            raise ValueError(f"faults: {fault.kind.value} target {fault.target!r} is not a learner "
                             f"or region of this fleet")
    plan.reset()
    pending = sorted(plan.faults, key=Fault.order_key)
    windows = FaultWindows()
    rngs = [fleet.noise_rng(i) for i in range(m)]
    timeline = Timeline(num_learners=m,
                        allreduce_bytes_per_learner=ring_allreduce_bytes(num_params, m))
    back_at: dict[str, float] = {}          # learner -> when it is back (while down)
    trajectory: list[int] = []              # indices into attempts of the current trajectory
    step, checkpoint = 0, 0
    t = 0.0

    def next_fault_s() -> float:
        return pending[0].at_s if pending else math.inf

    def fire_until(now: float) -> bool:
        """Applies the faults due at or before ``now``; True if a learner was lost."""
        lost = False
        while pending and pending[0].at_s <= now:
            pending.pop(0)
        for fault in plan.due(now):
            if fault.kind in LEARNER_LOSS_KINDS:
                victims = ([fault.target] if fault.kind != FaultKind.REGION_LOSS else
                           [n for n, r in zip(ids, regions) if r == fault.target])
                for name in victims:
                    if back_at.get(name, -math.inf) > fault.at_s:
                        timeline.faults_skipped.append((fault, f"{name} is already down"))
                        continue
                    back_at[name] = fault.at_s + restart.down_s(fault)
                    lost = True
            elif fault.kind == FaultKind.SYNCER_KILL:
                timeline.faults_skipped.append((fault, "no syncer in data-parallel"))
            else:
                windows.add(fault)
        return lost

    stopped = fire_until(t)
    while True:
        if stopped:
            # Everyone waits until every lost learner is back; a loss meanwhile extends the wait.
            outage_start = t
            while next_fault_s() < max(back_at.values()):
                fire_until(next_fault_s())
            resume = max(back_at.values())
            down = tuple(sorted(back_at))
            if until_s is not None and resume >= until_s:
                timeline.outages.append((outage_start, until_s, down))
                t = until_s
                break
            timeline.outages.append((outage_start, resume, down))
            t = resume
            back_at.clear()
            if step > checkpoint:
                timeline.rollbacks.append((t, step, checkpoint))
            while trajectory and timeline.attempts[trajectory[-1]].step > checkpoint:
                trajectory.pop()
            step = checkpoint
            stopped = fire_until(t)
            continue
        if (steps is not None and step >= steps) or (until_s is not None and t >= until_s):
            break
        step_s = max(fleet.nominal_step_s(i)
                     * (1.0 + (rngs[i].uniform(-fleet.step_noise, fleet.step_noise)
                               if fleet.step_noise else 0.0))
                     * windows.slowdown(ids[i], regions[i], t) for i in range(m))
        end = t + step_s + allreduce_s(windows, fleet, regions, t + step_s,
                                       timeline.allreduce_bytes_per_learner, m)
        # A slowdown or network fault that fires mid-step applies from the next step on.
        while next_fault_s() < end and not stopped:
            at = next_fault_s()
            stopped = fire_until(at)
        if stopped:
            timeline.attempts.append(StepAttempt(step + 1, t, at, completed=False))
            t = at
            continue
        timeline.attempts.append(StepAttempt(step + 1, t, end))
        trajectory.append(len(timeline.attempts) - 1)
        step += 1
        t = end
        if step % checkpoint_every_steps == 0:
            t += checkpoint_s
            checkpoint = step
            timeline.checkpoints.append((t, step))
        stopped = fire_until(t)
    for index in trajectory:
        a = timeline.attempts[index]
        timeline.attempts[index] = StepAttempt(a.step, a.start_s, a.end_s, a.completed, kept=True)
    timeline.end_s = max([t] + [a.end_s for a in timeline.attempts])
    if until_s is not None:
        timeline.end_s = max(timeline.end_s, until_s)
    timeline.final_step = step
    timeline.faults_fired = list(plan.fired)
    return timeline


@dataclass
class BaselineRecord:
    """What a baseline run produced."""

    params: Any
    opt_state: Any
    timeline: Timeline
    evals: list[tuple[float, int, float]] = field(default_factory=list)  # (time_s, tokens, loss)
    eval_steps: list[int] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    num_params: int = 0

    @property
    def goodput(self) -> float:
        return self.timeline.goodput

    @property
    def wire_bytes(self) -> float:
        return self.timeline.wire_bytes

    @property
    def tokens(self) -> int:
        """Tokens in the final model (kept steps × M × tokens per batch)."""
        return self.timeline.final_step * self.tokens_per_step


def run_baseline(*, params: Any, optimizer: optax.GradientTransformation,
                 loss_fn: Callable[[Any, Any], jax.Array], batch_for: Callable[[int, int], Any],
                 tokens_per_batch: int, fleet: Fleet, learner_ids: Sequence[str],
                 checkpoint_every_steps: int = 100, steps: Optional[int] = None,
                 until_s: Optional[float] = None, faults: Optional[FaultPlan] = None,
                 restart: RestartCosts = RestartCosts(), checkpoint_s: float = 0.0,
                 evaluate: Optional[Callable[[Any], float]] = None, eval_every_steps: int = 0,
                 sync_step=None) -> BaselineRecord:
    """Synchronous data-parallel training under ``faults``; see the module docstring.

    Args:
      params: initial parameters (the same as the syncer's Θ for Decoupled DiLoCo).
      optimizer: the inner optimizer (the same AdamW), applied once per step to the averaged
        gradient.
      loss_fn: ``(params, batch) -> scalar loss``.
      batch_for: ``(learner_index, step) -> batch``, the same shards as Decoupled DiLoCo.
      tokens_per_batch: tokens in one learner's batch.
      fleet, learner_ids, checkpoint_every_steps, steps, until_s, faults, restart, checkpoint_s:
        see ``simulate_timeline``.
      evaluate: loss of a parameter tree; evaluated at step 0, every ``eval_every_steps`` steps
        and at the final step, each placed at the time its kept step ended.
      sync_step: a prebuilt ``make_sync_step(loss_fn, optimizer)`` (saves a compile).

    Returns:
      The record: final params and optimizer state, timeline, evals, train losses.
    """
    num_params = sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(params))
    timeline = simulate_timeline(learner_ids=learner_ids, fleet=fleet, num_params=num_params,
                                 checkpoint_every_steps=checkpoint_every_steps, steps=steps,
                                 until_s=until_s, faults=faults, restart=restart,
                                 checkpoint_s=checkpoint_s)
    sync_step = sync_step or make_sync_step(loss_fn, optimizer)
    m = len(learner_ids)
    record = BaselineRecord(params=params, opt_state=optimizer.init(params), timeline=timeline,
                            tokens_per_step=m * tokens_per_batch, num_params=num_params)

    def maybe_eval(k: int) -> None:
        if evaluate is not None:
            record.evals.append((timeline.step_end_s(k), k * record.tokens_per_step,
                                 float(evaluate(record.params))))
            record.eval_steps.append(k)

    maybe_eval(0)
    for k in range(timeline.final_step):
        batches = [batch_for(i, k) for i in range(m)]
        record.params, record.opt_state, loss = sync_step(record.params, record.opt_state, batches)
        record.train_losses.append(float(loss))
        if eval_every_steps and (k + 1) % eval_every_steps == 0 and k + 1 < timeline.final_step:
            maybe_eval(k + 1)
    if timeline.final_step > 0:
        maybe_eval(timeline.final_step)
    return record
