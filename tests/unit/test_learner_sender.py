"""The learner's sender thread: a push it holds (its encode, the emulated WAN delay) is in flight,
so a drain never ends with it unsent."""

import threading
import time

import numpy as np

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
