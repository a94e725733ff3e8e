"""A remote region's planned preemption: its agent (the controller in region mode, its region
local) reads its own cluster's draining nodes as the home does (``groups.cluster_observation``), hands
its learners over, and the home mirrors the handover as one (no failure, no crash books).

The agent's fleet is built as the agent builds it (``region_config``, ``build.fleet_settings``,
``RegionRole.fleet_settings``); its transitions go through the role's ``recorded`` as the
controller sends them, and its ``stepped`` report's rows reach the home's fleet."""

import inspect

from islands.orchestrator import build
from islands.orchestrator import fleet as F
from islands.orchestrator.config import JobConfig
from islands.orchestrator.controller import Controller
from islands.orchestrator.region_agent import RegionRole, region_config

JOB = {"name": "j", "quorum": {"min_learners": 1}, "link": {"port": 50051},
       "regions": {"home": {"learners": 1}, "far": {"learners": 2, "remote": True}}}


def agent_step(role, fleet, observations, now):
    result = F.step(fleet, observations, now)
    for t in result.transitions:
        role.recorded(t)
    return result


def report(role, fleet, beat=True):
    """The rows the agent's ``stepped`` sends home, as the home's observations."""
    return [F.RemoteReport(s.learner, "far", s.incarnation, s.state.value, s.shard,
                           last_cause=role.last_cause.get(s.learner, ""), beat=beat)
            for s in fleet.slots.values()]


def test_the_agent_reads_its_own_clusters_drains():
    # The same owner loop: the draining table of the cluster it is connected to (its own).
    from islands.orchestrator.groups import cluster_observation

    assert "cluster_observation(" in inspect.getsource(Controller._owner_loop)
    assert "draining_nodes(" in inspect.getsource(cluster_observation)


def test_a_remote_regions_handover_is_drained_by_its_agent_and_mirrored_home_as_one():
    role = RegionRole("far", 1, 3)
    settings = role.fleet_settings(build.fleet_settings(region_config(JOB, "far")))
    assert not settings.regions["far"].remote   # its learners are the agent's own
    fleet = F.step(F.initial(settings), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat("far:0", 0, True, 0.1, node_id="n1"),
                           F.Beat("far:1", 0, True, 0.1, node_id="n2")], 1.0).fleet
    home = F.initial(build.fleet_settings(JobConfig.model_validate(JOB)))
    home = F.step(home, [F.Beat("home:0", 0, True, 0.1)] + report(role, fleet), 1.0).fleet
    assert home.slots["far:1"].state == F.SlotState.TRAINING

    # Ray drains n2 in the region's cluster: the agent drains far:1 ...
    notice = agent_step(role, fleet, [F.Cluster({"far": 2}, frozenset({"n1", "n2"}),
                                                {"n2": None})], 2.0)
    assert F.DrainLearner("far:1") in notice.actions
    home = F.step(home, [F.Beat("home:0", 0, True, 0.1)] + report(role, notice.fleet), 2.0).fleet
    assert home.slots["far:1"].state == F.SlotState.DRAINING
    # ... hands it over once out (no place yet: awaiting placement), spending no budget ...
    out = agent_step(role, notice.fleet, [F.Beat("far:0", 0, True, 0.1),
                                          F.RunEnded("far:1", 0)], 3.0)
    assert out.fleet.slots["far:1"].state == F.SlotState.AWAITING_PLACEMENT
    assert role.last_cause["far:1"] == "drained"
    # ... and the home settles the old incarnation as drained (not a crash), fails nothing,
    # and never finds the unplaced one hung.
    mirrored = F.step(home, [F.Beat("home:0", 0, True, 0.1)] + report(role, out.fleet), 3.0)
    assert F.Forget("far:1", 0, "drained") in mirrored.actions
    assert "learner_failed" not in [t.name for t in mirrored.transitions]
    assert mirrored.fleet.slots["far:1"].state == F.SlotState.AWAITING_PLACEMENT
    later = F.step(mirrored.fleet, [F.Beat("home:0", 0, True, 0.1)]
                   + report(role, out.fleet, beat=False), 600.0)
    assert [t.name for t in later.transitions if t.learner == "far:1"] == []
    assert later.fleet.slots["far:1"].restarts == ()


def test_a_remote_handover_ended_at_its_drain_deadline_is_settled_home_as_such():
    role = RegionRole("far", 1, 3)
    settings = role.fleet_settings(build.fleet_settings(region_config(JOB, "far")))
    fleet = F.step(F.initial(settings), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat("far:0", 0, True, 0.1, node_id="n1"),
                           F.Beat("far:1", 0, True, 0.1, node_id="n2")], 1.0).fleet
    fleet = agent_step(role, fleet, [F.Cluster({"far": 2}, frozenset({"n1", "n2"}),
                                               {"n2": None})], 2.0).fleet
    limit = settings.drain_timeout_s
    ended = agent_step(role, fleet, [F.Beat("far:0", 0, True, 0.1)], 2.0 + limit)
    assert [t.name for t in ended.transitions][:2] == ["learner_drain_timeout",
                                                       "learner_restart_scheduled"]
    assert role.last_cause["far:1"] == F.DRAIN_TIMEOUT


def test_a_remote_drain_ended_at_its_deadline_is_booked_home_under_its_own_cause():
    """A plain drain (a scale-down) past its deadline in the region retires its learner; the
    agent reports the retirement's cause as the word ``drain_timeout`` (once it read
    "drain_timeout:" off the reason's text, a cause nobody knows), and the home settles it so:
    its Forget's reason, and no learner failure."""
    role = RegionRole("far", 1, 3)
    settings = role.fleet_settings(build.fleet_settings(region_config(JOB, "far")))
    fleet = F.step(F.initial(settings), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat("far:0", 0, True, 0.1), F.Beat("far:1", 0, True, 0.1)],
                   1.0).fleet
    home = F.initial(build.fleet_settings(JobConfig.model_validate(JOB)))
    home = F.step(home, [F.Beat("home:0", 0, True, 0.1)] + report(role, fleet), 1.0).fleet
    fleet = agent_step(role, fleet, [F.Scale("far", 1)], 2.0).fleet
    assert fleet.slots["far:1"].state == F.SlotState.DRAINING
    ended = agent_step(role, fleet, [F.Beat("far:0", 0, True, 0.1)],
                       2.0 + settings.drain_timeout_s)
    assert [t.name for t in ended.transitions][:2] == ["learner_drain_timeout",
                                                       "learner_retired"]
    assert role.last_cause["far:1"] == F.DRAIN_TIMEOUT
    mirrored = F.step(home, [F.Beat("home:0", 0, True, 0.1)] + report(role, ended.fleet),
                      2.0 + settings.drain_timeout_s)
    assert F.Forget("far:1", 0, F.DRAIN_TIMEOUT) in mirrored.actions
    assert "learner_failed" not in [t.name for t in mirrored.transitions]
