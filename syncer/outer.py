"""Outer optimizer: one optax transform applied per fragment to the merged outer gradient (docs/architecture.md#outer-step)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

DEFAULT_OUTER_LR = 0.7        # DiLoCo's values; the Decoupled DiLoCo paper gives none
DEFAULT_OUTER_MOMENTUM = 0.9


def build(kind: str = "nesterov", lr: float = DEFAULT_OUTER_LR,
          momentum: float = DEFAULT_OUTER_MOMENTUM, **kwargs: Any) -> optax.GradientTransformation:
    """The outer optimizer. ``sgd`` with lr 1 and no momentum makes Θ the weighted mean of learners.

    Raises:
      ValueError: for an unknown kind.
    """
    if kind == "nesterov":
        return optax.sgd(lr, momentum=momentum, nesterov=True)
    if kind == "sgd":
        return optax.sgd(lr, momentum=momentum or None)
    if kind == "adam":
        return optax.adam(lr, **kwargs)
    raise ValueError(f"unknown outer optimizer {kind!r}; choose one of nesterov, sgd, adam")


def _update_and_apply(optimizer: optax.GradientTransformation, merged_grad: dict, state: Any,
                      fragment: dict) -> tuple[dict, Any]:
    updates, new_state = optimizer.update(merged_grad, state, fragment)
    return optax.apply_updates(fragment, updates), new_state


# One compiled program per (optimizer, fragment structure): run eagerly on numpy, optax dispatches
# an op per leaf and step (165 ms against 28 ms compiled for 8.4M parameters).
_compiled_update_and_apply = jax.jit(_update_and_apply, static_argnums=0)


def outer_step(optimizer: optax.GradientTransformation, merged_grad: dict, state: Any,
               fragment: dict) -> tuple[dict, Any]:
    """``updates, s = outer.update(Δ̄, s, Θ); Θ = apply_updates(Θ, updates)`` for one fragment.

    Returns:
      The new fragment as float32 numpy arrays, and the new optimizer state.
    """
    new_fragment, new_state = _compiled_update_and_apply(optimizer, merged_grad, state, fragment)
    return jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=np.float32), new_fragment), new_state
