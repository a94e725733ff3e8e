"""Syncer snapshots: (Θ, outer state, versions, epoch, ledger) saved with orbax at merge boundaries."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import numpy as np

from .core import LedgerEntry, SyncerCore


def snapshot_tree(core: SyncerCore) -> tuple[dict, dict]:
    """Arrays (a pytree of numpy arrays) and JSON metadata describing ``core`` completely."""
    arrays = {
        "params": {str(p): dict(slot.params) for p, slot in enumerate(core.slots)},
        "outer": {str(p): {str(i): np.asarray(leaf)
                           for i, leaf in enumerate(jax.tree_util.tree_leaves(slot.outer_state))}
                  for p, slot in enumerate(core.slots)},
    }
    meta = {
        "epoch": core.epoch,
        "versions": list(core.versions),
        "ledger": {name: dataclasses.asdict(entry) for name, entry in core.ledger.items()},
        "merges": sum(core.versions),
    }
    return arrays, meta


def restore_into(core: SyncerCore, arrays: dict, meta: dict, min_epoch: int = 0) -> None:
    """Loads a snapshot into a freshly built core (same fragments) and fences it with a new epoch.

    The new epoch is above the saved one (and at least ``min_epoch``), so every push a learner
    made to the previous incarnation is refused as STALE_EPOCH.
    """
    for p, slot in enumerate(core.slots):
        saved = arrays["params"][str(p)]
        slot.params = {path: np.asarray(saved[path], np.float32) for path in slot.params}
        template = slot.outer_state
        leaves = [np.asarray(arrays["outer"][str(p)][str(i)])
                  for i in range(len(jax.tree_util.tree_leaves(template)))]
        slot.outer_state = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(template), leaves)
        slot.version = int(meta["versions"][p])
        slot.history = {slot.version: slot.params}
        slot.round = {}
        slot.quorum_reached_at_s = None
        slot.round_opened_at_s = None
    core.ledger = {name: LedgerEntry(**entry) for name, entry in meta["ledger"].items()}
    core.learners = {}  # every learner must register again with the new epoch
    core.epoch = max(min_epoch, int(meta["epoch"]) + 1)


class SnapshotStore:
    """An orbax CheckpointManager keyed by the total merge count; keeps the newest few."""

    def __init__(self, directory: str, max_to_keep: int = 3, fresh: bool = False):
        """``fresh`` empties the directory first: a new job must never restore an older job's
        snapshots (their merge counts could outrank its own)."""
        import shutil

        import orbax.checkpoint as ocp

        self._ocp = ocp
        if fresh and os.path.isdir(directory):
            shutil.rmtree(directory)
        os.makedirs(directory, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False))

    def save(self, core: SyncerCore) -> int:
        arrays, meta = snapshot_tree(core)
        step = meta["merges"]
        if step in (self.manager.all_steps() or []):
            return step
        self.manager.save(step, args=self._ocp.args.Composite(
            arrays=self._ocp.args.StandardSave(arrays), meta=self._ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()
        return step

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore_latest(self, core: SyncerCore, min_epoch: int = 0) -> Optional[int]:
        """Restores the newest snapshot into ``core``; returns its step, or None if there is none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        template, _ = snapshot_tree(core)
        restored = self.manager.restore(step, args=self._ocp.args.Composite(
            arrays=self._ocp.args.StandardRestore(template), meta=self._ocp.args.JsonRestore()))
        restore_into(core, restored["arrays"], restored["meta"], min_epoch)
        return step

    def close(self) -> None:
        self.manager.close()
