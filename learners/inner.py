"""The inner step: optax AdamW with warmup + cosine decay, jitted; and the held-out loss."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from .model import ModelConfig, loss_fn


def inner_schedule(lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """0 → lr linearly over ``warmup_steps``, then cosine down to lr/10 at ``total_steps``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(warmup_steps, 0),
        decay_steps=max(total_steps, warmup_steps + 1), end_value=lr * 0.1)


def inner_optimizer(lr: float = 3e-3, warmup_steps: int = 20, total_steps: int = 5000,
                    weight_decay: float = 0.1, b1: float = 0.9, b2: float = 0.95,
                    clip_norm: float = 1.0) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(inner_schedule(lr, warmup_steps, total_steps), b1=b1, b2=b2,
                    weight_decay=weight_decay))


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation) -> Callable:
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted."""

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_eval_fn(cfg: ModelConfig) -> Callable:
    """``evaluate(params, batches) -> float``: mean loss over fixed held-out batches."""
    batch_loss = jax.jit(lambda params, batch: loss_fn(params, batch, cfg))

    def evaluate(params, batches: Sequence) -> float:
        return float(jnp.mean(jnp.stack([batch_loss(params, b) for b in batches])))

    return evaluate
