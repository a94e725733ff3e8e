"""Checks a JobConfig against the model and corpus it builds, before Ray or any actor starts.

A job naming its own task (``task.path``) is imported and traced here once with abstract shapes:
a path that does not import, a factory that raises or a loss that is not a scalar fails with
``task.path`` named, before any actor starts.

pydantic validates each field alone; some limits depend on what the config builds: the number of
parameter tensors (counted with ``jax.eval_shape``, no real init), the size of the corpus's train
and eval splits (file sizes only, nothing read), and a learner's memory for batch × model. A
config that breaks one fails here with the field named, instead of minutes later inside an actor:
``syncer.fragments: 50 fragments but the model has 19 parameter tensors``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .config import ConfigError

FLOAT_BYTES = 4
# Per-parameter float32 copies a learner holds: params, grads, Adam m and v, the params at the
# last sync (outer gradient), error-feedback residuals and a received fragment.
PARAM_COPIES = 7
GIB = 1024 ** 3


@dataclass(frozen=True)
class CorpusSize:
    """Bytes the learners' train split and the controller's eval split will hold."""

    train: int
    eval: int
    train_files: int
    eval_files: int


def model_tensors(config) -> tuple[int, int]:
    """``(parameter tensors, parameters)`` of the config's model, from shapes only."""
    import jax

    from islands.learners.model import ModelConfig, init_params

    cfg = ModelConfig(**config.model.model_dump())
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0))
    leaves = jax.tree_util.tree_leaves(shapes)
    total = 0
    for leaf in leaves:
        size = 1
        for dim in leaf.shape:
            size *= int(dim)
        total += size
    return len(leaves), total


def corpus_size(config) -> CorpusSize:
    """The split sizes :func:`islands.learners.data.load_directory_corpus` will produce, from file
    sizes alone (same file list, same hash split, same caps).

    Raises:
      ConfigError: ``data.corpus`` names no directory, or a split gets no file.
    """
    from islands.learners import data

    d = config.data
    root = data.stdlib_root() if d.corpus == "stdlib" else d.corpus
    if not os.path.isdir(root):
        raise ConfigError(f"data.corpus: directory {root!r} does not exist")
    sizes = {False: 0, True: 0}
    files = {False: 0, True: 0}
    for rel in data.list_files(root):
        to_eval = data.is_eval_file(rel, d.eval_fraction)
        try:
            sizes[to_eval] += os.path.getsize(os.path.join(root, rel))
        except OSError:
            continue
        files[to_eval] += 1
    if not files[False] or not files[True]:
        raise ConfigError(f"data.corpus: {root!r} gives {files[False]} train and {files[True]} "
                          f"eval .py files; each split needs at least one (data.eval_fraction is "
                          f"{d.eval_fraction})")
    train, eval_ = sizes[False], sizes[True]
    if d.max_bytes is not None:
        train = min(train, d.max_bytes)
        eval_ = min(eval_, max(d.max_bytes // data.EVAL_CAP_DIVISOR, data.MIN_EVAL_BYTES))
    return CorpusSize(train=train, eval=eval_, train_files=files[False], eval_files=files[True])


def learner_memory_bytes(config, num_params: Optional[int] = None) -> int:
    """A rough upper estimate of one learner's memory: parameter copies plus the activations a
    train step keeps for the backward pass (per layer: the residual stream, q/k/v, attention
    weights, the MLP hidden; then the logits)."""
    m = config.model
    if num_params is None:
        num_params = model_tensors(config)[1]
    b, length = config.data.batch_size, m.seq_len
    per_layer = b * length * (6 * m.d_model + 2 * m.d_ff) + 2 * b * m.n_heads * length * length
    logits = 3 * b * length * m.vocab_size
    activations = m.n_layers * per_layer + logits
    return FLOAT_BYTES * (PARAM_COPIES * num_params + 2 * activations)


def default_memory_limit_bytes() -> Optional[int]:
    """This machine's physical memory (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def preflight(config, memory_limit_bytes: Optional[int] = None,
              check_corpus: bool = True) -> None:
    """Checks what depends on the built model and corpus; raises ConfigError naming each field.

    Args:
      config: a validated JobConfig.
      memory_limit_bytes: the most one learner may need (default: this machine's memory).
      check_corpus: also size the corpus (skip where it lives only on the cluster's nodes).

    Raises:
      ConfigError: every problem found, one ``field.path: message`` per line.
    """
    if not config.task.builtin:
        return _preflight_task(config, memory_limit_bytes)
    problems = []
    tensors, params = model_tensors(config)
    if config.syncer.fragments > tensors:
        problems.append(f"syncer.fragments: {config.syncer.fragments} fragments but the model has "
                        f"{tensors} parameter tensors (a fragment would be empty); use at most "
                        f"{tensors} or a deeper model")

    b, window = config.data.batch_size, config.model.seq_len + 1
    if check_corpus:
        try:
            corpus = corpus_size(config)
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            if b * window > corpus.train:
                problems.append(
                    f"data.batch_size: a batch of {b} × (model.seq_len + 1 = {window}) = "
                    f"{b * window:,d} tokens exceeds the corpus's train split ({corpus.train:,d} "
                    "bytes); lower data.batch_size or model.seq_len, or raise data.max_bytes")
            shards = sum(max(r.learners, r.max_learners or 0) for r in config.regions.values())
            shards = max(shards, 1)
            if corpus.train // shards < window:
                problems.append(
                    f"data.max_bytes: the train split ({corpus.train:,d} bytes) cut into {shards} "
                    f"learner shards gives {corpus.train // shards:,d} bytes each, shorter than "
                    f"one window (model.seq_len + 1 = {window}); raise data.max_bytes or use "
                    "fewer learners")
            if corpus.eval < window:
                problems.append(
                    f"data.eval_fraction: the eval split ({corpus.eval:,d} bytes) is shorter "
                    f"than one window (model.seq_len + 1 = {window})")

    limit = memory_limit_bytes if memory_limit_bytes is not None else default_memory_limit_bytes()
    if limit:
        need = learner_memory_bytes(config, params)
        if need > limit:
            problems.append(
                f"data.batch_size: a learner needs about {need / GIB:.1f} GiB for a batch of {b} "
                f"× seq_len {config.model.seq_len} on a model of {params:,d} parameters, over "
                f"the {limit / GIB:.1f} GiB limit; lower data.batch_size or shrink the model")
    if problems:
        raise ConfigError("\n".join(problems))


def task_summary(config) -> dict:
    """Imports and builds the config's task on this machine and traces it with abstract shapes
    (``jax.eval_shape``): ``{"tensors", "params", "tokens_per_batch"}``.

    Raises:
      ConfigError: naming ``task.path``: the path does not import, the factory raises, or the
        loss is not a scalar.
    """
    from islands.learners.task import TaskError, check_task, load_task

    try:
        return check_task(load_task(config.task.path, config.task.args), config.task.path,
                          config.seed)
    except TaskError as exc:
        raise ConfigError(str(exc)) from None


def _preflight_task(config, memory_limit_bytes: Optional[int]) -> None:
    """The checks for a task named by ``task.path`` (its data is its own: only what the traced
    task tells: tensors for the fragments, parameter copies for memory)."""
    summary = task_summary(config)
    problems = []
    if config.syncer.fragments > summary["tensors"]:
        problems.append(f"syncer.fragments: {config.syncer.fragments} fragments but the task "
                        f"{config.task.path!r} has {summary['tensors']} parameter tensors (a "
                        f"fragment would be empty); use at most {summary['tensors']}")
    limit = memory_limit_bytes if memory_limit_bytes is not None else default_memory_limit_bytes()
    need = FLOAT_BYTES * PARAM_COPIES * summary["params"]
    if limit and need > limit:
        problems.append(f"task.path: the task's {summary['params']:,d} parameters need about "
                        f"{need / GIB:.1f} GiB per learner, over the {limit / GIB:.1f} GiB limit")
    if problems:
        raise ConfigError("\n".join(problems))
