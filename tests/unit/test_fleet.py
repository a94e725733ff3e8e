"""The fleet state machine, stepped by hand: observations in, actions and named transitions out.

No Ray and no sleeps: clocks are plain numbers, backdated or advanced as each test needs. Every
named transition of ``fleet.py`` has a test here (``test_every_transition_name_is_tested``).
"""

import dataclasses
import re
from pathlib import Path

import pytest

from islands.faults import Fault, FaultKind
from islands.orchestrator import fleet as F
from islands.orchestrator.health import Cause, RestartPolicy
from islands.orchestrator.fleet import SlotState

POLICY = RestartPolicy(backoff_initial_s=0.5, backoff_multiplier=2.0, backoff_max_s=30.0,
                       max_crash_restarts=2, max_preemption_restarts=None,
                       crash_loop_after=None)   # budgets here; crash loops have their own tests


def region_plan(*args, prestart=False, **kwargs) -> F.RegionPlan:
    """A region's plan as these hand-worked transitions have it: a failed learner's process
    is prestarted only where a test asks (the service's default prestarts every one)."""
    return F.RegionPlan(*args, prestart=prestart, **kwargs)


def settings(**overrides) -> F.FleetSettings:
    # spare_wait_s 0 unless a test asks (the service's default waits 10 s for a preparing spare)
    base = dict(regions={"a": region_plan(2, 3), "b": region_plan(1, 2, (0.5,))},
                min_learners=1, policy=POLICY, heartbeat_timeout_s=10.0, startup_timeout_s=60.0,
                straggler_factor=4.0, spare_wait_s=0.0)
    base.update(overrides)
    return F.FleetSettings(**base)


def names(result):
    return [t.name for t in result.transitions]


def kinds(result):
    return [type(a).__name__ for a in result.actions]


def training(s=None, now=1.0, step_time=0.1):
    """A fleet whose three learners were launched at t=0 and beat "training" at ``now``, each
    having adopted a merged fragment (so each may be a peer donor)."""
    fleet = F.step(F.initial(s or settings()), [], 0.0).fleet
    beats = [F.Beat(n, 0, True, step_time, node_id="n1", ready_at_s=now, adopted=True)
             for n in fleet.slots]
    return F.step(fleet, beats, now).fleet


def states(fleet):
    return {n: s.state.value for n, s in fleet.slots.items()}


def test_initial_slots_are_pending_then_launched_with_their_shards():
    fleet = F.initial(settings())
    assert states(fleet) == {"a:0": "pending", "a:1": "pending", "b:0": "pending"}
    assert fleet.slots["b:0"].speed_factor == 0.5
    result = F.step(fleet, [], 0.0)
    assert names(result) == ["learner_launched"] * 3
    launches = result.actions
    assert [(a.learner, a.shard, a.num_shards, a.incarnation, a.start_step) for a in launches] == [
        ("a:0", 0, 3, 0, 0), ("a:1", 1, 3, 0, 0), ("b:0", 2, 3, 0, 0)]
    assert set(states(result.fleet).values()) == {"starting"}


def test_ready_on_the_first_training_beat_and_old_incarnations_are_ignored():
    fleet = F.step(F.initial(settings()), [], 0.0).fleet
    result = F.step(fleet, [F.Beat("a:0", 0, False)], 1.0)  # alive, still compiling
    assert names(result) == [] and result.fleet.slots["a:0"].state == SlotState.STARTING
    result = F.step(result.fleet, [F.Beat("a:0", 0, True, 0.1)], 2.0)
    assert names(result) == ["learner_ready"]
    assert result.fleet.slots["a:0"].state == SlotState.TRAINING
    ghost = F.step(result.fleet, [F.Beat("a:0", 7, True)], 3.0)
    assert ghost.fleet.slots["a:0"].last_beat_s == 2.0  # a beat from another incarnation


def test_a_crash_restarts_after_the_backoff_with_a_same_region_peer_and_the_applied_step():
    fleet = training()
    fleet = F.step(fleet, [F.Applied({"a:1": (0, 12, 4096)})], 2.0).fleet
    failed = F.step(fleet, [F.RunEnded("a:1", 0, "actor died")], 5.0)
    assert names(failed) == ["learner_failed", "learner_restart_scheduled"]
    assert kinds(failed) == ["Kill", "Forget"]  # bury it, drop its unmerged pushes
    scheduled = failed.transitions[1].fields
    assert scheduled["cause"] == "crash" and scheduled["delay_s"] == 0.5  # first backoff 0.5 s
    slot = failed.fleet.slots["a:1"]
    assert slot.state == SlotState.RESTARTING and slot.restart_at_s == 5.5
    assert slot.restart_counts == {Cause.CRASH: 1}
    early = F.step(failed.fleet, [], 5.4999)
    assert names(early) == []
    due = F.step(failed.fleet, [], 5.5)
    assert names(due) == ["learner_restarted"]
    (launch,) = due.actions
    assert (launch.learner, launch.incarnation, launch.peer, launch.start_step) == (
        "a:1", 1, "a:0", 12)


def test_backoff_doubles_per_restart_and_the_crash_budget_ends_in_failed():
    fleet = training(settings(heartbeat_timeout_s=1e9))
    delays, now = [], 2.0
    for incarnation in range(2):
        result = F.step(fleet, [F.RunEnded("a:0", incarnation, "died")], now)
        delays.append(result.transitions[1].fields["delay_s"])
        fleet = F.step(result.fleet, [], now + 100).fleet  # relaunched
        now += 200
    assert delays == [0.5, 1.0]  # 0.5·2^0, 0.5·2^1
    result = F.step(fleet, [F.RunEnded("a:0", 2, "died")], now)
    assert names(result) == ["learner_failed", "learner_retired"]
    assert "crash budget of 2 spent" in result.transitions[1].fields["reason"]
    assert result.fleet.slots["a:0"].state == SlotState.FAILED


def test_a_learner_that_trained_healthily_starts_its_budget_and_backoff_over():
    """RestartPolicy.reset_after_s: seven failures of a:0, each after 10 s of training (the
    reset), never spend a budget of 2 and always wait the first backoff, 0.5 s; the lifetime
    count still says 7. Then three failures each 1 s after it trained (a crash loop) spend the
    budget: the third retires it."""
    policy = dataclasses.replace(POLICY, max_crash_restarts=2, reset_after_s=10.0)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))   # a:0 trains since 1.0
    now, incarnation, delays = 1.0, 0, []

    def fail_after(fleet, trained_s):
        nonlocal now, incarnation
        now += trained_s   # its last beat then (the failure time the fleet knows)
        fleet = F.step(fleet, [F.Beat("a:0", incarnation, True)], now).fleet
        result = F.step(fleet, [F.RunEnded("a:0", incarnation, "died")], now)
        if result.fleet.slots["a:0"].state == SlotState.FAILED:
            return result
        delays.append(result.transitions[1].fields["delay_s"])
        now += 1.0                                          # past any backoff here
        fleet = F.step(result.fleet, [], now).fleet         # relaunched
        incarnation += 1
        return F.step(fleet, [F.Beat("a:0", incarnation, True)], now)  # trains from now

    for _ in range(7):
        fleet = fail_after(fleet, 10.0).fleet
    assert delays == [0.5] * 7
    slot = fleet.slots["a:0"]
    assert slot.restart_counts == {Cause.CRASH: 7} and dict(slot.counted) == {Cause.CRASH: 1}
    fleet = fail_after(fleet, 1.0).fleet       # the counted ones go on: 2 of 2, backoff 1.0
    assert delays[-1] == 1.0
    result = fail_after(fleet, 1.0)
    assert names(result) == ["learner_failed", "learner_retired"]
    assert "crash budget of 2 spent" in result.transitions[1].fields["reason"]


def test_preemption_uses_its_own_budget_node_gone_or_platform_says_so():
    fleet = F.step(training(), [F.Cluster({"a": 3, "b": 2}, frozenset({"n2"}))], 2.0).fleet
    result = F.step(fleet, [F.RunEnded("a:0", 0, "actor died")], 3.0)  # its node n1 is gone
    assert result.transitions[0].fields["cause"] == "preemption"
    result = F.step(training(), [F.RunEnded("a:0", 0, "x", preempted=True)], 3.0)
    assert result.transitions[0].fields["cause"] == "preemption"
    assert result.fleet.slots["a:0"].restart_counts == {Cause.PREEMPTION: 1}


def test_a_loop_that_raised_is_a_crash_even_when_the_node_is_gone():
    fleet = F.step(training(), [F.Cluster({"a": 3}, frozenset())], 2.0).fleet
    result = F.step(fleet, [F.RunEnded("a:0", 0, "ValueError()", crashed=True)], 3.0)
    assert result.transitions[0].fields["cause"] == "crash"


def test_hang_detected_after_the_timeout_backdated_clock():
    fleet = training(now=1.0)
    assert names(F.step(fleet, [], 11.0)) == []  # exactly the timeout: not yet
    result = F.step(fleet, [], 11.01)
    assert names(result)[:3] == ["learner_unhealthy", "learner_failed",
                                 "learner_restart_scheduled"]
    assert {t.fields["cause"] for t in result.transitions if t.name == "learner_unhealthy"} == {
        "hang"}
    assert kinds(result)[:2] == ["Kill", "Forget"]


def test_a_learner_that_never_beats_hangs_after_the_startup_timeout():
    fleet = F.step(F.initial(settings()), [], 0.0).fleet
    assert names(F.step(fleet, [], 60.0)) == []
    result = F.step(fleet, [], 60.5)
    assert names(result).count("learner_unhealthy") == 3


def unhealthy(result):
    return [(t.learner, t.fields["cause"]) for t in result.transitions
            if t.name == "learner_unhealthy"]


def test_straggler_against_its_peers_for_a_window_but_not_a_slow_by_design_learner():
    s = settings(regions={"a": region_plan(3, 3), "b": region_plan(1, 1, (0.5,))},
                 straggler_window_s=30.0)
    fleet = F.step(F.initial(s), [], 0.0).fleet
    beats = [F.Beat("a:0", 0, True, 0.1), F.Beat("a:1", 0, True, 0.1),
             F.Beat("a:2", 0, True, 0.41), F.Beat("b:0", 0, True, 0.9)]
    first = F.step(fleet, beats, 1.0)
    # Slow for a moment is not a verdict: the window starts now.
    assert unhealthy(first) == [] and first.fleet.slots["a:2"].slow_since_s == 1.0
    keep = [F.Beat(b.learner, 0, True, None) for b in beats]   # beats without a new pace
    early = F.step(first.fleet, keep, 30.9)
    assert unhealthy(early) == []
    result = F.step(early.fleet, keep, 31.0)
    # a:2 at 0.41 s > 4 × median(0.1, 0.1) for 30 s; b:0 is slower still but runs at speed 0.5
    # on purpose.
    assert unhealthy(result) == [("a:2", "straggler")]


def test_a_learner_fast_again_within_the_window_starts_the_window_over():
    s = settings(regions={"a": region_plan(3, 3)}, straggler_window_s=10.0)
    fleet = F.step(F.initial(s), [], 0.0).fleet
    pace = lambda t2: [F.Beat("a:0", 0, True, 0.1), F.Beat("a:1", 0, True, 0.1),  # noqa: E731
                       F.Beat("a:2", 0, True, t2)]
    fleet = F.step(fleet, pace(0.5), 1.0).fleet
    fleet = F.step(fleet, pace(0.1), 8.0).fleet
    assert fleet.slots["a:2"].slow_since_s is None
    fleet = F.step(fleet, pace(0.5), 9.0).fleet
    assert unhealthy(F.step(fleet, pace(0.5), 18.0)) == []        # 9 s slow, not 10
    assert unhealthy(F.step(fleet, pace(0.5), 19.0)) == [("a:2", "straggler")]


def test_a_straggler_restarted_once_and_slow_again_trains_on_and_is_never_retired():
    """The loop seen in the README demo: each new incarnation was judged by its predecessor's
    step time at the moment it became ready, until the crash budget retired the learner."""
    policy = RestartPolicy(backoff_initial_s=0.5, backoff_multiplier=2.0, backoff_max_s=30.0,
                           max_crash_restarts=1)
    s = settings(regions={"a": region_plan(3, 3)}, policy=policy, straggler_window_s=5.0)
    fleet = F.step(F.initial(s), [], 0.0).fleet
    fast = [F.Beat("a:0", 0, True, 0.1), F.Beat("a:1", 0, True, 0.1)]
    fleet = F.step(fleet, fast + [F.Beat("a:2", 0, True, 0.5)], 1.0).fleet
    result = F.step(fleet, fast + [F.Beat("a:2", 0, True, 0.5)], 6.0)
    assert unhealthy(result) == [("a:2", "straggler")]
    fleet = F.step(result.fleet, [], 7.0).fleet                   # the restart is due (0.5 s)
    assert fleet.slots["a:2"].incarnation == 1
    assert fleet.slots["a:2"].step_time_s is None                 # its predecessor's pace is gone
    # Ready, with no pace of its own yet (its first step is not a pace): not judged.
    ready = F.step(fleet, fast + [F.Beat("a:2", 1, True, None)], 8.0)
    assert unhealthy(ready) == [] and ready.fleet.slots["a:2"].state == SlotState.TRAINING
    fleet = ready.fleet
    for t in (9.0, 12.0, 15.0, 60.0, 600.0):                     # as slow again, for ever
        result = F.step(fleet, fast + [F.Beat("a:2", 1, True, 0.5)], t)
        assert unhealthy(result) == [], t
        fleet = result.fleet
        if t == 15.0:
            assert names(result) == ["learner_slow_tolerated"]
    slot = fleet.slots["a:2"]
    assert slot.state == SlotState.TRAINING and slot.incarnation == 1
    assert slot.slow_tolerated == 1 and slot.restart_counts == {Cause.STRAGGLER: 1}
    # The one straggler restart spent nothing of the crash budget (1): a crash still restarts.
    crashed = F.step(fleet, [F.RunEnded("a:2", 1, "boom", crashed=True)], 601.0)
    assert "learner_restart_scheduled" in names(crashed)


def test_millisecond_steps_and_a_region_of_two_are_not_stragglers():
    s = settings(regions={"a": region_plan(3, 3), "b": region_plan(2, 2)},
                 straggler_window_s=0.0, straggler_min_excess_s=0.05)
    fleet = F.step(F.initial(s), [], 0.0).fleet
    # a:2 at 5× its peers' 2 ms: 8 ms above them is timing noise, not a slow machine. b's pair
    # is 5× slower than region a, but a region is its own hardware and a pair has no median.
    beats = [F.Beat("a:0", 0, True, 0.002), F.Beat("a:1", 0, True, 0.002),
             F.Beat("a:2", 0, True, 0.010), F.Beat("b:0", 0, True, 0.5),
             F.Beat("b:1", 0, True, 0.5)]
    fleet = F.step(fleet, beats, 1.0).fleet
    assert unhealthy(F.step(fleet, beats, 2.0)) == []
    # The machine starves a whole region: its median rises with it, so nobody is slow.
    starved = [F.Beat(f"a:{i}", 0, True, 0.4) for i in range(3)]
    assert unhealthy(F.step(fleet, starved, 3.0)) == []


def test_launch_failure_postpones_and_retries_the_same_incarnation():
    fleet = F.step(training(), [F.RunEnded("a:0", 0, "died")], 2.0).fleet
    fleet = F.step(fleet, [], 2.5).fleet  # relaunched as incarnation 1
    result = F.step(fleet, [F.LaunchFailed("a:0", 1, "name taken")], 2.6)
    assert names(result) == ["learner_restart_postponed"]
    assert result.fleet.slots["a:0"].state == SlotState.RESTARTING
    retry = F.step(result.fleet, [], 2.6 + 0.2)
    assert names(retry) == ["learner_restarted"] and retry.actions[0].incarnation == 1
    # a ledger entry of the dead incarnation 0 is no first contribution of incarnation 1
    assert "learner_recovered" not in names(F.step(result.fleet, [F.Applied({"a:0": (0, 4, 9)})],
                                                   2.7))


def test_recovered_on_the_first_applied_tokens_of_the_new_incarnation_with_its_phases():
    fleet = F.step(training(), [F.Chaos(Fault(3.0, FaultKind.KILL, "a:0"))], 3.0).fleet
    fleet = F.step(fleet, [F.RunEnded("a:0", 0, "killed")], 3.25).fleet
    fleet = F.step(fleet, [], 3.75).fleet                                # restarted
    fleet = F.step(fleet, [F.Beat("a:0", 1, True, 0.1, ready_at_s=5.0)], 5.0).fleet
    assert "learner_recovered" not in names(F.step(fleet, [F.Applied({"a:0": (1, 0, 0)})], 5.5))
    result = F.step(fleet, [F.Applied({"a:0": (1, 20, 512)})], 6.0)
    (rec,) = [t for t in result.transitions if t.name == "learner_recovered"]
    assert rec.fields == {"cause": "crash", "detect_s": 0.25, "restart_s": 0.5, "restore_s": 1.25,
                          "first_contribution_s": 1.0, "total_s": 3.0}


def test_chaos_kill_with_repair_waits_for_the_repair_counted_from_detection():
    fault = Fault(2.0, FaultKind.KILL, "a:0", duration_s=4.0)
    fleet = F.step(training(), [F.Chaos(fault)], 2.0)
    # The kill carries its fault: a body times the death's detection by its kind.
    assert names(fleet) == ["chaos"] and fleet.actions[0] == F.Kill("a:0", 0, "ray_kill",
                                                                    fault=fault)
    result = F.step(fleet.fleet, [F.RunEnded("a:0", 0, "killed")], 2.1)
    assert result.fleet.slots["a:0"].restart_at_s == pytest.approx(2.1 + 4.0)  # repair > 0.5


def test_a_syncer_shard_kill_names_its_shard_and_an_unknown_shard_is_refused():
    fleet = training(settings(syncer_shards=2))
    fault = Fault(2.0, FaultKind.SYNCER_KILL, "syncer:1")
    result = F.step(fleet, [F.Chaos(fault)], 2.0)
    assert result.actions == (F.KillSyncer(1, fault),)
    assert result.transitions[0].fields["target"] == "syncer:1"
    fault = Fault(2.0, FaultKind.SYNCER_KILL, "syncer")
    assert F.step(fleet, [F.Chaos(fault)], 2.0).actions == (F.KillSyncer(0, fault),)
    with pytest.raises(F.CommandError, match=r"syncer shard 2 does not exist \(syncer.shards = 2\)"):
        F.check_command(fleet, F.Chaos(Fault(2.0, FaultKind.SYNCER_KILL, "syncer:2")))
    with pytest.raises(ValueError, match="'syncer' or 'syncer:<shard>', got 'syncer:x'"):
        Fault(2.0, FaultKind.SYNCER_KILL, "syncer:x")


def test_chaos_region_loss_kills_every_running_learner_of_the_region():
    result = F.step(training(), [F.Chaos(Fault(2.0, FaultKind.REGION_LOSS, "a", 1.0))], 2.0)
    assert result.transitions[0].fields["action"] == "region_loss"
    assert result.transitions[0].fields["learners"] == ["a:0", "a:1"]
    assert [(a.learner, a.mode) for a in result.actions] == [("a:0", "ray_kill"),
                                                             ("a:1", "ray_kill")]


def test_chaos_slowdown_network_partition_syncer_and_hang_become_actions():
    fleet = training()
    slow = F.step(fleet, [F.Chaos(Fault(2.0, FaultKind.SLOWDOWN, "a", 3.0, factor=2.0))], 2.0)
    assert slow.actions[0].learners == ("a:0", "a:1") and slow.actions[0].fault.factor == 2.0
    net = F.step(fleet, [F.Chaos(Fault(2.0, FaultKind.PARTITION, "b", 5.0))], 2.0)
    assert net.actions[0].learners == ("b:0",) and net.fleet.link_faults[0].end_s == 7.0
    assert kinds(F.step(fleet, [F.Chaos(Fault(2.0, FaultKind.SYNCER_KILL, "syncer"))], 2.0)) == [
        "KillSyncer"]
    hang = F.step(fleet, [F.HangCommand("b:0", 9.0)], 2.0)
    assert names(hang) == ["chaos"] and hang.actions[0] == F.Hang("b:0", 9.0)


def test_a_learner_launched_during_a_link_fault_gets_it():
    fleet = F.step(training(settings(heartbeat_timeout_s=1e9)), [F.Chaos(Fault(2.0, FaultKind.NETWORK, "a", 10.0,
                                              extra_latency_ms=300))], 2.0).fleet
    fleet = F.step(fleet, [F.RunEnded("a:0", 0, "died")], 3.0).fleet
    (launch,) = F.step(fleet, [], 3.5).actions
    assert launch.link_faults[0].extra_latency_ms == 300
    fleet = F.step(fleet, [F.RunEnded("a:1", 0, "died")], 20.0).fleet
    (launch,) = F.step(fleet, [], 20.5).actions
    assert launch.link_faults == ()  # over by then


def test_commands_that_cannot_be_done_are_refused_and_change_nothing():
    fleet = training()
    for command, message in [(F.Scale("z", 1), "unknown region 'z'"),
                             (F.Scale("a", 4), "exceeds max_learners"),
                             (F.Scale("a", -1), ">= 0"),
                             (F.Drain("a:9"), "no active learner 'a:9'"),
                             (F.Chaos(Fault(1.0, FaultKind.KILL, "a:9")), "no running learner"),
                             (F.Chaos(Fault(1.0, FaultKind.REGION_LOSS, "z")), "unknown region"),
                             (F.HangCommand("a:9", 1.0), "no running learner")]:
        with pytest.raises(F.CommandError, match=re.escape(message)):
            F.check_command(fleet, command)
    s = settings(min_learners=3)
    with pytest.raises(F.CommandError, match="below quorum 3"):
        F.check_command(training(s), F.Scale("a", 1))


def test_scale_up_adds_and_launches_scale_down_drains_the_highest_index():
    fleet = training()
    up = F.step(fleet, [F.Scale("a", 3)], 2.0)
    assert names(up) == ["learner_launched", "scaled"]
    assert up.actions[0].learner == "a:2" and up.actions[0].shard == 3
    assert up.actions[0].peer is None   # a new learner starts its own inner state (its steps from 0)
    down = F.step(up.fleet, [F.Scale("a", 1)], 3.0)
    assert names(down) == ["learner_draining", "learner_draining", "scaled"]
    assert [a.learner for a in down.actions] == ["a:1", "a:2"]
    assert down.fleet.targets["a"] == 1
    drained = F.step(down.fleet, [F.RunEnded("a:1", 0)], 4.0)
    assert names(drained) == ["learner_retired"]
    assert drained.transitions[0].fields["reason"] == "drained"
    assert kinds(drained) == ["Forget"]


def test_drain_of_a_restarting_learner_retires_it_at_once_and_one_that_dies_draining_leaves():
    fleet = F.step(training(), [F.RunEnded("a:0", 0, "died")], 2.0).fleet
    result = F.step(fleet, [F.Drain("a:0")], 2.1)
    assert names(result) == ["learner_retired"]
    assert result.transitions[0].fields["reason"] == "drained while restarting"
    fleet = F.step(training(), [F.Drain("a:1")], 2.0).fleet
    died = F.step(fleet, [F.RunEnded("a:1", 0, "segfault")], 3.0)
    assert names(died) == ["learner_retired"]  # not restarted: it was leaving


def test_node_join_grows_a_region_up_to_its_ceiling():
    fleet = F.step(training(), [F.Cluster({"a": 2, "b": 1})], 2.0).fleet
    result = F.step(fleet, [F.Cluster({"a": 5, "b": 1})], 3.0)
    assert names(result) == ["region_grew", "learner_launched", "scaled"]
    assert result.transitions[0].fields["target"] == 3  # max_learners of a


def test_quorum_floor_pauses_below_k_and_resumes_when_learners_return():
    fleet = training(settings(min_learners=3))
    paused = F.step(fleet, [F.RunEnded("a:0", 0, "died")], 2.0)
    assert names(paused)[-1] == "training_paused"
    assert [a for a in paused.actions if isinstance(a, F.PauseLearner)] == [
        F.PauseLearner("a:1", True), F.PauseLearner("b:0", True)]
    assert paused.fleet.slots["a:1"].state == SlotState.PAUSED
    relaunched = F.step(paused.fleet, [], 2.5).fleet
    back = F.step(relaunched, [F.Beat("a:0", 1, True, 0.1)], 4.0)
    assert names(back) == ["learner_ready", "training_resumed"]
    assert set(states(back.fleet).values()) == {"training"}


def test_a_learner_that_becomes_ready_during_a_pause_joins_it():
    s = settings(min_learners=3, regions={"a": region_plan(3, 3), "b": region_plan(1, 1)})
    fleet = F.step(F.initial(s), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat(n, 0, True, 0.1) for n in ("a:0", "a:1", "a:2")], 1.0).fleet
    fleet = F.step(fleet, [F.RunEnded("a:0", 0, "x"), F.RunEnded("a:1", 0, "x")], 2.0).fleet
    assert fleet.paused_reason is not None
    joined = F.step(fleet, [F.Beat("b:0", 0, True, 0.1)], 2.1)
    assert joined.fleet.slots["b:0"].state == SlotState.PAUSED
    assert F.PauseLearner("b:0", True) in joined.actions


def test_stop_retires_clean_ends_and_nothing_restarts():
    fleet = F.step(training(), [F.RunEnded("a:0", 0, "died")], 2.0).fleet
    stopped = F.step(fleet, [F.Stop()], 2.1)
    assert names(stopped) == ["learner_retired"]  # a:0 was waiting for its restart
    ended = F.step(stopped.fleet, [F.RunEnded("a:1", 0), F.RunEnded("b:0", 0, "x")], 3.0)
    assert [t.fields["reason"] for t in ended.transitions] == ["stopped", "stopped"]
    assert kinds(F.step(ended.fleet, [], 100.0)) == []


def test_step_is_pure():
    fleet = training()
    before = dataclasses.replace(fleet)
    F.step(fleet, [F.RunEnded("a:0", 0, "died"), F.Scale("a", 3)], 5.0)
    assert fleet == before and fleet.slots["a:0"].state == SlotState.TRAINING


def test_every_transition_name_is_tested():
    source = Path(F.__file__).read_text()
    emitted = set(re.findall(r'"((?:learner|training|region)_[a-z_]+|scaled|chaos)"', source))
    tested = set(re.findall(r'"([a-z_]+)"', Path(__file__).read_text()))
    assert emitted and emitted <= tested, sorted(emitted - tested)


def test_a_quarantined_learner_is_restarted_from_a_peer_under_its_own_reason():
    result = F.step(training(), [F.Quarantine("a:1", 0, "outlier_norm")], 2.0)
    assert names(result) == ["learner_quarantined", "learner_failed", "learner_restart_scheduled"]
    assert kinds(result) == ["Kill", "Forget"]
    assert result.fleet.slots["a:1"].restart_counts == {Cause.QUARANTINE: 1}
    assert names(F.step(result.fleet, [F.Quarantine("a:1", 0, "again")], 2.1)) == []  # once


def test_a_resumed_job_launches_its_learners_at_their_applied_steps():
    fleet = F.initial(settings())
    result = F.step(fleet, [F.Applied({"a:0": (3, 120, 0), "b:0": (0, 40, 0)})], 0.0)
    assert [(a.learner, a.start_step) for a in result.actions] == [("a:0", 120), ("a:1", 0),
                                                                   ("b:0", 40)]


# -- remote regions (a region in its own Ray cluster, mirrored from its agent's reports) ----------
def remote_settings(**overrides):
    return settings(regions={"a": region_plan(2, 3), "r": region_plan(2, 2, remote=True)},
                    **overrides)


def test_remote_slots_are_never_launched_here_and_keep_their_shards():
    result = F.step(F.initial(remote_settings()), [], 0.0)
    assert [(a.learner, a.shard, a.num_shards) for a in result.actions] == [("a:0", 0, 4),
                                                                         ("a:1", 1, 4)]
    assert states(result.fleet)["r:0"] == "pending" and result.fleet.slots["r:1"].shard == 3
    # Never reported: nothing to judge (a pending remote slot is its agent's to launch).
    assert names(F.step(result.fleet, [], 3600.0)).count("learner_failed") == 2  # only a:0, a:1


def test_a_remote_report_mirrors_the_agents_decisions_and_settles_what_ended():
    fleet = F.step(F.initial(remote_settings()), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat(n, 0, True, 0.1) for n in ("a:0", "a:1")], 0.5).fleet
    up = F.step(fleet, [F.RemoteReport("r:0", "r", 0, "training", 2, 0.1)], 1.0)
    assert names(up) == ["learner_launched", "learner_state"] and not up.actions
    assert up.fleet.slots["r:0"].state == SlotState.TRAINING
    # The agent restarted it (a crash): the old incarnation is forgotten here with its cause.
    again = F.step(up.fleet, [F.RemoteReport("r:0", "r", 1, "starting", 2, None, "crash")], 2.0)
    assert [(type(a).__name__, a.incarnation, a.reason) for a in again.actions] == [
        ("Forget", 0, "crash")]
    assert names(again) == ["learner_failed", "learner_restarted", "learner_state"]
    assert again.fleet.slots["r:0"].incarnation == 1
    gone = F.step(again.fleet, [F.RemoteReport("r:0", "r", 1, "retired", 2, None, "drained")], 3)
    assert names(gone) == ["learner_retired"] and kinds(gone) == ["Forget"]


def remote_training(t=1.0):
    """r:0 reported training by a live agent, with a heartbeat, at ``t``."""
    fleet = F.step(F.initial(remote_settings()), [], 0.0).fleet
    return F.step(fleet, [F.RemoteReport("r:0", "r", 0, "training", 2, 0.1)], t).fleet


def test_a_remote_learner_whose_agent_went_silent_is_unreachable_within_the_hang_timeout():
    fleet = remote_training()
    # 10 s timeout: at 10.9 s nothing yet; at 11.1 s it is hung, and its agent is silent too.
    assert "learner_unhealthy" not in names(F.step(fleet, [], 10.9))
    hung = F.step(fleet, [], 11.1)
    # It no longer counts as training: the only live learner, so the quorum floor pauses.
    assert names(hung) == ["learner_unhealthy", "learner_failed", "learner_unreachable",
                           "training_paused"]
    assert [(type(a).__name__, a.learner, a.incarnation, a.reason) for a in hung.actions
            if isinstance(a, F.Forget)] == [("Forget", "r:0", 0, "hang")]
    assert not [a for a in hung.actions if isinstance(a, F.RestartRemote)]
    assert hung.fleet.slots["r:0"].state == SlotState.UNREACHABLE
    failed = next(t for t in hung.transitions if t.name == "learner_failed")
    assert failed.fields["cause"] == "hang" and "silent" in failed.fields["detail"]
    # A report of the same incarnation with no heartbeat (a link client that outlived its
    # agent) does not bring it back; the agent's next incarnation does.
    stale = F.step(hung.fleet, [F.RemoteReport("r:0", "r", 0, "training", 2, beat=False,
                                               agent_alive=False)], 12.0)
    assert stale.fleet.slots["r:0"].state == SlotState.UNREACHABLE and not stale.transitions
    back = F.step(stale.fleet, [F.RemoteReport("r:0", "r", 1, "training", 2, 0.1)], 13.0)
    assert names(back) == ["learner_restarted", "learner_state", "training_resumed"]
    assert back.fleet.slots["r:0"].state == SlotState.TRAINING


def test_a_remote_learner_that_stops_beating_under_a_live_agent_is_restarted_through_it():
    fleet = remote_training()
    # The agent keeps reporting (its slots, no heartbeat of r:0).
    for t in (4.0, 8.0):
        fleet = F.step(fleet, [F.RemoteReport("r:0", "r", 0, "training", 2, beat=False)],
                       t).fleet
    hung = F.step(fleet, [], 11.1)
    assert names(hung)[:3] == ["learner_unhealthy", "learner_failed",
                               "learner_restart_scheduled"]
    assert [(a.learner, a.region, a.incarnation, a.cause) for a in hung.actions
            if isinstance(a, F.RestartRemote)] == [("r:0", "r", 0, "hang")]
    assert hung.fleet.slots["r:0"].state == SlotState.RESTARTING
    # Nothing is launched here, however long it takes its agent.
    assert not [a for a in F.step(hung.fleet, [], 100.0).actions if isinstance(a, F.Launch)]


def test_the_homes_hang_verdict_fails_the_current_incarnation_in_the_agents_fleet():
    fleet = training()
    stale = F.step(fleet, [F.Unhealthy("a:0", 7, "hang")], 1.5)
    assert not stale.transitions  # not its incarnation: already restarted there
    hung = F.step(fleet, [F.Unhealthy("a:0", 0, "hang", "hang seen at home")], 1.5)
    assert names(hung)[:2] == ["learner_unhealthy", "learner_failed"]
    assert hung.fleet.slots["a:0"].state == SlotState.RESTARTING
    assert hung.fleet.slots["a:0"].restart_counts == {Cause.HANG: 1}


def test_remote_regions_refuse_home_scale_and_kill_commands():
    fleet = F.step(F.initial(remote_settings()), [F.RemoteReport("r:0", "r", 0, "training")],
                   1.0).fleet
    with pytest.raises(F.CommandError, match="own Ray cluster"):
        F.check_command(fleet, F.Scale("r", 1))
    with pytest.raises(F.CommandError, match="own Ray cluster"):
        F.check_command(fleet, F.Chaos(Fault(1.0, FaultKind.KILL, "r:0")))


def test_an_agents_fleet_numbers_shards_from_its_regions_first_shard():
    s = settings(regions={"r": region_plan(2, 2)}, first_shard=3, num_shards=5)
    assert [(a.shard, a.num_shards) for a in F.step(F.initial(s), [], 0.0).actions] == [
        (3, 5), (4, 5)]


# -- warm spares ----------------------------------------------------------------------------------
def alive(fleet, *skip):
    """Heartbeats of every live learner's current incarnation (so nobody hangs meanwhile)."""
    return [F.Beat(n, x.incarnation, True) for n, x in fleet.slots.items()
            if x.state in F.LIVE and n not in skip]


def spare_fleet(spares=1):
    """Region a: 3 learners training since t=1 (the step that saw them ready launched the first
    spare) and ``spares`` READY spares."""
    s = settings(regions={"a": region_plan(3, 4, spares=spares)})
    fleet = training(s)
    t = 2.0
    while len(fleet.spares) < spares:
        fleet = F.step(fleet, [], t).fleet
        t += 1.0
    return F.step(fleet, [F.SpareReady(n) for n in fleet.spares], t).fleet


def test_spares_start_only_once_no_learner_is_starting_one_at_a_time():
    s = settings(regions={"a": region_plan(2, 3, spares=2)})
    launched = F.step(F.initial(s), [], 0.0)
    assert kinds(launched) == ["Launch", "Launch"]               # learners first, no spare
    one = F.step(launched.fleet, [F.Beat("a:0", 0, True)], 1.0)
    assert "LaunchSpare" not in kinds(one)                       # a:1 is still starting
    both = F.step(one.fleet, [F.Beat("a:1", 0, True)], 2.0)
    assert [a for a in both.actions if isinstance(a, F.LaunchSpare)] == [
        F.LaunchSpare("spare:a:0", "a")]
    second = F.step(both.fleet, [], 3.0)
    assert second.actions == (F.LaunchSpare("spare:a:1", "a"),)
    assert F.step(second.fleet, [], 4.0).actions == ()            # two is the target
    ready = F.step(second.fleet, [F.SpareReady("spare:a:0")], 5.0)
    assert ready.fleet.spares["spare:a:0"].state == F.SpareState.READY
    assert names(ready) == ["spare_ready"] and ready.transitions[0].fields["prepare_s"] == 3.0


def test_a_crash_promotes_a_ready_spare_at_once_and_a_new_spare_follows_once_it_trains():
    fleet = spare_fleet()
    crashed = F.step(fleet, alive(fleet, "a:1") + [F.RunEnded("a:1", 0, "boom", crashed=True)],
                     10.0)
    launch = [a for a in crashed.actions if isinstance(a, F.Launch)]
    # No backoff (0.5 s) and no new process: the spare takes a:1's id, shard and a new incarnation.
    assert launch == [F.Launch("a:1", "a", 1, 1, 3, 1.0, "a:0", 0, (), "spare:a:0", None)]
    assert names(crashed) == ["learner_failed", "learner_restart_scheduled", "spare_promoted",
                              "learner_restarted"]
    slot = crashed.fleet.slots["a:1"]
    assert slot.state == SlotState.STARTING and slot.actor == "spare:a:0"
    assert slot.restart_counts == {Cause.CRASH: 1}               # it is a restart all the same
    assert crashed.fleet.spares == {}
    # No new spare while the promotion is under way ...
    assert "LaunchSpare" not in kinds(F.step(crashed.fleet, alive(crashed.fleet, "a:1"), 11.0))
    # ... and one once the promoted learner trains.
    ready = F.step(crashed.fleet, alive(crashed.fleet, "a:1") + [
        F.Beat("a:1", 1, True, ready_at_s=11.2, adopted=True)], 11.5)
    assert "LaunchSpare" in kinds(ready)
    # A learner hosted by a spare is a peer like any other: its actor is the spare's.
    again = F.step(ready.fleet, alive(ready.fleet, "a:0") + [
        F.RunEnded("a:0", 0, "boom", crashed=True)], 20.0)
    later = F.step(again.fleet, alive(again.fleet), 20.5)
    relaunch = [a for a in later.actions if isinstance(a, F.Launch)][0]
    assert relaunch.spare is None and relaunch.peer == "a:1"
    assert relaunch.peer_actor == "spare:a:0"


def test_a_spare_that_dies_or_never_gets_ready_is_replaced_and_stop_ends_the_spares():
    s = settings(regions={"a": region_plan(3, 4, spares=1)}, startup_timeout_s=60.0)
    fleet = training(s)                       # its learners' ready step launched the spare
    assert list(fleet.spares) == ["spare:a:0"]
    slow = F.step(fleet, alive(fleet), 61.5)                      # 60.5 s and not ready
    assert F.KillSpare("spare:a:0") in slow.actions and names(slow)[0] == "spare_ended"
    assert slow.transitions[0].fields["next_spare_in_s"] == 0.5   # the first backoff
    assert "LaunchSpare" not in kinds(slow)
    slow = F.step(slow.fleet, alive(slow.fleet), 62.0)
    assert F.LaunchSpare("spare:a:1", "a") in slow.actions        # its replacement
    died = F.step(slow.fleet, alive(slow.fleet) + [F.SpareEnded("spare:a:1", "actor died")],
                  63.0)
    assert F.KillSpare("spare:a:1") in died.actions and "LaunchSpare" not in kinds(died)
    assert died.transitions[0].fields["next_spare_in_s"] == 1.0   # two in a row: doubled
    died = F.step(died.fleet, alive(died.fleet), 64.0)
    assert F.LaunchSpare("spare:a:2", "a") in died.actions
    stopped = F.step(died.fleet, [F.Stop()], 64.0)
    assert F.KillSpare("spare:a:2") in stopped.actions and stopped.fleet.spares == {}
    # A crash with no READY spare waits for its backoff and starts a process, as before.
    crash = F.step(died.fleet, [F.RunEnded("a:0", 0, "boom", crashed=True)], 65.0)
    assert "Launch" not in kinds(crash)


def test_a_spare_ready_after_the_fault_takes_the_waiting_slot_at_its_spare_ready_not_the_repair():
    """The soak of issue 35: a learner killed with a 5 s repair while its region's replacement
    spare still prepared; the spare got ready 1.9 s later and must take over then (its own
    process and devices), not when the failed slot's repair ends."""
    fleet = spare_fleet()
    # spare:a:0 takes a:1's place at 90.0; its replacement spare:a:1 starts once a:1 trains.
    first = F.step(fleet, alive(fleet, "a:1") + [F.RunEnded("a:1", 0, "boom", crashed=True)],
                   90.0)
    trains = F.step(first.fleet, alive(first.fleet, "a:1") + [
        F.Beat("a:1", 1, True, ready_at_s=90.8, adopted=True)], 91.0)
    assert F.LaunchSpare("spare:a:1", "a") in trains.actions
    fleet = F.step(trains.fleet, alive(trains.fleet), 92.0).fleet
    # 94.0: a:0 killed with a 5 s repair, seen dead at 94.2; no ready spare yet.
    kill = F.Chaos(Fault(94.0, FaultKind.KILL, "a:0", duration_s=5.0))
    fleet = F.step(fleet, alive(fleet) + [kill], 94.0).fleet
    dead = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "killed")], 94.2)
    slot = dead.fleet.slots["a:0"]
    assert slot.state == SlotState.RESTARTING and "Launch" not in kinds(dead)
    # The repair counts from the detection: 94.2 + (99.0 - 94.0) = 99.2.
    assert slot.restart_at_s == pytest.approx(99.2)
    waiting = F.step(dead.fleet, alive(dead.fleet), 95.0)
    assert "Launch" not in kinds(waiting)
    # 95.9: spare:a:1 is ready, and is promoted in the same step.
    ready = F.step(waiting.fleet, alive(waiting.fleet) + [F.SpareReady("spare:a:1")], 95.9)
    launch = [a for a in ready.actions if isinstance(a, F.Launch)]
    assert launch == [F.Launch("a:0", "a", 1, 0, 3, 1.0, "a:1", 0, (), "spare:a:1", "spare:a:0")]
    assert names(ready) == ["spare_ready", "spare_promoted", "learner_restarted"]
    assert ready.transitions[1].fields["waited_s"] == 0.0
    slot = ready.fleet.slots["a:0"]
    assert slot.state == SlotState.STARTING and slot.actor == "spare:a:1"
    assert dict(slot.recovery)["restarted_s"] == 95.9    # not 99.2
    assert slot.restart_at_s is None and ready.fleet.spares == {}
    # Nothing happens again at the repair's end.
    assert "Launch" not in kinds(F.step(ready.fleet, alive(ready.fleet, "a:0"), 99.2))


def test_a_region_loss_takes_its_spares_and_nothing_starts_there_before_the_repair():
    """A region's warm spares run on its nodes: a region loss ends them with its learners. No
    replacement spare and no prestarted restart starts in the region before the repair is
    over; then the learners come back in new processes and the region gets a spare again."""
    fleet = spare_fleet()
    plan = dataclasses.replace(fleet.settings.regions["a"], prestart=True)
    fleet = dataclasses.replace(fleet, settings=dataclasses.replace(fleet.settings,
                                                                    regions={"a": plan}))
    (spare,) = fleet.spares
    loss = F.Chaos(Fault(10.0, FaultKind.REGION_LOSS, "a", duration_s=5.0))
    lost = F.step(fleet, alive(fleet) + [loss], 10.0)
    assert lost.transitions[0].fields["spares"] == [spare]
    assert F.KillSpare(spare) in lost.actions and lost.fleet.spares == {}
    ended = [t for t in lost.transitions if t.name == "spare_ended"]
    assert [t.fields["reason"] for t in ended] == ["its region was lost"]
    # The deaths are seen at 10.2: the repair counts from there (restarts at 15.2).
    result = F.step(lost.fleet, [F.RunEnded(n, 0, "killed") for n in ("a:0", "a:1", "a:2")],
                    10.2)
    during = [result]
    for t in (11.0, 13.0, 14.9):   # the region is back at 15.0 (the loss at 10.0 + 5 s)
        during.append(F.step(during[-1].fleet, [], t))
    for t, r in zip((10.2, 11.0, 13.0, 14.9), during):
        assert not {"Launch", "LaunchSpare"} & set(kinds(r)), (t, kinds(r))
    assert during[-1].fleet.spares == {}
    back = F.step(during[-1].fleet, [], 15.2)
    launches = [a for a in back.actions if isinstance(a, F.Launch)]
    assert sorted(a.learner for a in launches) == ["a:0", "a:1", "a:2"]
    assert all(a.spare is None for a in launches)     # new processes: the spare is gone
    after, t = back, 15.2
    while not any(isinstance(a, F.LaunchSpare) for a in after.actions) and t < 20.0:
        t += 0.5
        after = F.step(after.fleet, [F.Beat(n, 1, True) for n in ("a:0", "a:1", "a:2")], t)
    assert any(isinstance(a, F.LaunchSpare) for a in after.actions), "no spare after the repair"


def preparing_spare_fleet(wait_s=5.0):
    """spare_fleet() after spare:a:0 took a:1's place at 90.0; its replacement spare:a:1 has
    been preparing since 91.0 (when a:1 trained), and restarts wait ``wait_s`` for a spare."""
    fleet = spare_fleet()
    fleet = dataclasses.replace(fleet, settings=dataclasses.replace(fleet.settings,
                                                                    spare_wait_s=wait_s))
    first = F.step(fleet, alive(fleet, "a:1") + [F.RunEnded("a:1", 0, "boom", crashed=True)],
                   90.0)
    trains = F.step(first.fleet, alive(first.fleet, "a:1") + [
        F.Beat("a:1", 1, True, ready_at_s=90.8, adopted=True)], 91.0)
    assert F.LaunchSpare("spare:a:1", "a") in trains.actions
    return trains.fleet


def test_a_restart_due_while_its_regions_spare_prepares_waits_for_it_not_a_new_process():
    fleet = preparing_spare_fleet()
    crashed = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "boom", crashed=True)],
                     92.0)
    assert crashed.fleet.slots["a:0"].restart_at_s == 92.5          # the 0.5 s backoff
    # Due at 92.5, but spare:a:1 is preparing: no second new process beside it.
    due = F.step(crashed.fleet, alive(crashed.fleet), 92.5)
    assert "Launch" not in kinds(due) and due.fleet.slots["a:0"].state == SlotState.RESTARTING
    # Its preparation is on a:0's critical path now: it leaves its low priority, once.
    assert due.actions == (F.HurrySpare("spare:a:1"),)
    assert "HurrySpare" not in kinds(F.step(due.fleet, alive(due.fleet), 93.0))
    # 94.0: the spare is ready and takes a:0's place in that step.
    ready = F.step(due.fleet, alive(due.fleet) + [F.SpareReady("spare:a:1")], 94.0)
    (launch,) = [a for a in ready.actions if isinstance(a, F.Launch)]
    assert (launch.learner, launch.incarnation, launch.spare) == ("a:0", 1, "spare:a:1")
    assert names(ready) == ["spare_ready", "spare_promoted", "learner_restarted"]
    # A spare not ready within spare_wait_s (92.5 + 5.0): the restart starts a new process.
    late = F.step(due.fleet, alive(due.fleet), 97.4)
    assert "Launch" not in kinds(late)
    gave_up = F.step(late.fleet, alive(late.fleet), 97.5)
    (launch,) = [a for a in gave_up.actions if isinstance(a, F.Launch)]
    assert (launch.learner, launch.spare) == ("a:0", None)
    # spare_wait_s 0: a new process at the due time, as before.
    eager = preparing_spare_fleet(wait_s=0.0)
    crashed = F.step(eager, alive(eager, "a:0") + [F.RunEnded("a:0", 0, "boom", crashed=True)],
                     92.0)
    (launch,) = [a for a in F.step(crashed.fleet, alive(crashed.fleet), 92.5).actions
                 if isinstance(a, F.Launch)]
    assert (launch.learner, launch.spare) == ("a:0", None)


def test_one_preparing_spare_holds_back_only_the_earliest_due_restart():
    fleet = preparing_spare_fleet()
    # a:0 and a:2 crash at 92.0 and 92.2: both due 0.5 s later; one spare is preparing.
    one = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "boom", crashed=True)], 92.0)
    two = F.step(one.fleet, alive(one.fleet, "a:2") + [
        F.RunEnded("a:2", 0, "boom", crashed=True)], 92.2)
    due = F.step(two.fleet, alive(two.fleet), 92.7)
    # a:0 (due at 92.5) waits for spare:a:1; a:2 (due at 92.7) starts a new process now.
    assert [(a.learner, a.spare) for a in due.actions if isinstance(a, F.Launch)] == [
        ("a:2", None)]
    assert due.fleet.slots["a:0"].state == SlotState.RESTARTING
    ready = F.step(due.fleet, alive(due.fleet) + [F.SpareReady("spare:a:1")], 93.5)
    assert [(a.learner, a.spare) for a in ready.actions if isinstance(a, F.Launch)] == [
        ("a:0", "spare:a:1")]


def prestart_fleet(spares=0):
    """Region a: 3 learners training since t=1, restarts prestarted, ``spares`` spares (none
    launched yet: the region's plan gets them after ``training``)."""
    s = settings(regions={"a": region_plan(3, 4, spares=0, prestart=True)})
    fleet = training(s)
    plan = region_plan(3, 4, spares=spares, prestart=True)
    return dataclasses.replace(fleet, settings=dataclasses.replace(s, regions={"a": plan}))


def test_a_failed_learners_next_process_is_prestarted_and_promoted_when_its_restart_is_due():
    fleet = prestart_fleet()
    kill = F.Chaos(Fault(10.0, FaultKind.KILL, "a:0", duration_s=5.0))
    fleet = F.step(fleet, alive(fleet) + [kill], 10.0).fleet
    dead = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "killed")], 10.2)
    # Due at 15.2 (the repair from the detection); its process starts now, reserved for it.
    assert dead.fleet.slots["a:0"].restart_at_s == pytest.approx(15.2)
    assert F.LaunchSpare("spare:a:0", "a") in dead.actions and "Launch" not in kinds(dead)
    launched = [t for t in dead.transitions if t.name == "spare_launched"]
    assert [(t.learner, t.fields["spare"]) for t in launched] == [("a:0", "spare:a:0")]
    assert dead.fleet.spares["spare:a:0"].for_learner == "a:0"
    # Ready at 12.0: it waits for the restart's due time (the slot's wait, backoff included).
    ready = F.step(dead.fleet, alive(dead.fleet) + [F.SpareReady("spare:a:0")], 12.0)
    assert "Launch" not in kinds(ready)
    # a:1 crashes at 12.5 (due at 13.0): it never takes a:0's process; it gets its own.
    crash = F.step(ready.fleet, alive(ready.fleet, "a:1") + [
        F.RunEnded("a:1", 0, "boom", crashed=True)], 12.5)
    assert F.LaunchSpare("spare:a:1", "a") in crash.actions
    due1 = F.step(crash.fleet, alive(crash.fleet), 13.0)
    assert "Launch" not in kinds(due1)              # a:1 waits for its own, still preparing
    assert due1.actions == (F.HurrySpare("spare:a:1"),)   # now at normal priority
    # 15.2: a:0 is due and takes its prestarted process: a promotion, not a new process.
    due0 = F.step(due1.fleet, alive(due1.fleet), 15.2)
    assert [(a.learner, a.spare) for a in due0.actions if isinstance(a, F.Launch)] == [
        ("a:0", "spare:a:0")]
    assert names(due0) == ["spare_promoted", "learner_restarted"]
    # a:1's gets ready at 16.0, past its due time: promoted in that step.
    one = F.step(due0.fleet, alive(due0.fleet) + [F.SpareReady("spare:a:1")], 16.0)
    assert [(a.learner, a.spare) for a in one.actions if isinstance(a, F.Launch)] == [
        ("a:1", "spare:a:1")]
    assert one.fleet.spares == {}                   # no spares kept: none left over


def test_a_prestarted_process_left_over_joins_the_regions_spares_or_ends():
    # spares: 1, not launched yet when a:0 fails: a:0's process is prestarted.
    fleet = prestart_fleet(spares=1)
    crash = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "boom", crashed=True)],
                   2.0)
    reserved = [a for a in crash.actions if isinstance(a, F.LaunchSpare)]
    assert reserved == [F.LaunchSpare("spare:a:0", "a"), F.LaunchSpare("spare:a:1", "a")]
    assert crash.fleet.spares["spare:a:0"].for_learner == "a:0"
    assert crash.fleet.spares["spare:a:1"].for_learner is None   # the region's spare
    # The region's spare gets ready first, at 2.4 (a:0 not due yet, 2.5): it takes a:0 at
    # once; a:0's own process becomes the region's spare (no other one started).
    ready = F.step(crash.fleet, alive(crash.fleet) + [F.SpareReady("spare:a:1")], 2.4)
    assert [(a.learner, a.spare) for a in ready.actions if isinstance(a, F.Launch)] == [
        ("a:0", "spare:a:1")]
    assert ready.fleet.spares["spare:a:0"].for_learner is None
    assert "LaunchSpare" not in kinds(ready) and "KillSpare" not in kinds(ready)
    # No spares kept: a learner retired while its process is prestarted ends that process.
    fleet = prestart_fleet()
    crash = F.step(fleet, alive(fleet, "a:2") + [F.RunEnded("a:2", 0, "boom", crashed=True)],
                   2.0)
    drained = F.step(crash.fleet, alive(crash.fleet) + [F.Drain("a:2")], 2.1)
    assert F.KillSpare("spare:a:0") in drained.actions and drained.fleet.spares == {}
    assert drained.fleet.slots["a:2"].state == SlotState.RETIRED


def test_a_restart_a_preparing_spare_will_take_prestarts_nothing():
    fleet = preparing_spare_fleet()         # spare:a:1 (the region's) preparing since 91.0
    plan = dataclasses.replace(fleet.settings.regions["a"], prestart=True)
    fleet = dataclasses.replace(fleet, settings=dataclasses.replace(
        fleet.settings, regions={"a": plan}))
    crashed = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "boom", crashed=True)],
                     92.0)
    assert "LaunchSpare" not in kinds(crashed)      # it will wait for spare:a:1
    # A second failure has no preparing spare left to wait for: its process is prestarted.
    second = F.step(crashed.fleet, alive(crashed.fleet, "a:2") + [
        F.RunEnded("a:2", 0, "boom", crashed=True)], 92.1)
    assert F.LaunchSpare("spare:a:2", "a") in second.actions
    assert second.fleet.spares["spare:a:2"].for_learner == "a:2"


def test_a_scale_up_takes_a_ready_spare():
    fleet = spare_fleet()
    result = F.step(fleet, [F.Scale("a", 4)], 10.0)
    launch = [a for a in result.actions if isinstance(a, F.Launch)]
    # A new learner (incarnation 0) on the spare, with its own inner state (no peer).
    assert launch == [F.Launch("a:3", "a", 0, 3, 4, 1.0, None, 0, (), "spare:a:0", None)]


def test_a_restart_in_a_new_process_does_not_hold_back_a_spare():
    """Under a burst of failures spares pay: only a promotion (or a new learner's start) under
    way holds a new spare back, not a restart in a fresh process."""
    s = settings(regions={"a": region_plan(3, 4, spares=2)})
    fleet = training(settings(regions={"a": region_plan(3, 4)}))   # no spare yet
    fleet = dataclasses.replace(fleet, settings=s)
    crashed = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0, "boom", crashed=True)],
                     2.0)
    assert F.LaunchSpare("spare:a:0", "a") in crashed.actions     # the first, one at a time
    restarted = F.step(crashed.fleet, alive(crashed.fleet), 2.5)   # after its 0.5 s backoff
    slot = restarted.fleet.slots["a:0"]
    assert slot.state == SlotState.STARTING and slot.incarnation == 1 and slot.actor is None
    assert F.LaunchSpare("spare:a:1", "a") in restarted.actions


def test_an_operator_pause_holds_every_learner_until_resumed_and_the_floor_still_applies():
    fleet = training(settings(min_learners=2))
    paused = F.step(fleet, [F.PauseJob(True, "console 127.0.0.1")], 2.0)
    assert names(paused) == ["job_pause_requested", "training_paused"]
    assert paused.transitions[0].fields == {"origin": "console 127.0.0.1"}
    assert "operator" in paused.fleet.paused_reason
    assert set(states(paused.fleet).values()) == {"paused"}
    assert sorted(a.learner for a in paused.actions if a == F.PauseLearner(a.learner, True)) == [
        "a:0", "a:1", "b:0"]
    with pytest.raises(F.CommandError, match="already paused"):
        F.check_command(paused.fleet, F.PauseJob(True))
    # A learner dying meanwhile leaves the job paused, for the operator's reason still.
    fewer = F.step(paused.fleet, [F.RunEnded("a:0", 0, "died"), F.RunEnded("a:1", 0, "died")],
                   3.0).fleet
    assert "operator" in fewer.paused_reason
    # Resumed below the quorum floor (1 live of 2): still paused, now for the floor.
    resumed_low = F.step(fewer, [F.PauseJob(False)], 3.1)
    assert names(resumed_low) == ["job_resume_requested"]
    assert "below quorum" in resumed_low.fleet.paused_reason
    # Resumed with enough learners: training again.
    back = F.step(paused.fleet, [F.PauseJob(False)], 4.0)
    assert names(back) == ["job_resume_requested", "training_resumed"]
    assert set(states(back.fleet).values()) == {"training"}
    assert back.fleet.paused_reason is None and not back.fleet.operator_paused
    with pytest.raises(F.CommandError, match="already running"):
        F.check_command(back.fleet, F.PauseJob(False))


def test_an_operator_pause_before_the_quorum_was_ever_reached_still_pauses():
    fleet = F.step(F.initial(settings(min_learners=3)), [], 0.0).fleet
    paused = F.step(fleet, [F.PauseJob(True)], 0.5)
    assert paused.fleet.paused_reason is not None
    joined = F.step(paused.fleet, [F.Beat("a:0", 0, True, 0.1)], 1.0)
    assert joined.fleet.slots["a:0"].state == SlotState.PAUSED


def test_a_region_agent_pauses_its_learners_with_its_home_and_resumes_with_it():
    """The home's pause (its quorum floor or an operator) reaches a remote region's learners
    through its agent's fleet (orchestrator/region_agent.py's ``home_pause``)."""
    fleet = training(settings(min_learners=1))
    paused = F.step(fleet, [F.HomePause("1 live learner(s) below quorum 2: training paused")],
                    2.0)
    assert names(paused) == ["training_paused"]
    assert paused.fleet.paused_reason == ("paused at home: 1 live learner(s) below quorum 2: "
                                          "training paused")
    assert set(states(paused.fleet).values()) == {"paused"}
    assert sorted(a.learner for a in paused.actions if a == F.PauseLearner(a.learner, True)) == [
        "a:0", "a:1", "b:0"]
    again = F.step(paused.fleet, [F.HomePause("paused by an operator")], 2.5)
    assert names(again) == [] and again.fleet.paused_reason == "paused at home: paused by an operator"
    back = F.step(again.fleet, [F.HomePause(None)], 3.0)
    assert names(back) == ["training_resumed"]
    assert set(states(back.fleet).values()) == {"training"}
    assert sorted(a.learner for a in back.actions if a == F.PauseLearner(a.learner, False)) == [
        "a:0", "a:1", "b:0"]


def test_a_dead_syncer_shard_restarts_alone_at_its_next_epoch_once():
    """Syncer shards are fleet members: a shard whose actor ended restarts from its snapshot at
    the next epoch (fencing), once, while the others stay up; nothing restarts while stopping."""
    fleet = training(settings(syncer_shards=2))
    assert {s: x.state for s, x in fleet.syncer_shards.items()} == {
        0: F.ShardState.UP, 1: F.ShardState.UP}
    ended = F.step(fleet, [F.SyncerEnded(1, 4)], 2.0)
    assert names(ended) == ["syncer_failed"]
    assert ended.transitions[0].fields == {"epoch": 4, "shard": 1}
    assert list(ended.actions) == [F.StartSyncer(1, 5, restore=True)]
    assert ended.fleet.syncer_shards[1].state == F.ShardState.RESTARTING
    assert ended.fleet.syncer_shards[0].state == F.ShardState.UP
    again = F.step(ended.fleet, [F.SyncerEnded(1, 4)], 2.1)   # seen twice: one restart
    assert not again.actions and names(again) == []
    up = F.step(again.fleet, [F.SyncerStarted(1, 5)], 3.0).fleet
    assert up.syncer_shards[1] == F.SyncerShard(1, F.ShardState.UP, epoch=5, restarts=1)
    # The learners never noticed: nobody was restarted.
    assert set(states(up).values()) == {"training"}
    stopping = F.step(up, [F.Stop()], 4.0).fleet
    assert not F.step(stopping, [F.SyncerEnded(0, 5)], 4.1).actions


# -- issue 36: a restart's failure to reintegrate is not the learner's fault ----------------------
def test_a_quarantine_before_a_restarts_first_merge_spends_no_budget_once():
    """Issue 36: a learner killed once, restarted without a peer, was quarantined 5 times in a row
    and retired (crash budget spent). The first quarantine of a restart that has not
    reintegrated yet (no merged push) is free; the next counts, so garbage still retires."""
    fleet = F.step(training(), [F.RunEnded("a:1", 0, "actor died")], 2.0).fleet
    fleet = F.step(fleet, [], 3.0).fleet                      # relaunched after the 0.5 s backoff
    fleet = F.step(fleet, [F.Beat("a:1", 1, True, 0.1, node_id="n1")], 4.0).fleet
    assert fleet.slots["a:1"].restart_counts == {Cause.CRASH: 1}
    free = F.step(fleet, [F.Quarantine("a:1", 1, "outlier_norm")], 5.0)
    assert names(free) == ["learner_quarantined", "learner_failed", "learner_restart_scheduled"]
    assert "not counted" in free.transitions[-1].fields["message"]
    assert free.fleet.slots["a:1"].restart_counts == {Cause.CRASH: 1}
    fleet = F.step(free.fleet, [], 10.0).fleet
    fleet = F.step(fleet, [F.Beat("a:1", 2, True, 0.1, node_id="n1")], 11.0).fleet
    counted = F.step(fleet, [F.Quarantine("a:1", 2, "outlier_norm")], 12.0)
    assert counted.fleet.slots["a:1"].restart_counts == {Cause.CRASH: 1, Cause.QUARANTINE: 1}
    # Budget 2 spent by the crash and that quarantine: the next quarantine retires it.
    fleet = F.step(counted.fleet, [], 20.0).fleet
    fleet = F.step(fleet, [F.Beat("a:1", 3, True, 0.1, node_id="n1")], 21.0).fleet
    retired = F.step(fleet, [F.Quarantine("a:1", 3, "outlier_norm")], 22.0)
    assert retired.fleet.slots["a:1"].state == SlotState.FAILED


def test_a_quarantine_after_the_restart_merged_counts():
    fleet = F.step(training(), [F.RunEnded("a:1", 0, "actor died")], 2.0).fleet
    fleet = F.step(fleet, [], 3.0).fleet
    fleet = F.step(fleet, [F.Beat("a:1", 1, True, 0.1, node_id="n1")], 4.0).fleet
    fleet = F.step(fleet, [F.Applied({"a:1": (1, 20, 512)})], 5.0).fleet   # reintegrated
    counted = F.step(fleet, [F.Quarantine("a:1", 1, "non_finite")], 6.0)
    assert counted.fleet.slots["a:1"].restart_counts == {Cause.CRASH: 1, Cause.QUARANTINE: 1}


def test_the_home_mirrors_a_remote_learners_restart_count_and_keeps_none_of_its_own():
    """Issue 36: the home and the region agent each counted the restart budget of the same
    incarnation. The agent counts (it restarts); the home mirrors its reports."""
    fleet = F.step(F.initial(remote_settings()), [
        F.RemoteReport("r:0", "r", 0, "training", 2, 0.1)], 1.0).fleet
    quarantined = F.step(fleet, [F.Quarantine("r:0", 0, "outlier_norm")], 2.0)
    assert names(quarantined)[:3] == ["learner_quarantined", "learner_failed",
                                      "learner_restart_scheduled"]
    assert "Kill" not in kinds(quarantined)   # not this cluster's actor: its agent restarts it          # no Kill: it is not this cluster's actor
    assert quarantined.fleet.slots["r:0"].restart_counts == {}
    back = F.step(quarantined.fleet, [F.RemoteReport(
        "r:0", "r", 1, "training", 2, 0.1, "quarantine",
        restarts=F.restart_counts('{"quarantine": 1}'))], 3.0)
    assert back.fleet.slots["r:0"].restart_counts == {Cause.QUARANTINE: 1}
    assert back.fleet.slots["r:0"].state == SlotState.TRAINING


# -- a failed device check ------------------------------------------------------------------------
MISMATCH = ("device check failed: region a asked Ray for num_gpus=1 and needs 1 gpu device(s); "
            "JAX gave it 1 cpu device(s) (cpu), backend cpu; likely cause: JAX_PLATFORMS=cpu "
            "reached the learner")
BACKEND_DOWN = ("device backend did not start: region a asked Ray for num_gpus=1 and needs 1 gpu "
                "device(s); JAX gave it no backend (JAX_PLATFORMS=cuda did not start: Unable to "
                "initialize backend 'cuda'); likely cause: the device is held by another process "
                "or its driver is not loaded (nvidia-smi / the TPU runtime logs on that node) "
                "(node n1)")


def on(node):
    return f"{MISMATCH} (node {node})"


def with_nodes(fleet, now, **regions):
    """The membership report: region -> its alive nodes."""
    nodes = {r: frozenset(n) for r, n in regions.items()}
    alive = frozenset().union(*nodes.values())
    return F.step(fleet, [F.Cluster(dict(fleet.capacity), alive, region_nodes=nodes)], now).fleet


def test_the_controllers_membership_report_names_each_regions_nodes():
    pytest.importorskip("ray")
    from islands.orchestrator.groups import region_nodes

    nodes = [{"NodeID": "n1", "Resources": {"region:a": 2.0, "region:b": 1.0}},
             {"NodeID": "n2", "Resources": {"region:a": 1.0, "GPU": 1.0}},
             {"NodeID": "n3", "Resources": {"CPU": 4.0}}]
    assert region_nodes(["a", "b", "c"], nodes) == {
        "a": frozenset({"n1", "n2"}), "b": frozenset({"n1"}), "c": frozenset()}


def test_a_failed_device_check_retires_the_learner_and_marks_its_node_once():
    """No membership known (or one node): the mark blocks its region, as before."""
    fleet = training()
    result = F.step(fleet, [F.RunEnded("a:1", 0, on("n1"), crashed=True)], 5.0)
    assert names(result) == ["node_misconfigured", "learner_failed", "learner_retired"]
    assert result.transitions[0].fields == {"node": "n1", "region": "a", "message": on("n1"),
                                            "region_blocked": True}
    assert result.transitions[1].fields["cause"] == "config"
    assert "not restarted" in result.transitions[2].fields["reason"]
    slot = result.fleet.slots["a:1"]
    assert slot.state == SlotState.FAILED and slot.restart_at_s is None and slot.restarts == ()
    assert result.fleet.misconfigured == {"n1": {"a": on("n1")}}
    # Nothing restarts later, and a second learner failing on the node does not mark it again.
    later = F.step(result.fleet, [F.RunEnded("a:0", 0, on("n1"), crashed=True)], 6.0)
    assert names(later) == ["learner_failed", "learner_retired"]
    assert not [a for a in later.actions if isinstance(a, F.Launch)]
    # A scale-up of the region is refused with the check's line; other regions scale as ever.
    with pytest.raises(F.CommandError, match="its learners cannot train there: device check"):
        F.step(later.fleet, [F.Scale("a", 2)], 6.5)
    assert "scaled" in names(F.step(later.fleet, [F.Scale("b", 2)], 6.5))
    # A line that names no node (an in-process learner) marks the region's unknown node.
    unknown = F.step(fleet, [F.RunEnded("a:1", 0, MISMATCH, crashed=True)], 5.0)
    assert set(unknown.fleet.misconfigured) == {"n1"}   # its beats said where it ran
    assert set(F.step(F.step(F.initial(settings()), [], 0.0).fleet,
                      [F.RunEnded("a:1", 0, MISMATCH, crashed=True)], 1.0).fleet.misconfigured
               ) == {F.UNKNOWN_NODE}


def test_a_mark_blocks_its_region_only_while_every_alive_node_of_it_is_marked():
    fleet = with_nodes(training(settings(heartbeat_timeout_s=1e9)), 2.0,
                       a={"n1", "n2"}, b={"n1"})
    # a:1 fails its check on n1; n2 is unmarked: it may pass there, so it restarts as a crash.
    first = F.step(fleet, [F.RunEnded("a:1", 0, on("n1"), crashed=True)], 5.0)
    assert names(first) == ["node_misconfigured", "learner_failed", "learner_restart_scheduled"]
    assert first.transitions[0].fields["region_blocked"] is False
    assert first.transitions[1].fields["cause"] == "crash"
    assert "another node of its region is not marked" in first.transitions[1].fields["detail"]
    assert first.fleet.slots["a:1"].restart_counts == {Cause.CRASH: 1}
    assert first.fleet.blocked("a") is None and first.fleet.blocked("b") is None
    assert "scaled" in names(F.step(first.fleet, [F.Scale("a", 3)], 5.5))
    # Every alive node of a marked: blocked; its next failing learner retires as config.
    both = F.step(first.fleet, [F.RunEnded("a:0", 0, on("n2"), crashed=True)], 6.0)
    assert names(both)[:3] == ["node_misconfigured", "learner_failed", "learner_retired"]
    assert both.fleet.blocked("a") == on("n1") and both.fleet.blocked("b") is None
    with pytest.raises(F.CommandError, match="every alive node of the region is marked"):
        F.step(both.fleet, [F.Scale("a", 3)], 6.5)
    # A node joins the region (or a marked one leaves): it is not blocked any more.
    grown = with_nodes(both.fleet, 7.0, a={"n1", "n2", "n3"}, b={"n1"})
    assert grown.blocked("a") is None
    assert [m["blocked"] for m in grown.marks()] == [False, False]
    gone = with_nodes(both.fleet, 7.0, a={"n1"}, b={"n1"})
    assert gone.blocked("a") is not None


def test_a_good_start_on_a_marked_node_clears_its_mark_for_that_region_only():
    fleet = with_nodes(training(settings(heartbeat_timeout_s=1e9)), 2.0,
                       a={"n1", "n2"}, b={"n1"})
    marked = F.step(fleet, [F.RunEnded("a:1", 0, on("n1"), crashed=True)], 5.0).fleet
    relaunched = F.step(marked, [], 10.0).fleet
    assert relaunched.slots["a:1"].state == SlotState.STARTING
    # b's learner starting on n1 proves nothing about a's devices there.
    b_back = F.step(F.step(relaunched, [F.RunEnded("b:0", 0, "died")], 10.0).fleet, [], 20.0)
    b_ready = F.step(b_back.fleet, [F.Beat("b:0", 1, True, 0.1, node_id="n1")], 21.0)
    assert "node_misconfigured_cleared" not in names(b_ready)
    ready = F.step(b_ready.fleet, [F.Beat("a:1", 1, True, 0.1, node_id="n1")], 22.0)
    assert names(ready) == ["learner_ready", "node_misconfigured_cleared"]
    assert ready.transitions[1].fields["reason"] == "a:1 started there"
    assert ready.fleet.misconfigured == {}


def test_an_operator_clears_one_marked_node_or_every_one():
    fleet = with_nodes(training(settings(heartbeat_timeout_s=1e9)), 2.0,
                       a={"n1", "n2"}, b={"n1"})
    marked = F.step(fleet, [F.RunEnded("a:1", 0, on("n1"), crashed=True),
                            F.RunEnded("a:0", 0, on("n2"), crashed=True)], 5.0).fleet
    assert marked.blocked("a") is not None
    with pytest.raises(F.CommandError, match="node 'n9' is not marked misconfigured; marked are"):
        F.check_command(marked, F.ClearMisconfigured("n9"))
    one = F.step(marked, [F.ClearMisconfigured("n2", origin="cli")], 6.0)
    assert names(one)[0] == "node_misconfigured_cleared"
    assert one.transitions[0].fields["origin"] == "cli"
    assert set(one.fleet.misconfigured) == {"n1"} and one.fleet.blocked("a") is None
    every = F.step(marked, [F.ClearMisconfigured()], 6.0)
    assert names(every)[:2] == ["node_misconfigured_cleared"] * 2
    assert every.fleet.misconfigured == {}


def test_a_backend_that_did_not_start_is_a_crash_with_budget_and_backoff():
    """A GPU held for a moment: the learner restarts after the backoff, nothing is marked."""
    fleet = training(settings(heartbeat_timeout_s=1e9))
    result = F.step(fleet, [F.RunEnded("a:1", 0, BACKEND_DOWN, crashed=True)], 5.0)
    assert names(result) == ["learner_failed", "learner_restart_scheduled"]
    assert result.transitions[1].fields["cause"] == "crash"
    assert result.transitions[1].fields["delay_s"] == 0.5
    assert result.fleet.misconfigured == {} and result.fleet.blocked("a") is None
    assert result.fleet.slots["a:1"].restart_counts == {Cause.CRASH: 1}


def test_a_spare_that_fails_its_device_check_is_not_replaced():
    s = settings(regions={"a": region_plan(1, 2, spares=1)})
    fleet = F.step(F.initial(s), [], 0.0).fleet
    launched = F.step(fleet, [F.Beat("a:0", 0, True, 0.1)], 1.0)
    assert F.LaunchSpare("spare:a:0", "a") in launched.actions
    ended = F.step(launched.fleet, [F.SpareEnded("spare:a:0", on("n1"))], 3.0)
    assert names(ended) == ["node_misconfigured", "spare_ended"]
    for t in (4.0, 10.0, 100.0):   # a spare that died of anything else would be replaced
        assert not [a for a in F.step(ended.fleet, [], t).actions if isinstance(a, F.LaunchSpare)]
    # Once the operator clears the node, a spare starts again.
    cleared = F.step(ended.fleet, [F.ClearMisconfigured("n1")], 101.0)
    assert F.LaunchSpare("spare:a:1", "a") in cleared.actions
    # Another node of the region is unmarked (not blocked): still no new spare, which could
    # land on the marked node again and again with no budget to stop it.
    other = with_nodes(ended.fleet, 102.0, a={"n1", "n2"})
    assert other.blocked("a") is None
    assert not [a for a in F.step(other, [], 103.0).actions if isinstance(a, F.LaunchSpare)]


def test_spares_whose_backend_does_not_start_back_off_and_mark_the_node_past_the_budget():
    """A driver too old on n1: every spare of region a fails its check there with a backend
    that did not start. A spare has no budget, so before this each failure started the next
    process at once, for the rest of the job. Now the region's next spare waits the restart
    policy's backoff (0.5, 1, 2 s ...); a spare that gets ready starts it over; past the crash
    budget (2) of such failures in a row on n1 the node is marked and no spare starts until
    it is cleared."""
    s = settings(regions={"a": F.RegionPlan(1, 2, spares=1)}, heartbeat_timeout_s=1e9)
    fleet = F.step(F.step(F.initial(s), [], 0.0).fleet, [F.Beat("a:0", 0, True, 0.1)], 1.0)
    assert F.LaunchSpare("spare:a:0", "a") in fleet.actions
    fleet, now = fleet.fleet, 2.0

    def fail_spare(fleet, now, error=BACKEND_DOWN):
        """The newest spare fails at ``now``: (result, its wait for the next)."""
        (name,) = fleet.spares
        result = F.step(fleet, [F.SpareEnded(name, error)], now)
        assert "LaunchSpare" not in kinds(result)   # not at once
        return result, result.transitions[-1].fields["next_spare_in_s"]

    def next_spare(fleet, now, wait):
        assert "LaunchSpare" not in kinds(F.step(fleet, [], now + wait - 0.01))
        started = F.step(fleet, [], now + wait)
        assert "LaunchSpare" in kinds(started)
        return started.fleet, now + wait + 1.0

    waits = []
    for _ in range(2):
        result, wait = fail_spare(fleet, now)
        waits.append(wait)
        fleet, now = next_spare(result.fleet, now, wait)
    assert waits == [0.5, 1.0]
    # A spare that gets ready (elsewhere, or the driver came back) starts the backoff over.
    (name,) = fleet.spares
    fleet = F.step(fleet, [F.SpareReady(name, node_id="n2"), F.SpareEnded(name, "actor died")],
                   now).fleet
    assert fleet.spare_backoff["a"].failed == 1
    fleet, now = next_spare(fleet, now, 0.5)
    # Three backend failures on n1 in a row (the budget is 2): n1 is marked, spares stop.
    for expected in (1.0, 2.0):
        result, wait = fail_spare(fleet, now)
        assert wait == expected and "node_misconfigured" not in names(result)
        fleet, now = next_spare(result.fleet, now, wait)
    result, wait = fail_spare(fleet, now)
    assert names(result) == ["node_misconfigured", "spare_ended"]
    assert result.transitions[0].fields["node"] == "n1"
    assert result.fleet.misconfigured["n1"]["a"].startswith("device backend did not start")
    assert "LaunchSpare" not in kinds(F.step(result.fleet, [], now + 1000.0))
    # Cleared (an operator, or a learner of the region starting well there): spares start at once.
    cleared = F.step(result.fleet, [F.ClearMisconfigured("n1")], now + 1000.0)
    assert "LaunchSpare" in kinds(cleared) and cleared.fleet.spare_backoff == {}


def test_a_mark_on_a_node_gone_does_not_hold_back_spares():
    """An autoscaler replaced the bad node n1: its mark stays (shown, clearable) but no longer
    keeps the region from its spares."""
    s = settings(regions={"a": F.RegionPlan(1, 2, spares=1)}, heartbeat_timeout_s=1e9)
    fleet = F.step(F.step(F.initial(s), [], 0.0).fleet, [F.Beat("a:0", 0, True, 0.1)], 1.0).fleet
    fleet = with_nodes(fleet, 1.5, a={"n1", "n2"})
    ended = F.step(fleet, [F.SpareEnded("spare:a:0", on("n1"))], 2.0).fleet
    assert set(ended.misconfigured) == {"n1"}
    assert "LaunchSpare" not in kinds(F.step(ended, [], 100.0))   # n1 is alive and marked
    replaced = with_nodes(ended, 101.0, a={"n2", "n3"})   # that report's step starts one
    assert set(replaced.misconfigured) == {"n1"} and list(replaced.spares) == ["spare:a:1"]


def test_a_good_start_anywhere_in_its_region_clears_its_unknown_node_mark():
    """A mark that names no node (an in-process learner, or a state file from before marks
    were a node's) is the region's: it blocked the region and its spares until an operator
    cleared it. A learner of the region that starts well clears it, and spares start again;
    another region's start does not."""
    s = settings(regions={"a": F.RegionPlan(2, 3, spares=1), "b": F.RegionPlan(1, 2)},
                 heartbeat_timeout_s=1e9)
    fleet = F.step(F.initial(s), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat(n, 0, True, 0.1) for n in fleet.slots], 1.0).fleet
    (spare,) = fleet.spares
    fleet = F.step(fleet, [F.SpareEnded(spare, "actor died")], 1.5).fleet   # no spare now
    marked = F.step(fleet, [F.RunEnded("a:1", 0, MISMATCH, crashed=True)], 2.0).fleet
    assert set(marked.misconfigured) == {F.UNKNOWN_NODE} and marked.blocked("a") is not None
    assert "LaunchSpare" not in kinds(F.step(marked, [], 50.0))
    back = F.step(F.step(marked, [F.RunEnded("b:0", 0, "died")], 3.0).fleet, [], 10.0).fleet
    b_ready = F.step(back, [F.Beat("b:0", 1, True, 0.1)], 11.0)
    assert "node_misconfigured_cleared" not in names(b_ready)
    back = F.step(F.step(b_ready.fleet, [F.RunEnded("a:0", 0, "died")], 12.0).fleet, [], 20.0)
    ready = F.step(back.fleet, [F.Beat("a:0", 1, True, 0.1)], 21.0)
    assert names(ready)[:2] == ["learner_ready", "node_misconfigured_cleared"]
    assert ready.transitions[1].fields["reason"] == "a:0 started in its region"
    assert ready.fleet.misconfigured == {} and ready.fleet.blocked("a") is None
    assert "LaunchSpare" in kinds(ready)


# -- crash loops and the crash backoff ------------------------------------------------------------
def fail_at(fleet, learner, incarnation, now, error, resume_step=None, crashed=True):
    """``learner``'s incarnation dies with ``error`` at ``now`` (``crashed``: its loop raised;
    else its process died); relaunched (past any backoff) at ``resume_step`` (the syncer's
    ledger) and training again. Returns (result, fleet)."""
    result = F.step(fleet, [F.RunEnded(learner, incarnation, error, crashed=crashed)], now)
    if result.fleet.slots[learner].state != SlotState.RESTARTING:
        return result, result.fleet
    obs = [F.Applied({learner: (incarnation, resume_step, 1)})] if resume_step is not None else []
    fleet = F.step(result.fleet, obs, now + 60.0).fleet
    fleet = F.step(fleet, [F.Beat(learner, incarnation + 1, True, 0.1)], now + 61.0).fleet
    return result, fleet


def test_a_learner_failing_at_one_resume_step_is_retired_as_a_crash_loop():
    """A bad record at step 50: each restart resumes at 48 and dies there again. The third
    failure at 48 retires it as crash_loop (its budget of 5 is not spent), naming the step and
    the error."""
    policy = dataclasses.replace(POLICY, max_crash_restarts=5, crash_loop_after=3)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    error = "RayTaskError(ValueError)(ValueError('bad record at step 50 (pid=%d)'))"
    now = 10.0
    result, fleet = fail_at(fleet, "a:0", 0, now, error % 101, resume_step=48)  # from step 0
    for incarnation, pid in ((1, 202), (2, 303), (3, 404)):
        assert fleet.slots["a:0"].start_step == 48
        now += 100.0
        result, fleet = fail_at(fleet, "a:0", incarnation, now, error % pid, resume_step=48)
        assert result.transitions[0].fields["resume_step"] == 48
    assert names(result) == ["learner_failed", "learner_retired"]
    retired = result.transitions[1].fields
    assert retired["cause"] == "crash_loop" and retired["step"] == 48
    assert retired["error"] == "RayTaskError(ValueError)(ValueError('bad record at step # (pid=#)'))"
    assert "crash loop: failed 3 times at resume step 48" in retired["reason"]
    slot = fleet.slots["a:0"]
    assert slot.state == SlotState.FAILED and "resume step 48" in slot.crash_loop
    assert slot.restart_counts == {Cause.CRASH: 3}   # budget left: the loop, not the budget


def test_process_deaths_at_one_step_spend_the_budget_not_a_crash_loop():
    """A dead process's line is Ray's, alike for an OOM kill, a segfault and a SIGKILL from
    outside: not the learner's own error, so no crash loop; the budget of 5 ends it."""
    policy = dataclasses.replace(POLICY, max_crash_restarts=5, crash_loop_after=3)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    died = "The actor died unexpectedly before finishing this task. pid=%d"
    now, events = 10.0, []
    for incarnation in range(6):
        result, fleet = fail_at(fleet, "a:0", incarnation, now, died % (100 + incarnation),
                                resume_step=48, crashed=False)
        events += names(result)
        now += 100.0
    assert "learner_retired" in events
    retired = next(t for t in result.transitions if t.name == "learner_retired").fields
    assert retired.get("cause") != "crash_loop" and fleet.slots["a:0"].crash_loop is None
    assert fleet.slots["a:0"].restart_counts == {Cause.CRASH: 5}


def test_chaos_kills_at_one_step_are_never_a_crash_loop():
    policy = dataclasses.replace(POLICY, max_crash_restarts=None, crash_loop_after=2)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    now = 10.0
    for incarnation in range(4):
        fleet = F.step(fleet, [F.Chaos(Fault(now, FaultKind.KILL, "a:0", 0.0))], now).fleet
        result, fleet = fail_at(fleet, "a:0", incarnation, now + 0.1, "actor died",
                                resume_step=48)
        assert "learner_restart_scheduled" in names(result)
        now += 100.0


def test_chaos_hangs_at_one_step_are_never_a_crash_loop():
    policy = dataclasses.replace(POLICY, max_crash_restarts=None, crash_loop_after=2)
    fleet = training(settings(heartbeat_timeout_s=5.0, policy=policy))
    now = 1.0
    for incarnation in range(3):
        fleet = F.step(fleet, [F.HangCommand("a:0", 60.0)], now).fleet
        hung = F.step(fleet, [F.Beat(n, 0, True, 0.1) for n in ("a:1", "b:0")], now + 6.0)
        assert names(hung)[:2] == ["learner_unhealthy", "learner_failed"], names(hung)
        assert "learner_restart_scheduled" in names(hung)
        fleet = F.step(hung.fleet, [F.Applied({"a:0": (incarnation, 48, 1)})], now + 60.0).fleet
        now += 61.0
        fleet = F.step(fleet, [F.Beat("a:0", incarnation + 1, True, 0.1)] + [
            F.Beat(n, 0, True, 0.1) for n in ("a:1", "b:0")], now).fleet
    assert fleet.slots["a:0"].failures == ()


def test_the_same_error_within_the_window_of_steps_is_a_crash_loop_and_progress_is_not():
    policy = dataclasses.replace(POLICY, max_crash_restarts=None, crash_loop_after=3,
                                 crash_loop_window_steps=16)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    # An out-of-memory death every ~100 steps: far apart, never a loop.
    now, step = 10.0, 0
    for incarnation in range(5):
        step += 100
        result, fleet = fail_at(fleet, "a:0", incarnation, now, "actor died: OOM", step)
        assert "learner_restart_scheduled" in names(result)
        now += 100.0
    # Then three within 16 steps (500, 508, 512): retired.
    for incarnation, at in ((5, 508), (6, 512), (7, None)):
        result, fleet = fail_at(fleet, "a:0", incarnation, now, "actor died: OOM", at)
        now += 100.0
    assert result.transitions[-1].fields["cause"] == "crash_loop"
    assert result.transitions[-1].fields["step"] == 512


def test_start_up_timeouts_and_hangs_at_one_resume_step_spend_the_budget_not_a_crash_loop():
    """A busy machine: a:0 crashes once, then its next processes never beat (start-up timeouts,
    each "hang detected" at the same resume step 0). Those are the fleet's verdicts, not the
    learner's error: they spend its budget of 5 and retire it as such, never as a crash loop
    (before, a crash and two timeouts at step 0 made one)."""
    policy = dataclasses.replace(POLICY, max_crash_restarts=5, crash_loop_after=3)
    fleet = training(settings(heartbeat_timeout_s=1e9, startup_timeout_s=120.0, policy=policy))
    result = F.step(fleet, [F.RunEnded("a:0", 0, "RuntimeError('died')", crashed=True)], 10.0)
    now, outcomes = 10.0, []
    for incarnation in range(1, 6):
        fleet = F.step(result.fleet, [], now + 60.0).fleet   # relaunched, past any backoff
        assert fleet.slots["a:0"].state == SlotState.STARTING
        assert fleet.slots["a:0"].incarnation == incarnation
        now += 60.0 + 121.0                                 # no beat: the start-up timeout
        result = F.step(fleet, [], now)
        assert names(result)[:2] == ["learner_unhealthy", "learner_failed"]
        assert result.transitions[1].fields["resume_step"] == 0
        outcomes.append(names(result)[-1])
    assert outcomes == ["learner_restart_scheduled"] * 4 + ["learner_retired"]
    retired = result.transitions[-1].fields
    assert "cause" not in retired and "crash budget of 5 spent (hang)" in retired["reason"]
    slot = result.fleet.slots["a:0"]
    assert slot.crash_loop is None and slot.failures == ((0, "RuntimeError('died')"),)


def test_the_same_step_with_different_errors_is_no_crash_loop():
    policy = dataclasses.replace(POLICY, max_crash_restarts=None, crash_loop_after=3)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    now = 10.0
    errors = ("OSError('disk')", "MemoryError()", "KeyError('x')", "ValueError('y')")
    for incarnation, error in enumerate(errors):   # the first at step 0, then three at 48
        result, fleet = fail_at(fleet, "a:0", incarnation, now, error, resume_step=48)
        assert names(result)[-1] == "learner_restart_scheduled"
        now += 100.0
    assert [step for step, _ in fleet.slots["a:0"].failures] == [0, 48, 48, 48]
    # The third of one error at 48 is one.
    for incarnation in (4, 5):
        result, fleet = fail_at(fleet, "a:0", incarnation, now, "MemoryError()", resume_step=48)
        now += 100.0
    assert result.transitions[-1].fields["cause"] == "crash_loop"


def test_device_mismatches_on_a_marked_node_are_never_a_crash_loop():
    """n2 of region a is unmarked, so a:1's mismatch on n1 restarts it as a crash; Ray puts it
    back on n1 each time. Its line names the node (hex, alike in every signature) and it is the
    node's fault, not the learner's at its resume step: no crash loop after three; its budget
    ends it, and the node stays marked."""
    policy = dataclasses.replace(POLICY, max_crash_restarts=4, crash_loop_after=3)
    fleet = with_nodes(training(settings(heartbeat_timeout_s=1e9, policy=policy)), 2.0,
                       a={"n1", "n2"}, b={"n1"})
    node = "4f2a9c0d1e7b3a5f6c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d"
    now, outcomes = 5.0, []
    for incarnation in range(5):
        result, fleet = fail_at(fleet, "a:1", incarnation, now, on(node))
        assert all(t.fields.get("cause") != "crash_loop" for t in result.transitions)
        outcomes.append(names(result)[-1])
        now += 100.0
    assert outcomes == ["learner_restart_scheduled"] * 4 + ["learner_retired"]
    assert "crash budget of 4 spent" in result.transitions[-1].fields["reason"]
    slot = fleet.slots["a:1"]
    assert slot.crash_loop is None and slot.failures == ()
    assert set(fleet.misconfigured) == {node} and fleet.blocked("a") is None


def test_a_learner_failing_a_fixed_time_after_each_start_is_retired_once_its_budget_is_spent():
    """It dies 40 s after each start, somewhere else each time (no crash loop by step): with
    the default policy (reset after 600 s of training) its crashes keep counting, and the sixth
    retires it. The old 30 s reset restarted it forever."""
    policy = RestartPolicy()
    assert policy.reset_after_s >= 300 and policy.max_crash_restarts == 5
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    now, step, delays = 1.0, 0, []
    for incarnation in range(6):
        now += 40.0
        fleet = F.step(fleet, [F.Beat("a:0", incarnation, True, 0.1)], now).fleet
        step += 400
        result, fleet = fail_at(fleet, "a:0", incarnation, now, "MemoryError()", step)
        if incarnation < 5:
            delays.append(result.transitions[1].fields["delay_s"])
        now += 61.0
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert names(result) == ["learner_failed", "learner_retired"]
    assert "crash budget of 5 spent" in result.transitions[1].fields["reason"]
    # The old default let each 40 s of training start the budget over: never retired.
    old = dataclasses.replace(policy, reset_after_s=30.0)
    assert old.healthy(40.0) and not policy.healthy(40.0)


def test_paused_time_is_not_training_time():
    """a:0 trains 2 s, is paused 100 s, trains 2 s more and fails: it trained 4 s, not 104 s
    (reset_after_s 10): its earlier crash still counts."""
    policy = dataclasses.replace(POLICY, max_crash_restarts=5, reset_after_s=10.0)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))   # trains since 1.0
    result, fleet = fail_at(fleet, "a:0", 0, 2.0, "died")   # counted: crash 1, trains from 63.0
    paused = F.step(fleet, [F.PauseJob(True)], 65.0)
    assert fleet.slots["a:0"].training_since_s == 63.0
    assert paused.fleet.slots["a:0"].paused_since_s == 65.0
    resumed = F.step(paused.fleet, [F.PauseJob(False)], 165.0).fleet
    assert resumed.slots["a:0"].paused_s == 100.0 and resumed.slots["a:0"].paused_since_s is None
    beat = F.step(resumed, [F.Beat("a:0", 1, True, 0.1)], 167.0).fleet
    assert beat.slots["a:0"].trained_seconds(167.0) == 4.0
    result = F.step(beat, [F.RunEnded("a:0", 1, "died")], 167.0)
    assert dict(result.fleet.slots["a:0"].counted) == {Cause.CRASH: 2}   # not reset
    assert result.transitions[1].fields["delay_s"] == 1.0
    # Failing while still paused: the pause so far is left out too.
    again = F.step(F.step(beat, [F.PauseJob(True)], 168.0).fleet, [], 500.0).fleet
    assert again.slots["a:0"].trained_seconds(500.0) == 5.0


def test_handovers_and_straggler_restarts_do_not_lengthen_the_crash_backoff():
    policy = dataclasses.replace(POLICY, max_crash_restarts=5)
    fleet = training(settings(heartbeat_timeout_s=1e9, policy=policy))
    history = ((Cause.STRAGGLER, 1), (Cause.PREEMPTED_PLANNED, 4))
    slot = dataclasses.replace(fleet.slots["a:0"], restarts=history, counted=history)
    fleet = dataclasses.replace(fleet, slots={**fleet.slots, "a:0": slot})
    result = F.step(fleet, [F.RunEnded("a:0", 0, "died")], 5.0)
    assert result.transitions[1].fields["delay_s"] == 0.5   # a first crash: 0.5·2^0, not 2^5


# -- planned preemption (a node Ray reports draining) ----------------------------------------------
def on_nodes(fleet, now, **nodes):
    """Every live learner beats from its node: ``on_nodes(fleet, t, n2=["b:0"])`` puts b:0 on n2
    and everyone else on n1."""
    where = {learner: node for node, learners in nodes.items() for learner in learners}
    return F.step(fleet, [F.Beat(n, x.incarnation, True, 0.1, node_id=where.get(n, "n1"))
                          for n, x in fleet.slots.items() if x.state in F.LIVE], now).fleet


def draining(now, deadline=None, **extra):
    return F.Cluster({"a": 3, "b": 2}, frozenset({"n1", "n2", "n3"}),
                     draining={"n2": deadline, **extra})


def test_a_draining_node_drains_its_learners_and_restarts_them_elsewhere_at_once():
    fleet = on_nodes(training(), 9.0, n2=["b:0"])
    notice = F.step(fleet, alive(fleet) + [draining(10.0, deadline=30.0)], 10.0)
    assert names(notice) == ["node_draining", "learner_draining"]
    node, drain = (t.fields for t in notice.transitions)
    assert (node["node"], node["deadline_in_s"], node["learners"]) == ("n2", 20.0, ["b:0"])
    assert drain["cause"] == "preempted_planned" and drain["to"] == "draining"
    assert notice.actions == (F.DrainLearner("b:0"),)   # finishes its in-flight pushes first
    assert states(notice.fleet) == {"a:0": "training", "a:1": "training", "b:0": "draining"}
    assert names(F.step(notice.fleet, alive(notice.fleet) + [draining(12.0, 30.0)], 12.0)) == []
    # Out (every push answered): restarted now, no backoff, a new process (no spare here).
    out = F.step(notice.fleet, alive(notice.fleet, "b:0") + [F.RunEnded("b:0", 0)], 13.0)
    assert names(out) == ["learner_restart_scheduled", "learner_restarted"]
    assert out.transitions[0].fields["cause"] == "preempted_planned"
    assert out.transitions[0].fields["delay_s"] == 0.0
    forget, launch = out.actions
    assert forget == F.Forget("b:0", 0, "drained")
    assert (launch.learner, launch.incarnation, launch.spare) == ("b:0", 1, None)
    slot = out.fleet.slots["b:0"]
    # (a new process Ray has yet to place off the draining node)
    assert slot.state == SlotState.AWAITING_PLACEMENT and slot.node_id is None   # not its old node's
    assert slot.restart_counts == {Cause.PREEMPTED_PLANNED: 1}
    assert dict(slot.recovery)["cause"] == "preempted_planned"
    # Its new incarnation beats from another node: the drain that goes on is not its business.
    moved = F.step(out.fleet, alive(out.fleet, "b:0") + [F.Beat("b:0", 1, True, node_id="n3")],
                   14.0)
    assert names(moved) == ["learner_ready"]
    assert names(F.step(moved.fleet, alive(moved.fleet) + [draining(15.0, 30.0)], 15.0)) == []


def test_planned_preemptions_spend_no_budget_and_one_still_on_the_node_at_the_end_dies():
    fleet, now = on_nodes(training(), 9.0, n2=["b:0"]), 10.0
    for incarnation in range(3):   # more than the crash budget (2) of handovers
        fleet = F.step(fleet, alive(fleet) + [F.Cluster({"a": 3}, None, {})], now).fleet
        fleet = F.step(fleet, alive(fleet) + [draining(now, now + 20)], now + 1).fleet
        result = F.step(fleet, alive(fleet, "b:0") + [F.RunEnded("b:0", incarnation)], now + 2)
        assert "learner_restarted" in names(result)
        fleet = on_nodes(result.fleet, now + 3, n2=["b:0"])
        now += 10
    assert fleet.slots["b:0"].restart_counts == {Cause.PREEMPTED_PLANNED: 3}
    assert RestartPolicy(max_crash_restarts=0).budget_for(Cause.PREEMPTED_PLANNED) is None
    # Still on the node when it went: a preemption as ever (its own budget), not a handover.
    fleet = F.step(fleet, alive(fleet) + [F.Cluster({"a": 3}, None, {})], now).fleet
    fleet = F.step(fleet, alive(fleet) + [draining(now, now + 20)], now + 1).fleet
    died = F.step(fleet, alive(fleet, "b:0") + [F.RunEnded("b:0", 3, "actor died")], now + 21)
    assert names(died) == ["learner_failed", "learner_restart_scheduled"]
    assert died.transitions[0].fields["cause"] == "preemption"
    assert "restart 1 of unlimited (preemption)" in died.transitions[1].fields["message"]


def test_a_draining_node_hands_over_to_a_ready_spare_elsewhere_and_ends_its_own_spares():
    s = settings(regions={"a": region_plan(3, 4, spares=2)})
    fleet = on_nodes(training(s), 1.5, n2=["a:0", "a:1"])      # a:2 on n1 (the quorum holds)
    fleet = F.step(fleet, alive(fleet), 2.0).fleet             # the second spare starts
    assert sorted(fleet.spares) == ["spare:a:0", "spare:a:1"]
    fleet = F.step(fleet, alive(fleet) + [F.SpareReady("spare:a:0", node_id="n3"),
                                          F.SpareReady("spare:a:1", node_id="n2")], 3.0).fleet
    notice = F.step(fleet, alive(fleet) + [draining(4.0)], 4.0)
    assert names(notice) == ["node_draining", "learner_draining", "learner_draining",
                             "spare_ended", "spare_launched"]      # its replacement, elsewhere
    assert notice.transitions[0].fields["spares"] == ["spare:a:1"]
    assert notice.transitions[0].fields["deadline_in_s"] is None
    assert F.KillSpare("spare:a:1") in notice.actions
    assert F.LaunchSpare("spare:a:2", "a") in notice.actions
    first = F.step(notice.fleet, alive(notice.fleet, "a:0") + [F.RunEnded("a:0", 0)], 5.0)
    launch = [a for a in first.actions if isinstance(a, F.Launch)]
    assert [(a.learner, a.incarnation, a.spare) for a in launch] == [("a:0", 1, "spare:a:0")]
    second = F.step(first.fleet, alive(first.fleet, "a:1") + [F.RunEnded("a:1", 0)], 6.0)
    launch = [a for a in second.actions if isinstance(a, F.Launch)]
    assert [(a.learner, a.incarnation, a.spare) for a in launch] == [("a:1", 1, None)]
    # A spare that gets ready on a draining node is ended at once, never promoted.
    ended = F.step(second.fleet, alive(second.fleet) + [F.SpareReady("spare:a:2", node_id="n2")],
                   8.0)
    assert {"spare_ready", "spare_ended"} <= set(names(ended))
    assert "spare:a:2" not in ended.fleet.spares


def test_a_learner_draining_off_a_preempted_node_counts_for_scaling():
    fleet = on_nodes(training(), 9.0, n2=["a:1"])
    fleet = F.step(fleet, alive(fleet) + [draining(10.0)], 10.0).fleet
    same = F.step(fleet, alive(fleet), 10.5)
    assert names(F.step(same.fleet, alive(same.fleet) + [F.Scale("a", 2)], 11.0)) == ["scaled"]
    down = F.step(fleet, alive(fleet) + [F.Scale("a", 1)], 11.0)    # a:1 leaves for good
    assert down.transitions[-1].fields["drained"] == ["a:1"]
    gone = F.step(down.fleet, alive(down.fleet, "a:1") + [F.RunEnded("a:1", 0)], 12.0)
    assert names(gone) == ["learner_retired"] and gone.fleet.slots["a:1"].restarts == ()


def test_a_spare_ready_while_a_learner_waits_for_its_repair_takes_its_place_at_once():
    s = settings(regions={"a": region_plan(3, 4, spares=1)}, heartbeat_timeout_s=1e9)
    fleet = training(s)                                   # spare:a:0 launched, not ready yet
    killed = F.step(fleet, [F.Chaos(Fault(4.0, FaultKind.KILL, "a:1", duration_s=5.0))], 4.0)
    failed = F.step(killed.fleet, [F.RunEnded("a:1", 0, "actor died")], 4.0)
    assert failed.transitions[-1].fields["delay_s"] == 5.0    # the lost process's repair time
    assert names(F.step(failed.fleet, [], 5.0)) == []
    ready = F.step(failed.fleet, [F.SpareReady("spare:a:0")], 5.9)    # not at 9.0
    assert names(ready) == ["spare_ready", "spare_promoted", "learner_restarted"]
    (launch,) = ready.actions
    assert (launch.learner, launch.incarnation, launch.spare) == ("a:1", 1, "spare:a:0")


# -- every drain ends ----------------------------------------------------------------------------
def test_a_wedged_draining_learner_is_ended_at_its_deadline_and_its_work_dropped_as_such():
    from islands.learners.fates import IncarnationFates
    from islands.orchestrator.books import Books

    fleet = training(settings(drain_timeout_s=20.0))
    down = F.step(fleet, alive(fleet) + [F.Scale("a", 1)], 5.0)        # a:1 drains
    assert down.fleet.slots["a:1"].draining_since_s == 5.0
    # Draining sends no beats and the health check leaves it alone: it waits for its answers.
    assert names(F.step(down.fleet, alive(down.fleet, "a:1"), 24.9)) == []
    ended = F.step(down.fleet, alive(down.fleet, "a:1"), 25.0)
    assert names(ended) == ["learner_drain_timeout", "learner_retired"]
    assert ended.actions == (F.Kill("a:1", 0, "bury", "drain_timeout"),
                             F.Forget("a:1", 0, "drain_timeout"))   # one Forget, its reason
    assert ended.transitions[0].fields["draining_s"] == 20.0
    assert not ended.transitions[0].fields["handover"]
    slot = ended.fleet.slots["a:1"]
    assert slot.state == SlotState.RETIRED and slot.restarts == ()   # no budget spent
    assert ended.transitions[1].fields["reason"].startswith("drain_timeout")
    # Its run ending later (the kill) changes nothing.
    assert names(F.step(ended.fleet, [F.RunEnded("a:1", 0, "actor died")], 26.0)) == []
    # The books: what it held (a push never answered, the steps since) is dropped for the
    # Forget's reason, and they balance.
    held = IncarnationFates(1)
    held.step(64, 1.0)
    held.pushed(0, step=1)
    held.step(64, 1.0)
    books = Books(num_fragments=1)
    books.allocate("a:1", 0.0)
    (forget,) = [a for a in ended.actions if isinstance(a, F.Forget)]
    assert books.close_incarnation("a:1", held.to_json(), {}, forget.reason) == 128
    tokens = books.tokens({})
    assert tokens.dropped_by == {"drain_timeout": 128} and tokens.in_flight == 0
    assert tokens.balanced()


def test_a_wedged_handover_is_ended_at_its_deadline_and_still_restarts_elsewhere():
    fleet = on_nodes(training(settings(drain_timeout_s=20.0)), 9.0, n2=["b:0"])
    notice = F.step(fleet, alive(fleet) + [draining(10.0, deadline=60.0)], 10.0)
    assert notice.fleet.slots["b:0"].draining_since_s == 10.0
    ended = F.step(notice.fleet, alive(notice.fleet, "b:0"), 30.0)
    assert names(ended) == ["learner_drain_timeout", "learner_restart_scheduled",
                            "learner_restarted"]
    assert ended.transitions[0].fields["handover"]
    kill, forget, launch = ended.actions
    assert (kill, forget) == (F.Kill("b:0", 0, "bury", "drain_timeout"),
                              F.Forget("b:0", 0, "drain_timeout"))
    assert (launch.learner, launch.incarnation) == ("b:0", 1)
    slot = ended.fleet.slots["b:0"]
    assert slot.restart_counts == {Cause.PREEMPTED_PLANNED: 1} and slot.draining_since_s is None


def test_a_drain_that_ends_in_time_is_not_timed_out_and_its_successor_starts_afresh():
    fleet = on_nodes(training(settings(drain_timeout_s=20.0)), 9.0, n2=["b:0"])
    notice = F.step(fleet, alive(fleet) + [draining(10.0)], 10.0)
    out = F.step(notice.fleet, alive(notice.fleet, "b:0") + [F.RunEnded("b:0", 0)], 29.0)
    assert "learner_drain_timeout" not in names(out)
    assert out.fleet.slots["b:0"].draining_since_s is None
    later = F.step(out.fleet, [F.Beat("b:0", 1, True, node_id="n3")], 31.0)
    assert "learner_drain_timeout" not in names(later)


def test_a_handover_with_nowhere_to_run_awaits_placement_never_hung_and_spends_no_budget():
    fleet = on_nodes(training(), 9.0, n2=["b:0"])
    notice = F.step(fleet, alive(fleet) + [draining(10.0, deadline=30.0)], 10.0)
    out = F.step(notice.fleet, alive(notice.fleet, "b:0") + [F.RunEnded("b:0", 0)], 11.0)
    assert names(out) == ["learner_restart_scheduled", "learner_restarted"]
    assert out.transitions[1].fields["to"] == "awaiting_placement"
    slot = out.fleet.slots["b:0"]
    assert slot.state == SlotState.AWAITING_PLACEMENT and slot in out.fleet.live()
    # Far past the start-up timeout (60 s) and the heartbeat timeout: no verdict, no budget.
    waited = F.step(out.fleet, alive(out.fleet, "b:0"), 11.0 + 600.0)
    assert names(waited) == [] and waited.actions == ()
    assert waited.fleet.slots["b:0"].restart_counts == {Cause.PREEMPTED_PLANNED: 1}
    # Ray places it (a node of the region joined): it starts, timed from now, not its launch.
    placed = F.step(waited.fleet, alive(waited.fleet, "b:0") + [F.Placed("b:0", 1, "n4")], 700.0)
    assert names(placed) == ["learner_placed"]
    assert placed.transitions[0].fields["waited_s"] == 689.0
    slot = placed.fleet.slots["b:0"]
    assert (slot.state, slot.launched_s, slot.node_id) == (SlotState.STARTING, 700.0, "n4")
    assert names(F.step(placed.fleet, alive(placed.fleet, "b:0"), 759.0)) == []
    hung = F.step(placed.fleet, alive(placed.fleet, "b:0"), 761.0)   # then it may hang
    assert [t.learner for t in hung.transitions if t.name == "learner_unhealthy"] == ["b:0"]
    ready = F.step(placed.fleet, [F.Beat("b:0", 1, True, node_id="n4")], 710.0)
    assert names(ready) == ["learner_ready"]
    # A placement of another incarnation, or of a learner not waiting, changes nothing.
    other = F.step(waited.fleet, alive(waited.fleet, "b:0") + [F.Placed("b:0", 0),
                                                               F.Placed("a:0", 0)], 701.0)
    assert names(other) == [] and other.fleet.slots["b:0"].state == SlotState.AWAITING_PLACEMENT


def test_a_first_training_beat_also_ends_the_wait_and_a_drain_or_stop_calls_it_off():
    fleet = on_nodes(training(), 9.0, n2=["a:1"])
    fleet = F.step(fleet, alive(fleet) + [draining(10.0)], 10.0).fleet
    fleet = F.step(fleet, alive(fleet, "a:1") + [F.RunEnded("a:1", 0)], 11.0).fleet
    assert fleet.slots["a:1"].state == SlotState.AWAITING_PLACEMENT
    beat = F.step(fleet, [F.Beat("a:1", 1, True, node_id="n3")], 20.0)
    assert names(beat) == ["learner_ready"]
    down = F.step(fleet, alive(fleet, "a:1") + [F.Scale("a", 1)], 20.0)
    assert F.Kill("a:1", 1) in down.actions
    assert down.fleet.slots["a:1"].state == SlotState.RETIRED
    stop = F.step(fleet, [F.Stop()], 20.0)
    assert F.Kill("a:1", 1) in stop.actions
    assert stop.fleet.slots["a:1"].state == SlotState.RETIRED


def test_a_handover_to_a_ready_spare_does_not_await_placement():
    s = settings(regions={"a": region_plan(3, 4, spares=1)})
    fleet = on_nodes(training(s), 1.5, n2=["a:0"])
    fleet = F.step(fleet, alive(fleet) + [F.SpareReady("spare:a:0", node_id="n3")], 3.0).fleet
    fleet = F.step(fleet, alive(fleet) + [draining(4.0)], 4.0).fleet
    out = F.step(fleet, alive(fleet, "a:0") + [F.RunEnded("a:0", 0)], 5.0)
    assert out.fleet.slots["a:0"].state == SlotState.STARTING
