"""The learner's sender thread: a push it holds (its encode, the emulated WAN delay) is in flight,
so a drain never ends with it unsent."""

import threading
import time

import numpy as np
import pytest

from islands.learners.core import PushPlan
from islands.learners.unit import LearnerUnit, _Sender
from islands.syncer.validate import Push


class _Shard:
    """Where the sender hands pushes (the syncer handle's ``push.remote``): records them."""

    def __init__(self):
        self.sent = []
        self.push = self

    def remote(self, push):
        self.sent.append(push)
        return f"ref-{len(self.sent)}"


def _unit(shard) -> LearnerUnit:
    unit = object.__new__(LearnerUnit)
    unit.lock, unit.stats = threading.Lock(), {}
    unit.syncer_for = lambda p: shard
    return unit


def _plan(p=0):
    push = Push("a:0", p, {"w": np.zeros(2, np.float32)}, 0, 0, 64, 1, step=1, tokens_done=64)
    return PushPlan(push, 8, 0.0)


def test_a_push_in_the_senders_hand_is_not_idle_until_sent():
    shard = _Shard()
    sender = _Sender(_unit(shard), None)
    sender.start()
    try:
        assert sender.idle() and sender.unsent() == 0
        sender.send(time.time() + 0.5, _plan())   # half a second of emulated WAN delay
        deadline = time.time() + 5
        while not sender.queue.empty():           # taken off the queue: now in the hand
            assert time.time() < deadline
            time.sleep(0.005)
        assert not shard.sent
        assert not sender.idle() and sender.unsent() == 1   # in flight, though the queue is empty
        while not sender.idle():
            assert time.time() < deadline
            time.sleep(0.005)
        # Idle only once it is sent and its future is kept: a drain then waits for its answer.
        assert len(shard.sent) == 1 and [push for _, push in sender.pending] == shard.sent
    finally:
        sender.close()


def test_a_push_that_could_not_be_sent_leaves_the_hand_as_failed():
    unit = _unit(None)

    def dead(p):
        raise RuntimeError("the syncer handle is dead")

    unit.syncer_for = dead
    sender = _Sender(unit, None)
    sender.start()
    try:
        sender.send(time.time(), _plan(1))
        deadline = time.time() + 5
        while not sender.idle():
            assert time.time() < deadline
            time.sleep(0.005)
        assert [push.fragment for push in sender.take_failed()] == [1] and not sender.pending
    finally:
        sender.close()


def test_a_sent_push_counts_once_in_flight_while_it_leaves_the_hand():
    """Between the push's future joining ``pending`` and its task being marked done, the old
    count (``len(pending) + unsent()``) said 2 for one push."""
    import queue as queue_lib

    reached, gate = threading.Event(), threading.Event()

    class Gated(queue_lib.PriorityQueue):   # holds the sender right before its task_done
        def task_done(self):
            reached.set()
            assert gate.wait(10)
            super().task_done()

    shard = _Shard()
    sender = _Sender(_unit(shard), None)
    sender.queue = Gated()
    sender.start()
    try:
        sender.send(time.time(), _plan())
        assert reached.wait(10) and len(shard.sent) == 1   # sent; its task not yet done
        seen = []
        reader = threading.Thread(target=lambda: seen.append(sender.in_flight()))
        reader.start()
        gate.set()
        reader.join(10)
        assert seen == [1], seen
        assert sender.in_flight() == 1 and sender.idle() and len(sender.pending) == 1
    finally:
        gate.set()
        sender.close()


# -- answers to pushes a re-registration voided -----------------------------------------------------
def _learner():
    """The learner's reply handling over a real LearnerCore (two fragments, one syncer shard),
    registered with the syncer's epoch 1 after a restart; ``reregistered`` records what a new
    registration would be asked for."""
    import jax.numpy as jnp

    from islands.syncer import fragments
    from islands.learners.core import LearnerCore
    from islands.syncer import codec as codec_lib

    params = {"a": jnp.zeros(3), "b": jnp.ones(2)}
    codec = codec_lib.make_codec("none")
    core = LearnerCore("r:0", params, None, fragments.partition(params, 2), [0, 0],
                       codec_lib.error_feedback(codec), codec_lib.tree_wire_bytes,
                       lambda c: codec_lib.decode_tree(codec, c), overlap_steps=1)
    unit = object.__new__(LearnerUnit)
    unit.core, unit.gang, unit.lock = core, None, threading.Lock()
    unit.stats = {"refused": 0, "wire_bytes_down": 0}
    unit.epochs, unit.shard_of = [0], {0: 0, 1: 0}
    unit.registering, unit.registered = set(), []   # (the sharded syncer's registrations)
    unit.done = threading.Event()
    unit.reregistered = []
    unit._reregister = unit.reregistered.append
    return unit, core


def test_a_sharded_learner_registers_with_a_restarting_shard_off_its_training_thread():
    """With several syncer shards, a lost push's re-registration runs on a thread of its own:
    the training loop's call returns before the shard answers (it waited up to a second per
    lost push, and pushed nothing to the other shards meanwhile), a second lost push starts no
    second registration, and the loop's next collection applies the answer: that shard's
    fragment gets the new epoch and base, the other shard's fragment is untouched."""
    import types

    unit, core = _learner()
    del unit._reregister                      # the real method, not the recorder
    unit.spec = types.SimpleNamespace(syncer_shards=2, learner="r:0", incarnation=0)
    unit.epochs, unit.shard_of, unit.epoch = [0, 0], {0: 0, 1: 1}, 0
    unit.stats["reregistered"] = 0
    unit.stop_event, unit.done = threading.Event(), threading.Event()
    unit.syncers = ["shard 0", "shard 1, dead"]
    gate, calls = threading.Event(), []
    restored = {k: np.full_like(np.asarray(v), 2.0) for k, v in core.tracks[1].base.items()}

    def register_with(shard, deadline):   # the restarted shard answers once set
        calls.append((shard, deadline))
        assert gate.wait(10)
        return ({"epoch": 1, "fragments": [restored], "versions": [4], "session": "s1",
                 "fragment_ids": [1]}, "shard 1, restarted")

    unit._register_with = register_with
    base0 = {k: np.asarray(v).copy() for k, v in core.tracks[0].base.items()}
    unit._reregister(1)
    unit._reregister(1)                        # another lost push to the same shard
    assert unit.registered == [] and unit.registering == {1}   # returned before the answer
    gate.set()
    deadline = time.monotonic() + 10
    while not unit.registered:
        assert time.monotonic() < deadline, "the registration thread never answered"
        time.sleep(0.01)
    assert calls == [(1, None)]                # one registration, trying until it answers
    # Nothing applied off the training thread: not the bases, not the epoch, not the handle
    # (the old epoch's pushes would go to the new shard, refused as stale).
    assert core.tracks[1].base_version == 0 and unit.syncers[1] == "shard 1, dead"
    unit._collect_replies(_Sender(unit, None), [])
    assert unit.epochs == [0, 1] and unit.registering == set() and unit.stats["reregistered"] == 1
    assert unit.syncers == ["shard 0", "shard 1, restarted"]
    assert core.tracks[1].base_version == 4
    assert all(np.array_equal(np.asarray(v), restored[k])
               for k, v in core.tracks[1].base.items())
    assert core.tracks[0].base_version == 0
    assert all(np.array_equal(np.asarray(v), base0[k]) for k, v in core.tracks[0].base.items())


def test_the_loss_of_a_push_a_reregistration_voided_leaves_the_newer_push_alone():
    """After a syncer restart the learner re-registered (epoch 1) and pushed fragment 0 again;
    its older push of fragment 0 (epoch 0) then fails to send. Acting on that failure reset the
    fragment's track while the newer push was out, so it was pushed twice (its drift twice, and
    at the syncer a second push of the fragment accepted while the first was being merged)."""
    import numpy as np

    unit, core = _learner()
    core.record_step(8, 0.1)
    old = core.make_push(0, epoch=0).push                 # to the syncer that died
    core.reregistered([{k: np.asarray(v) for k, v in t.base.items()} for t in core.tracks],
                      [0, 0], "s1")
    unit.epochs = [1]
    core.record_step(8, 0.1)
    new = core.make_push(0, epoch=1).push                 # to the restarted one
    sender = _Sender(unit, None)
    sender.failed = [old]
    unit._collect_replies(sender, [])
    assert core.tracks[0].in_flight_since_step == new.step and unit.reregistered == []
    assert 0 not in core.due(2, 1)                        # not pushed again while out
    # The newer push's own loss is acted on: it goes again after a registration.
    sender.failed = [new]
    unit._collect_replies(sender, [])
    assert core.tracks[0].in_flight_since_step is None and unit.reregistered == [0]


def _restarted_syncer(unit, core):
    """What ``_reregister`` does once the restarted syncer answered: its epoch, new bases."""
    import numpy as np

    def reregister(shard):
        unit.reregistered.append(shard)
        unit.epochs[shard] = 1
        core.reregistered([{k: np.asarray(v) for k, v in t.base.items()} for t in core.tracks],
                          [0, 0], "s1")
    return reregister


@pytest.mark.parametrize("merge_first", [False, True])
def test_a_merge_answered_by_a_syncer_that_then_died_is_not_adopted_after_reregistering(
        merge_first):
    """The syncer answers fragment 0's merge and dies; fragment 1's push fails with it, and the
    learner re-registers (epoch 1), which returns fragment 0's push to its drift. The old merge
    (answered in the same collection, or arrived earlier and waiting out its downlink delay) is
    void: adopted later, it would be taken for the answer to fragment 0's next push."""
    import numpy as np

    from islands.syncer.actor import Reply, ReplyStatus

    unit, core = _learner()
    unit.arrival_s = lambda sent_s, nbytes: sent_s + (1.0 if merge_first else 0.0)
    unit._reregister = _restarted_syncer(unit, core)
    core.record_step(8, 0.1)
    a = core.make_push(0, epoch=0).push
    b = core.make_push(1, epoch=0).push
    merged = Reply(ReplyStatus.MERGED, 0, 0, params={"a": np.full(3, 5.0, np.float32)},
                   version=1)
    sender = _Sender(unit, None)
    arrived = []
    if merge_first:                       # arrived in an earlier collection, not yet usable
        unit._answered(a, merged, arrived)
        assert len(arrived) == 1
    sender.failed = [b]                   # this collection: b's loss, then a's merge
    unit._collect_replies(sender, arrived)
    if not merge_first:
        unit._answered(a, merged, arrived)
    assert unit.reregistered == [0] and unit.epochs == [1]
    unit._offer_arrived(arrived, time.time() + 10.0)
    assert arrived == [] and core.tracks[0].reply is None
    # Fragment 0's next push (epoch 1) is out; nothing adopts the old merge for it.
    core.record_step(8, 0.1)
    core.make_push(0, epoch=1)
    core.record_step(8, 0.1)
    assert core.adopt_ready() == [] and core.tracks[0].base_version == 0
    assert core.tracks[0].in_flight_since_step is not None and core.fates.balanced()
