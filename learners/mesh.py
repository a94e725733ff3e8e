"""A learner unit's devices as one SPMD program: its mesh, and where params, inner state and
batches live on it.

One mesh axis, ``AXIS``, over every device the learner process sees. The unit's batch is split
along its rows over that axis (data-parallel inside the unit); the parameters and the inner
optimizer state are replicated (``learner.sharding: replicated``, the default) or sliced over the
same axis (``fsdp``). XLA inserts the gradient all-reduce (and, with FSDP, the all-gathers), so
the train step, the drift and the push encode are the same jitted functions as on one device.

A learner on one device gets no layout (``learner_layout`` returns None) and runs exactly the
program it ran before meshes existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The one mesh axis: batch rows and, with FSDP, parameter slices. A task's partition specs name it.
AXIS = "data"
REPLICATED, FSDP = "replicated", "fsdp"
SHARDINGS = (REPLICATED, FSDP)


class BatchSplitError(ValueError):
    """A batch whose rows do not split evenly over the learner's devices."""


def fsdp_axis(shape: Sequence[int], num_devices: int) -> Optional[int]:
    """The axis FSDP slices a tensor along: its largest axis divisible by the device count (the
    first of equal ones); None when none divides (the tensor is replicated).

    >>> fsdp_axis((32, 64), 4), fsdp_axis((6, 3), 4), fsdp_axis((8, 8), 4)
    (1, None, 0)
    """
    best = None
    for axis, size in enumerate(shape):
        if size % num_devices == 0 and size >= num_devices and (
                best is None or size > shape[best]):
            best = axis
    return best


def fsdp_spec(shape: Sequence[int], num_devices: int) -> PartitionSpec:
    """``AXIS`` on the tensor's ``fsdp_axis``, or replicated (``PartitionSpec()``)."""
    axis = fsdp_axis(shape, num_devices)
    if axis is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * axis + [AXIS]))


def matrix_specs(params: Any) -> Any:
    """The built-in tasks' ``partition_specs``: every matrix (rank >= 2) on ``AXIS`` along its
    largest dimension (the first of equal ones: embeddings by row), vectors whole (a norm scale
    is d floats, read in full by every token; slicing it saves nothing).

    >>> matrix_specs({"w_in": np.zeros((32, 64)), "wq": np.zeros((32, 32)), "scale": np.zeros(32)})
    {'scale': P(), 'w_in': P(None, 'data'), 'wq': P('data',)}
    """
    def spec(x):
        shape = np.shape(x)
        if len(shape) < 2:
            return PartitionSpec()
        axis = int(np.argmax(shape))
        return PartitionSpec(*([None] * axis + [AXIS]))

    return jax.tree_util.tree_map(spec, params)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], num_devices: int) -> PartitionSpec:
    """A task's spec for this mesh: a dimension the device count does not divide is replicated
    instead of failing (a task cannot know how many devices a unit will have).

    >>> fit_spec(PartitionSpec("data", None), (6, 8), 4)
    P(None, None)
    >>> fit_spec(PartitionSpec(None, "data"), (6, 8), 4)
    P(None, 'data')
    """
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the tensor's shape {shape}")
    return PartitionSpec(*(axes if axes is None or shape[i] % num_devices == 0 else None
                           for i, axes in enumerate(spec)))


def _float32(x: Any) -> Any:
    """float32, without a host round trip for an array already on a device."""
    return x.astype(np.float32) if isinstance(x, jax.Array) else np.asarray(x, np.float32)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put``, without multi-controller JAX's check that a host value is the same on
    every process (an all-gather of the whole value in every call): every host of a multi-host
    unit holds the same value by construction (learners/gang.py), and a batch or a fragment is
    placed at every step."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array)
                                         and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_tree(tree: Any, shardings: Any) -> Any:
    """``put`` over a tree; ``shardings`` is one sharding or a tree like ``tree``."""
    if isinstance(shardings, NamedSharding):
        return jax.tree_util.tree_map(lambda x: put(x, shardings), tree)
    return jax.tree_util.tree_map(put, tree, shardings)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def param_specs(params: Any, sharding: str, num_devices: int,
                task_specs: Optional[Callable[[Any], Any]] = None) -> Any:
    """A PartitionSpec per parameter (a pytree like ``params``, abstract shapes suffice).

    ``replicated``: every tensor whole on every device. ``fsdp``: the task's ``partition_specs``
    when it gives them (fitted to the device count), otherwise each tensor along its
    ``fsdp_axis``.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"learner.sharding: {sharding!r} is not one of {SHARDINGS}")
    if sharding == REPLICATED:
        return jax.tree_util.tree_map(lambda _: PartitionSpec(), params)
    if task_specs is None:
        return jax.tree_util.tree_map(lambda x: fsdp_spec(np.shape(x), num_devices), params)
    specs = task_specs(params)
    return jax.tree_util.tree_map(lambda spec, x: fit_spec(spec, np.shape(x), num_devices),
                                  specs, params, is_leaf=_is_spec)


def opt_state_specs(optimizer: optax.GradientTransformation, params: Any, specs: Any) -> Any:
    """The inner state's specs: every parameter-shaped part (Adam's moments) sliced like its
    parameter, the rest (step counts) replicated."""
    abstract_state = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, lambda _, spec: spec, abstract_state, specs,
                                 transform_non_params=lambda _: PartitionSpec(), is_leaf=_is_spec)


def check_batch(batch: Any, num_devices: int) -> None:
    """Raises BatchSplitError unless every batch leaf's rows divide over ``num_devices``."""
    for leaf in jax.tree_util.tree_leaves(batch):
        rows = np.shape(leaf)[0] if np.ndim(leaf) else None
        if rows is None or rows % num_devices:
            raise BatchSplitError(
                f"data.batch_size: a batch of {rows} rows (shape {np.shape(leaf)}) does not split "
                f"over this learner's {num_devices} devices; use a batch size divisible by "
                f"{num_devices} (a task with its own batch size: set it in task.args)")


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes each device holds of ``tree``'s arrays, from their addressable shards."""
    held: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held


@dataclass(frozen=True)
class Layout:
    """Where a multi-device learner keeps things: its mesh and a sharding per array.

    Attributes:
      mesh: the learner's devices along ``AXIS``.
      params, opt_state: NamedSharding trees like the parameters and the inner state.
      by_path: the parameters' shardings by fragment path (``"blocks/0/attn/wq"``).
    """

    mesh: Mesh
    params: Any
    opt_state: Any
    by_path: dict

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def rows(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(AXIS))

    def place_params(self, params: Any) -> Any:
        return put_tree(jax.tree_util.tree_map(_float32, params), self.params)

    def place_opt_state(self, opt_state: Any) -> Any:
        """A peer's (numpy) inner state, or one made here, laid out like this learner's."""
        return put_tree(opt_state, self.opt_state)

    def init_opt_state(self, optimizer: optax.GradientTransformation, params: Any) -> Any:
        """A fresh inner state, made directly in its slices (no whole copy on one device)."""
        return jax.jit(optimizer.init, out_shardings=self.opt_state)(params)

    def place_fragment(self, fragment: dict) -> dict:
        """A fragment from the syncer (host arrays), as float32 arrays sliced like the params."""
        return {path: put(_float32(value), self.by_path[path])
                for path, value in fragment.items()}

    def place_step(self, step: Any) -> Any:
        """A ``task.Step`` with its batch split by rows over the mesh (the index stays a host
        scalar: every device folds the same step rng from it)."""
        check_batch(step.batch, self.num_devices)
        return step._replace(batch=put_tree(step.batch, self.rows))

    def jit_step(self, train_step: Callable) -> Callable:
        """The train step with its outputs pinned to the layout, so the params and inner state
        keep their slices step after step (the loss is replicated)."""
        return jax.jit(train_step, out_shardings=(self.params, self.opt_state, self.replicated))


def learner_layout(params: Any, optimizer: optax.GradientTransformation, sharding: str,
                   devices: Optional[Sequence[Any]] = None,
                   task_specs: Optional[Callable[[Any], Any]] = None) -> Optional[Layout]:
    """The layout of a learner over ``devices`` (default: every device this process sees);
    None on one device, which keeps the single-device program as it was.

    ``params``: the parameter tree (abstract shapes suffice).
    """
    from islands.syncer import fragments as fragments_lib

    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) == 1:
        return None
    mesh = Mesh(np.array(devices), (AXIS,))
    specs = param_specs(params, sharding, len(devices), task_specs)
    to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    param_shardings = jax.tree_util.tree_map(to_sharding, specs, is_leaf=_is_spec)
    state_shardings = jax.tree_util.tree_map(to_sharding,
                                             opt_state_specs(optimizer, params, specs),
                                             is_leaf=_is_spec)
    return Layout(mesh, param_shardings, state_shardings, fragments_lib.flatten(param_shardings))
