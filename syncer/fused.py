"""The syncer's hot path as compiled programs: a push's outer gradient with its norms, and a
fragment's merge with its outer step in one pass over memory.

Plain numpy walks a fragment once per operation (θ = base + δ, g = Θ − θ, ‖g‖, φ(g), the weighted
sums, the optimizer's moments, Θ's update, the finiteness check), each pass a fresh array. Here a
push costs one program, ``outer_gradient`` (reads Θ, the base and δ; writes g; the norms come
out of the same loop), and a merge another, ``merge_and_step`` (reads every g once for the
direction, then Θ and the optimizer state once). The math is ``merge.py``'s and ``outer.py``'s
(docs/architecture.md#token-weighted-merge-and-rda): ``RDA = (Σ w‖g‖/Σ w)·φ(Σ w φ(g)/Σ w)``,
falling back to the weighted mean when the directions cancel, the embeddings always the mean.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

RDA_EPS = 1e-12   # as merge.radial_directional_average


@jax.jit
def _outer_gradient(params: dict, base: dict, drift: dict) -> tuple[dict, dict]:
    grads, norms = {}, {}
    for path, value in params.items():
        g = value - (base[path] + drift[path].astype(jnp.float32))
        grads[path] = g
        norms[path] = jnp.sqrt(jnp.sum(jnp.square(g)))
    return grads, norms


def outer_gradient(params: dict, base: dict, drift: dict) -> tuple[dict, dict]:
    """``g = Θ − (base + δ)`` per tensor and ``‖g‖`` (float32), in one compiled call.

    ``base + δ`` is the learner's fragment θ_m as the syncer reconstructs it; rounding as numpy's
    ``Θ − (base + δ)`` in float32.
    """
    return _outer_gradient(params, base, drift)


def _combine(grads: Sequence[jax.Array], norms: jax.Array, weights: jax.Array,
             use_rda: bool) -> jax.Array:
    """One tensor's merged outer gradient from the M learners' ``grads`` (their norms given)."""
    w = weights / jnp.sum(weights)
    mean = functools.reduce(jnp.add, [w[m] * g for m, g in enumerate(grads)])
    if not use_rda:
        return mean
    inv = jnp.where(norms > 0, 1.0 / jnp.where(norms > 0, norms, 1.0), 0.0)
    direction = functools.reduce(jnp.add, [(w[m] * inv[m]) * g for m, g in enumerate(grads)])
    d_norm = jnp.sqrt(jnp.sum(jnp.square(direction)))
    mean_norm = jnp.sum(w * norms)
    scale = mean_norm / jnp.where(d_norm > 0, d_norm, 1.0)
    return jnp.where(d_norm < RDA_EPS, mean, scale * direction)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _merge_and_step(optimizer: optax.GradientTransformation, rda_paths: tuple, grads: tuple,
                    norms: tuple, weights: jax.Array, share: jax.Array, params: dict,
                    state: Any):
    merged = {}
    for path in params:
        stacked_norms = jnp.stack([n[path] for n in norms])
        merged[path] = share * _combine([g[path] for g in grads], stacked_norms, weights,
                                        path in rda_paths)
    updates, new_state = optimizer.update(merged, state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in new_params.values()]))
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in merged.values()))
    return new_params, new_state, finite, grad_norm


def merge_and_step(optimizer: optax.GradientTransformation, rda_paths: frozenset,
                   grads: Sequence[dict], norms: Sequence[dict], weights: Sequence[float],
                   share: float, params: dict, state: Any):
    """Merges the M outer gradients of one fragment and applies the outer optimizer.

    Args:
      optimizer: the outer optax transform.
      rda_paths: the tensors merged by RDA (the others, embeddings, by the weighted mean).
      grads, norms: per learner, ``{path: g_m}`` and ``{path: ‖g_m‖}`` (``outer_gradient``).
      weights: the learners' merge weights (token weight × staleness factor), summing to > 0.
      share: the participation scale n/M (1 without it).
      params: Θ of the fragment.
      state: the outer optimizer's state.

    Returns:
      ``(new Θ as float32 numpy, new state, every value finite, ‖merged outer gradient‖)``.
    """
    new_params, new_state, finite, grad_norm = _merge_and_step(
        optimizer, tuple(sorted(rda_paths)), tuple(grads), tuple(norms),
        jnp.asarray(weights, jnp.float32), jnp.float32(share), params, state)
    return ({k: np.asarray(v) for k, v in new_params.items()}, new_state, bool(finite),
            float(grad_norm))
