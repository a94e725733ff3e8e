"""The in-process driver trains the default model with 4 learners on the stdlib corpus (the
model, corpus, schedule and train step have their own tests in test_learner_core.py)."""

import jax
import pytest

from islands.learners import data, inner, model
from islands.orchestrator import inprocess
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, outer
from islands.syncer.core import SyncerSettings


@pytest.mark.slow  # 1,200 steps of the 25M-parameter default model: ~30 s; tiny models below
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
