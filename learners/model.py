"""A small decoder-only transformer LM in plain JAX: params are a nested dict of float32 arrays.

Mixed precision (``ModelConfig.compute_dtype="bfloat16"``): the params, their gradients and the
inner optimizer's state stay float32 (the syncer, codecs and fragments never see anything else);
inside the forward pass each matmul's operands are cast to bfloat16. The residual stream, the
RMSNorm statistics, the attention softmax, the logits and the loss (log-softmax and
cross-entropy) stay float32; the attention scores and the logits are bfloat16 products
accumulated into float32 (``preferred_element_type``). Gradients flow back through the casts and
arrive float32. ``"float32"`` (the default) runs exactly the float32 graph it always ran.

The tree reads like the model (``params["blocks"]["0"]["attn"]["wq"]``), so fragment paths
(``"blocks/0/attn/wq"``), snapshots and merge rules (docs/architecture.md#the-algorithm) name tensors the same way. The
output head is tied to the token embedding, so ``embed/tokens`` is both the first and last layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp

Params = dict[str, Any]

# Std of the token and position embeddings at init. Small, so that the tied head starts near the
# uniform distribution: logits std ≈ 0.02·√d_model, and the loss at init is ≈ ln(vocab_size).
EMBED_INIT_STD = 0.02
RMS_NORM_EPS = 1e-6
# What ``ModelConfig.compute_dtype`` may name: the dtype of the forward pass's matmuls.
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Model dimensions. The default has 119,104 parameters and trains visibly on 2 CPU cores.

    Attributes:
      vocab_size: number of token ids (256 for raw bytes).
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: attention heads per block; must divide ``d_model``.
      d_ff: hidden width of the MLP.
      seq_len: longest input the model takes (rows of the position embedding).
      compute_dtype: ``"float32"`` or ``"bfloat16"``: the dtype of the forward pass's matmuls
        (the module docstring says what stays float32). Params are float32 either way.

    Raises:
      ValueError: naming the field, when a size is not a positive int, heads don't divide width,
        or ``compute_dtype`` is not one of :data:`COMPUTE_DTYPES`.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    seq_len: int = 64
    compute_dtype: str = "float32"

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got "
                             f"{self.compute_dtype!r}")
        for field in fields(self):
            if field.name == "compute_dtype":
                continue
            value = getattr(self, field.name)
            # bool is an int subclass; ``n_layers=True`` is a mistake, not one layer.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field.name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{field.name} must be >= 1, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mixed(self) -> bool:
        """Whether the matmuls run in a narrower dtype than the float32 params."""
        return self.compute_dtype != "float32"

    @property
    def dtype(self) -> Any:
        """The matmuls' operand dtype, as a jnp dtype."""
        return jnp.dtype(self.compute_dtype)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Scaled normal init, deterministic for a key.

    Dense weights are ``N(0, 1/fan_in)``; the two projections that write into the residual stream
    (``wo``, ``w_out``) are further scaled by ``1/√(2·n_layers)`` so its variance stays flat with
    depth. RMSNorm scales start at 1. The output head reuses ``embed/tokens``.

    Args:
      cfg: model dimensions.
      key: a ``jax.random`` key.

    Returns:
      The params tree ``{"embed", "blocks": {"0": …}, "ln_f"}`` of float32 arrays.
    """
    d, f = cfg.d_model, cfg.d_ff
    embed_key, pos_key, *block_keys = jax.random.split(key, 2 + cfg.n_layers)
    out_scale = 1.0 / math.sqrt(2.0 * cfg.n_layers)

    def dense(k: jax.Array, shape: tuple[int, int], scale: float = 1.0) -> jax.Array:
        return jax.random.normal(k, shape, jnp.float32) * (scale / math.sqrt(shape[0]))

    def block(k: jax.Array) -> Params:
        kq, kk, kv, ko, ki, kout = jax.random.split(k, 6)
        return {
            "ln1": {"scale": jnp.ones((d,), jnp.float32)},
            "attn": {"wq": dense(kq, (d, d)), "wk": dense(kk, (d, d)), "wv": dense(kv, (d, d)),
                     "wo": dense(ko, (d, d), out_scale)},
            "ln2": {"scale": jnp.ones((d,), jnp.float32)},
            "mlp": {"w_in": dense(ki, (d, f)), "w_out": dense(kout, (f, d), out_scale)},
        }

    def embedding(k: jax.Array, rows: int) -> jax.Array:
        return EMBED_INIT_STD * jax.random.normal(k, (rows, d), jnp.float32)

    return {
        "embed": {"tokens": embedding(embed_key, cfg.vocab_size),
                  "positions": embedding(pos_key, cfg.seq_len)},
        "blocks": {str(i): block(k) for i, k in enumerate(block_keys)},
        "ln_f": {"scale": jnp.ones((d,), jnp.float32)},
    }


def _mm(x: jax.Array, w: jax.Array, cfg: ModelConfig,
        out_dtype: Optional[Any] = None) -> jax.Array:
    """``x @ w`` with both operands in the compute dtype; float32 runs the plain ``x @ w``.

    ``out_dtype``: the product's dtype when mixed (float32 accumulates and returns float32)."""
    if not cfg.mixed:
        return x @ w
    return jnp.matmul(x.astype(cfg.dtype), w.astype(cfg.dtype), preferred_element_type=out_dtype)


def _rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array) -> jax.Array:
    inv_rms_BxLx1 = jax.lax.rsqrt(jnp.mean(x_BxLxD * x_BxLxD, axis=-1, keepdims=True)
                                  + RMS_NORM_EPS)
    return x_BxLxD * inv_rms_BxLx1 * scale_D[None, None, :]


def _attention(block: Params, x_BxLxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    batch, length, _ = x_BxLxD.shape
    heads, head_dim = cfg.n_heads, cfg.head_dim

    def project(name: str) -> jax.Array:  # [B, L, H, Dh], in the compute dtype
        return _mm(x_BxLxD, block["attn"][name], cfg).reshape(batch, length, heads, head_dim)

    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = project("wq"), project("wk"), project("wv")
    # Mixed: bf16 products accumulated into fp32 scores, so the mask and softmax run in fp32.
    extra = {"preferred_element_type": jnp.float32} if cfg.mixed else {}
    scores_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK,
                                **extra) / math.sqrt(head_dim)
    causal_LxL = jnp.tril(jnp.ones((length, length), bool))
    # finfo.min rather than -inf: a fully masked row can't occur (the diagonal is always kept),
    # but -inf would turn any such row into NaNs instead of a harmless uniform.
    scores_BxHxLxL = jnp.where(causal_LxL[None, None], scores_BxHxLxL,
                               jnp.finfo(scores_BxHxLxL.dtype).min)
    weights_BxHxLxL = jax.nn.softmax(scores_BxHxLxL, axis=-1).astype(v_BxLxHxK.dtype)
    out_BxLxD = jnp.einsum("bhlm,bmhk->blhk", weights_BxHxLxL, v_BxLxHxK).reshape(x_BxLxD.shape)
    return _mm(out_BxLxD, block["attn"]["wo"], cfg)


def forward(params: Params, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal LM logits: position ``t`` sees tokens ``0..t`` only.

    Args:
      params: the tree from :func:`init_params`.
      tokens_BxL: int token ids, ``L <= cfg.seq_len``.
      cfg: model dimensions.

    Returns:
      float32 logits ``[B, L, V]`` (with ``cfg.compute_dtype`` bfloat16 too: bf16 products,
      float32 accumulation).

    Raises:
      ValueError: if ``tokens_BxL`` is not 2-D or longer than ``cfg.seq_len``.
    """
    if tokens_BxL.ndim != 2:
        raise ValueError(f"tokens_BxL must be [B, L], got shape {tokens_BxL.shape}")
    length = tokens_BxL.shape[1]
    if length > cfg.seq_len:
        raise ValueError(f"sequence length {length} exceeds seq_len ({cfg.seq_len})")
    h_BxLxD = (params["embed"]["tokens"][tokens_BxL]
               + params["embed"]["positions"][None, :length, :])
    for i in range(cfg.n_layers):
        block = params["blocks"][str(i)]
        # The residual stream h stays float32: a bf16 branch output is promoted as it is added.
        h_BxLxD = h_BxLxD + _attention(block, _rms_norm(h_BxLxD, block["ln1"]["scale"]), cfg)
        x_BxLxD = _rms_norm(h_BxLxD, block["ln2"]["scale"])
        h_BxLxD = h_BxLxD + _mm(jax.nn.gelu(_mm(x_BxLxD, block["mlp"]["w_in"], cfg)),
                                block["mlp"]["w_out"], cfg)
    h_BxLxD = _rms_norm(h_BxLxD, params["ln_f"]["scale"])
    return _mm(h_BxLxD, params["embed"]["tokens"].T, cfg, jnp.float32)  # tied head


def loss_fn(params: Params, tokens_BxL_plus_1: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-token cross-entropy (nats) of a batch of windows.

    Args:
      params: the tree from :func:`init_params`.
      tokens_BxL_plus_1: int ``[B, L+1]``; inputs are ``[:, :-1]``, targets ``[:, 1:]``.
      cfg: model dimensions.

    Returns:
      A float32 scalar; ≈ ln(vocab_size) at init.
    """
    inputs_BxL, targets_BxL = tokens_BxL_plus_1[:, :-1], tokens_BxL_plus_1[:, 1:]
    logp_BxLxV = jax.nn.log_softmax(forward(params, inputs_BxL, cfg), axis=-1)
    target_logp_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return -jnp.mean(target_logp_BxL)


def num_params(params: Params) -> int:
    """Total number of scalars in the tree (the tied head counts once)."""
    return sum(int(leaf.size) for leaf in jax.tree_util.tree_leaves(params))


def _key_name(key: Any) -> str:
    # jax key-path entries: DictKey(.key), GetAttrKey(.name), SequenceKey(.idx); or plain values.
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_embedding_path(path: Union[Sequence[Any], str]) -> bool:
    """Whether a leaf lies under ``"embed"``: those merge by plain weighted mean (docs/architecture.md#the-algorithm).

    Args:
      path: a key path, as a tuple of keys (``("embed", "tokens")`` or the entries that
        ``jax.tree_util.tree_flatten_with_path`` yields) or the syncer's ``"embed/tokens"`` string.

    >>> is_embedding_path(("embed", "tokens")), is_embedding_path("blocks/0/attn/wq")
    (True, False)
    """
    if isinstance(path, str):
        first = path.split("/", 1)[0]
    else:
        first = _key_name(path[0]) if len(path) else ""
    return first == "embed"
