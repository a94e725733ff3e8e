"""Every refusal reason fires once, and a refused push leaves the global state bit-identical."""

import copy

import numpy as np
import optax
import pytest

from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.validate import REJECT_REASONS, Push, RejectReason


def decode(codes):
    return {k: np.asarray(v) for k, v in codes.items()}


@pytest.fixture
def core():
    frags = [{"w": np.arange(4, dtype=np.float32)}, {"v": np.ones((2, 2), np.float32)}]
    c = SyncerCore(frags, SyncerSettings(history_versions=3, max_staleness=1,
                                         outlier_norm_factor=10.0),
                   optax.sgd(1.0), decode, epoch=3)
    for name in ("a", "b", "c", "d"):
        c.register(name, 0)
    return c


def good_push(learner="a", fragment=0, base_version=0, scale=0.01, **kw):
    shape = (4,) if fragment == 0 else (2, 2)
    name = "w" if fragment == 0 else "v"
    fields = dict(learner=learner, fragment=fragment,
                  codes={name: np.full(shape, scale, np.float32)}, base_version=base_version,
                  epoch=3, c_tokens=64, c_steps=1)
    fields.update(kw)
    return Push(**fields)


def snapshot(core):
    return copy.deepcopy(([s.params for s in core.slots], [s.version for s in core.slots],
                          [dict(s.round) for s in core.slots],
                          [dict(s.history) for s in core.slots]))


def assert_unchanged(before, core):
    after = snapshot(core)
    for a, b in zip(before[0], after[0]):
        for k in a:
            assert a[k].tobytes() == b[k].tobytes()
    assert before[1] == after[1]
    assert [sorted(r) for r in before[2]] == [sorted(r) for r in after[2]]
    for a, b in zip(before[3], after[3]):
        assert a.keys() == b.keys()


def test_every_reason_fires_and_changes_nothing(core):
    # Three normal pushes of fragment 1 make its outlier baseline (median norm 0.02).
    for name in ("a", "b", "c"):
        assert core.accept_push(good_push(name, fragment=1), 0.0).ok
    core.merge(1)
    # Fragment 0: merge three times so version 0 leaves the 3-version history {1, 2, 3}.
    for _ in range(3):
        assert core.accept_push(good_push("a", base_version=core.versions[0]), 0.0).ok
        core.merge(0)
    assert core.accept_push(good_push("a", base_version=3), 0.0).ok  # a is in fragment 0's round

    bad = {
        RejectReason.STALE_EPOCH: good_push("b", base_version=3, epoch=2),
        RejectReason.UNKNOWN_LEARNER: good_push("zz", base_version=3),
        RejectReason.UNKNOWN_FRAGMENT: good_push("b", fragment=7, base_version=0),
        RejectReason.DUPLICATE: good_push("a", base_version=3),
        RejectReason.UNKNOWN_VERSION: good_push("b", base_version=0),
        RejectReason.BAD_SHAPE: good_push("b", base_version=3, codes={"w": np.zeros(5, np.float32)}),
        RejectReason.BAD_DTYPE: good_push("b", base_version=3, codes={"w": np.zeros(4, np.float64)}),
        RejectReason.NON_FINITE: good_push("b", base_version=3,
                                           codes={"w": np.array([0, np.nan, 0, 0], np.float32)}),
        RejectReason.OUTLIER_NORM: good_push("b", fragment=1, base_version=1, scale=5.0),
    }
    # Base 1 is still in the history, but staleness 3 − 1 = 2 exceeds max_staleness 1.
    bad[RejectReason.TOO_STALE] = good_push("b", base_version=1)
    bad[RejectReason.BAD_COUNTERS] = good_push("b", base_version=3, c_tokens=-1)
    core.register("e", 0, session="e's token")
    bad[RejectReason.BAD_SESSION] = good_push("e", base_version=3, session="forged")
    # BAD_MERGE and UNADOPTED refuse a whole merge at merge time (tests/unit/test_refusals.py,
    # tests/unit/test_participation.py), NOT_DURABLE the pushes of a merge whose journal entry
    # could not be written (tests/unit/test_syncer_answers.py).
    assert set(bad) == set(RejectReason) - {RejectReason.BAD_MERGE, RejectReason.UNADOPTED,
                                             RejectReason.NOT_DURABLE}
    assert set(REJECT_REASONS) == {r.value for r in RejectReason}

    for reason, push in bad.items():
        before = snapshot(core)
        verdict = core.accept_push(push, 1.0)
        assert not verdict.ok and verdict.reason == reason, (reason, verdict)
        assert verdict.detail  # the refusal says what was wrong
        assert_unchanged(before, core)
        assert core.rejected[reason] == 1
    # The accepted push is still there and merges normally afterwards.
    assert list(core.slots[0].round) == ["a"]
    assert core.merge(0).version == 4


def test_wrong_incarnation_is_refused(core):
    core.register("a", 1)
    verdict = core.accept_push(good_push("a", incarnation=0), 0.0)
    assert verdict.reason == RejectReason.UNKNOWN_LEARNER
    assert core.accept_push(good_push("a", incarnation=1), 0.0).ok


def test_forget_drops_unmerged_pushes_and_quorum(core):
    assert core.accept_push(good_push("a"), 5.0).ok
    assert core.slots[0].quorum_reached_at_s == 5.0
    dropped = core.forget("a")
    assert [p.learner for p in dropped] == ["a"]
    assert core.slots[0].round == {} and core.slots[0].quorum_reached_at_s is None
    assert core.accept_push(good_push("a"), 6.0).reason == RejectReason.UNKNOWN_LEARNER
