"""Syncer snapshots: (Θ, outer state, versions, epoch, ledger) saved with orbax at merge boundaries,
and the merge journal: each fragment's newest merged state, written before the merge is answered."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from typing import Optional

import jax
import numpy as np

from .core import LedgerEntry, SyncerCore

log = logging.getLogger("islands.syncer.state")

# orbax names a step's directory after the step ("12"); an unfinished save is
# "12.orbax-checkpoint-tmp-…".
_STEP_DIR = re.compile(r"^\d+($|\.orbax-checkpoint-tmp)")


class SnapshotDirError(RuntimeError):
    """A new job was pointed at a directory that already holds snapshots (nothing is deleted)."""


class SnapshotError(RuntimeError):
    """Snapshots exist but none of them could be restored intact."""


def snapshot_directory(checkpoint_dir: Optional[str], run_dir: str, job_name: str) -> str:
    """Where a job's syncer snapshots go (an absolute path).

    ``checkpoint_dir`` None: ``<run_dir>/syncer``. A directory the user names is never written into
    directly: each job gets its own subdirectory ``<checkpoint_dir>/<job_name>`` (the name made
    safe as a single path component), so nothing else in it is ever touched.

    >>> snapshot_directory(None, "/runs/a", "a")
    '/runs/a/syncer'
    >>> snapshot_directory("/ckpt", "/runs/a", "my job/../x")
    '/ckpt/my_job_.._x'
    """
    if not checkpoint_dir:
        return os.path.abspath(os.path.join(run_dir, "syncer"))
    component = re.sub(r"[^A-Za-z0-9._-]", "_", job_name or "")
    if component in ("", ".", ".."):
        component = f"job{component.replace('.', '_')}"
    return os.path.abspath(os.path.join(os.path.expanduser(checkpoint_dir), component))


def snapshot_steps(directory: str) -> list[str]:
    """Names of the snapshot (step) directories in ``directory``; [] if it does not exist."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted(e for e in entries
                  if _STEP_DIR.match(e) and os.path.isdir(os.path.join(directory, e)))


def arrays_checksum(arrays: dict) -> str:
    """sha256 over every array of a snapshot (path, dtype, shape and bytes, in path order)."""
    digest = hashlib.sha256()
    leaves, _ = jax.tree_util.tree_flatten_with_path(arrays)
    for path, leaf in sorted(((jax.tree_util.keystr(p), x) for p, x in leaves),
                             key=lambda item: item[0]):
        value = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{path}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


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
        "ledger": _ledger_json(core),
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
        slot.stepped, slot.round_start = {}, None   # a restarted syncer opens new rounds
        slot.quorum_reached_at_s = None
        slot.round_opened_at_s = None
    core.ledger = {name: LedgerEntry(**entry) for name, entry in meta["ledger"].items()}
    core.ledger_durable()
    core.learners = {}  # every learner must register again with the new epoch
    core.catching_up = set(range(len(core.slots)))  # learners may hold newer merged versions
    core.epoch = max(min_epoch, int(meta["epoch"]) + 1)


class SnapshotStore:
    """An orbax CheckpointManager keyed by the total merge count; keeps the newest few.

    It never deletes or empties a directory (orbax prunes only its own older step directories).
    """

    def __init__(self, directory: str, max_to_keep: int = 3, fresh: bool = False):
        """``fresh``: a new job. Its directory must not already hold snapshots (an older job's
        merge counts could outrank its own and be restored later); if it does, SnapshotDirError
        names it and nothing is touched. Use :func:`snapshot_directory` for a per-job directory.
        """
        import orbax.checkpoint as ocp

        self._ocp = ocp
        steps = snapshot_steps(directory) if fresh else []
        found = ([f"snapshots (steps {', '.join(steps)})"] if steps else []) + (
            ["a merge journal"] if fresh and FragmentJournal.entries(directory) else [])
        if found:
            raise SnapshotDirError(
                f"snapshot directory {os.path.abspath(directory)!r} already holds "
                f"{' and '.join(found)} of an earlier job; a new job never deletes or "
                "overwrites them. Resume that job (islands run --resume), or point the job at "
                "another directory (syncer.checkpoint_dir, --run-dir or the job name)")
        os.makedirs(directory, exist_ok=True)
        # The fragments' versions in the newest snapshot this store wrote (None: none yet): a
        # merge they hold is durable, whatever becomes of its journal entry (syncer/actor.py).
        self.saved_versions: Optional[tuple] = None
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory),
            # A save that failed (a full disk) leaves orbax's temporary folder of its step;
            # the next store on this folder (the shard's restart) removes those, and only those.
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False,
                                                 cleanup_tmp_directories=True))

    def save(self, core: SyncerCore) -> int:
        arrays, meta = snapshot_tree(core)
        meta["sha256"] = arrays_checksum(arrays)
        step = meta["merges"]
        if step in (self.manager.all_steps() or []):
            # This store's own (the versions only grow: the same ones, saved_versions has
            # them), or an earlier life's that the restore passed over: nothing more is saved.
            return step
        self.manager.save(step, args=self._ocp.args.Composite(
            arrays=self._ocp.args.StandardSave(arrays), meta=self._ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()
        self.saved_versions = tuple(meta["versions"])
        return step

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def restore_latest(self, core: SyncerCore, min_epoch: int = 0) -> Optional[int]:
        """Restores the newest intact snapshot into ``core``; returns its step, or None if there is
        none. A snapshot that cannot be read or whose arrays do not match their recorded sha256
        (a truncated or corrupt file) is skipped with a warning for the one before it.

        Raises:
          SnapshotError: snapshots exist but none is intact.
        """
        steps = sorted(self.manager.all_steps() or [], reverse=True)
        if not steps:
            return None
        template, _ = snapshot_tree(core)
        problems = []
        for step in steps:
            try:
                restored = self.manager.restore(step, args=self._ocp.args.Composite(
                    arrays=self._ocp.args.StandardRestore(template),
                    meta=self._ocp.args.JsonRestore()))
                arrays, meta = restored["arrays"], restored["meta"]
                expected = meta.get("sha256")
                if expected is not None and arrays_checksum(arrays) != expected:
                    raise ValueError("arrays do not match their sha256")
            except Exception as exc:  # a torn or corrupt snapshot: fall back to an older one
                problems.append(f"step {step}: {type(exc).__name__}: {exc}")
                log.warning("snapshot step %s in %s is unreadable or corrupt (%s); trying an "
                            "older one", step, self.manager.directory, exc)
                continue
            restore_into(core, arrays, meta, min_epoch)
            return step
        raise SnapshotError(f"no intact snapshot in {str(self.manager.directory)!r}: "
                            + "; ".join(problems))

    def close(self) -> None:
        self.manager.close()


def _ledger_json(core: SyncerCore) -> dict:
    return {name: dataclasses.asdict(entry) for name, entry in core.ledger.items()}


def snapshot_due(merges_since: int, seconds_since: float, every_merges: int,
                 min_interval_s: float) -> bool:
    """Whether the syncer snapshots now: ``every_merges`` merges made since the last snapshot and
    at least ``min_interval_s`` seconds gone by (a snapshot blocks the syncer's loop for as long
    as it writes every fragment).

    >>> snapshot_due(10, 0.0, 10, 0.0), snapshot_due(9, 99.0, 10, 0.0)
    (True, False)
    >>> snapshot_due(10, 29.9, 10, 30.0), snapshot_due(57, 30.0, 10, 30.0)
    (False, True)
    """
    return merges_since >= every_merges and seconds_since >= min_interval_s


class FragmentJournal:
    """Each fragment's newest merged state (Θ_p, its outer optimizer state, its version), plus the
    epoch and the ledger, written before the merge is answered.

    Snapshots come every ``snapshot_every_merges`` merges; a syncer killed between two of them used
    to restart from the older one, and the merges since were lost unless a live learner that had
    adopted them re-registered (the full soak saw versions go back by up to 4). A merge is now
    durable before any learner hears of it, so a restart loses none. One file per fragment,
    replaced atomically (write, then ``os.replace``): a kill mid-write leaves the previous entry;
    the zip format's CRC-32 of every member, checked as ``np.load`` reads it, catches a corrupt one.
    Not an orbax checkpoint: orbax makes a step directory, metadata and a barrier per save, which
    would cost the syncer's thread more than the merge at every merge of a small fragment; the
    snapshots stay orbax's. Written into ``<snapshot dir>/journal``; nothing is ever deleted.
    """

    def __init__(self, directory: str):
        self.directory = os.path.join(directory, "journal")
        os.makedirs(self.directory, exist_ok=True)

    @staticmethod
    def entries(directory: str) -> list[str]:
        """The journal files in a snapshot directory ([] if there are none)."""
        try:
            return sorted(e for e in os.listdir(os.path.join(directory, "journal"))
                          if e.endswith(".npz"))
        except OSError:
            return []

    def _path(self, p: int) -> str:
        return os.path.join(self.directory, f"fragment-{p}.npz")

    def record(self, core: SyncerCore, p: int) -> None:
        """Writes fragment ``p`` as ``core`` holds it now (call right after its merge)."""
        self.write(*self.entry(core, p))

    def entry(self, core: SyncerCore, p: int) -> tuple[int, dict, dict]:
        """What ``record`` writes, taken now: ``(p, arrays, meta)``. The arrays are the core's own
        (not copied: a merge makes a new Θ and a new momentum rather than writing the old ones; the
        caller keeps the fragment from merging again until ``write`` is done, since its next merge
        hands the old momentum's buffers back to the pool)."""
        slot = core.slots[p]
        paths = sorted(slot.params)
        arrays = {f"param{i}": np.asarray(slot.params[path]) for i, path in enumerate(paths)}
        arrays.update({f"outer{i}": np.asarray(leaf)
                       for i, leaf in enumerate(jax.tree_util.tree_leaves(slot.outer_state))})
        meta = {"fragment": p, "paths": paths, "version": int(slot.version),
                "epoch": int(core.epoch), "merges": int(sum(core.versions)),
                "ledger": _ledger_json(core)}
        return p, arrays, meta

    def write(self, p: int, arrays: dict, meta: dict) -> None:
        """Writes one ``entry`` (from any thread): the file is complete once this returns."""
        tmp = self._path(p) + ".tmp"
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        os.replace(tmp, self._path(p))

    def _read(self, p: int) -> Optional[tuple[dict, dict]]:
        if not os.path.exists(self._path(p)):
            return None
        try:
            with np.load(self._path(p)) as npz:
                meta = json.loads(npz["meta"].tobytes().decode())
                arrays = {k: npz[k] for k in npz.files if k != "meta"}
            if meta["fragment"] != p:
                raise ValueError(f"it holds fragment {meta['fragment']}")
        except Exception as exc:  # torn or corrupt: the snapshot (and catch-up) must do
            log.warning("merge journal entry %s is unreadable or corrupt (%s); ignored",
                        self._path(p), exc)
            return None
        return meta, arrays

    def replay(self, core: SyncerCore, snapshot_merges: int = 0) -> list[int]:
        """After ``restore_latest`` (or on a core with no snapshot): takes every fragment whose
        journal entry is newer than what the core holds, the newest ledger if it is newer than
        the snapshot's (``snapshot_merges``: the snapshot's total merge count), and an epoch
        above every journaled one. Returns the fragments taken."""
        taken, newest = [], (snapshot_merges, None)
        for p, slot in enumerate(core.slots):
            entry = self._read(p)
            if entry is None:
                continue
            meta, arrays = entry
            params = {path: np.asarray(arrays[f"param{i}"], np.float32)
                      for i, path in enumerate(meta["paths"])}
            template = jax.tree_util.tree_leaves(slot.outer_state)
            if set(params) != set(slot.params) or any(
                    params[k].shape != np.shape(v) for k, v in slot.params.items()) or len(
                    [k for k in arrays if k.startswith("outer")]) != len(template):
                log.warning("merge journal entry of fragment %d does not fit this job's "
                            "fragment; ignored", p)
                continue
            core.epoch = max(core.epoch, int(meta["epoch"]) + 1)
            if meta["merges"] > newest[0]:
                newest = (meta["merges"], meta["ledger"])
            if meta["version"] <= slot.version:
                continue
            slot.params, slot.version = params, int(meta["version"])
            slot.outer_state = jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(slot.outer_state),
                [np.asarray(arrays[f"outer{i}"]) for i in range(len(template))])
            slot.history = {slot.version: params}
            slot.round, slot.quorum_reached_at_s, slot.round_opened_at_s = {}, None, None
            taken.append(p)
        if newest[1] is not None:
            core.ledger = {name: LedgerEntry(**entry) for name, entry in newest[1].items()}
            core.ledger_durable()
        if taken:
            log.info("merge journal: fragments %s newer than the snapshot (versions %s)", taken,
                     [core.slots[p].version for p in taken])
        return taken


class JournalWriter:
    """Writes merge journal entries on one thread of its own, in the order they are submitted, so
    the file write (an ``.npz`` of the fragment: as long as the merge itself at 4M parameters) is
    off the syncer's event loop. ``submit`` takes the entry on the caller's thread and returns a
    ``concurrent.futures.Future`` that resolves once the file is in place (or raises what the
    write raised): the syncer answers a merge only after it (syncer/actor.py)."""

    def __init__(self, journal: FragmentJournal):
        from concurrent.futures import ThreadPoolExecutor

        self.journal = journal
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-journal")

    def submit(self, core: SyncerCore, p: int):
        return self._thread.submit(self.journal.write, *self.journal.entry(core, p))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
