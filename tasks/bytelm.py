"""The built-in task: the 119k-parameter byte-level decoder LM (learners/model.py) on a local corpus.

It is the default ``task.path``; its arguments are the job's ``model:`` and ``data:`` sections, so
a job without a ``task:`` section trains exactly what it trained before there were tasks: the same
init, batches (``data.ShardSampler``) and losses.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from islands.learners import data
from islands.learners import mesh
from islands.learners import model as model_lib
from islands.learners.task import Task

PATH = "islands.tasks.bytelm:task"


def load_corpus(corpus: str = "stdlib", eval_fraction: float = data.DEFAULT_EVAL_FRACTION,
                max_bytes: Optional[int] = 2_000_000) -> data.Corpus:
    """The train and eval bytes: ``"stdlib"`` (Python's own sources) or a directory of ``.py``."""
    if corpus == "stdlib":
        return data.load_stdlib_corpus(eval_fraction=eval_fraction, max_bytes=max_bytes)
    return data.load_directory_corpus(corpus, eval_fraction=eval_fraction, max_bytes=max_bytes)


def task(model: Optional[dict] = None, corpus: str = "stdlib",
         eval_fraction: float = data.DEFAULT_EVAL_FRACTION, max_bytes: Optional[int] = 2_000_000,
         batch_size: int = 8, eval_batches: int = 8, seed: int = 0,
         train_bytes: Optional[Any] = None) -> Task:
    """The byte LM as a :class:`Task`. The corpus is read on first use, not here.

    Args:
      model: ``ModelConfig`` fields (the job's ``model:`` section).
      corpus, eval_fraction, max_bytes: the corpus (the job's ``data:`` section).
      batch_size: windows per batch (B); a batch is int32 ``[B, seq_len + 1]``.
      eval_batches: how many fixed held-out batches ``eval_batches()`` returns.
      seed: the shard samplers' seed.
      train_bytes: the train split, already loaded (a learner given it by its controller skips
        reading the corpus).
    """
    cfg = model_lib.ModelConfig(**(model or {}))

    @functools.lru_cache(maxsize=1)
    def corpus_() -> data.Corpus:
        return load_corpus(corpus, eval_fraction, max_bytes)

    def train() -> np.ndarray:
        return train_bytes if train_bytes is not None else corpus_().train

    def batches(shard: int, num_shards: int, start_step: int):
        sampler = data.ShardSampler(train(), batch_size, cfg.seq_len, shard, num_shards, seed=seed)
        step = start_step
        while True:
            yield sampler.batch_at(step)
            step += 1

    return Task(
        init_params=lambda rng: model_lib.init_params(cfg, rng),
        loss=lambda params, batch, rng: model_lib.loss_fn(params, batch, cfg),
        batches=batches,
        eval_batches=lambda: data.eval_batches(corpus_().eval, batch_size, cfg.seq_len,
                                               eval_batches),
        tokens=lambda batch: int(batch.shape[0]) * (int(batch.shape[1]) - 1),
        is_embedding=model_lib.is_embedding_path,
        partition_specs=mesh.matrix_specs,
    )
