"""Every push the syncer accepts is answered exactly once, by the merge that took it (the real
Syncer actor class, driven directly on an asyncio loop)."""

import asyncio
import threading
import time

import numpy as np

from islands.syncer import codec as codec_lib
from islands.syncer.actor import Syncer, SyncerSpec
from islands.syncer.core import SyncerSettings
from islands.syncer.validate import Push

CODEC = codec_lib.make_codec("none")


def _spec(tmp_path):
    settings = SyncerSettings(min_learners=1, outlier_norm_factor=None, grace_cap_s=0.0)
    return SyncerSpec(fragments=[{"w": np.ones(4, np.float32)}], settings=settings,
                      outer_kind="nesterov", outer_kwargs={}, codec_kind="none",
                      codec_block_size=64, checkpoint_dir=str(tmp_path / "syncer"),
                      journal=True)


def _push(reg, version, step):
    drift = {"w": np.full(4, -0.1, np.float32)}
    return Push("a", 0, codec_lib.encode_tree(CODEC, drift), version, reg["epoch"], 64, 2,
                step=step, tokens_done=64 * step, session=reg["session"])


async def _until(predicate, timeout_s=10.0):
    deadline = asyncio.get_event_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_event_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_push_taken_while_the_previous_merge_is_journaled_leaves_no_push_unanswered(tmp_path):
    """A learner's next push of a fragment can arrive while the merge of its previous one is
    being journaled (a backlog sent at once after a syncer restart does): the merge answers the
    push it merged, and the next push is answered by its own merge, not left waiting forever."""

    async def scenario():
        syncer = Syncer(_spec(tmp_path))
        reg = await syncer.register("a", 0)
        await asyncio.sleep(0.01)   # (the progress bound: a few steps need a few 10 µs)
        gate = threading.Event()    # the journal's disk is slow: its thread is busy until set
        syncer.journal_writer._thread.submit(gate.wait, 10)
        first = asyncio.ensure_future(syncer.push(_push(reg, 0, 2)))
        await _until(lambda: 0 in syncer.journal_pending)   # merged, being journaled
        second = asyncio.ensure_future(syncer.push(_push(reg, 0, 4)))
        await _until(lambda: syncer.core.slots[0].round)     # taken into the next round
        gate.set()
        done, _ = await asyncio.wait([first, second], timeout=10)
        assert first in done, "the merged push was never answered"
        assert second in done, "the next push was never answered"
        assert (first.result().status, first.result().version) == ("merged", 1)
        assert (second.result().status, second.result().version) == ("merged", 2)
        syncer._loop_task.cancel()
        syncer.journal_writer.close()
        syncer.store.close()

    asyncio.run(scenario())


def test_a_merge_whose_journal_entry_is_not_written_refuses_its_pushes_with_the_fragment(tmp_path):
    """The journal's write fails (its file's place is taken by a folder): the merged push is
    not left waiting for good; it is refused ``not_durable`` with the current fragment, the
    merge in it, so its learner starts over from that (its tokens dropped with the reason)
    rather than pushing the same drift again (merged twice). The fragment merges again after."""
    import os

    async def scenario():
        syncer = Syncer(_spec(tmp_path))
        reg = await syncer.register("a", 0)
        await asyncio.sleep(0.01)
        os.makedirs(syncer.journal._path(0) + ".tmp")   # the write cannot put its file there
        reply = await asyncio.wait_for(syncer.push(_push(reg, 0, 2)), timeout=10)
        assert (reply.status, reply.reason) == ("rejected", "not_durable")
        assert reply.version == 1 and reply.params is not None   # the fragment, merged
        np.testing.assert_allclose(reply.params["w"], syncer.core.fragment(0)[0]["w"])
        assert "was not written" in reply.detail
        await _until(lambda: 0 not in syncer.journal_pending)
        os.rmdir(syncer.journal._path(0) + ".tmp")
        again = await asyncio.wait_for(syncer.push(_push(reg, 1, 4)), timeout=10)
        assert (again.status, again.version) == ("merged", 2)
        syncer._loop_task.cancel()
        syncer.journal_writer.close()
        syncer.store.close()

    asyncio.run(scenario())


def test_a_refusal_as_not_durable_drops_the_pushs_tokens_with_a_reason():
    """The learner's side of it: the refused push's tokens and the drift since are dropped as
    ``refused`` (not returned to the drift to be pushed again); the books balance."""
    import jax.numpy as jnp

    from islands.learners.core import LearnerCore
    from islands.syncer import fragments

    params = {"w": jnp.ones(4)}
    core = LearnerCore("a", params, None, fragments.partition(params, 1), [0],
                       codec_lib.error_feedback(CODEC), codec_lib.tree_wire_bytes,
                       lambda c: codec_lib.decode_tree(CODEC, c), overlap_steps=1)
    core.record_step(64, 0.1)
    core.make_push(0, epoch=0)
    core.record_step(64, 0.1)
    core.refused(0, "not_durable", {"w": np.full(4, 0.5, np.float32)}, 1)
    totals = core.fates.totals()
    assert totals["dropped_by"] == {"refused": 128} and totals["in_flight"] == 0
    assert core.fates.balanced() and core.tracks[0].base_version == 1


def test_a_not_durable_refusal_leaves_one_fate_per_token_on_both_sides(tmp_path):
    """The real Syncer and LearnerCore: the push's merge is not written to the journal, so it is
    refused ``not_durable``; the learner drops its tokens as refused, and the syncer's ledger
    takes back what the merge credited (merged tokens, merged step, applied watermark), so the
    two books agree: applied on neither side. The next push, merged durably, is applied on
    both."""
    import os

    import jax.numpy as jnp

    from islands.learners.core import LearnerCore
    from islands.syncer import fragments
    from islands.syncer.validate import RejectReason

    async def scenario():
        syncer = Syncer(_spec(tmp_path))
        reg = await syncer.register("a", 0)
        learner = LearnerCore("a", {"w": jnp.ones(4)}, None,
                              fragments.partition({"w": jnp.ones(4)}, 1), [0],
                              codec_lib.error_feedback(CODEC), codec_lib.tree_wire_bytes,
                              lambda c: codec_lib.decode_tree(CODEC, c), overlap_steps=1,
                              session=reg["session"])
        await asyncio.sleep(0.01)   # (the progress bound: a few steps need a few 10 µs)

        async def push_and_answer():
            learner.params = {"w": learner.params["w"] - 0.1}
            learner.record_step(64, 0.1)
            push = learner.make_push(0, reg["epoch"]).on_host().push
            reply = await asyncio.wait_for(syncer.push(push), timeout=10)
            learner.record_step(64, 0.1)   # the overlap step (τ = 1)
            if reply.status == "merged":
                learner.offer_reply(0, reply.update, reply.version)
                assert learner.adopt_ready() == [0]
            else:
                learner.refused(0, reply.reason, reply.params, reply.version)
            return reply

        os.makedirs(syncer.journal._path(0) + ".tmp")   # the journal's write cannot land
        reply = await push_and_answer()
        assert (reply.status, reply.reason) == ("rejected", "not_durable")
        entry, totals = syncer.core.ledger["a"], learner.fates.totals()
        assert totals["dropped_by"] == {"refused": 128} and totals["applied"] == 0
        assert entry.merged_tokens_total == totals["applied"] == 0
        assert (entry.merged_steps, entry.merged_tokens) == ({}, {})
        assert (entry.applied_tokens, entry.applied_step) == (0, 0)
        assert syncer.core.rejected[RejectReason.NOT_DURABLE] == 1
        assert syncer.core.refusals[-1]["reason"] == "not_durable"
        status = await syncer.status()
        assert status.ledger["a"]["merged_tokens_total"] == 0

        await _until(lambda: 0 not in syncer.journal_pending)
        os.rmdir(syncer.journal._path(0) + ".tmp")
        again = await push_and_answer()
        assert (again.status, again.version) == ("merged", 2)
        totals = learner.fates.totals()
        assert totals["applied"] == entry.merged_tokens_total == 64
        assert (entry.merged_steps, entry.applied_step, entry.applied_tokens) == ({0: 3}, 3, 192)
        assert learner.fates.balanced()
        syncer._loop_task.cancel()
        syncer.journal_writer.close()
        syncer.store.close()

    asyncio.run(scenario())


def _two_fragment_core_with_a():
    """A syncer core of two one-number fragments (mean merge, SGD(1) outer step) where learner
    ``a`` has registered long enough ago for a few steps."""
    import optax

    from islands.syncer import merge as merge_lib
    from islands.syncer.core import SyncerCore

    core = SyncerCore([{"w": np.zeros(1, np.float32)}, {"v": np.zeros(1, np.float32)}],
                      SyncerSettings(min_learners=1, outlier_norm_factor=None,
                                     merge_rule=merge_lib.MergeRule.MEAN),
                      optax.sgd(1.0), lambda codes: codes)
    core.register("a", 0)
    time.sleep(0.01)   # (the progress bound: a few steps need a few 10 µs)
    return core


def test_revoking_a_merge_restores_the_watermark_of_the_merges_that_stay():
    """SyncerCore.revoke: a's push of fragment 0 (step 6) merges, then its older push of
    fragment 1 (step 5); fragment 0's merge is revoked: the applied watermark is fragment 1's
    push (step 5, 500 tokens), not what it was before both (0), nor fragment 0's."""
    from islands.syncer.validate import RejectReason

    core = _two_fragment_core_with_a()

    def merged(p, path, step):
        push = Push("a", p, {path: np.ones(1, np.float32)}, 0, core.epoch, 100, 1, step=step,
                    tokens_done=100 * step, compute_s=float(step))
        assert core.accept_push(push, 0.0).ok
        return core.merge(p)

    first = merged(0, "w", 6)
    merged(1, "v", 5)
    entry = core.ledger["a"]
    assert (entry.applied_step, entry.merged_tokens_total) == (6, 200)
    core.revoke(first, "the journal entry was not written")
    assert (entry.applied_tokens_done, entry.applied_compute_s, entry.applied_step) == (
        500, 5.0, 5)
    assert (entry.merged_steps, entry.merged_tokens, entry.merged_tokens_total) == (
        {1: 5}, {1: 100}, 100)
    assert core.rejected[RejectReason.NOT_DURABLE] == 1


def test_revoking_two_pending_merges_leaves_the_durable_watermark():
    """A full disk fails every pending journal write: fragment 1's merge (tokens_done 200) and
    then fragment 0's (300, credited on top of it) are both revoked, in the order they were
    submitted. The applied watermark (what a restarted learner resumes from) goes back to the
    durable merge before them (100, step 1), not to what the entry held when fragment 0's merge
    was credited (fragment 1's 200, revoked itself)."""
    core = _two_fragment_core_with_a()

    def merged(p, path, step):
        push = Push("a", p, {path: np.ones(1, np.float32)}, core.fragment(p)[1], core.epoch,
                    100, 1, step=step, tokens_done=100 * step, compute_s=float(step))
        assert core.accept_push(push, 0.0).ok
        return core.merge(p)

    entry = core.ledger["a"]

    def watermark():
        return entry.applied_tokens_done, entry.applied_compute_s, entry.applied_step

    merged(0, "w", 1)                     # durable (its journal entry written)
    q = merged(1, "v", 2)                 # pending
    p = merged(0, "w", 3)                 # pending
    assert watermark() == (300, 3.0, 3)
    core.revoke(q, "disk full")
    assert watermark() == (300, 3.0, 3)   # fragment 0's merge still stands
    core.revoke(p, "disk full")
    assert watermark() == (100, 1.0, 1), "a revoked merge came back with the other's revoke"
    assert (entry.merged_steps, entry.merged_tokens, entry.merged_tokens_total) == (
        {0: 1}, {0: 100}, 100)


def test_a_merge_a_snapshot_holds_is_answered_though_its_journal_entry_is_not_written(tmp_path):
    """A snapshot is saved at every merge, before the merge's journal entry is written; the
    write fails. The snapshot holds the merge (Θ[p] and the ledger's credit), so it is durable:
    the push is answered as merged, the ledger keeps the credit, and a syncer restarted from
    that snapshot agrees with the learner (not "merged" for tokens it dropped)."""
    import dataclasses
    import os

    from islands.syncer.validate import RejectReason

    spec = dataclasses.replace(_spec(tmp_path), snapshot_every_merges=1)

    async def scenario():
        syncer = Syncer(spec)
        reg = await syncer.register("a", 0)
        await asyncio.sleep(0.01)   # (the progress bound: a few steps need a few 10 µs)
        os.makedirs(syncer.journal._path(0) + ".tmp")   # the journal's write cannot land
        reply = await asyncio.wait_for(syncer.push(_push(reg, 0, 2)), timeout=10)
        assert (reply.status, reply.version) == ("merged", 1), reply
        await _until(lambda: 0 not in syncer.journal_pending)
        assert syncer.store.saved_versions == (1,)
        assert not os.path.exists(syncer.journal._path(0)), "the journal entry was written"
        entry = syncer.core.ledger["a"]
        assert (entry.merged_tokens_total, entry.applied_step) == (64, 2)
        assert syncer.core.rejected[RejectReason.NOT_DURABLE] == 0
        syncer._loop_task.cancel()
        syncer.journal_writer.close()
        syncer.store.close()

    asyncio.run(scenario())
    restarted = Syncer(spec, epoch=1, restore=True)
    entry = restarted.core.ledger["a"]
    assert restarted.core.versions == (1,)
    assert (entry.merged_tokens_total, entry.applied_step, entry.applied_tokens) == (64, 2, 128)
    restarted.journal_writer.close()
    restarted.store.close()


def test_a_snapshot_that_cannot_be_saved_is_counted_and_merging_goes_on(tmp_path):
    """The snapshot cannot be written (a file holds the snapshot folder's name): the merge is still
    answered as merged, the failure is counted with its error in the status, the loop merges
    the next push, and once the folder is back the next snapshot lands and clears the error. (A raise from the save ended the merge loop and left the merged push unanswered.)"""
    import dataclasses
    import os

    spec = dataclasses.replace(_spec(tmp_path), snapshot_every_merges=1, journal=False,
                               snapshot_min_interval_s=0.0)

    async def scenario():
        syncer = Syncer(spec)
        reg = await syncer.register("a", 0)
        await asyncio.sleep(0.01)
        folder = str(syncer.store.manager.directory)
        os.rmdir(folder)                    # (empty: nothing saved yet)
        open(folder, "w").close()           # no snapshot can be written under it
        reply = await asyncio.wait_for(syncer.push(_push(reg, 0, 2)), timeout=10)
        assert (reply.status, reply.version) == ("merged", 1), reply
        status = await syncer.status()
        assert status.snapshot_failures == 1 and status.snapshot_error, status
        assert syncer.store.saved_versions is None
        os.remove(folder)
        os.makedirs(folder)
        reply = await asyncio.wait_for(syncer.push(_push(reg, 1, 4)), timeout=10)
        assert (reply.status, reply.version) == ("merged", 2), reply
        status = await syncer.status()
        assert (status.snapshot_failures, status.snapshot_error) == (1, None)
        assert syncer.store.saved_versions == (2,)
        syncer._loop_task.cancel()
        syncer.store.close()

    asyncio.run(scenario())


def test_a_save_that_fails_midway_is_tried_again_a_snapshot_later_and_restarts_clean_up(
        tmp_path, monkeypatch):
    """The disk fails in the middle of a snapshot (the arrays are written, the metadata is
    not): every merge is still answered, the next try comes ``snapshot_every_merges`` merges
    later (not at every merge, each a blocking write), and once the disk works the snapshot
    lands and a restarted syncer restores it. A restarted shard's store removes the temporary
    folders failed saves left, and nothing else in the folder."""
    import dataclasses
    import os

    import orbax.checkpoint as ocp

    from islands.syncer.state import SnapshotStore

    spec = dataclasses.replace(_spec(tmp_path), snapshot_every_merges=2, journal=False,
                               snapshot_min_interval_s=0.0)
    real_save, disk = ocp.JsonCheckpointHandler.async_save, {"full": False, "tries": 0}

    async def json_save(self, *args, **kwargs):   # the disk, failing at the metadata
        if disk["full"]:
            disk["tries"] += 1
            raise OSError(28, "No space left on device")
        return await real_save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", json_save)

    async def scenario():
        syncer = Syncer(spec)
        reg = await syncer.register("a", 0)
        await asyncio.sleep(0.01)
        disk["full"] = True
        for version in range(5):                # merges 1..5: tries at 2 and 4 only
            reply = await asyncio.wait_for(syncer.push(_push(reg, version, 2 * version + 2)),
                                           timeout=10)
            assert (reply.status, reply.version) == ("merged", version + 1), reply
        assert disk["tries"] == 2 and syncer.snapshot_failures == 2
        assert "No space left" in syncer.snapshot_error
        disk["full"] = False
        reply = await asyncio.wait_for(syncer.push(_push(reg, 5, 12)), timeout=10)
        assert reply.version == 6 and syncer.snapshot_error is None
        assert syncer.store.manager.all_steps() == [6]
        syncer._loop_task.cancel()
        syncer.store.close()

    asyncio.run(scenario())
    restarted = Syncer(spec, epoch=1, restore=True)
    assert restarted.restored_from == 6 and restarted.core.versions == (6,)
    restarted.store.close()
    # What a failed save leaves, as a restarted shard's store finds it: removed, and only it.
    folder = tmp_path / "left"
    (folder / "3.orbax-checkpoint-tmp" / "arrays").mkdir(parents=True)
    (folder / "notes.txt").write_text("the operator's")
    store = SnapshotStore(str(folder))          # (orbax removes them on a thread of its own)
    deadline = time.monotonic() + 20
    while "3.orbax-checkpoint-tmp" in os.listdir(folder):
        assert time.monotonic() < deadline, "the failed save's folder was never removed"
        time.sleep(0.05)
    assert sorted(os.listdir(folder)) == ["notes.txt"]
    store.close()
