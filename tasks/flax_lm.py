"""The reference task on the JAX ecosystem's own libraries: a small decoder LM written with Flax
(NNX) and fed by a Grain pipeline over local text files (docs/tasks.md).

The model is an ``nnx.Module``; ``nnx.split`` gives its graph (static) and its state, whose pure
dict (``{"embed": {"embedding": …}, "block_0": {"attn_q": {"kernel": …}}, …}``) is the params
pytree the learners, the syncer and the export see; ``nnx.merge(graph, params)`` rebuilds the
module inside the pure jitted step. The data are non-overlapping byte windows of the files'
concatenation (``.py`` files of the standard library by default, any directory otherwise),
shuffled by Grain, split per learner with Grain's dataset slicing (``ds[shard::num_shards]``) and
batched; a learner (re)starting at step k restores the iterator's state ``{"next_index": k}``.

Needs the ``flax`` extra: ``pip install 'islands[flax]'``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from islands.learners import mesh
from islands.learners.task import Task

PATH = "islands.tasks.flax_lm:task"
EXTRA_HINT = "the Flax task needs flax and grain: pip install 'islands[flax]'"


def _import_flax():
    try:
        import grain
        from flax import nnx
    except ImportError as exc:
        raise ImportError(f"{EXTRA_HINT} ({exc})") from exc
    return nnx, grain


class ByteWindows:
    """A Grain random-access source: window i is bytes ``[i·w, (i+1)·w)`` of ``data`` (int32)."""

    def __init__(self, data: np.ndarray, window: int):
        if len(data) < window:
            raise ValueError(f"{len(data)} bytes hold no window of {window}")
        self.data, self.window = data, window

    def __len__(self) -> int:
        return len(self.data) // self.window

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(index) * self.window
        return self.data[start:start + self.window].astype(np.int32)


def build_model(nnx, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                seq_len: int, compute_dtype: str = "float32"):
    """The decoder LM class (built here so that importing this module needs no flax).

    ``compute_dtype="bfloat16"``: the Linear layers compute in bf16 (``dtype``) on float32
    params; the residual stream, the RMSNorms, the attention softmax and the logits (bf16
    products accumulated into float32) stay float32, as in the built-in model."""
    head_dim = d_model // n_heads
    mixed = compute_dtype != "float32"
    linear_dtype = compute_dtype if mixed else None   # None: float32, as before this option

    class Block(nnx.Module):
        def __init__(self, rngs):
            dense = functools.partial(nnx.Linear, use_bias=False, dtype=linear_dtype, rngs=rngs)
            out_init = nnx.initializers.normal(1.0 / math.sqrt(2 * n_layers * d_model))
            self.norm_attn = nnx.RMSNorm(d_model, rngs=rngs)
            self.attn_q, self.attn_k, self.attn_v = (dense(d_model, d_model) for _ in range(3))
            self.attn_out = dense(d_model, d_model, kernel_init=out_init)
            self.norm_mlp = nnx.RMSNorm(d_model, rngs=rngs)
            self.mlp_in = dense(d_model, d_ff)
            self.mlp_out = dense(d_ff, d_model, kernel_init=out_init)

        def __call__(self, h_BxLxD):
            import jax
            import jax.numpy as jnp

            batch, length, _ = h_BxLxD.shape
            x_BxLxD = self.norm_attn(h_BxLxD)
            split = lambda t: t.reshape(batch, length, n_heads, head_dim)  # noqa: E731
            q, k, v = split(self.attn_q(x_BxLxD)), split(self.attn_k(x_BxLxD)), split(
                self.attn_v(x_BxLxD))
            extra = {"preferred_element_type": jnp.float32} if mixed else {}
            scores_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q, k, **extra) / math.sqrt(head_dim)
            causal_LxL = jnp.tril(jnp.ones((length, length), bool))
            scores_BxHxLxL = jnp.where(causal_LxL[None, None], scores_BxHxLxL,
                                       jnp.finfo(scores_BxHxLxL.dtype).min)
            weights_BxHxLxL = jax.nn.softmax(scores_BxHxLxL, axis=-1).astype(v.dtype)
            attended = jnp.einsum("bhlm,bmhk->blhk", weights_BxHxLxL, v)
            h_BxLxD = h_BxLxD + self.attn_out(attended.reshape(batch, length, d_model))
            return h_BxLxD + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm_mlp(h_BxLxD))))

    class DecoderLM(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.02)
            self.embed = nnx.Embed(vocab_size, d_model, embedding_init=init, rngs=rngs)
            self.pos_embed = nnx.Param(init(rngs.params(), (seq_len, d_model)))
            for i in range(n_layers):  # named attributes: the params dict has string keys only
                setattr(self, f"block_{i}", Block(rngs))
            self.norm_out = nnx.RMSNorm(d_model, rngs=rngs)

        def __call__(self, tokens_BxL):
            length = tokens_BxL.shape[1]
            h_BxLxD = self.embed(tokens_BxL) + self.pos_embed[...][None, :length, :]
            for i in range(n_layers):
                h_BxLxD = getattr(self, f"block_{i}")(h_BxLxD)
            if not mixed:
                return self.embed.attend(self.norm_out(h_BxLxD))  # tied head
            import jax.numpy as jnp

            return jnp.matmul(self.norm_out(h_BxLxD).astype(compute_dtype),
                              self.embed.embedding[...].astype(compute_dtype).T,
                              preferred_element_type=jnp.float32)  # tied head, fp32 logits

    return DecoderLM


def task(corpus: str = "stdlib", suffix: str = ".py", max_bytes: Optional[int] = 2_000_000,
         eval_fraction: float = 0.05, batch_size: int = 8, eval_batches: int = 8,
         seq_len: int = 64, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
         d_ff: int = 256, seed: int = 0, compute_dtype: str = "float32") -> Task:
    """The Flax decoder LM over a Grain pipeline, as a :class:`Task`.

    Args:
      corpus: ``"stdlib"`` or a directory; every file ending in ``suffix`` is read, in sorted
        order, and split into train and eval by a hash of its path (``learners/data.py``).
      suffix: file name ending to read (``""``: every file).
      max_bytes: caps the train split (eval at 1/20 of it); None: no cap.
      eval_fraction: share of files held out.
      batch_size, eval_batches: windows per batch (B); fixed held-out batches.
      seq_len, d_model, n_layers, n_heads, d_ff: model sizes (vocabulary: the 256 bytes).
      seed: Grain's shuffle seed.
      compute_dtype: ``"float32"`` or ``"bfloat16"``, the dtype of the matmuls (params, grads
        and optimizer state stay float32), as the built-in task's ``model.compute_dtype``.

    Raises:
      ImportError: naming the ``flax`` extra when flax or grain is missing.
      ValueError: on sizes that do not fit (heads must divide ``d_model``), or an unknown
        ``compute_dtype``.
    """
    from islands.learners.model import COMPUTE_DTYPES

    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got "
                         f"{compute_dtype!r}")
    nnx, grain = _import_flax()
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    for name, value in (("batch_size", batch_size), ("eval_batches", eval_batches),
                        ("seq_len", seq_len), ("n_layers", n_layers)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    model_cls = build_model(nnx, 256, d_model, n_layers, n_heads, d_ff, seq_len, compute_dtype)
    graph, _ = nnx.split(nnx.eval_shape(lambda: model_cls(nnx.Rngs(0))))
    window = seq_len + 1

    @functools.lru_cache(maxsize=1)
    def corpus_():
        from islands.learners import data

        root = data.stdlib_root() if corpus == "stdlib" else corpus
        return data.load_directory_corpus(root, eval_fraction, max_bytes, suffix=suffix)

    def init_params(rng):
        return nnx.split(model_cls(nnx.Rngs(rng)))[1].to_pure_dict()

    def loss(params, tokens_BxLp1, rng):
        import jax
        import jax.numpy as jnp

        model = nnx.merge(graph, params)
        logits_BxLxV = model(tokens_BxLp1[:, :-1])
        logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
        target_BxL = tokens_BxLp1[:, 1:]
        nll = -jnp.mean(jnp.take_along_axis(logp_BxLxV, target_BxL[..., None], axis=-1))
        return nll, {"nll": nll}

    def batches(shard: int, num_shards: int, start_step: int):
        dataset = (grain.MapDataset.source(ByteWindows(corpus_().train, window))
                   .seed(seed).shuffle().repeat()[shard::num_shards]
                   .batch(batch_size, drop_remainder=True))
        iterator = iter(dataset.to_iter_dataset())
        iterator.set_state({"next_index": start_step})  # exact resume at step k
        return iterator

    def eval_batches_():
        source = ByteWindows(corpus_().eval, window)
        if len(source) < batch_size:
            raise ValueError(f"the eval split holds {len(source)} windows of {window} bytes, "
                             f"fewer than one batch ({batch_size})")
        dataset = grain.MapDataset.source(source).batch(batch_size, drop_remainder=True)
        return [dataset[i] for i in range(min(eval_batches, len(dataset)))]

    return Task(init_params=init_params, loss=loss, batches=batches,
                eval_batches=eval_batches_,
                tokens=lambda batch: int(batch.shape[0]) * (int(batch.shape[1]) - 1),
                is_embedding=lambda path: path.split("/", 1)[0] in ("embed", "pos_embed"),
                partition_specs=mesh.matrix_specs)
