"""The learner's pure core: model shapes and causality, the inner schedule worked by hand, the
stdlib corpus split, shard windows, and a train step that learns."""

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_trees_close
from islands.learners import data, inner, model

# Small enough that compiling and 100 steps take a couple of seconds on 2 shared cores.
SMALL = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16)
# Jitted once: eager init and forward dispatch op by op, which costs seconds on shared cores.
init_params = jax.jit(model.init_params, static_argnums=0)
forward = jax.jit(model.forward, static_argnums=2)
loss_fn = jax.jit(model.loss_fn, static_argnums=2)


# --- model -------------------------------------------------------------------------------------

def test_default_model_layout_and_param_count():
    cfg = model.ModelConfig()
    params = init_params(cfg, jax.random.PRNGKey(0))
    # embed 256·64 + 64·64 = 20,480; per block 4·64² + 2·64·256 + 2·64 = 49,280 (×2);
    # ln_f 64; the head is tied to embed/tokens, so it adds nothing.
    assert model.num_params(params) == 20_480 + 2 * 49_280 + 64 == 119_104
    assert set(params) == {"embed", "blocks", "ln_f"}
    assert list(params["blocks"]) == ["0", "1"]
    shapes = jax.tree_util.tree_map(lambda x: x.shape, params["blocks"]["1"])
    assert shapes == {"ln1": {"scale": (64,)},
                      "attn": {"wq": (64, 64), "wk": (64, 64), "wv": (64, 64), "wo": (64, 64)},
                      "ln2": {"scale": (64,)}, "mlp": {"w_in": (64, 256), "w_out": (256, 64)}}
    assert params["embed"]["tokens"].shape == (256, 64)
    assert params["embed"]["positions"].shape == (64, 64)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    logits = forward(params, jnp.zeros((2, 64), jnp.int32), cfg)
    assert logits.shape == (2, 64, 256) and logits.dtype == jnp.float32


def test_init_is_deterministic_for_a_key():
    a = init_params(SMALL, jax.random.PRNGKey(3))
    assert_trees_close(a, init_params(SMALL, jax.random.PRNGKey(3)), atol=0, rtol=0)
    other = init_params(SMALL, jax.random.PRNGKey(4))
    assert not np.array_equal(a["blocks"]["0"]["attn"]["wq"], other["blocks"]["0"]["attn"]["wq"])


@pytest.mark.parametrize("kwargs, message", [
    ({"d_model": 30}, r"d_model \(30\) must be divisible by n_heads \(4\)"),
    ({"n_layers": 0}, r"n_layers must be >= 1, got 0"),
    ({"seq_len": -1}, r"seq_len must be >= 1, got -1"),
    ({"vocab_size": 256.0}, r"vocab_size must be an int, got 256.0"),
])
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.ModelConfig(**kwargs)


def test_forward_rejects_sequences_longer_than_seq_len():
    params = init_params(SMALL, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds seq_len \(16\)"):
        forward(params, jnp.zeros((1, 17), jnp.int32), SMALL)


def test_changing_a_future_token_leaves_earlier_logits_alone():
    params = init_params(SMALL, jax.random.PRNGKey(1))
    tokens = jnp.arange(16, dtype=jnp.int32)[None, :]
    changed = tokens.at[0, 10].set(99)
    a, b = forward(params, tokens, SMALL), forward(params, changed, SMALL)
    np.testing.assert_array_equal(a[0, :10], b[0, :10])  # positions 0..9 can't see position 10
    assert not np.allclose(a[0, 10], b[0, 10], atol=1e-3)  # position 10 sees its own token


def test_loss_at_init_is_about_ln_vocab():
    cfg = model.ModelConfig()
    params = init_params(cfg, jax.random.PRNGKey(0))
    batch = jax.random.randint(jax.random.PRNGKey(2), (8, cfg.seq_len + 1), 0, 256)
    # Near-uniform predictions: ln 256 = 5.545; the tied head's small logits (std ≈ 0.02·√64)
    # add only ~0.01 nats on top.
    assert float(loss_fn(params, batch, cfg)) == pytest.approx(math.log(256), abs=0.05)


def test_embedding_paths():
    params = init_params(SMALL, jax.random.PRNGKey(0))
    flagged = {jax.tree_util.keystr(path): model.is_embedding_path(path)
               for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert [p for p, is_embed in flagged.items() if is_embed] == [
        "['embed']['positions']", "['embed']['tokens']"]
    assert model.is_embedding_path(("embed", "tokens"))
    assert model.is_embedding_path("embed/positions")  # the syncer's fragment path form
    assert not model.is_embedding_path("blocks/0/attn/wq")
    assert not model.is_embedding_path(("ln_f", "scale"))
    assert doctest.testmod(model).failed == 0


# --- inner schedule and optimizer ---------------------------------------------------------------

def test_schedule_by_hand():
    # warmup 10 steps to 1e-3, then cosine to 1e-4 at step 110 (total includes the warmup):
    # step 0 → 0; step 5 → 5e-4; step 10 → 1e-3; step 60 (halfway) → 1e-4 + 9e-4·(1 + cos π/2)/2
    # = 5.5e-4; step 110 → 1e-4; and it stays at 1e-4 after.
    sched = inner.inner_schedule(1e-3, 10, 110)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(5e-4)
    assert float(sched(10)) == pytest.approx(1e-3)
    assert float(sched(60)) == pytest.approx(5.5e-4)
    assert float(sched(110)) == pytest.approx(1e-4)
    assert float(sched(500)) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match=r"total_steps \(10\) must exceed warmup_steps \(10\)"):
        inner.inner_schedule(1e-3, 10, 10)


def test_optimizer_first_step_is_a_no_op_and_decay_skips_norm_scales():
    params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    zero_grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    # With warmup, step 0 has lr 0: the first update moves nothing.
    opt = inner.inner_optimizer(lr=0.1, warmup_steps=10, total_steps=100, weight_decay=0.1)
    updates, _ = opt.update(zero_grads, opt.init(params), params)
    assert_trees_close(updates, zero_grads, atol=0, rtol=0)
    # Without warmup, step 0 has lr 0.1. Zero gradients leave only the decay term:
    # w ← w − lr·wd·w = 1 − 0.1·0.1 = 0.99; the rank-1 scale is not decayed and stays 1.
    opt = inner.inner_optimizer(lr=0.1, warmup_steps=0, total_steps=100, weight_decay=0.1)
    updates, _ = opt.update(zero_grads, opt.init(params), params)
    new = optax.apply_updates(params, updates)
    assert_trees_close(new, {"w": jnp.full((2, 2), 0.99), "scale": jnp.ones((2,))}, atol=1e-7)


# --- corpus and shards --------------------------------------------------------------------------

def test_stdlib_split_is_deterministic_and_disjoint():
    files = data.list_files(data.stdlib_root())
    assert files == sorted(files) and "json/decoder.py" in files
    eval_files = [f for f in files if data.is_eval_file(f, 0.05)]
    train_files = [f for f in files if not data.is_eval_file(f, 0.05)]
    assert set(eval_files).isdisjoint(train_files)
    assert len(eval_files) + len(train_files) == len(files)
    assert 0.01 < len(eval_files) / len(files) < 0.1  # about 5 % of files by name hash
    # sha1("json/decoder.py")[:8] is fixed forever, so so is the file's side of the split.
    assert data.is_eval_file("json/decoder.py", 0.05) is data.is_eval_file("json/decoder.py", 0.05)

    corpus = data.load_stdlib_corpus(max_bytes=100_000)
    again = data.load_stdlib_corpus(max_bytes=100_000)
    np.testing.assert_array_equal(corpus.train, again.train)
    np.testing.assert_array_equal(corpus.eval, again.eval)
    # Caps: train 100,000 bytes; eval max(100,000 // 20, 4096) = 5,000 bytes.
    assert corpus.train.dtype == np.uint8 and corpus.train.shape == (100_000,)
    assert corpus.eval.shape == (5_000,)
    # Each split starts with the first file of its side, in sorted order: no file is in both.
    root = data.stdlib_root()
    with open(f"{root}/{train_files[0]}", "rb") as f:
        head = np.frombuffer(f.read(), np.uint8)[:1000]
    np.testing.assert_array_equal(corpus.train[:len(head)], head)
    with open(f"{root}/{eval_files[0]}", "rb") as f:
        head = np.frombuffer(f.read(), np.uint8)[:1000]
    np.testing.assert_array_equal(corpus.eval[:len(head)], head)


def test_max_files_reads_only_the_first_files():
    files = data.list_files(data.stdlib_root())
    first_eval = next(i for i, f in enumerate(files) if data.is_eval_file(f, 0.05))
    corpus = data.load_stdlib_corpus(max_files=first_eval + 1)
    root = data.stdlib_root()
    expected_eval = open(f"{root}/{files[first_eval]}", "rb").read()
    np.testing.assert_array_equal(corpus.eval, np.frombuffer(expected_eval, np.uint8))
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        data.load_stdlib_corpus(eval_fraction=1.0, max_bytes=1000)


def test_batch_at_is_a_pure_function_of_seed_shard_and_index():
    train = data.synthetic_corpus(20_000, seed=1).train
    s0 = data.ShardSampler(train, 4, 16, shard_index=0, num_shards=2, seed=3)
    restarted = data.ShardSampler(train, 4, 16, shard_index=0, num_shards=2, seed=3)
    b7 = s0.batch_at(7)
    assert b7.shape == (4, 17) and b7.dtype == np.int32 and s0.tokens_per_batch == 4 * 16
    for _ in range(3):
        s0.batch_at(2)  # no hidden cursor: what was drawn before doesn't matter
    np.testing.assert_array_equal(restarted.batch_at(7), b7)  # a restart resumes exactly at 7
    assert not np.array_equal(s0.batch_at(8), b7)
    assert not np.array_equal(data.ShardSampler(train, 4, 16, 0, 2, seed=4).batch_at(7), b7)
    assert not np.array_equal(data.ShardSampler(train, 4, 16, 1, 2, seed=3).batch_at(7), b7)


def test_shard_windows_stay_inside_their_shard():
    # 4 shards of 100 bytes, shard s filled with the value s: any leak shows up as a wrong value.
    train = np.repeat(np.arange(4, dtype=np.uint8), 100)
    for shard in range(4):
        sampler = data.ShardSampler(train, 8, 16, shard, 4, seed=0)
        assert (sampler.start, sampler.stop) == (100 * shard, 100 * shard + 100)
        batches = np.stack([sampler.batch_at(i) for i in range(100)])
        assert np.all(batches == shard)
        starts = np.concatenate([sampler.window_starts(i) for i in range(100)])
        assert starts.min() >= sampler.start and starts.max() + 17 <= sampler.stop
    # A shard exactly one window long has a single start: its first byte.
    tight = data.ShardSampler(np.arange(34, dtype=np.uint8), 3, 16, 1, 2)
    np.testing.assert_array_equal(tight.batch_at(0), np.tile(np.arange(17, 34), (3, 1)))
    with pytest.raises(ValueError, match=r"shard_index 2 not in \[0, 2\)"):
        data.ShardSampler(train, 4, 16, 2, 2)
    with pytest.raises(ValueError, match=r"shard of 16 bytes is shorter than seq_len \+ 1 \(17\)"):
        data.ShardSampler(np.zeros(32, np.uint8), 4, 16, 0, 2)


def test_eval_batches_are_fixed_windows_spanning_the_split():
    eval_bytes = (np.arange(1000) % 251).astype(np.uint8)
    batches = data.eval_batches(eval_bytes, 4, 16, 3)
    assert len(batches) == 3 and all(b.shape == (4, 17) and b.dtype == np.int32 for b in batches)
    np.testing.assert_array_equal(batches[0][0], eval_bytes[:17])  # first window at the start
    np.testing.assert_array_equal(batches[-1][-1], eval_bytes[-17:])  # last one ends at the end
    for a, b in zip(batches, data.eval_batches(eval_bytes, 4, 16, 3)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"eval split \(10 bytes\) shorter than seq_len \+ 1"):
        data.eval_batches(eval_bytes[:10], 4, 16, 3)


# --- train step and evaluation ------------------------------------------------------------------

def test_train_step_is_pure_and_learns_a_synthetic_corpus_and_eval_is_deterministic():
    corpus = data.synthetic_corpus(50_000, seed=0)
    opt = inner.inner_optimizer(lr=1e-2, warmup_steps=5, total_steps=100)
    train_step = inner.make_train_step(SMALL, opt)
    evaluate = inner.make_eval_fn(SMALL)
    params = init_params(SMALL, jax.random.PRNGKey(0))
    state = opt.init(params)
    sampler = data.ShardSampler(corpus.train, 8, SMALL.seq_len, 0, 1, seed=0)
    held_out = data.eval_batches(corpus.eval, 8, SMALL.seq_len, 2)

    before = evaluate(params, held_out)
    # evaluate is the plain mean of the per-batch losses
    per_batch = [float(loss_fn(params, jnp.asarray(b), SMALL)) for b in held_out]
    assert before == pytest.approx(np.mean(per_batch), abs=1e-5)
    assert before == pytest.approx(math.log(256), abs=0.1)
    once = train_step(params, state, sampler.batch_at(0))
    twice = train_step(params, state, sampler.batch_at(0))  # the inputs weren't consumed
    assert_trees_close(once, twice, atol=0, rtol=0)
    losses = []
    for i in range(100):
        params, state, loss = train_step(params, state, sampler.batch_at(i))
        losses.append(float(loss))
    after = evaluate(params, held_out)
    # Only 9 byte values occur (8 letters, space): ln 9 ≈ 2.2 nats, against ln 256 ≈ 5.5 at init.
    assert after < 2.5 < before - 2.5, (before, after)
    assert np.mean(losses[-10:]) < losses[0] - 3.0
    assert evaluate(params, held_out) == after  # same params, same batches, same number



def test_a_spare_prepares_at_low_priority_and_only_its_thread_does():
    import os
    import threading

    from islands.learners.unit import SPARE_NICENESS, low_priority

    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}

    def prepare():
        with low_priority():
            seen["inside"] = os.getpriority(os.PRIO_PROCESS, 0)
            child = threading.Thread(
                target=lambda: seen.__setitem__("child", os.getpriority(os.PRIO_PROCESS, 0)))
            child.start()
            child.join()

    worker = threading.Thread(target=prepare)
    worker.start()
    worker.join()
    assert seen["inside"] == min(base + SPARE_NICENESS, 19) == seen["child"]
    assert os.getpriority(os.PRIO_PROCESS, 0) == base      # the training thread is untouched


def test_a_hurried_or_promoted_spare_brings_every_thread_back_to_normal_priority():
    """The threads a spare's preparation started (JAX's) keep its low priority after it: a
    hurry (a restart waits for it) or its promotion puts every thread back."""
    import os
    import threading

    from islands.learners.unit import low_priority, normal_priority

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= 19:
        pytest.skip("this process runs at the lowest priority already")
    low, back, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def preparing():   # a thread started by the preparation, still alive after it
        with low_priority():
            low.set()
            back.wait(10)
            seen["after"] = os.getpriority(os.PRIO_PROCESS, 0)
        done.set()

    worker = threading.Thread(target=preparing)
    worker.start()
    assert low.wait(10)
    if not normal_priority(base):
        back.set()
        worker.join()
        pytest.skip("lowering a thread's niceness is not permitted here")
    back.set()
    worker.join()
    assert done.is_set() and seen["after"] == base
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_the_profiler_server_listens_where_the_learner_says():
    """learner.profiler: the address a learner reports (heartbeat, console) accepts a capture
    client's connection."""
    import socket

    from islands.learners.unit import start_profiler

    address = start_profiler()
    assert address is not None, "jax.profiler.start_server failed on this platform"
    port = int(address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass
