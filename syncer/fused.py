"""The syncer's hot path in place: a push's outer gradient with its norms, and a fragment's merge
with its outer step, each a few single passes over memory (BLAS axpy, dot) into reused buffers.

Plain numpy expressions walk a fragment once per operation and allocate a fresh array for each
(θ = base + δ, g = Θ − θ, φ(g), the weighted sums, the optimizer's moments, Θ's update); a jitted
XLA program on the syncer's single CPU thread measured slower still (26 ns per parameter for
``Θ − (base + δ)``, against 2 ns for a copy). Here ``outer_gradient`` writes g into a buffer of
the pool (two subtractions and a dot), and ``merge_and_step`` accumulates the direction with one
axpy per learner and applies SGD or Nesterov in place on the momentum and a new Θ; other outer
optimizers (adam) take optax's compiled step. The math is ``merge.py``'s and ``outer.py``'s
(docs/architecture.md#token-weighted-merge-and-rda): ``RDA = (Σ w‖g‖/Σ w)·φ(Σ w φ(g)/Σ w)``,
falling back to the weighted mean when the directions cancel, the embeddings always the mean;
``optax.sgd``: ``m ← g + μ·m``, ``Θ ← Θ − lr·(g + μ·m)`` (Nesterov) or ``Θ − lr·m``.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Optional, Sequence

import numpy as np
from scipy.linalg import blas

from . import outer as outer_lib

RDA_EPS = 1e-12   # as merge.radial_directional_average


class BufferPool:
    """Float32 arrays by shape, handed back after a merge so the next pushes reuse them (fresh
    arrays cost a page fault per 4 KiB on first touch: as much again as writing them)."""

    def __init__(self, per_shape: int = 16):
        self.free: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.per_shape = per_shape

    def take(self, shape: tuple) -> np.ndarray:
        free = self.free.get(tuple(shape))
        return free.pop() if free else np.empty(shape, np.float32)

    def give(self, array: np.ndarray) -> None:
        free = self.free[array.shape]
        if len(free) < self.per_shape:
            free.append(array)


def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1)


def _norm(x: np.ndarray) -> float:
    flat = _flat(x)
    return math.sqrt(max(float(blas.sdot(flat, flat)), 0.0)) if flat.size else 0.0


def _axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a·x`` in place (y contiguous float32)."""
    if y.size:
        flat = _flat(y)
        out = blas.saxpy(_flat(x), flat, a=a)
        if out is not flat and not np.shares_memory(out, flat):   # BLAS copied: keep the result
            np.copyto(flat, out)


def outer_gradient(params: dict, base: dict, drift: dict,
                   pool: Optional[BufferPool] = None) -> tuple[dict, dict]:
    """``g = Θ − (base + δ)`` per tensor and ``‖g‖`` (float32 g, float norms).

    ``base + δ`` is the learner's fragment θ_m as the syncer reconstructs it. g is computed as
    ``(Θ − base) − δ``, so it may differ from ``Θ − (base + δ)`` in the last bit.
    """
    grads, norms = {}, {}
    for path, value in params.items():
        g = pool.take(value.shape) if pool is not None else np.empty(value.shape, np.float32)
        np.subtract(value, base[path], out=g)
        np.subtract(g, np.asarray(drift[path], np.float32), out=g)
        grads[path] = g
        norms[path] = _norm(g)
    return grads, norms


def combine(grads: Sequence[np.ndarray], norms: Sequence[float], weights: Sequence[float],
            use_rda: bool, out: np.ndarray) -> tuple[np.ndarray, Optional[float]]:
    """One tensor's merged outer gradient into ``out`` (RDA, or the weighted mean); returns it
    and its norm when known without another pass (RDA: the mean norm), else None."""
    total = float(sum(weights))
    w = [float(x) / total for x in weights]
    if use_rda:
        first = True
        for g, n, wm in zip(grads, norms, w):
            if n > 0:
                if first:
                    np.multiply(g, np.float32(wm / n), out=out)
                    first = False
                else:
                    _axpy(wm / n, g, out)
        d_norm = 0.0 if first else _norm(out)
        if d_norm >= RDA_EPS:
            mean_norm = sum(wm * n for wm, n in zip(w, norms))
            out *= np.float32(mean_norm / d_norm)
            return out, mean_norm
    # the weighted mean (embeddings, rule "mean", or RDA directions that cancel)
    np.multiply(grads[0], np.float32(w[0]), out=out)
    for g, wm in zip(grads[1:], w[1:]):
        _axpy(wm, g, out)
    return out, None


def _sgd_kind(optimizer) -> Optional[tuple[float, float, bool]]:
    spec = getattr(optimizer, "spec", None)
    if spec is None or spec[0] not in ("nesterov", "sgd"):
        return None
    kind, lr, momentum = spec
    return float(lr), float(momentum or 0.0), kind == "nesterov"


def _trace(state: Any) -> Optional[dict]:
    """The momentum ``{path: array}`` inside an optax sgd state (None without momentum)."""
    for part in state:
        trace = getattr(part, "trace", None)
        if trace is not None:
            return trace
    return None


def merge_and_step(optimizer, rda_paths: frozenset, grads: Sequence[dict],
                   norms: Sequence[dict], weights: Sequence[float], share: float, params: dict,
                   state: Any, pool: Optional[BufferPool] = None):
    """Merges the M outer gradients of one fragment and applies the outer optimizer.

    Args:
      optimizer: the outer optax transform (``outer.build``'s carry their kind: sgd and
        Nesterov run in place, others through optax).
      rda_paths: the tensors merged by RDA (the others, embeddings, by the weighted mean).
      grads, norms: per learner, ``{path: g_m}`` and ``{path: ‖g_m‖}`` (``outer_gradient``).
      weights: the learners' merge weights (token weight × staleness factor), summing to > 0.
      share: the participation scale n/M (1 without it).
      params: Θ of the fragment (not modified: earlier versions stay in the history).
      state: the outer optimizer's state (not modified; with a pool, sgd/Nesterov hand its
        momentum buffers back once the new state replaces it).
      pool: where the merged gradient's scratch buffers come from and go back to.

    Returns:
      ``(new Θ, new state, every value finite, ‖merged outer gradient‖)``.
    """
    take = pool.take if pool is not None else (lambda shape: np.empty(shape, np.float32))
    merged, norm_sq = {}, 0.0
    for path, value in params.items():
        out, norm = combine([g[path] for g in grads], [n[path] for n in norms], weights,
                            path in rda_paths, take(value.shape))
        if share != 1.0:
            out *= np.float32(share)
        norm_sq += (norm * share) ** 2 if norm is not None else _norm(out) ** 2
        merged[path] = out
    grad_norm = math.sqrt(norm_sq)
    sgd = _sgd_kind(optimizer)
    if sgd is None:
        new_params, new_state = outer_lib.outer_step(optimizer, merged, state, params)
    else:
        lr, momentum, nesterov = sgd
        trace = _trace(state)
        new_trace = {} if trace is not None else None
        new_params = {}
        for path, value in params.items():
            g = merged[path]
            new = np.array(value, np.float32, copy=True)
            if trace is None:              # Θ − lr·g
                _axpy(-lr, g, new)
            else:                          # m ← g + μ·m, into a new buffer: a refused merge
                m = take(value.shape)      # leaves the state as it was
                np.multiply(np.asarray(trace[path], np.float32), np.float32(momentum), out=m)
                m += g
                new_trace[path] = m
                if nesterov:                # Θ − lr·(g + μ·m)
                    _axpy(-lr, g, new)
                    _axpy(-lr * momentum, m, new)
                else:                       # Θ − lr·m
                    _axpy(-lr, m, new)
            new_params[path] = new
        new_state = state if trace is None else tuple(
            part._replace(trace=new_trace) if getattr(part, "trace", None) is not None else part
            for part in state)
    finite = all(np.isfinite(_norm(v)) or bool(np.all(np.isfinite(v)))
                 for v in new_params.values())
    if pool is not None:
        for v in merged.values():
            pool.give(v)
        if finite and sgd is not None and _trace(state) is not None:
            for v in _trace(state).values():   # the old momentum is no longer anyone's
                if isinstance(v, np.ndarray) and v.flags.writeable:
                    pool.give(v)
    return new_params, new_state, finite, grad_norm
