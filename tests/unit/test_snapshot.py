"""Syncer snapshots round-trip through orbax: Θ, outer momentum, versions, ledger; epoch fences."""

import numpy as np
import pytest

from islands.syncer import outer
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.state import FragmentJournal, SnapshotDirError, SnapshotStore
from islands.syncer.validate import Push, RejectReason


def decode(codes):
    return {k: np.asarray(v, np.float32) for k, v in codes.items()}


def build():
    frags = [{"w": np.ones(3, np.float32)}, {"v": np.zeros((2, 2), np.float32)}]
    return SyncerCore(frags, SyncerSettings(outlier_norm_factor=None), outer.build("nesterov"),
                      decode)


def test_snapshot_round_trip(tmp_path):
    core = build()
    core.register("a", 0)
    for round_ in range(2):
        drift = {"w": np.full(3, -0.5, np.float32)}
        core.accept_push(Push("a", 0, drift, core.versions[0], 0, 64, 2, step=2 * round_ + 2,
                              tokens_done=128 * (round_ + 1)), 0.0)
        core.merge(0)
    store = SnapshotStore(str(tmp_path / "snap"))
    assert store.save(core) == 2

    fresh = build()
    assert store.restore_latest(fresh) == 2
    assert fresh.epoch == 1 and fresh.versions == (2, 0)
    np.testing.assert_array_equal(fresh.slots[0].params["w"], core.slots[0].params["w"])
    # Momentum survived: the next identical merge lands in the same place on both.
    for c, epoch in ((core, 0), (fresh, 1)):
        c.register("a", 0)
        c.accept_push(Push("a", 0, {"w": np.full(3, -0.5, np.float32)}, 2, epoch, 64, 2), 0.0)
        c.merge(0)
    np.testing.assert_allclose(fresh.slots[0].params["w"], core.slots[0].params["w"], rtol=1e-6)
    assert fresh.ledger["a"].applied_tokens == 256
    # A push of the old epoch is refused by the restored syncer.
    verdict = fresh.accept_push(Push("a", 1, {"v": np.zeros((2, 2), np.float32)}, 0, 0, 1, 1), 0.0)
    assert verdict.reason == RejectReason.STALE_EPOCH
    store.close()


def test_a_restored_syncer_loses_no_merged_version_a_learner_adopted(tmp_path):
    """The syncer snapshots every 10 merges by default: a kill between two snapshots used to roll
    the job back to the older one. A re-registering learner now offers what it adopted."""
    core = build()
    core.register("a", 0)

    def one_merge(c, epoch):
        c.accept_push(Push("a", 0, {"w": np.full(3, -0.5, np.float32)}, c.versions[0], epoch,
                           64, 2), 0.0)
        return c.merge(0)

    one_merge(core, 0)
    store = SnapshotStore(str(tmp_path / "snap"))
    store.save(core)                                   # snapshot at version 1
    newest = one_merge(core, 0)                         # version 2: adopted by "a", not saved
    fresh = build()
    store.restore_latest(fresh)
    assert fresh.versions == (1, 0)
    # Only a learner of the restored ledger, only newer versions, only sound values.
    assert fresh.catch_up("mallory", 0, [(9, {"w": np.zeros(3, np.float32)})]) == []
    assert fresh.catch_up("a", 0, [(5, {"w": np.full(3, np.nan, np.float32)})]) == []
    assert fresh.catch_up("a", 0, [(newest.version, newest.params), (0, {"v": np.zeros((2, 2))})]) \
        == [0]
    assert fresh.versions == (2, 0)
    np.testing.assert_array_equal(fresh.slots[0].params["w"], newest.params["w"])
    fresh.register("a", 0)
    one_merge(fresh, fresh.epoch)                       # the next merge closes the catch-up
    assert fresh.versions == (3, 0)
    assert fresh.catch_up("a", 0, [(7, {"w": np.zeros(3, np.float32)})]) == []
    store.close()


# -- the merge journal ----------------------------------------------------------------------------
def _merge_once(core, epoch, step):
    core.accept_push(Push("a", 0, {"w": np.full(3, -0.5, np.float32)}, core.versions[0], epoch,
                          64, 2, step=step, tokens_done=64 * step), 0.0)
    return core.merge(0)


def test_the_journal_loses_no_merged_version_that_no_learner_holds(tmp_path):
    """The full soak saw versions go back by up to 4: a syncer killed between snapshots restarted
    from the older one when no live learner had adopted the newer merges. Every merge is now
    journaled before it is answered."""
    core = build()
    core.register("a", 0)
    store, journal = SnapshotStore(str(tmp_path / "snap")), FragmentJournal(str(tmp_path / "snap"))
    _merge_once(core, 0, 2)
    journal.record(core, 0)
    store.save(core)                                      # snapshot at merge 1
    for step in (4, 6):
        _merge_once(core, 0, step)
        journal.record(core, 0)                           # versions 2, 3: journaled only

    fresh = build()
    assert store.restore_latest(fresh) == 1 and fresh.versions == (1, 0)   # what it was before
    assert journal.replay(fresh, snapshot_merges=1) == [0]
    assert fresh.versions == (3, 0) and fresh.epoch == 1
    np.testing.assert_array_equal(fresh.slots[0].params["w"], core.slots[0].params["w"])
    assert fresh.ledger["a"].merged_steps == {0: 6} and fresh.ledger["a"].applied_tokens == 384
    # The outer momentum is the journaled one: the same next merge lands on the same Θ.
    for c, epoch in ((core, 0), (fresh, 1)):
        c.register("a", 0)
        _merge_once(c, epoch, 8)
    np.testing.assert_array_equal(fresh.slots[0].params["w"], core.slots[0].params["w"])
    # Replaying again takes nothing older than what the core now holds.
    assert journal.replay(fresh, snapshot_merges=1) == [] and fresh.versions == (4, 0)
    store.close()


def test_a_journal_alone_restores_and_fences_the_epoch(tmp_path):
    """A syncer killed before its first snapshot: the journal is all there is."""
    core = build()
    core.register("a", 0)
    journal = FragmentJournal(str(tmp_path / "snap"))
    core.epoch = 4
    _merge_once(core, 4, 2)
    journal.record(core, 0)
    fresh = build()
    assert journal.replay(fresh) == [0]
    assert fresh.versions == (1, 0) and fresh.epoch == 5   # above every journaled epoch


@pytest.mark.parametrize("damage", ["truncated", "bit flip"])
def test_a_corrupt_journal_entry_is_ignored_with_a_warning(tmp_path, caplog, damage):
    core = build()
    core.register("a", 0)
    journal = FragmentJournal(str(tmp_path / "snap"))
    _merge_once(core, 0, 2)
    journal.record(core, 0)
    path = tmp_path / "snap" / "journal" / "fragment-0.npz"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:100]
    else:   # one bit of Θ's bytes (the zip member's CRC-32 no longer matches)
        at = data.index(np.asarray(core.slots[0].params["w"]).tobytes())
        data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    fresh = build()
    assert journal.replay(fresh) == [] and fresh.versions == (0, 0)
    assert "unreadable or corrupt" in caplog.text


def test_a_new_job_refuses_a_directory_holding_a_journal_and_deletes_nothing(tmp_path):
    core = build()
    FragmentJournal(str(tmp_path / "snap")).record(core, 1)
    before = sorted(p.name for p in (tmp_path / "snap" / "journal").iterdir())
    with pytest.raises(SnapshotDirError, match="merge journal"):
        SnapshotStore(str(tmp_path / "snap"), fresh=True)
    assert sorted(p.name for p in (tmp_path / "snap" / "journal").iterdir()) == before


def test_the_syncer_actor_journals_every_merge_and_a_restart_replays_it(tmp_path):
    """The actor without Ray: merges, a 'kill' (the object is dropped), a restart with restore.
    Snapshots every 10 merges, so only the journal holds merges 1-3."""
    import asyncio

    from islands.syncer import codec as codec_lib
    from islands.syncer.actor import Syncer, SyncerSpec

    codec = codec_lib.make_codec("none")
    spec = SyncerSpec(fragments=[{"w": np.ones(4, np.float32)}],
                      settings=SyncerSettings(outlier_norm_factor=None, grace_cap_s=0.0),
                      outer_kind="nesterov", outer_kwargs={}, codec_kind="none",
                      codec_block_size=64, checkpoint_dir=str(tmp_path / "syncer"))

    async def run():
        first = Syncer(spec)
        reg = await first.register("a", 0)
        for version in range(3):
            drift = {"w": np.full(4, -0.25, np.float32)}
            reply = await asyncio.wait_for(first.push(Push(
                "a", 0, codec_lib.encode_tree(codec, drift), version, reg["epoch"], 64, 2,
                step=2 * version + 2, tokens_done=128 * (version + 1), session=reg["session"])),
                timeout=30)
            assert (reply.status, reply.version) == ("merged", version + 1)
        first._loop_task.cancel()
        restarted = Syncer(spec, epoch=1, restore=True)
        ready = await restarted.ready()
        restarted._loop_task.cancel()
        return reply, ready, restarted

    reply, ready, restarted = asyncio.run(run())
    assert ready["restored_from"] is None and ready["journaled"] == [0]
    assert ready["versions"] == [3] and ready["epoch"] == 1
    np.testing.assert_array_equal(restarted.core.slots[0].params["w"], reply.update.params["w"])


def test_the_journal_is_written_off_the_loop_and_the_merge_answered_once_durable(tmp_path,
                                                                                  monkeypatch):
    """The journal's file write is held on its thread: the syncer's loop still answers calls,
    the merge is not answered and the fragment not merged again; once the file is written the
    push gets its merge."""
    import asyncio
    import threading

    from islands.syncer import codec as codec_lib
    from islands.syncer.actor import Syncer, SyncerSpec

    started, release = threading.Event(), threading.Event()
    write = FragmentJournal.write

    def held_write(self, p, arrays, meta):
        started.set()
        assert release.wait(timeout=60)
        write(self, p, arrays, meta)

    monkeypatch.setattr(FragmentJournal, "write", held_write)
    codec = codec_lib.make_codec("none")
    spec = SyncerSpec(fragments=[{"w": np.ones(4, np.float32)}],
                      settings=SyncerSettings(outlier_norm_factor=None, grace_cap_s=0.0),
                      outer_kind="nesterov", outer_kwargs={}, codec_kind="none",
                      codec_block_size=64, checkpoint_dir=str(tmp_path / "syncer"))
    entry = tmp_path / "syncer" / "journal" / "fragment-0.npz"

    async def run():
        syncer = Syncer(spec)
        reg = await syncer.register("a", 0)
        drift = {"w": np.full(4, -0.25, np.float32)}
        reply = asyncio.ensure_future(syncer.push(Push(
            "a", 0, codec_lib.encode_tree(codec, drift), 0, reg["epoch"], 64, 2, step=2,
            tokens_done=128, session=reg["session"])))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)  # being written
        status = await syncer.status()            # the loop is free meanwhile
        held = (reply.done(), status.versions, entry.exists(), 0 in syncer.journal_pending)
        release.set()
        answer = await asyncio.wait_for(reply, timeout=60)
        syncer._loop_task.cancel()
        return held, answer, syncer

    held, answer, syncer = asyncio.run(run())
    assert held == (False, [1], False, True)   # merged in memory, neither written nor answered
    assert (answer.status, answer.version) == ("merged", 1)
    assert entry.exists() and syncer.journal_pending == {}
    fresh = build_one()
    assert FragmentJournal(str(tmp_path / "syncer")).replay(fresh) == [0]
    assert fresh.versions == (1,)
    np.testing.assert_array_equal(fresh.slots[0].params["w"], answer.update.params["w"])


def build_one():
    return SyncerCore([{"w": np.ones(4, np.float32)}], SyncerSettings(outlier_norm_factor=None),
                      outer.build("nesterov"), decode)


def test_the_snapshot_interval_defaults_follow_the_journal():
    from islands.orchestrator.build import snapshot_min_interval_s
    from islands.orchestrator.config import parse

    def syncer(**kw):
        return parse({"name": "j", "regions": {"a": {"learners": 1}}, "syncer": kw}).syncer

    assert snapshot_min_interval_s(syncer()) == 30.0                  # the journal holds merges
    assert snapshot_min_interval_s(syncer(journal=False)) == 0.0      # snapshots are all there is
    assert snapshot_min_interval_s(syncer(snapshot_min_interval_s=5)) == 5.0
    with pytest.raises(Exception, match="snapshot_min_interval_s"):
        syncer(snapshot_min_interval_s=-1)
