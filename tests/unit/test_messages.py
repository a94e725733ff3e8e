"""What crosses Ray between learners, the controller and the syncer is typed: heartbeats with a
state enum, replies with a status enum; the dict and string forms (the link's wire) convert at
the boundary or are refused naming what is wrong."""

import pytest

from islands.learners.messages import Heartbeat, LearnerState, beat_dict, known_stats
from islands.syncer.actor import Reply, ReplyStatus


def test_a_heartbeat_round_trips_through_its_dict():
    beat = Heartbeat("eu:0", 2, 1.5, "training", node_id="n1", step=7, tokens_done=896,
                     step_time_s=0.05, fates={"0": [1, 2]})
    assert beat.state is LearnerState.TRAINING and beat.training
    plain = beat.as_dict()
    assert plain["state"] == "training" and type(plain["state"]) is str
    assert Heartbeat.from_dict(plain) == beat
    assert Heartbeat.of(plain) == beat and Heartbeat.of(beat) is beat
    assert beat_dict(beat) == plain and beat_dict(plain) == plain


def test_a_newer_agents_extra_keys_are_ignored_but_a_bad_state_is_refused_by_learner():
    beat = Heartbeat.from_dict({"learner": "eu:0", "incarnation": 0, "t": 0.0,
                                "state": "paused", "gpu_temperature": 61})
    assert beat.state is LearnerState.PAUSED and not beat.training
    with pytest.raises(ValueError, match="heartbeat from 'eu:0' refused: 'sleeping' is not a "
                                         "valid LearnerState"):
        Heartbeat.from_dict({"learner": "eu:0", "incarnation": 0, "t": 0.0,
                             "state": "sleeping"})
    with pytest.raises(ValueError, match="heartbeat from 'eu:1' refused: .*incarnation"):
        Heartbeat.from_dict({"learner": "eu:1", "t": 0.0, "state": "training"})


def test_known_stats_keeps_only_heartbeat_fields():
    assert known_stats({"step": 3, "loss": 1.0, "scratch": 9}) == {"step": 3, "loss": 1.0}


def test_reply_status_is_an_enum_and_a_wire_string_converts():
    reply = Reply("merged", 1, 0, version=4)
    assert reply.status is ReplyStatus.MERGED and reply.status == "merged"
    assert Reply(ReplyStatus.DROPPED, -1, 0).status.value == "dropped"
    with pytest.raises(ValueError, match="'merge' is not a valid ReplyStatus"):
        Reply("merge", 1, 0)


def test_enums_read_as_their_values_in_strings():
    """Counters and labels are built with f-strings (``pushes_merged``)."""
    assert f"pushes_{ReplyStatus.MERGED}" == "pushes_merged"
    assert f"{LearnerState.TRAINING}" == "training" == str(LearnerState.TRAINING)
