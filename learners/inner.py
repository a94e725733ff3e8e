"""The inner step: optax AdamW with warmup + cosine decay, jitted; and the held-out loss."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .model import ModelConfig, Params, loss_fn

# The cosine ends at this fraction of the peak learning rate.
END_LR_FRACTION = 0.1

TrainStep = Callable[[Params, optax.OptState, jax.Array], tuple[Params, optax.OptState, jax.Array]]


def inner_schedule(lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """0 → ``lr`` linearly over ``warmup_steps``, then cosine to ``lr/10`` at ``total_steps``.

    ``total_steps`` counts the warmup (optax's ``decay_steps``); past it the rate stays at
    ``lr/10``, so a learner that trains longer than planned keeps going.

    Args:
      lr: peak learning rate.
      warmup_steps: steps of linear warmup, >= 0.
      total_steps: step at which the cosine reaches its end, > ``warmup_steps``.

    Raises:
      ValueError: on a non-positive lr or ``total_steps <= warmup_steps``.
    """
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps <= warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup_steps, decay_steps=total_steps,
        end_value=lr * END_LR_FRACTION)


def _matrices_only(params: Params) -> Params:
    # Decay weight matrices and embeddings, not RMSNorm scales: pulling a scale toward 0 would
    # shrink the whole normalized activation rather than regularize it.
    return jax.tree_util.tree_map(lambda leaf: len(np.shape(leaf)) >= 2, params)


def inner_optimizer(lr: float = 3e-3, warmup_steps: int = 20, total_steps: int = 5000,
                    weight_decay: float = 0.1, b1: float = 0.9, b2: float = 0.95,
                    clip_norm: float = 1.0) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on :func:`inner_schedule` (docs/architecture.md#the-algorithm, learner step 1).

    Args:
      lr: peak learning rate.
      warmup_steps: linear warmup steps.
      total_steps: length of warmup + cosine; the rate ends at ``lr/10``.
      weight_decay: decoupled decay, applied to tensors of rank >= 2 only.
      b1, b2: Adam moment decay rates.
      clip_norm: gradients are rescaled to at most this global L2 norm.

    Returns:
      An ``optax.GradientTransformation``; its state is what a reintegrating learner copies from
      a peer (docs/architecture.md#failures-and-reintegration).
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(inner_schedule(lr, warmup_steps, total_steps), b1=b1, b2=b2,
                    weight_decay=weight_decay, mask=_matrices_only))


def at_schedule_step(opt_state, step: int):
    """``opt_state`` with every learning-rate schedule's count (optax ``ScaleByScheduleState``)
    set to ``step``; everything else (Adam's moments and their own count) unchanged.

    A restarted learner resumes its data at ``step`` and its pushes say so; the syncer's outlier
    bound reads the schedule there (``syncer/validate.py: lr_sum``). A fresh state (count 0)
    would warm up to the peak rate instead, 10× the end of a finished cosine, and a peer's
    count is the peer's step, not this learner's. Keeps each count's dtype, host or device.

    >>> import jax.numpy as jnp
    >>> s = at_schedule_step(inner_optimizer().init({"w": jnp.zeros((2, 2))}), 4744)
    >>> int(s[1][0].count), int(s[1][2].count)   # Adam's count, the schedule's
    (0, 4744)
    """
    is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree_util.tree_map(
        lambda node: node._replace(count=node.count * 0 + step) if is_schedule(node) else node,
        opt_state, is_leaf=is_schedule)


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation) -> TrainStep:
    """A jitted ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``.

    Args:
      cfg: model dimensions (static).
      optimizer: any optax transformation; ``update`` gets ``params`` for decoupled decay.

    Returns:
      The step; ``batch`` is int ``[B, L+1]`` and ``loss`` is the batch loss before the update.
    """

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_eval_fn(cfg: ModelConfig) -> Callable[[Params, Sequence[np.ndarray]], float]:
    """``evaluate(params, batches) -> float``: mean loss over fixed, equal-shaped held-out batches.

    The batches are stacked and scanned in one jitted call (one compile per batch count), so the
    result is bit-identical for the same params and batches.
    """

    @jax.jit
    def mean_loss(params, batches_NxBxLp1):
        losses_N = jax.lax.map(lambda batch: loss_fn(params, batch, cfg), batches_NxBxLp1)
        return jnp.mean(losses_N)

    def evaluate(params: Params, batches: Sequence[np.ndarray]) -> float:
        if not len(batches):
            raise ValueError("evaluate needs at least one batch")
        return float(mean_loss(params, jnp.stack([jnp.asarray(b) for b in batches])))

    return evaluate
