"""The typed seam between an owner loop and its learners and syncers (orchestrator/groups_api.py):
the Ray bodies implement the interfaces, and what they report is typed, not dicts."""

import dataclasses

from islands.learners.messages import Heartbeat
from islands.orchestrator import groups_api as api
from islands.orchestrator.groups_api import Incarnation
from islands.orchestrator.groups import LearnerGroups, SyncerShards


def test_the_ray_bodies_implement_the_interfaces():
    assert isinstance(LearnerGroups(), api.LearnerGroup)
    assert isinstance(SyncerShards(2), api.SyncerGroup)


def test_the_out_messages_are_frozen_dataclasses():
    for message in (api.RunEnded, api.SpareReady, api.SpareFailed, api.ShardEnded,
                    api.SyncerStatus):
        assert dataclasses.is_dataclass(message)
        assert message.__dataclass_params__.frozen


def test_a_run_says_how_it_ended_with_one_enum():
    assert not api.RunEnded("a:0", 1, {"step": 3}, None).crashed
    crashed = api.RunEnded("a:0", 1, None, "ValueError()", api.How.CRASHED)
    assert (crashed.crashed, crashed.preempted) == (True, False)


def test_a_syncer_status_reads_the_actors_answer_and_combines():
    one = api.SyncerStatus.from_dict({"epoch": 2, "versions": [3, 4], "merges": 7,
                                      "ledger": {"a:0": {"incarnation": 1}}, "new_key": 1})
    assert (one.epoch, list(one.versions), one.ledger["a:0"]["incarnation"]) == (2, [3, 4], 1)
    assert api.SyncerStatus.from_dict(None) == api.SyncerStatus()
    both = api.combined([one, None])
    assert (both.epoch, both.merges, [row["epoch"] for row in both.shards]) == (2, 7, [2])


def test_an_incarnation_keeps_its_heartbeat_typed_and_its_final_stats():
    inc = Incarnation(3, start_step=10)
    assert inc.counters() == {"step": 10}
    inc.beat = Heartbeat("a:0", 3, 1.0, "training", step=12, fates={"events": 1})
    inc.ended_with({"learner": "a:0", "incarnation": 3, "state": "stopped", "step": 15,
                    "not_a_beat_field": 1})
    assert (inc.beat.step, inc.beat.fates, inc.beat.state.value) == (15, {"events": 1}, "stopped")
    fresh = Incarnation(0, start_step=4)
    fresh.ended_with({"learner": "b:0", "incarnation": 0, "state": "stopped", "pushes": 2})
    assert (fresh.beat.learner, fresh.beat.step, fresh.beat.pushes) == ("b:0", 4, 2)
