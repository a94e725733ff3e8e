"""The learner's pieces: model, corpus and shards, inner schedule, train step, and the in-process
driver training the default model with 4 learners."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from islands.learners import data, inner, model
from islands.orchestrator import inprocess
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, outer
from islands.syncer.core import SyncerSettings

SMALL = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16)


def test_default_model_shapes_and_size():
    cfg = model.ModelConfig()
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    # embed 256·64 + 64·64, per block 4·64² + 64·256·2 + 2·64, final 64
    expected = 256 * 64 + 64 * 64 + 2 * (4 * 64 * 64 + 2 * 64 * 256 + 2 * 64) + 64
    assert model.num_params(params) == expected == 119_104
    logits = model.forward(params, jnp.zeros((2, 64), jnp.int32), cfg)
    assert logits.shape == (2, 64, 256)
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        model.ModelConfig(d_model=30)


def test_causal_and_initial_loss():
    params = model.init_params(SMALL, jax.random.PRNGKey(1))
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 256
    changed = tokens.at[0, 10].set(99)
    a, b = model.forward(params, tokens, SMALL), model.forward(params, changed, SMALL)
    np.testing.assert_allclose(a[0, :10], b[0, :10], atol=1e-6)  # the past can't see the future
    assert not np.allclose(a[0, 10:], b[0, 10:])
    batch = jax.random.randint(jax.random.PRNGKey(2), (4, 17), 0, 256)
    assert abs(float(model.loss_fn(params, batch, SMALL)) - math.log(256)) < 0.3


def test_schedule_first_middle_last():
    # warmup 10 to 1e-3, cosine over the next 100 steps to 1e-4:
    # step 0 → 0, step 10 → 1e-3, step 60 → 1e-4 + 9e-4·(1 + cos π/2)/2 = 5.5e-4, step 110 → 1e-4.
    sched = inner.inner_schedule(1e-3, 10, 110)
    assert float(sched(0)) == 0.0
    assert float(sched(10)) == pytest.approx(1e-3)
    assert float(sched(60)) == pytest.approx(5.5e-4)
    assert float(sched(110)) == pytest.approx(1e-4)


def test_corpus_split_and_shards_are_deterministic():
    corpus = data.load_stdlib_corpus(max_bytes=200_000)
    again = data.load_stdlib_corpus(max_bytes=200_000)
    assert corpus.train.dtype == np.uint8 and len(corpus.train) == 200_000
    np.testing.assert_array_equal(corpus.train, again.train)
    np.testing.assert_array_equal(corpus.eval, again.eval)
    assert data.is_eval_file("json/decoder.py", 0.05) == data.is_eval_file("json/decoder.py", 0.05)
    s0 = data.ShardSampler(corpus.train, 4, 16, 0, 2, seed=3)
    s1 = data.ShardSampler(corpus.train, 4, 16, 1, 2, seed=3)
    np.testing.assert_array_equal(s0.batch_at(7), data.ShardSampler(
        corpus.train, 4, 16, 0, 2, seed=3).batch_at(7))
    assert s0.batch_at(7).shape == (4, 17) and s0.tokens_per_batch == 64
    assert not np.array_equal(s0.batch_at(7), s1.batch_at(7))
    assert s0.stop <= s1.start  # shards are disjoint slices
    with pytest.raises(ValueError, match="shard_index 2 not in"):
        data.ShardSampler(corpus.train, 4, 16, 2, 2)
    evals = data.eval_batches(corpus.eval, 4, 16, 3)
    assert len(evals) == 3 and evals[0].shape == (4, 17)


def test_train_step_learns_synthetic_data():
    corpus = data.synthetic_corpus(50_000)
    opt = inner.inner_optimizer(lr=1e-2, warmup_steps=5, total_steps=100)
    step = inner.make_train_step(SMALL, opt)
    params = model.init_params(SMALL, jax.random.PRNGKey(0))
    state = opt.init(params)
    sampler = data.ShardSampler(corpus.train, 8, 16, 0, 1)
    evaluate = inner.make_eval_fn(SMALL)
    batches = data.eval_batches(corpus.eval, 8, 16, 2)
    before = evaluate(params, batches)
    for i in range(100):
        params, state, _ = step(params, state, sampler.batch_at(i))
    after = evaluate(params, batches)
    assert after < before - 2.0, (before, after)
    assert evaluate(params, batches) == after  # deterministic


def test_inprocess_driver_trains_the_default_model_with_four_learners():
    """4 learners, P = 4, H = 8, τ = 2, K = 1, int4 + error feedback, 300 steps each."""
    cfg = model.ModelConfig()
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    corpus = data.load_stdlib_corpus(max_bytes=1_000_000)
    opt = inner.inner_optimizer(lr=3e-3, warmup_steps=20, total_steps=300)
    samplers = [data.ShardSampler(corpus.train, 8, cfg.seq_len, i, 4) for i in range(4)]
    evaluate = inner.make_eval_fn(cfg)
    eval_set = data.eval_batches(corpus.eval, 8, cfg.seq_len, 4)
    codec = codec_lib.make_codec("int4")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=opt.init, plan=fragments.partition(params, 4),
        settings=SyncerSettings(min_learners=1, overlap_steps=2), outer_optimizer=outer.build(),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=[f"local:{i}" for i in range(4)], merge_alpha=0.0,
        is_embedding=model.is_embedding_path)
    record = inprocess.run_inprocess(
        learners=learners, syncer=syncer, train_step=inner.make_train_step(cfg, opt),
        batch_for=lambda i, k: samplers[i].batch_at(k), tokens_per_batch=8 * cfg.seq_len,
        fleet=inprocess.Fleet(speed_factors=[1.0, 1.0, 0.5, 0.5], step_noise=0.1),
        num_fragments=4, sync_every_steps=8, steps=300, evaluate=lambda p: evaluate(p, eval_set),
        assemble=inprocess.assemble_like(params))
    start, end = record.evals[0][2], record.evals[-1][2]
    print(f"eval loss {start:.3f} -> {end:.3f}, merges {len(record.merges)}, "
          f"bytes up {record.wire_bytes_up}, rejected {record.rejected}")
    assert start > 5.0 and end < 3.2
    assert len(record.merges) >= 4 * (300 // 8) - 4
    assert record.steps == [300] * 4
