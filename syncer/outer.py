"""Outer optimizer: one optax transform applied per fragment to the merged outer gradient (docs/architecture.md#outer-step)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax

DILOCO_OUTER_LR = 0.7         # DiLoCo's values, tuned for H in the hundreds; the Decoupled
DILOCO_OUTER_MOMENTUM = 0.9   # DiLoCo paper gives none
DEFAULT_OUTER_LR = DILOCO_OUTER_LR
DEFAULT_OUTER_MOMENTUM = DILOCO_OUTER_MOMENTUM
# The outer rule's ends (docs/tuning.md): plain averaging up to AVERAGING_UP_TO_H inner steps per
# sync (measured best at H = 24 and H = 96: every larger effective outer step made the model
# worse), DiLoCo's Nesterov 0.7 / 0.9 (published for H = 500) from DILOCO_FROM_H on,
# log-linear in H between.
AVERAGING_UP_TO_H = 128
DILOCO_FROM_H = 512


def rule(sync_every_steps: int) -> tuple[float, float]:
    """The default outer Nesterov ``(lr, momentum)`` for H = ``sync_every_steps``.

    With x = clip(log(H / 128) / log(512 / 128), 0, 1): ``lr = 1 − 0.3·x``, ``momentum = 0.9·x``.
    Short periods get plain averaging (Nesterov with momentum 0 and lr 1 is sgd(1.0): Θ becomes
    the token-weighted mean of the learners); long ones DiLoCo's values. The number of learners
    M enters through the participation scale of each merge (a merge of n of M learners takes
    the share n/M of a step, ``syncer.participation_scale``), not through these two numbers.

    >>> rule(1), rule(128), rule(512), rule(5000)
    ((1.0, 0.0), (1.0, 0.0), (0.7, 0.9), (0.7, 0.9))
    >>> rule(256)  # x = 1/2
    (0.85, 0.45)

    Raises:
      ValueError: H below 1.
    """
    if sync_every_steps < 1:
        raise ValueError(f"sync_every_steps ({sync_every_steps}) must be >= 1")
    x = math.log(sync_every_steps / AVERAGING_UP_TO_H) / math.log(DILOCO_FROM_H / AVERAGING_UP_TO_H)
    x = min(max(x, 0.0), 1.0)
    lr = 1.0 + (DILOCO_OUTER_LR - 1.0) * x
    return lr, DILOCO_OUTER_MOMENTUM * x


def build(kind: str = "nesterov", lr: float = DEFAULT_OUTER_LR,
          momentum: float = DEFAULT_OUTER_MOMENTUM, **kwargs: Any) -> optax.GradientTransformation:
    """The outer optimizer. ``sgd`` with lr 1 and no momentum makes Θ the weighted mean of learners.

    Raises:
      ValueError: for an unknown kind.
    """
    if kind == "nesterov":
        # Momentum 0 (the rule's up to H = 128) keeps no trace: m' = g, and Θ − lr·(g + 0·m') is
        # plain SGD, so a fragment-sized array of it would be stored and never read.
        return _with_spec(optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum)),
                          kind, lr, momentum)
    if kind == "sgd":
        return _with_spec(optax.sgd(lr, momentum=momentum or None), kind, lr, momentum)
    if kind == "adam":
        return optax.adam(lr, **kwargs)
    raise ValueError(f"unknown outer optimizer {kind!r}; choose one of nesterov, sgd, adam")


class OuterTransform(optax.GradientTransformation):
    """An optax transform that also says what it is (``spec``: kind, lr, momentum), so the syncer
    can run SGD and Nesterov in place (syncer/fused.py); equal and hashed as the plain one."""


def _with_spec(tx: optax.GradientTransformation, kind: str, lr: float,
               momentum: float) -> OuterTransform:
    out = OuterTransform(tx.init, tx.update)
    out.spec = (kind, float(lr), float(momentum or 0.0))
    return out


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
