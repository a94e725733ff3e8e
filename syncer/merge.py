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
