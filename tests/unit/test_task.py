"""The Task interface: the built-in byte LM is the old model bit for bit, streams resume exactly,
bad tasks fail naming task.path before Ray, and a task defined here trains in-process."""

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

from islands.learners import data, inner, model
from islands.learners.task import (Task, TaskError, TaskStream, batch_digest, check_task,
                                   load_task, make_eval_fn, make_train_step)
from islands.orchestrator import build, inprocess
from islands.orchestrator.config import ConfigError, parse
from islands.orchestrator.preflight import preflight
from islands.tasks import bytelm

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 16}


# -- a user's task, defined in this test module ------------------------------------------------
def regression_task(dim: int = 4, batch_size: int = 16, seed: int = 0) -> Task:
    """y = x·w* + 0.5 with a fixed w*; a 2-layer MLP learns it. Batch k of shard s is drawn from
    rng (seed, s, num_shards, k), so any start step gives the same batch."""
    w_true = np.linspace(-1.0, 1.0, dim).astype(np.float32)

    def make(rng_key):
        x = rng_key.normal(size=(batch_size, dim)).astype(np.float32)
        return {"x": x, "y": (x @ w_true + 0.5).astype(np.float32)}

    def batches(shard, num_shards, start_step):
        step = start_step
        while True:
            yield make(np.random.default_rng((seed, shard, num_shards, step)))
            step += 1

    def init_params(rng):
        k1, k2 = jax.random.split(rng)
        return {"hidden": {"w": jax.random.normal(k1, (dim, 16)) / np.sqrt(dim),
                           "b": jnp.zeros((16,))},
                "out": {"w": jax.random.normal(k2, (16,)) / 4.0, "b": jnp.zeros(())}}

    def loss(params, batch, rng):
        h = jax.nn.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"][None, :])
        pred = h @ params["out"]["w"] + params["out"]["b"]
        mse = jnp.mean((pred - batch["y"]) ** 2)
        return mse, {"mse": mse}

    return Task(init_params=init_params, loss=loss, batches=batches,
                eval_batches=lambda: [make(np.random.default_rng((seed, 99, i)))
                                      for i in range(4)],
                tokens=lambda batch: int(batch["x"].shape[0]))


def vector_loss_task() -> Task:
    base = regression_task()
    return base._replace(loss=lambda params, batch, rng: batch["y"] * params["out"]["b"])


def raising_factory():
    raise RuntimeError("no data today")


# -- the built-in task is the old model ----------------------------------------------------------
def test_builtin_task_has_the_old_init_batches_losses_and_eval():
    corpus = data.synthetic_corpus(50_000)
    cfg = model.ModelConfig(**SMALL)
    task = bytelm.task(model=SMALL, batch_size=4, eval_batches=2, seed=3,
                       train_bytes=corpus.train)
    key = jax.random.PRNGKey(0)
    old_params = model.init_params(cfg, key)
    new_params = task.init_params(key)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(jnp.array_equal(a, b)), old_params, new_params))
    sampler = data.ShardSampler(corpus.train, 4, cfg.seq_len, 1, 3, seed=3)
    stream = TaskStream(task, 1, 3)
    opt = inner.inner_optimizer(lr=3e-3, warmup_steps=2, total_steps=20)
    old_step, new_step = inner.make_train_step(cfg, opt), make_train_step(task, opt, seed=0)
    p_old, s_old = old_params, opt.init(old_params)
    p_new, s_new = new_params, opt.init(new_params)
    for k in range(4):
        np.testing.assert_array_equal(stream.batch_at(k).batch, sampler.batch_at(k))
        p_old, s_old, loss_old = old_step(p_old, s_old, sampler.batch_at(k))
        p_new, s_new, loss_new = new_step(p_new, s_new, stream.batch_at(k))
        assert float(loss_old) == float(loss_new)
    assert task.tokens(stream.batch_at(0).batch) == 4 * 16
    assert task.is_embedding("embed/tokens") and not task.is_embedding("blocks/0/attn/wq")


def test_builtin_eval_matches_the_old_eval_fn():
    cfg = model.ModelConfig(**SMALL)
    task = bytelm.task(model=SMALL, corpus="stdlib", max_bytes=100_000, batch_size=4,
                       eval_batches=3)
    corpus = bytelm.load_corpus("stdlib", max_bytes=100_000)
    old_batches = data.eval_batches(corpus.eval, 4, cfg.seq_len, 3)
    for old, new in zip(old_batches, task.eval_batches()):
        np.testing.assert_array_equal(old, new)
    params = task.init_params(jax.random.PRNGKey(1))
    assert (make_eval_fn(task)(params, task.eval_batches())
            == inner.make_eval_fn(cfg)(params, old_batches))


def test_job_config_without_task_section_trains_the_builtin_with_its_sections():
    config = parse({"model": SMALL, "data": {"batch_size": 4, "max_bytes": 100_000}, "seed": 7})
    spec = build.training_spec(config)
    assert spec.task_path == "islands.tasks.bytelm:task"
    assert spec.task_args == {"model": {**SMALL, "vocab_size": 256, "compute_dtype": "float32"},
                              "corpus": "stdlib", "eval_fraction": 0.05, "max_bytes": 100_000,
                              "batch_size": 4, "eval_batches": 8, "seed": 7}
    assert build.syncer_settings(config).tokens_per_step == 4 * 16


# -- exact resume ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_a_resumed_stream_sees_exactly_the_batches_the_dead_one_would_have(num_shards):
    """Incarnation 0 reads steps 0..9 and dies; incarnation 1 resumes at its applied step 6."""
    task = bytelm.task(model=SMALL, batch_size=4, seed=1,
                       train_bytes=data.synthetic_corpus(30_000).train)
    for shard in range(num_shards):
        dead = TaskStream(task, shard, num_shards)
        seen = [batch_digest(dead.batch_at(k).batch) for k in range(10)]
        resumed = TaskStream(task, shard, num_shards)
        again = [batch_digest(resumed.batch_at(k).batch) for k in range(6, 10)]
        assert again == seen[6:]
        assert len(set(seen)) == 10  # every step a new batch
        assert resumed.reopened == 1 and dead.reopened == 1
    # shards differ
    a, b = TaskStream(task, 0, 2).batch_at(0), TaskStream(task, 1, 2).batch_at(0)
    assert batch_digest(a.batch) != batch_digest(b.batch)


def test_stream_reopens_on_a_jump_back_and_repeats_the_last_step():
    task = regression_task()
    stream = TaskStream(task, 0, 2)
    first = [batch_digest(stream.batch_at(k).batch) for k in range(5)]
    assert batch_digest(stream.batch_at(4).batch) == first[4] and stream.reopened == 1
    assert batch_digest(stream.batch_at(2).batch) == first[2] and stream.reopened == 2
    assert int(stream.batch_at(3).index) == 3
    with pytest.raises(ValueError, match="step must be >= 0"):
        stream.batch_at(-1)


# -- bad tasks fail early, naming task.path -------------------------------------------------------
@pytest.mark.parametrize("path, message", [
    ("no_colon_here", "must read 'package.module:factory'"),
    ("islands_no_such_module:task", "does not import"),
    ("islands.tasks.bytelm:no_such", "has no attribute 'no_such'"),
    ("islands.tasks.bytelm:PATH", "not a callable"),
    ("test_task:raising_factory", "raised RuntimeError: no data today"),
])
def test_load_task_names_task_path(path, message):
    with pytest.raises(TaskError, match="task.path") as info:
        load_task(path)
    assert message in str(info.value)


def test_check_task_refuses_a_loss_that_is_not_a_scalar():
    with pytest.raises(TaskError, match=r"task.path: x: loss must be a scalar.*shape \(16,\)"):
        check_task(vector_loss_task(), "x")
    summary = check_task(regression_task(), "x")
    assert summary == {"tensors": 4, "params": 4 * 16 + 16 + 16 + 1, "tokens_per_batch": 16}


def test_preflight_fails_before_ray_naming_task_path():
    with pytest.raises(ConfigError, match="task.path: module 'islands_nope.tasks' of .*does not import"):
        preflight(parse({"task": {"path": "islands_nope.tasks:make"}}))
    with pytest.raises(ConfigError, match="task.path: .*loss must be a scalar"):
        preflight(parse({"task": {"path": "test_task:vector_loss_task"}}))
    with pytest.raises(ConfigError, match="syncer.fragments: 5 fragments but the task"):
        preflight(parse({"task": {"path": "test_task:regression_task"}, "syncer": {"fragments": 5}}))
    preflight(parse({"task": {"path": "test_task:regression_task", "args": {"dim": 3}}}))


def test_config_refuses_args_for_the_builtin_and_a_malformed_path():
    with pytest.raises(ConfigError, match=r"task.args: the built-in task takes its arguments"):
        parse({"task": {"args": {"d_model": 8}}})
    with pytest.raises(ConfigError, match=r"task.path: 'a b' must read"):
        parse({"task": {"path": "a b"}})


# -- a user's task trains through the in-process driver -----------------------------------------
def test_a_test_module_task_trains_in_process():
    """2 learners, P = 2, H = 8, τ = 1, 200 steps, Adam 3e-2: eval MSE 4.25 -> about 0.1."""
    record = inprocess.run_task(regression_task(), steps=200, optimizer=optax.adam(3e-2),
                                num_learners=2, fragments=2, sync_every_steps=8, overlap_steps=1)
    start, end = record.evals[0][2], record.evals[-1][2]
    print(f"regression eval MSE {start:.4f} -> {end:.4f}, merges {len(record.merges)}")
    assert start > 2.0 and end < 0.25
    assert record.steps == [200, 200] and len(record.merges) >= 2 * (200 // 8) - 2


def test_islands_export_names_what_is_missing(tmp_path, capsys):
    from islands.orchestrator.cli import main

    assert main(["export", str(tmp_path)]) == 2
    assert "job.json' not found" in capsys.readouterr().err
