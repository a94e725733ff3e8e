"""Operator commands as fleet observations (orchestrator/commands.py): a bad argument raises,
naming it, before anything reaches the controller's inbox; a good one becomes the fleet's own
command with the reply its caller gets."""

import pytest

from islands.orchestrator import commands
from islands.orchestrator import fleet as F
from islands.orchestrator.chaos import HOME_TARGET, FaultKind


def test_a_kill_targets_a_learner_with_its_mode_or_a_syncer_shard():
    obs, reply = commands.chaos_kill("a:0", "ray_kill", now=3.0)
    assert (obs.fault.kind, obs.fault.at_s, obs.mode, reply) == (
        FaultKind.KILL, 3.0, "ray_kill", "killed a:0 (ray_kill)")
    obs, reply = commands.chaos_kill("syncer:1", "ray_kill", now=3.0)
    assert (obs.fault.kind, obs.fault.target, reply) == (FaultKind.SYNCER_KILL, "syncer:1",
                                                         "killed syncer:1")
    for target in ("a:0", "syncer"):
        with pytest.raises(ValueError, match="unknown kill mode 'nuke'"):
            commands.chaos_kill(target, "nuke", now=3.0)


def test_bad_durations_and_a_degraded_home_are_refused():
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        commands.chaos_hang("a:0", 0)
    with pytest.raises(ValueError, match="deadline_s must be >= 0"):
        commands.drain_node_reply("n1", -1.0)
    with pytest.raises(ValueError, match="the home can be partitioned"):
        commands.chaos_network(HOME_TARGET, 5.0, 10.0, None, False, 0.0, now=0.0)


def test_each_command_is_the_fleets_own_observation_with_its_reply():
    assert commands.scale("r", 3) == (F.Scale("r", 3), "r: 3 learners")
    assert commands.drain("r:0") == (F.Drain("r:0"), "draining r:0")
    assert commands.pause(False, "console") == (F.PauseJob(False, "console"), "resumed")
    assert commands.clear_misconfigured(None, "operator")[1] == "cleared every marked node"
    assert commands.chaos_hang("r:0", 2.0) == (F.HangCommand("r:0", 2.0), "hung r:0 for 2.0s")
    assert commands.drain_node_reply("n1", 30.0) == "draining node n1 (deadline in 30s)"
    obs, reply = commands.chaos_network(HOME_TARGET, 5.0, 0.0, None, True, 0.0, now=1.0)
    assert obs.fault.kind == FaultKind.PARTITION and reply.startswith("partition of the home")
    obs, reply = commands.chaos_network("r", 5.0, 20.0, 1.0, False, 0.1, now=1.0)
    assert (obs.fault.extra_latency_ms, obs.fault.loss_rate, reply) == (
        20.0, 0.1, "network on r for 5.0s")
