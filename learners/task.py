"""The Task: what a learner needs from a user — init, loss, resumable batches, eval — as plain functions.

A task is built by a factory named in the job config (``task.path: "package.module:factory"``,
``task.args: {...}``), imported inside each learner, so user code shipped with ``ray job submit
--working-dir`` or ``runtime_env: {py_modules: [...]}`` is found where it runs. The factory returns
a :class:`Task`; the learner builds its jitted inner step from it (docs/tasks.md)::

    class Task(NamedTuple):
        init_params: Callable[[jax.Array], Params]              # rng -> pytree of float arrays
        loss: Callable[[Params, Batch, jax.Array], Any]        # -> loss, or (loss, metrics)
        batches: Callable[[int, int, int], Iterator[Batch]]    # (shard, num_shards, start_step)
        eval_batches: Callable[[], Sequence[Batch]]            # fixed, equal-shaped
        tokens: Callable[[Batch], int]                         # tokens a batch trains on
        is_embedding: Callable[[str], bool] = no_embeddings    # merge hint: "embed/tokens"
        optimizer: Optional[optax.GradientTransformation] = None   # default: learner.inner_optimizer
        train_step: Optional[Callable] = None                  # optimizer -> step(p, s, batch, rng)
        partition_specs: Optional[Callable] = None             # params -> PartitionSpec per tensor

Exact resume: ``batches(shard, num_shards, k)`` must yield the batches a stream opened at step 0
yields from its k-th on, for every shard count; :class:`TaskStream` holds one open iterator and
reopens it at the asked step when a learner (re)starts or jumps (``batch_at`` semantics).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = Any
Batch = Any


def no_embeddings(path: str) -> bool:
    """The default merge hint: no tensor is an embedding (all merge by the syncer's rule)."""
    return False


class Task(NamedTuple):
    """What a learner trains. See the module docstring; every field is a plain function or value."""

    init_params: Callable[[jax.Array], Params]
    loss: Callable[[Params, Batch, jax.Array], Any]
    batches: Callable[[int, int, int], Iterator[Batch]]
    eval_batches: Callable[[], Sequence[Batch]]
    tokens: Callable[[Batch], int]
    is_embedding: Callable[[str], bool] = no_embeddings
    optimizer: Optional[optax.GradientTransformation] = None
    train_step: Optional[Callable[[optax.GradientTransformation], Callable]] = None
    # learner.sharding: fsdp slices each tensor by its spec over the mesh axis "data"
    # (learners/mesh.py); None: along the tensor's largest axis the device count divides.
    partition_specs: Optional[Callable[[Params], Any]] = None


class TaskError(ValueError):
    """A task that cannot train; the message names ``task.path`` and what was wrong."""


class Step(NamedTuple):
    """What the learner loop hands its train step: the step index (the rng is folded from it, so
    a resumed step draws the same randomness) and the task's batch."""

    index: Any
    batch: Batch


def import_factory(path: str) -> Callable[..., Task]:
    """The factory named by ``"package.module:factory"``.

    Raises:
      TaskError: naming ``task.path``, when the path is malformed, the module does not import or
        has no such attribute.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task.path: {path!r} must read 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise TaskError(f"task.path: module {module_name!r} of {path!r} does not import "
                        f"({type(exc).__name__}: {exc}); is it on the learners' path "
                        "(ray job submit --working-dir, runtime_env py_modules)?") from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise TaskError(f"task.path: {module_name!r} has no attribute {attr!r} ({path!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TaskError(f"task.path: {path!r} is a {type(factory).__name__}, not a callable")
    return factory


def load_task(path: str, args: Optional[dict] = None) -> Task:
    """Imports the factory at ``path`` and calls it with ``args`` as keywords.

    Raises:
      TaskError: naming ``task.path``, when the import fails, the factory raises, or it returns
        something that is not a :class:`Task`.
    """
    factory = import_factory(path)
    try:
        task = factory(**dict(args or {}))
    except Exception as exc:
        raise TaskError(f"task.path: factory {path!r} raised {type(exc).__name__}: {exc} "
                        f"(task.args: {dict(args or {})})") from exc
    if not isinstance(task, Task):
        raise TaskError(f"task.path: factory {path!r} returned {type(task).__name__}, not an "
                        "islands.learners.task.Task")
    return task


def scalar_loss(task: Task) -> Callable[[Params, Batch, jax.Array], jax.Array]:
    """``task.loss`` reduced to its loss (a ``(loss, metrics)`` pair gives its first item)."""

    def loss(params, batch, rng):
        out = task.loss(params, batch, rng)
        return out[0] if isinstance(out, tuple) else out

    return loss


def step_rng(seed: int, index) -> jax.Array:
    """The rng of inner step ``index``: ``fold_in(PRNGKey(seed), index)`` (same on every resume)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), index)


def make_train_step(task: Task, optimizer: optax.GradientTransformation, seed: int = 0):
    """A jitted ``train_step(params, opt_state, step: Step) -> (params, opt_state, loss)``.

    The gradient of ``task.loss`` goes through ``optimizer`` (``update`` gets the params for
    decoupled decay); a task's ``train_step`` factory replaces that whole body.
    """
    if task.train_step is not None:
        body = task.train_step(optimizer)

        @jax.jit
        def custom_step(params, opt_state, step: Step):
            return body(params, opt_state, step.batch, step_rng(seed, step.index))

        return custom_step
    loss_fn = scalar_loss(task)

    @jax.jit
    def train_step(params, opt_state, step: Step):
        loss, grads = jax.value_and_grad(loss_fn)(params, step.batch, step_rng(seed, step.index))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


# The eval loss draws no fresh randomness: every evaluation of a job is comparable.
EVAL_RNG_SEED = 0


def make_eval_fn(task: Task) -> Callable[[Params, Sequence[Batch]], float]:
    """``evaluate(params, batches) -> float``: mean ``task.loss`` over equal-shaped batches.

    The batches are stacked and mapped in one jitted call, so the result is bit-identical for the
    same params and batches (and a restored export reproduces a logged eval loss).
    """
    loss_fn = scalar_loss(task)

    @jax.jit
    def mean_loss(params, stacked):
        rng = jax.random.PRNGKey(EVAL_RNG_SEED)
        return jnp.mean(jax.lax.map(lambda batch: loss_fn(params, batch, rng), stacked))

    def evaluate(params: Params, batches: Sequence[Batch]) -> float:
        if not len(batches):
            raise ValueError("evaluate needs at least one batch")
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]),
                                         *batches)
        return float(mean_loss(params, stacked))

    return evaluate


class TaskStream:
    """A learner's batches as ``batch_at(step) -> Step``, read from one open task iterator.

    Consecutive steps read on (the last step asked again returns the same batch); any other
    step (a restart resuming at its applied step, a driver that jumps) reopens
    ``task.batches(shard, num_shards, step)``, so ``batch_at(k)`` is the same batch whichever
    incarnation asks.
    """

    def __init__(self, task: Task, shard_index: int, num_shards: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
        self.task, self.shard_index, self.num_shards = task, shard_index, num_shards
        self._iterator: Optional[Iterator[Batch]] = None
        self._next = -1
        self._last: Optional[Step] = None
        self.reopened = 0   # how many times the task's iterator was opened

    def batch_at(self, step: int) -> Step:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._last is not None and step == self._next - 1:
            return self._last
        if self._iterator is None or step != self._next:
            self._iterator = iter(self.task.batches(self.shard_index, self.num_shards, step))
            self.reopened += 1
        self._last = Step(np.int32(step), next(self._iterator))
        self._next = step + 1
        return self._last


def batch_digest(batch: Batch) -> str:
    """A sha1 over every leaf of a batch (dtype, shape, bytes): equal digests, equal batches."""
    import hashlib

    digest = hashlib.sha1()
    for leaf in jax.tree_util.tree_leaves(batch):
        value = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{value.dtype.str}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def check_task(task: Task, path: str, seed: int = 0) -> dict:
    """Traces the task once with abstract shapes (``jax.eval_shape``): no real init, no step.

    Returns:
      ``{"tensors": n, "params": n, "tokens_per_batch": n}`` of the task's model and first batch.

    Raises:
      TaskError: naming ``task.path``, when init, the first batch, ``tokens`` or the loss fail,
        the params hold a non-float leaf, or the loss is not a scalar.
    """
    try:
        shapes = jax.eval_shape(task.init_params, jax.random.PRNGKey(seed))
    except Exception as exc:
        raise TaskError(f"task.path: {path}: init_params failed: {type(exc).__name__}: {exc}") \
            from exc
    leaves = jax.tree_util.tree_leaves(shapes)
    if not leaves:
        raise TaskError(f"task.path: {path}: init_params returned no arrays")
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TaskError(f"task.path: {path}: parameter of dtype {leaf.dtype} (shape "
                            f"{leaf.shape}); every leaf must be a float array")
    try:
        batch = next(iter(task.batches(0, 1, 0)))
        tokens = int(task.tokens(batch))
    except Exception as exc:
        raise TaskError(f"task.path: {path}: the first batch failed: {type(exc).__name__}: "
                        f"{exc}") from exc
    if tokens < 1:
        raise TaskError(f"task.path: {path}: tokens(batch) is {tokens}; must be >= 1")
    try:
        out = jax.eval_shape(task.loss, shapes, batch, jax.random.PRNGKey(seed))
    except Exception as exc:
        raise TaskError(f"task.path: {path}: loss failed on the first batch: "
                        f"{type(exc).__name__}: {exc}") from exc
    loss = out[0] if isinstance(out, tuple) else out
    if getattr(loss, "shape", None) != ():
        raise TaskError(f"task.path: {path}: loss must be a scalar (or a (scalar, metrics) "
                        f"pair), got shape {getattr(loss, 'shape', type(loss).__name__)}")
    return {"tensors": len(leaves), "params": int(sum(np.prod(x.shape) for x in leaves)),
            "tokens_per_batch": tokens}


def factory_args(path: str) -> list[str]:
    """Names of the keyword arguments the factory at ``path`` accepts (for error messages)."""
    try:
        return list(inspect.signature(import_factory(path)).parameters)
    except (TaskError, TypeError, ValueError):
        return []
