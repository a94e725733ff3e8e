"""Merge: token weights and the per-tensor combination of the learners' outer gradients (docs/architecture.md#token-weighted-merge-and-rda)."""

from __future__ import annotations

import enum
from typing import Callable, Mapping, Sequence

import numpy as np


class MergeRule(str, enum.Enum):
    RDA = "rda"    # radial-directional average for non-embedding tensors
    MEAN = "mean"  # weighted mean for every tensor


def token_weight(c_tokens: float, c_steps: float) -> float:
    """``w = c_tokens² / c_steps`` (0 when c_steps = 0), docs/architecture.md#token-weighted-merge-and-rda.

    A learner that processed more tokens per step (a bigger batch) and more tokens overall counts
    more; a learner that did nothing since its base counts nothing.

    >>> token_weight(100, 1), token_weight(300, 3)
    (10000.0, 30000.0)
    """
    if c_steps <= 0:
        return 0.0
    return float(c_tokens) ** 2 / float(c_steps)


def staleness_factor(staleness: int, discount: float) -> float:
    """Optional extra weight ``(1 + staleness)^-discount``; discount 0 (the paper) gives 1."""
    if discount == 0.0:
        return 1.0
    return float((1.0 + staleness) ** (-discount))


def normalized(x: np.ndarray) -> np.ndarray:
    """``φ(x) = x / ‖x‖`` with ``φ(0) = 0``."""
    norm = float(np.linalg.norm(x))
    if norm == 0.0:
        return np.zeros_like(x)
    return x / norm


def weighted_mean(tensors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``Σ w g / Σ w``.

    Raises:
      ValueError: if the weights sum to zero (nobody did any work).
    """
    total = float(np.sum(weights))
    if total <= 0.0:
        raise ValueError(f"weights must sum to > 0, got {list(weights)}")
    acc = np.zeros_like(np.asarray(tensors[0], dtype=np.float32))
    for g, w in zip(tensors, weights):
        acc = acc + np.float32(w / total) * np.asarray(g, dtype=np.float32)
    return acc


def radial_directional_average(tensors: Sequence[np.ndarray], weights: Sequence[float],
                               eps: float = 1e-12) -> np.ndarray:
    """``RDA = (Σ w‖g‖ / Σ w) · φ(Σ w φ(g) / Σ w)``.

    The mean direction with the mean length: averaging vectors that point different ways would
    shrink the update; RDA keeps its size. When the directions cancel (the mean direction has norm
    below ``eps``) it falls back to the weighted mean.
    """
    total = float(np.sum(weights))
    if total <= 0.0:
        raise ValueError(f"weights must sum to > 0, got {list(weights)}")
    mean_norm = sum(w * float(np.linalg.norm(g)) for g, w in zip(tensors, weights)) / total
    direction = np.zeros_like(np.asarray(tensors[0], dtype=np.float32))
    for g, w in zip(tensors, weights):
        direction = direction + np.float32(w / total) * normalized(np.asarray(g, np.float32))
    if float(np.linalg.norm(direction)) < eps:
        return weighted_mean(tensors, weights)
    return (np.float32(mean_norm) * normalized(direction)).astype(np.float32)


def merge_outer_gradients(
    outer_grads: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    rule: MergeRule = MergeRule.RDA,
    is_embedding: Callable[[str], bool] = lambda path: False,
) -> dict[str, np.ndarray]:
    """Combines the learners' outer gradients of one fragment, tensor by tensor.

    Args:
      outer_grads: one ``{path: g_m}`` per learner, ``g_m = Θ[p] − θ_m[p]``.
      weights: one weight per learner (``token_weight``, times any staleness factor).
      rule: RDA for non-embedding tensors (embeddings always get the weighted mean), or MEAN.
      is_embedding: tells which paths are embedding tensors.

    Returns:
      ``{path: Δ̄}``, the merged outer gradient fed to the outer optimizer.
    """
    if len(outer_grads) != len(weights) or not outer_grads:
        raise ValueError(f"need one weight per gradient, got {len(outer_grads)} and {len(weights)}")
    merged = {}
    for path in outer_grads[0]:
        tensors = [g[path] for g in outer_grads]
        if rule == MergeRule.MEAN or is_embedding(path):
            merged[path] = weighted_mean(tensors, weights)
        else:
            merged[path] = radial_directional_average(tensors, weights)
    return merged


# -- asynchrony (issue 34): what a stale or partial merge steps with -----------------------------
class OuterGradientRule(str, enum.Enum):
    """Where a push's outer gradient is taken from (docs/architecture.md#asynchrony)."""

    PULL = "pull"         # g = Θ[p] − (base + δ): towards the learner's model (a stale push pulls
                          # Θ back towards its base, taking back the merges since)
    REBASED = "rebased"   # g = Θ[p](v_base) − (base + δ): the push's own drift (and the rounding
                          # of its base) applied to today's Θ; equal to PULL at staleness 0


class RoundStep(str, enum.Enum):
    """How many outer steps one round of a fragment takes when it arrives as partial merges."""

    PER_MERGE = "per_merge"   # every partial merge steps the outer optimizer (share n/M each)
    PER_ROUND = "per_round"   # the later pushes of a round join its step: the step is taken
                              # again from the round's start with every push in so far


class ScheduleClock(str, enum.Enum):
    """What a learner's inner learning-rate schedule runs on."""

    LEARNER = "learner"   # its own step count
    FLEET = "fleet"       # the fleet's progress: the mean merged step of the live learners


def gradient_anchor(rule: OuterGradientRule, current: Mapping[str, np.ndarray],
                    at_base_version: "Mapping[str, np.ndarray] | None",
                    base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The Θ a push's outer gradient ``g = anchor − (base + δ)`` is taken from.

    PULL: the current Θ[p]. REBASED: Θ[p] of the version the push was based on, so that only
    the push's drift (and the difference between what the learner held and that version: the
    downlink's rounding) is merged, whatever was merged since; when that version is no longer
    in the history, the learner's base itself (g = −δ).

    >>> now, then, held = {"w": np.array([5.0])}, {"w": np.array([2.0])}, {"w": np.array([2.5])}
    >>> gradient_anchor(OuterGradientRule.PULL, now, then, held)["w"].tolist()
    [5.0]
    >>> gradient_anchor(OuterGradientRule.REBASED, now, then, held)["w"].tolist()
    [2.0]
    >>> gradient_anchor(OuterGradientRule.REBASED, now, None, held)["w"].tolist()
    [2.5]
    """
    if rule == OuterGradientRule.PULL:
        return current
    return at_base_version if at_base_version is not None else base


def participation_share(staleness: Sequence[int], live_count: int, discount: float = 0.0) -> float:
    """The share of a synchronous outer step a merge takes: ``min(1, Σ_m (1 + s_m)^−d / M)``.

    With d = 0 it is the participation scale n/M. With d > 0 a stale push moves Θ less in
    absolute terms, also when it is merged alone (a discount of the merge *weights* cannot: a
    lone push's weight normalizes to 1). ``live_count`` 0 or None: no scaling (1).

    >>> participation_share([0, 0], 4), participation_share([0, 0, 0, 0, 0], 4)
    (0.5, 1.0)
    >>> participation_share([1], 4, 1.0), participation_share([0, 3], 4, 1.0)
    (0.125, 0.3125)
    """
    if not live_count:
        return 1.0
    return min(1.0, sum(staleness_factor(s, discount) for s in staleness) / live_count)


def fleet_step(merged_steps: Sequence[int]) -> float:
    """The fleet's progress in inner steps: the mean over the live learners of the step their
    newest merged push was sent at (0 with none). A learner's inner schedule reads it, so one
    that restarts, lags or runs fast neither replays nor skips the fleet's schedule, and the
    fleet reaches the schedule's end when it has processed M × total_steps batches.

    >>> fleet_step([100, 50, 120, 30]), fleet_step([])
    (75.0, 0.0)
    """
    return float(np.mean(merged_steps)) if len(merged_steps) else 0.0


def schedule_position(fleet: float, pushed_at_step: "int | None", step: int) -> int:
    """The schedule count a learner takes when it adopts a merge: the fleet's step at the merge
    plus the learner's own steps since its push (the merge is at most that old).

    >>> schedule_position(75.4, 200, 203), schedule_position(75.6, None, 203)
    (78, 76)
    """
    since = 0 if pushed_at_step is None else max(step - pushed_at_step, 0)
    return int(round(fleet)) + since
