"""A small decoder-only transformer LM in plain JAX: params are a nested dict of float32 arrays."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions. The default (~110k parameters) trains visibly on 2 CPU cores in a minute."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    seq_len: int = 64

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Scaled normal init; the output head is tied to the token embedding."""
    keys = iter(jax.random.split(key, 2 + 6 * cfg.n_layers))
    d, f = cfg.d_model, cfg.d_ff

    def dense(k, fan_in, shape):
        return jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan_in)

    params = {
        "embed": {"tokens": jax.random.normal(next(keys), (cfg.vocab_size, d)) * 0.02,
                  "positions": jax.random.normal(next(keys), (cfg.seq_len, d)) * 0.02},
        "blocks": {},
        "ln_f": {"scale": jnp.ones(d)},
    }
    out_scale = 1.0 / jnp.sqrt(2.0 * cfg.n_layers)  # keeps the residual stream's variance flat
    for i in range(cfg.n_layers):
        params["blocks"][str(i)] = {
            "ln1": {"scale": jnp.ones(d)},
            "attn": {"wq": dense(next(keys), d, (d, d)), "wk": dense(next(keys), d, (d, d)),
                     "wv": dense(next(keys), d, (d, d)),
                     "wo": dense(next(keys), d, (d, d)) * out_scale},
            "ln2": {"scale": jnp.ones(d)},
            "mlp": {"w_in": dense(next(keys), d, (d, f)),
                    "w_out": dense(next(keys), f, (f, d)) * out_scale},
        }
    return params


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def forward(params: dict, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal LM logits, ``[B, L, V]``."""
    _, length = tokens_BxL.shape
    h_BxLxD = params["embed"]["tokens"][tokens_BxL] + params["embed"]["positions"][:length]
    heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
    mask_LxL = jnp.tril(jnp.ones((length, length), bool))
    for i in range(cfg.n_layers):
        block = params["blocks"][str(i)]
        x = _rms_norm(h_BxLxD, block["ln1"]["scale"])
        split = lambda t: t.reshape(t.shape[0], length, heads, head_dim)  # noqa: E731
        q, k, v = (split(x @ block["attn"][w]) for w in ("wq", "wk", "wv"))
        scores_BxHxLxL = jnp.einsum("blhd,bmhd->bhlm", q, k) / jnp.sqrt(float(head_dim))
        scores_BxHxLxL = jnp.where(mask_LxL, scores_BxHxLxL, -1e9)
        attn = jax.nn.softmax(scores_BxHxLxL, axis=-1)
        out = jnp.einsum("bhlm,bmhd->blhd", attn, v).reshape(x.shape)
        h_BxLxD = h_BxLxD + out @ block["attn"]["wo"]
        x = _rms_norm(h_BxLxD, block["ln2"]["scale"])
        h_BxLxD = h_BxLxD + jax.nn.gelu(x @ block["mlp"]["w_in"]) @ block["mlp"]["w_out"]
    h_BxLxD = _rms_norm(h_BxLxD, params["ln_f"]["scale"])
    return h_BxLxD @ params["embed"]["tokens"].T


def loss_fn(params: dict, tokens_BxLp1: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-token cross-entropy of a ``[B, L+1]`` batch (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    inputs, targets = tokens_BxLp1[:, :-1], tokens_BxLp1[:, 1:]
    logits = forward(params, inputs, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def num_params(params: dict) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def is_embedding_path(path: str) -> bool:
    """Embedding tensors get the plain weighted mean in the merge (DESIGN §4.3)."""
    return path.startswith("embed/")
