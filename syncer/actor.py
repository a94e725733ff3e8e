"""The Syncer actor: a thin asyncio shell around ``SyncerCore``.

``push`` is awaited by nobody on the learner side: the learner keeps the returned future and checks
it at step boundaries. The future resolves when the round holding the push merges (with the new
global fragment), when the push is refused, or when its learner is forgotten.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

from islands import defaults

from . import downlink as downlink_lib
from . import shards as shards_lib
from . import timing
from .core import SyncerCore, SyncerSettings
from .state import snapshot_due
from .status import SyncerStatus
from .shards import SYNCER_NAME  # noqa: F401  (shard 0's name; shards.syncer_shard_name)
from .validate import Push, RejectReason

log = logging.getLogger("islands.syncer")


class ReplyStatus(str, enum.Enum):
    MERGED = "merged"       # in a merge: ``update`` (or ``params``) is the new global fragment
    REJECTED = "rejected"   # refused: ``reason``; ``params`` is the current global fragment
    DROPPED = "dropped"     # not judged: the syncer closed before merging it

    def __str__(self) -> str:   # f-strings, logs and metric labels read the value
        return self.value


@dataclass(frozen=True)
class Reply:
    """The answer to a push."""

    status: ReplyStatus
    fragment: int
    epoch: int
    params: Optional[dict] = None
    version: int = -1
    reason: str = ""
    detail: str = ""
    update: Any = None   # "merged": a downlink FullUpdate or DiffUpdate (params stays None)

    def __post_init__(self):   # a status string (the link's wire) becomes its enum, or raises
        object.__setattr__(self, "status", ReplyStatus(self.status))


@dataclass(frozen=True)
class SyncerSpec:
    """Everything needed to build (or rebuild) the syncer; picklable, so restarts reuse it."""

    fragments: list
    settings: SyncerSettings
    outer_kind: str
    outer_kwargs: dict
    codec_kind: str
    codec_block_size: int
    embedding_prefix: str = "embed/"
    # The downlink (syncer/downlink.py): codec kind (None: full fp32 fragments), block size,
    # error feedback, and how far behind a learner gets the full fragment instead.
    downlink_kind: Optional[str] = None
    downlink_block_size: int = 64
    downlink_error_feedback: bool = True
    downlink_full_after_versions: Optional[int] = 8
    downlink_max_shadows: Optional[int] = defaults.DOWNLINK_MAX_SHADOWS
    embedding_paths: Optional[tuple] = None   # the task's embedding tensors (else the prefix)
    checkpoint_dir: Optional[str] = None
    snapshot_every_merges: int = 10
    snapshot_min_interval_s: float = 0.0   # and at least this long since the last snapshot
    # Write each merged fragment before answering its merge (syncer/state.py FragmentJournal), so
    # a restart loses no merged version.
    journal: bool = True
    # A syncer shard (syncer/shards.py): the global ids of ``fragments`` (None: all of them, in
    # order: the single syncer) and which shard this is.
    fragment_ids: Optional[tuple] = None
    syncer_shard: int = 0
    # The transfer part of ξ_sync (syncer/timing.py round_trip_s): twice the largest configured
    # one-way region latency; the syncer adds its measured merge time.
    round_trip_s: float = 0.0


def downlink_settings(spec: SyncerSpec) -> downlink_lib.DownlinkSettings:
    """The downlink of a syncer spec (its codec is built here, where JAX may load)."""
    from . import codec as codec_lib

    codec = (None if spec.downlink_kind in (None, "none")
             else codec_lib.make_codec(spec.downlink_kind, block_size=spec.downlink_block_size))
    return downlink_lib.DownlinkSettings(codec, spec.downlink_error_feedback,
                                         spec.downlink_full_after_versions,
                                         spec.downlink_max_shadows)


class Syncer:
    """Owns Θ and the outer optimizer state. Create with ``ray.remote(Syncer).options(...)``."""

    def __init__(self, spec: SyncerSpec, epoch: int = 0, restore: bool = False):
        """``restore``: start from the newest snapshot in ``spec.checkpoint_dir`` (a restart within
        a job). A new job starts fresh even if the directory holds an older job's snapshots."""
        from . import codec as codec_lib
        from . import outer as outer_lib

        self.spec = spec
        codec = codec_lib.make_codec(spec.codec_kind, block_size=spec.codec_block_size)
        prefix, paths = spec.embedding_prefix, spec.embedding_paths
        is_embedding = ((lambda path: path.startswith(prefix)) if paths is None
                        else frozenset(paths).__contains__)
        self.core = SyncerCore(spec.fragments, spec.settings,
                               outer_lib.build(spec.outer_kind, **spec.outer_kwargs),
                               lambda codes: codec_lib.decode_tree(codec, codes),
                               is_embedding=is_embedding, epoch=epoch,
                               downlink=downlink_settings(spec))
        self.store = self.journal = self.journal_writer = None
        # Fragments whose newest merge is being journaled: not merged again until it is written
        # (the journal entry holds the momentum buffers that merge would recycle).
        self.journal_pending: dict[int, Any] = {}
        self.restored_from: Optional[int] = None
        self.journaled: list[int] = []   # fragments the journal had newer than the snapshot
        if spec.checkpoint_dir:
            from .state import FragmentJournal, JournalWriter, SnapshotStore

            self.store = SnapshotStore(spec.checkpoint_dir, fresh=not restore)
            if spec.journal:
                self.journal = FragmentJournal(spec.checkpoint_dir)
                self.journal_writer = JournalWriter(self.journal)
            if restore:
                self.restored_from = self.store.restore_latest(self.core, min_epoch=epoch)
                if self.journal:
                    self.journaled = [self._global(p) for p in self.journal.replay(
                        self.core, self.restored_from or 0)]
        self.started_s = time.time()
        # The last snapshot (or the restored state): merges then, and when.
        self.snapshot_merges, self.snapshot_s = sum(self.core.versions), time.monotonic()
        self.snapshot_failures = 0                  # snapshot saves that raised
        self.snapshot_error: Optional[str] = None   # the newest one's error while they fail
        self.waiters: dict[int, dict[str, asyncio.Future]] = collections.defaultdict(dict)
        # The grace window's inputs (syncer/timing.py, as the in-process driver has them):
        # ξ_step and the pause from the controller (set_fleet), ξ_sync = the configured round
        # trip + the EMA of this syncer's merge + outer step wall time.
        self.slowest_step_s = timing.DEFAULT_STEP_S
        self.sync_time = timing.SyncTime(round_trip_s=spec.round_trip_s)
        self.last_grace_s = 0.0
        self.merges_by_fragment = collections.Counter()
        self.last_quorum = {}
        self.wire_bytes_up = collections.Counter()    # by learner
        self.wire_bytes_down = collections.Counter()
        self.merge_events: collections.deque = collections.deque(maxlen=10_000)
        self.paused = False
        self._wake: Optional[asyncio.Event] = None
        self._loop_task = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def ready(self) -> dict:
        self._ensure_loop()
        return {"epoch": self.core.epoch, "versions": list(self.core.versions),
                "restored_from": self.restored_from, "journaled": self.journaled,
                "syncer_shard": self.spec.syncer_shard,
                "fragment_ids": self._ids()}

    def _ids(self) -> list[int]:
        """The global ids of this shard's fragments, in local order."""
        return [self._global(i) for i in range(len(self.core.slots))]

    def _global(self, i: int) -> int:
        return shards_lib.globalize(self.spec.fragment_ids, i)

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_event_loop().create_task(self._merge_loop())

    async def _merge_loop(self) -> None:
        while True:
            now = time.monotonic()
            deadline = None
            live = timing.live_set(self.core.learners)
            for p, slot in enumerate(self.core.slots):
                if not slot.round or self.paused or p in self.journal_pending:
                    continue
                decision, grace = self.core.timed_decision(p, now, live, self.slowest_step_s,
                                                           self.sync_time.sync_s)
                if decision.merge:
                    self.last_grace_s = grace
                    self._merge(p, decision.reason.value)
                elif decision.wait_until_s is not None:
                    deadline = min(deadline or decision.wait_until_s, decision.wait_until_s)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def _merge(self, p: int, reason: str) -> None:
        t0 = time.monotonic()
        result = self.core.merge(p, reason, live_count=len(self.core.learners))
        self.sync_time.observe_merge(time.monotonic() - t0)
        g = self._global(p)   # waiters are kept by local id; learners and books see global ids
        if result.refused:  # Θ kept: every waiting push is answered with the refusal
            for name in result.learners:
                future = self.waiters[p].pop(name, None)
                if future is not None and not future.done():
                    future.set_result(Reply(ReplyStatus.REJECTED, g, self.core.epoch, result.params,
                                            result.version, result.reason, result.detail))
            return
        self.merges_by_fragment[g] += 1
        self.last_quorum[g] = result.participants
        # The merge event: its participation (n of the live M, each push's staleness).
        self.merge_events.append({"t": time.time(), "fragment": g, "version": result.version,
                                  "learners": list(result.learners), "reason": reason,
                                  "participants": result.participants, "live": result.live,
                                  "staleness": list(result.staleness)})
        # Computed now: the shadows each update leaves are recorded as this merge left them.
        updates = self.core.updates(result)
        # The merged pushes' waiters are taken now, with the round: a learner's next push of
        # this fragment may be accepted while this merge is journaled, and its waiter must not
        # take this merge's answer (that left the merged push unanswered for good).
        waiters = self.waiters[p]
        taken = {name: waiters.pop(name) for name in updates if name in waiters}
        if self.store and snapshot_due(sum(self.core.versions) - self.snapshot_merges,
                                       time.monotonic() - self.snapshot_s,
                                       self.spec.snapshot_every_merges,
                                       self.spec.snapshot_min_interval_s):
            self._save_snapshot()
        if self.journal_writer is None:
            self._answer(g, result, updates, taken)
            return
        # Durable before any learner hears of it: the entry is written on the journal's thread
        # while the loop takes other pushes and merges; the merge is answered once it is.
        durable = asyncio.wrap_future(self.journal_writer.submit(self.core, p))
        self.journal_pending[p] = durable
        asyncio.ensure_future(self._answer_when_durable(p, g, result, updates, taken, durable))

    def _save_snapshot(self) -> None:
        """A snapshot that cannot be written (a full or read-only disk) is logged when the
        failures start (and when their error changes) and when they end, and counted
        (``snapshot_failures``); the merge goes on and is answered as it would be (a raise here
        ended the merge loop and left the merge's pushes unanswered). The next try is due as
        the next snapshot would have been (``snapshot_every_merges`` merges later, and the
        minimum interval): trying at every merge would block the loop on a failing write each
        time."""
        try:
            self.store.save(self.core)
        except Exception as exc:
            self.snapshot_failures += 1
            error = f"{type(exc).__name__}: {exc}"
            if self.snapshot_error is None or not self.snapshot_error.startswith(
                    type(exc).__name__):
                log.error("syncer shard %s: cannot save a snapshot (%s); merging goes on, a "
                          "restart would restore an older one", self.spec.syncer_shard, error,
                          exc_info=True)
            self.snapshot_error = error
            self.snapshot_merges, self.snapshot_s = sum(self.core.versions), time.monotonic()
            return
        if self.snapshot_error is not None:
            log.warning("syncer shard %s: snapshots are saved again after %d failure(s)",
                        self.spec.syncer_shard, self.snapshot_failures)
            self.snapshot_error = None
        self.snapshot_merges, self.snapshot_s = sum(self.core.versions), time.monotonic()

    async def _answer_when_durable(self, p: int, g: int, result, updates: dict, taken: dict,
                                   durable: asyncio.Future) -> None:
        try:
            await durable
            self._answer(g, result, updates, taken)
        except Exception as exc:
            if self._in_snapshot(p, result.version):
                # The snapshot saved at this merge (or since) holds it, Θ[p] and the ledger's
                # credit both: a restart restores it from there, so it is durable and answered
                # as merged. Refusing it would leave that snapshot's ledger saying "merged" for
                # tokens the learner dropped. (Saving the snapshot only after the journal write
                # would not do: it would still hold the other fragments' merges whose entries
                # are being written, and any of those could fail.)
                log.warning("fragment %d: the merge journal entry of version %d was not "
                            "written (%r); the snapshot holds the merge: answered", g,
                            result.version, exc)
                self._answer(g, result, updates, taken)
                return
            # Not durable (a restart replays the previous entry), yet merged here: a push
            # answered "dropped" would be pushed again and its drift merged twice. Refused
            # instead, with the current fragment (this merge in it) to start over from: its
            # tokens are dropped with the reason, the ledger takes back what the merge credited
            # (core.revoke: one fate per token on both sides), and nobody waits on an answer
            # for ever.
            log.exception("fragment %d: the merge journal entry of version %d was not written; "
                          "its pushes are refused as not durable", g, result.version)
            detail = (f"the merge journal entry of version {result.version} was not written: "
                      f"{exc!r}")[:300]
            self.core.revoke(result, detail)
            self._refuse_taken(p, g, taken, detail)
        finally:
            self.journal_pending.pop(p, None)
            if self._wake:
                self._wake.set()   # the fragment may merge again

    def _in_snapshot(self, p: int, version: int) -> bool:
        """Whether the newest snapshot this syncer saved holds fragment ``p`` at ``version`` or
        later (a merge of ``p`` waits for the previous one's journal entry: so it holds that
        merge, and the ledger as the merge credited it)."""
        saved = self.store.saved_versions if self.store is not None else None
        return saved is not None and saved[p] >= version

    def _refuse_taken(self, p: int, g: int, taken: dict, detail: str) -> None:
        """Answers the merged pushes' waiters ``taken`` whose merge could not be made durable:
        refused ``not_durable`` with the current fragment."""
        params, version = self.core.fragment(p)
        for future in taken.values():
            if not future.done():
                future.set_result(Reply(ReplyStatus.REJECTED, g, self.core.epoch, params=params,
                                        version=version, reason=RejectReason.NOT_DURABLE.value,
                                        detail=detail))

    def _answer(self, g: int, result, updates: dict, taken: dict) -> None:
        """Answers the merged pushes' waiters (``taken`` from ``waiters`` at the merge)."""
        for name, update in updates.items():
            future = taken.get(name)
            if future is not None and not future.done():
                self.wire_bytes_down[name] += downlink_lib.update_bytes(update)
                future.set_result(Reply(ReplyStatus.MERGED, g, self.core.epoch, version=result.version,
                                        update=update))

    # -- the data path --------------------------------------------------------------------------
    async def register(self, learner: str, incarnation: int,
                       adopted: Optional[list] = None, session: Optional[str] = None) -> dict:
        """Admits a learner incarnation. ``adopted``: [(version, fragment)] the learner holds,
        indexed by global fragment id, offered after a syncer restart so that merges newer than
        the snapshot are not lost. ``session``: the token the learner already carries to the
        other syncer shards (None: a fresh one). Returns this shard's fragments (global ids in
        ``fragment_ids``), their versions, the epoch, the session and ``schedule_step``: under
        the fleet clock the schedule count the learner starts at (``SyncerCore.schedule_start``;
        None: its own resume step)."""
        self._ensure_loop()
        adopted = shards_lib.localize_adopted(self.spec.fragment_ids, adopted)
        if adopted:
            self.core.catch_up(learner, incarnation, adopted)
        # Every push of this incarnation must carry it.
        session = session if session else secrets.token_hex(16)
        epoch, frags = self.core.register(learner, incarnation, session)
        self._wake.set()  # the live set changed
        return {"epoch": epoch, "fragments": [f for f, _ in frags],
                "versions": [v for _, v in frags], "session": session,
                "fragment_ids": self._ids(), "syncer_shard": self.spec.syncer_shard,
                "schedule_step": self.core.schedule_start()}

    async def push(self, push: Push) -> Reply:
        self._ensure_loop()
        g = push.fragment
        push = shards_lib.localize_push(self.spec.fragment_ids, push)
        verdict = self.core.accept_push(push, time.monotonic())
        for name in [m.learner for m in push.members] or [push.learner]:
            # A pre-merged push's bytes are its members' share of the link (link/premerge.py).
            self.wire_bytes_up[name] += push.wire_bytes // max(1, len(push.members))
        if not verdict.ok:  # logged (WARNING) and recorded by the core
            params, version = (self.core.fragment(push.fragment)
                               if 0 <= push.fragment < len(self.core.slots) else (None, -1))
            # The current fragment rides along so the learner can start over from it.
            return Reply(ReplyStatus.REJECTED, g, self.core.epoch, params=params, version=version,
                         reason=verdict.reason.value, detail=verdict.detail)
        loop = asyncio.get_event_loop()
        futures = []
        for name in [m.learner for m in push.members] or [push.learner]:
            futures.append(loop.create_future())
            self.waiters[push.fragment][name] = futures[-1]
        self._wake.set()
        replies = await asyncio.gather(*futures)
        # A pre-merged push's members merge, are refused or are dropped together (core.forget
        # drops a group whole), so their replies agree; any "dropped" answers the whole push.
        return next((r for r in replies if r.status != ReplyStatus.MERGED), replies[0])

    # -- control --------------------------------------------------------------------------------
    async def forget(self, learner: str, incarnation: Optional[int] = None,
                     reason: str = "") -> int:
        """Unregisters a learner; its unmerged pushes are dropped. Returns how many.

        With ``incarnation``, only that incarnation: a forget that arrives late over a region's
        link must not unregister the learner's next incarnation. ``reason`` is logged."""
        if incarnation is not None and self.core.learners.get(learner) != incarnation:
            return 0
        if reason:
            log.info("forget %s (incarnation %s): %s", learner, incarnation, reason)
        dropped = self.core.forget(learner)
        # Its pushes, and the members of a pre-merged push it was part of (dropped with it).
        for name in {learner} | {push.learner for push in dropped}:
            for waiters in self.waiters.values():
                future = waiters.pop(name, None)
                if future is not None and not future.done():
                    future.set_result(Reply(ReplyStatus.DROPPED, -1, self.core.epoch))
        if self._wake:
            self._wake.set()
        return len(dropped)

    async def set_fleet(self, slowest_step_s: float, paused: bool = False) -> None:
        """ξ_step (``timing.slowest_step_s`` of the controller's view) and the pause rule
        (``timing.merges_held``): while paused no round merges."""
        self.slowest_step_s = max(timing.MIN_STEP_S, float(slowest_step_s))
        self.paused = paused
        self.core.pause_periods(paused)   # round_wait's periods leave the pause out
        if self._wake:
            self._wake.set()

    async def global_params(self) -> tuple[dict, list[int]]:
        return self.core.params_flat(), list(self.core.versions)

    async def status(self) -> SyncerStatus:
        ledger = {name: {"incarnation": e.incarnation, "applied_tokens": e.applied_tokens,
                         "applied_tokens_incarnation": e.applied_tokens_done,
                         "applied_compute_s": e.applied_compute_total_s,
                         "applied_compute_incarnation_s": e.applied_compute_s,
                         "applied_step": e.applied_step,
                         "merged_steps": {self._global(p): v for p, v in e.merged_steps.items()},
                         "merged_tokens_total": e.merged_tokens_total, "fates": e.fates}
                  for name, e in self.core.ledger.items()}
        return SyncerStatus(
            epoch=self.core.epoch,
            versions=list(self.core.versions),
            merges=int(sum(self.core.versions)),  # survives restarts: versions are snapshotted
            merges_by_fragment={self._global(p): v for p, v in enumerate(self.core.versions)},
            quorum_size=dict(self.last_quorum),
            # Participation (docs/metrics.md): live learners at each fragment's last merge, and
            # the merges that replaced Θ by "participants/live".
            live_learners={self._global(p): n for p, n in self.core.last_live.items()},
            participation_counts=dict(self.core.participation_counts),
            grace_window_s=self.last_grace_s,
            staleness_counts=dict(self.core.staleness_counts),
            rejected={r.value: n for r, n in self.core.rejected.items()},
            registered=dict(self.core.learners),
            refusals_total=self.core.refusals_total,
            quarantined=dict(self.core.quarantined),
            ledger=ledger,
            wire_bytes_up=dict(self.wire_bytes_up),
            wire_bytes_down=dict(self.wire_bytes_down),
            restored_from=self.restored_from,
            syncer_shard=self.spec.syncer_shard,
            fragment_ids=self._ids(),
            snapshot_failures=self.snapshot_failures,
            snapshot_error=self.snapshot_error,
        )

    async def fragment_at(self, p: int, version: int) -> Optional[dict]:
        """Fragment p at ``version`` if it is still in the history, else None."""
        i = shards_lib.localize(self.spec.fragment_ids, p)
        return None if i < 0 else self.core.slots[i].history.get(version)

    async def shadow(self, learner: str, p: int) -> Optional[tuple]:
        """(shadow id, version, fragment) the syncer records for what ``learner`` holds of
        fragment p after its last encoded update, or None."""
        shadow = self.core.shadows.get((learner, shards_lib.localize(self.spec.fragment_ids, p)))
        return None if shadow is None else (shadow.shadow_id, shadow.version, shadow.params)

    async def refusals_since(self, total: int) -> tuple[list[dict], int]:
        """Refusals after the first ``total`` this syncer made (the newest 10,000 are kept)."""
        new = self.core.refusals_total - total
        recent = list(self.core.refusals)[-new:] if new > 0 else []
        if self.spec.fragment_ids is not None:
            recent = [dict(r, fragment=self._global(r["fragment"])
                           if isinstance(r["fragment"], int) else r["fragment"]) for r in recent]
        return recent, self.core.refusals_total

    async def recent_merges(self, since_s: float) -> list[dict]:
        return [m for m in self.merge_events if m["t"] > since_s]

    async def snapshot_now(self) -> Optional[int]:
        return self.store.save(self.core) if self.store else None

    async def ping(self) -> str:
        return "ok"

    async def wait_closed(self) -> None:
        """Never returns while the syncer lives: the controller's liveness probe."""
        await asyncio.Event().wait()
