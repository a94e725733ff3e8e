"""Fragments: a balanced partition of the parameter pytree, and the staggered sync schedule.

A fragment is a flat ``{path: array}`` dict of whole tensors, so the syncer can merge per tensor
(docs/architecture.md#the-algorithm: embeddings by weighted mean, the rest by RDA) and only 1/P of the model crosses the
network at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np

Fragment = dict[str, Any]  # path "blocks/0/attn/wq" -> array


def path_to_str(path: tuple) -> str:
    """Turns a jax key path into "a/b/c" (dict keys, sequence indices and attributes alike)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def leaf_paths(params: Any) -> list[str]:
    """Paths of every leaf, in the tree's flatten order."""
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    return [path_to_str(path) for path, _ in leaves_with_paths]


@dataclass(frozen=True)
class FragmentPlan:
    """Which tensors belong to which fragment.

    Attributes:
      paths: every leaf path, in flatten order.
      fragments: for each fragment p, the sorted tuple of its paths.
      sizes: number of parameters in each fragment.
    """

    paths: tuple[str, ...]
    fragments: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @functools.cached_property
    def leaf_index(self) -> dict[str, int]:
        """Path -> position in the tree's flatten order (so a fragment is found without paths)."""
        return {path: i for i, path in enumerate(self.paths)}

    def fragment_of(self, path: str) -> int:
        for p, members in enumerate(self.fragments):
            if path in members:
                return p
        raise KeyError(f"no fragment holds parameter {path!r}")


def partition(params: Any, num_fragments: int) -> FragmentPlan:
    """Splits the leaves of ``params`` into ``num_fragments`` groups balanced by size.

    Greedy bin packing, largest tensor first, each into the currently lightest fragment; ties are
    broken by path and fragment index so every process computes the same plan.

    Raises:
      ValueError: if there are fewer tensors than fragments (a fragment would be empty).
    """
    if num_fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {num_fragments}")
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    sized = [(path_to_str(path), int(np.size(leaf))) for path, leaf in leaves_with_paths]
    if len(sized) < num_fragments:
        raise ValueError(
            f"fragments ({num_fragments}) exceeds parameter tensors ({len(sized)}); "
            "use fewer fragments or a deeper model")
    bins: list[list[str]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    for path, size in sorted(sized, key=lambda item: (-item[1], item[0])):
        lightest = min(range(num_fragments), key=lambda p: (loads[p], p))
        bins[lightest].append(path)
        loads[lightest] += size
    return FragmentPlan(
        paths=tuple(path for path, _ in sized),
        fragments=tuple(tuple(sorted(members)) for members in bins),
        sizes=tuple(loads),
    )


def flatten(params: Any) -> dict[str, Any]:
    """``{path: leaf}`` for every leaf."""
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    return {path_to_str(path): leaf for path, leaf in leaves_with_paths}


def assembler(template: Any):
    """Returns ``flat {path: array} -> tree`` shaped like ``template`` (the inverse of
    ``flatten``); a learner builds its parameters from the syncer's fragments with it.

    >>> assemble = assembler({"b": 0, "a": {"w": 0}})
    >>> assemble({"a/w": 1, "b": 2})
    {'a': {'w': 1}, 'b': 2}
    """
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    paths = [path_to_str(path) for path, _ in leaves_with_paths]
    return lambda flat: jax.tree_util.tree_unflatten(treedef, [flat[p] for p in paths])


def extract(params: Any, plan: FragmentPlan, fragment: int) -> Fragment:
    """The tensors of one fragment, as a ``{path: array}`` dict (``params`` shaped like the plan's
    tree: leaves are found by position, which is cheap on a hot path)."""
    leaves = jax.tree_util.tree_leaves(params)
    if len(leaves) != len(plan.paths):
        raise ValueError(f"params have {len(leaves)} tensors, the plan {len(plan.paths)}")
    return {path: leaves[plan.leaf_index[path]] for path in plan.fragments[fragment]}


def insert(params: Any, plan: FragmentPlan, fragment: int, values: Mapping[str, Any]) -> Any:
    """A copy of ``params`` with one fragment's tensors replaced by ``values``."""
    expected = set(plan.fragments[fragment])
    if set(values) != expected:
        raise ValueError(f"fragment {fragment} holds {sorted(expected)}, got {sorted(values)}")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if len(leaves) != len(plan.paths):
        raise ValueError(f"params have {len(leaves)} tensors, the plan {len(plan.paths)}")
    for path, value in values.items():
        leaves[plan.leaf_index[path]] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def fragment_offsets(num_fragments: int, sync_every_steps: int) -> tuple[int, ...]:
    """Step offset of each fragment within one period of H steps: ``(p·H) // P``."""
    return tuple((p * sync_every_steps) // num_fragments for p in range(num_fragments))


def due_fragments(step: int, num_fragments: int, sync_every_steps: int) -> tuple[int, ...]:
    """Fragments whose sync starts after inner step ``step`` (1-based; step 0 is before training).

    Fragment p is due when ``step ≡ (p·H)//P (mod H)`` and step ≥ 1, so with P = H one fragment is
    due at every step (fragment ``step mod P``) and each is due once every H steps.

    >>> [due_fragments(t, 2, 4) for t in range(1, 9)]
    [(), (1,), (), (0,), (), (1,), (), (0,)]
    """
    if step < 1:
        return ()
    phase = step % sync_every_steps
    return tuple(p for p, offset in enumerate(fragment_offsets(num_fragments, sync_every_steps))
                 if offset == phase)
