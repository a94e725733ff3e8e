"""The Flax + Grain reference task: Grain shards and resumes exactly, the NNX params are a plain
pytree of named tensors, and two learners bring its eval loss down in a few hundred steps."""

import numpy as np
import optax
import pytest

pytest.importorskip("flax")
pytest.importorskip("grain")

import jax  # noqa: E402

from islands.learners.task import TaskStream, batch_digest, check_task  # noqa: E402
from islands.orchestrator import inprocess  # noqa: E402
from islands.syncer.fragments import leaf_paths  # noqa: E402
from islands.tasks import flax_lm  # noqa: E402

TINY = dict(max_bytes=300_000, batch_size=8, eval_batches=4, seq_len=32, d_model=32, n_layers=1,
            n_heads=2, d_ff=64)


@pytest.fixture(scope="module")
def task():
    return flax_lm.task(**TINY)


def test_params_are_named_tensors_and_embeddings_are_hinted(task):
    paths = leaf_paths(jax.eval_shape(task.init_params, jax.random.PRNGKey(0)))
    assert "embed/embedding" in paths and "block_0/attn_q/kernel" in paths
    assert [p for p in paths if task.is_embedding(p)] == ["embed/embedding", "pos_embed"]
    # 256·32 embed + 32·32 positions + 4·32² attention + 2·32·64 MLP + 3·32 norm scales
    assert check_task(task, flax_lm.PATH) == {
        "tensors": 11, "params": 256 * 32 + 32 * 32 + 4 * 32 * 32 + 2 * 32 * 64 + 3 * 32,
        "tokens_per_batch": 8 * 32}


@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_grain_resumes_exactly_after_a_kill(task, num_shards):
    """Incarnation 0 reads steps 0..11 and dies; incarnation 1 restores the iterator at step 7."""
    for shard in range(num_shards):
        dead = TaskStream(task, shard, num_shards)
        seen = [batch_digest(dead.batch_at(k).batch) for k in range(12)]
        resumed = TaskStream(task, shard, num_shards)
        assert [batch_digest(resumed.batch_at(k).batch) for k in range(7, 12)] == seen[7:]
        assert len(set(seen)) == 12
    first = [TaskStream(task, s, num_shards).batch_at(0).batch for s in range(num_shards)]
    assert len({batch_digest(b) for b in first}) == num_shards  # every shard its own windows


def test_shards_are_disjoint_slices_of_one_shuffled_epoch(task):
    """Windows of shard 0 and shard 1 of 2 never coincide within the first epoch's batches."""
    rows = [{bytes(np.asarray(r).tobytes()) for k in range(6)
             for r in TaskStream(task, s, 2).batch_at(k).batch} for s in range(2)]
    assert not rows[0] & rows[1]


def test_missing_extra_is_named(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_grain(name, *args, **kwargs):
        if name == "grain":
            raise ImportError("No module named 'grain'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_grain)
    with pytest.raises(ImportError, match=r"pip install 'islands\[flax\]'"):
        flax_lm.task(**TINY)


def test_flax_task_eval_loss_falls_in_a_few_hundred_steps(task):
    """2 learners × 200 steps, P = 2, H = 8, τ = 1, AdamW 3e-3: eval 5.56 nats → below 3.3."""
    from islands.learners import inner

    record = inprocess.run_task(task, steps=200, optimizer=inner.inner_optimizer(
        lr=3e-3, warmup_steps=10, total_steps=200), num_learners=2, fragments=2,
        sync_every_steps=8, overlap_steps=1)
    start, end = record.evals[0][2], record.evals[-1][2]
    print(f"flax task eval loss {start:.3f} -> {end:.3f}, merges {len(record.merges)}")
    assert start > 5.0 and end < 3.3
    assert record.steps == [200, 200]
