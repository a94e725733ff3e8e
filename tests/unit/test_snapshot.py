"""Syncer snapshots round-trip through orbax: Θ, outer momentum, versions, ledger; epoch fences."""

import numpy as np

from islands.syncer import outer
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.state import SnapshotStore
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
