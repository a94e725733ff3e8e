"""Mixed precision for the built-in tasks (``model.compute_dtype``), in real JAX on the CPU.

float32 is bit-identical to the model before the option existed (a frozen copy of that forward
pass lives here); bfloat16 stays within a stated tolerance of float32 on the same params and
batch, keeps params, grads and optimizer state float32, really hands bf16 operands to the
matmuls, and trains; the job config takes the key and refuses a bad value by name.

Tolerances. bf16 keeps 8 significant bits: one rounding is off by at most 2^-8 ≈ 3.9e-3
relative. Each logit is a few such roundings deep, and the loss averages B·L of them, so its error
should stay well under one rounding: we require |Δloss| / loss < 4e-3 (measured on this tiny model
after 30 bf16 AdamW steps: 1.9e-5). The gradients must point the same way: cosine > 0.999 over
the whole tree (measured 0.999997) and > 0.99 for every tensor (measured ≥ 0.99997 here; the
worst seen, on params from fp32 training, was 0.998 for a small attention-key gradient).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from islands.learners import model as model_lib
from islands.orchestrator.config import JobConfig

SMALL = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=32)
LOSS_RTOL = 4e-3          # ≈ bf16's unit roundoff, 2^-8
GRAD_COSINE_TREE = 0.999
GRAD_COSINE_TENSOR = 0.99


# -- the model as it was before compute_dtype (frozen copy: the float32 reference) ---------------
def _old_rms_norm(x, scale):
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + model_lib.RMS_NORM_EPS)
    return x * inv * scale[None, None, :]


def _old_attention(block, x, cfg):
    batch, length, _ = x.shape

    def project(name):
        return (x @ block["attn"][name]).reshape(batch, length, cfg.n_heads, cfg.head_dim)

    q, k, v = project("wq"), project("wk"), project("wv")
    scores = jnp.einsum("blhk,bmhk->bhlm", q, k) / math.sqrt(cfg.head_dim)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhlm,bmhk->blhk", weights, v).reshape(x.shape)
    return out @ block["attn"]["wo"]


def _old_loss(params, tokens, cfg):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    length = inputs.shape[1]
    h = params["embed"]["tokens"][inputs] + params["embed"]["positions"][None, :length, :]
    for i in range(cfg.n_layers):
        block = params["blocks"][str(i)]
        h = h + _old_attention(block, _old_rms_norm(h, block["ln1"]["scale"]), cfg)
        x = _old_rms_norm(h, block["ln2"]["scale"])
        h = h + jax.nn.gelu(x @ block["mlp"]["w_in"]) @ block["mlp"]["w_out"]
    h = _old_rms_norm(h, params["ln_f"]["scale"])
    logp = jax.nn.log_softmax(h @ params["embed"]["tokens"].T, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])


# -- fixtures -------------------------------------------------------------------------------------
def _text_batches(n, batch_size=8, window=SMALL["seq_len"] + 1, seed=0):
    """Real bytes (this file and the model's source), so a few steps find structure to learn."""
    text = b"".join(open(p, "rb").read() for p in (__file__, model_lib.__file__))
    data = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    return [np.stack([data[s:s + window] for s in rng.integers(0, len(data) - window, batch_size)])
            for _ in range(n)]


_value_and_grad = jax.jit(jax.value_and_grad(model_lib.loss_fn), static_argnums=2)
BF16_STEPS = 30


@pytest.fixture(scope="module")
def trained():
    """The learner's own path from a job's model dict: ``TrainingSpec.model`` with
    ``compute_dtype: bfloat16`` → the built-in task → the jitted train step, run for 30 steps.
    Returns the losses, the params and optimizer state after them (loss ≈ 3.4, off the uniform
    ln 256 ≈ 5.5, so the logits are not all near zero) and a held-out batch."""
    from islands.learners.task import Step
    from islands.learners.unit import TrainingSpec, build_training

    spec = TrainingSpec(model=dict(SMALL, compute_dtype="bfloat16"),
                        inner=dict(lr=1e-2, warmup_steps=0, total_steps=BF16_STEPS))
    _, params, optimizer, train_step = build_training(spec)
    opt_state, losses = optimizer.init(params), []
    *train, held_out = _text_batches(BF16_STEPS + 1)
    for i, batch in enumerate(train):
        params, opt_state, loss = train_step(params, opt_state, Step(np.int32(i), batch))
        losses.append(loss)
    return losses, params, opt_state, held_out


def _flat(tree):
    return jnp.concatenate([leaf.ravel() for leaf in jax.tree_util.tree_leaves(tree)])


def _cosine(a, b):
    return float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))


# -- (1) float32 is the model it was ---------------------------------------------------------------
def test_float32_is_bit_identical_to_the_model_before_compute_dtype(trained):
    _, params, _, batch = trained
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_old_loss), static_argnums=2)(
        params, batch, model_lib.ModelConfig(**SMALL))
    for cfg in (model_lib.ModelConfig(**SMALL),                              # old dicts: no key
                model_lib.ModelConfig(**SMALL, compute_dtype="float32")):
        loss, grads = _value_and_grad(params, batch, cfg)
        assert np.array_equal(np.asarray(loss), np.asarray(ref_loss))
        for got, want in zip(jax.tree_util.tree_leaves(grads),
                             jax.tree_util.tree_leaves(ref_grads)):
            assert np.array_equal(np.asarray(got), np.asarray(want))


# -- (2) bfloat16 is close to float32, and float32 where it must be --------------------------------
def test_bfloat16_is_within_tolerance_of_float32(trained):
    _, params, _, batch = trained
    loss32, grads32 = _value_and_grad(params, batch, model_lib.ModelConfig(**SMALL))
    loss16, grads16 = _value_and_grad(
        params, batch, model_lib.ModelConfig(**SMALL, compute_dtype="bfloat16"))
    assert loss16.dtype == jnp.float32
    assert float(loss16) != float(loss32)   # bf16 really ran
    assert abs(float(loss16) - float(loss32)) / float(loss32) < LOSS_RTOL
    assert _cosine(_flat(grads32), _flat(grads16)) > GRAD_COSINE_TREE
    for path, g32, g16 in zip(jax.tree_util.tree_flatten_with_path(grads32)[0],
                              jax.tree_util.tree_leaves(grads32),
                              jax.tree_util.tree_leaves(grads16)):
        assert g16.dtype == jnp.float32, path[0]
        assert _cosine(g32.ravel(), g16.ravel()) > GRAD_COSINE_TENSOR, path[0]


def _dot_dtypes(cfg, params, batch):
    jaxpr = jax.make_jaxpr(lambda p, b: model_lib.loss_fn(p, b, cfg))(params, batch)
    return {(str(eqn.invars[0].aval.dtype), str(eqn.invars[1].aval.dtype),
             str(eqn.outvars[0].aval.dtype))
            for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"}


def test_bfloat16_matmuls_take_bf16_operands_and_the_logits_are_float32(trained):
    _, params, _, batch = trained
    cfg16 = model_lib.ModelConfig(**SMALL, compute_dtype="bfloat16")
    # Every matmul multiplies bf16 by bf16; the attention scores and the logits accumulate into
    # fp32 (the softmax and log-softmax run there), the other products stay bf16.
    assert _dot_dtypes(cfg16, params, batch) == {("bfloat16", "bfloat16", "bfloat16"),
                                                 ("bfloat16", "bfloat16", "float32")}
    assert _dot_dtypes(model_lib.ModelConfig(**SMALL), params, batch) == {
        ("float32", "float32", "float32")}
    logits = jax.eval_shape(lambda p, t: model_lib.forward(p, t, cfg16), params, batch[:, :-1])
    assert logits.dtype == jnp.float32


def test_bfloat16_steps_keep_params_and_optimizer_state_float32(trained):
    losses, params, opt_state, _ = trained
    assert {loss.dtype for loss in losses} == {jnp.dtype(jnp.float32)}
    floats = [leaf for leaf in jax.tree_util.tree_leaves((params, opt_state))
              if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert len(floats) > 2 * len(jax.tree_util.tree_leaves(params))   # params, mu, nu
    assert {leaf.dtype for leaf in floats} == {jnp.dtype(jnp.float32)}


# -- (3) bfloat16 trains ----------------------------------------------------------------------------
def test_bfloat16_steps_lower_the_loss(trained):
    losses = [float(loss) for loss in trained[0]]
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < first - 1.0, losses


# -- (4) the job config ----------------------------------------------------------------------------
def test_the_job_config_takes_compute_dtype_and_refuses_a_bad_one():
    assert JobConfig().model.compute_dtype == "float32"
    config = JobConfig.model_validate({"model": {"compute_dtype": "bfloat16"}})
    assert config.model.compute_dtype == "bfloat16"
    # What the learners get (orchestrator/build.py passes model_dump() to the built-in task).
    assert model_lib.ModelConfig(**config.model.model_dump()).compute_dtype == "bfloat16"
    with pytest.raises(ValidationError, match="compute_dtype"):
        JobConfig.model_validate({"model": {"compute_dtype": "float16"}})


@pytest.mark.parametrize("value", ["float16", "bf16", None])
def test_model_config_refuses_an_unknown_compute_dtype_by_name(value):
    with pytest.raises(ValueError, match=r"compute_dtype must be one of \['float32', 'bfloat16'\]"):
        model_lib.ModelConfig(compute_dtype=value)


# -- the Flax task honours the same option ---------------------------------------------------------
def test_the_flax_task_takes_compute_dtype():
    pytest.importorskip("flax")
    pytest.importorskip("grain")
    from islands.tasks import flax_lm

    sizes = dict(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        flax_lm.task(**sizes, compute_dtype="float16")
    t32 = flax_lm.task(**sizes)
    t16 = flax_lm.task(**sizes, compute_dtype="bfloat16")
    params = t32.init_params(jax.random.PRNGKey(0))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(
        t16.init_params(jax.random.PRNGKey(0)))} == {jnp.dtype(jnp.float32)}
    batch = _text_batches(1, window=33)[0]
    def value_and_grad(task):
        return jax.jit(jax.value_and_grad(lambda p: task.loss(p, batch, None)[0]))(params)

    loss32, grads32 = value_and_grad(t32)
    loss16, grads16 = value_and_grad(t16)
    assert loss16.dtype == jnp.float32 and float(loss16) != float(loss32)
    assert abs(float(loss16) - float(loss32)) / float(loss32) < LOSS_RTOL
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads16)} == {jnp.dtype(jnp.float32)}
    assert _cosine(_flat(grads32), _flat(grads16)) > GRAD_COSINE_TREE
