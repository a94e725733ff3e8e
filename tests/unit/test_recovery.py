"""A restarted controller's slots from its saved state (orchestrator/owner.py, its saved rows)."""

from islands.orchestrator import fleet as F
from islands.orchestrator.health import Cause
from islands.orchestrator.owner import saved_slot

ROW = {"learner": "far:0", "region": "far", "index": 0, "shard": 1, "speed_factor": 1.0,
       "state": "training", "incarnation": 2, "start_step": 40, "restarts": {"hang": 1},
       "actor": "spare:far:3", "slow_tolerated": 0}


def test_a_remote_regions_learner_stays_mirrored_after_a_controller_restart():
    """Lost once: the restarted home took far:0 for its own, found it hung (no local beats),
    prestarted its restart at home and never took the region's reports of it again."""
    slot = saved_slot(ROW, remote=True)
    assert slot.remote and slot.state == F.SlotState.TRAINING
    assert (slot.incarnation, slot.start_step, slot.actor) == (2, 40, "spare:far:3")
    assert slot.restarts == ((Cause.HANG, 1),)
    assert not saved_slot({**ROW, "learner": "a:0", "region": "a"}, remote=False).remote


def test_the_counted_restarts_and_the_training_start_survive_a_controller_restart():
    """RestartPolicy.reset_after_s needs both; a state file written before ``counted`` existed
    counts every restart, as the rule then did."""
    slot = saved_slot({**ROW, "restarts": {"hang": 3, "crash": 2}, "counted": {"crash": 1},
                       "training_since_s": 1234.5}, remote=False)
    assert slot.counted == ((Cause.CRASH, 1),) and slot.training_since_s == 1234.5
    old = saved_slot(ROW, remote=False)
    assert old.counted == old.restarts == ((Cause.HANG, 1),) and old.training_since_s is None


def test_paused_time_survives_a_controller_restart():
    """a:0 trains from 100 s, was paused 20 s before and is paused since 150 s when the state is
    saved at 200 s: 70 s of it were paused. The restarted controller's slot still leaves them
    out of its training time (before, only the training start was saved: 150 s of training at
    250 s, enough for ``reset_after_s`` to forgive a crash loop's restarts)."""
    import json

    from islands.orchestrator.owner import slot_row

    paused = F.Slot("a:0", "a", 0, 0, state=F.SlotState.PAUSED, training_since_s=100.0,
                    paused_s=20.0, paused_since_s=150.0)
    row = json.loads(json.dumps(slot_row(paused, 200.0)))   # the state file
    slot = saved_slot(row, remote=False)
    assert slot.paused_s == 70.0 and slot.paused_since_s is None
    assert slot.trained_seconds(250.0) == 80.0   # 150 s since its start, 70 of them paused
    old = saved_slot({k: v for k, v in row.items() if k != "paused_s"}, remote=False)
    assert old.paused_s == 0.0 and old.trained_seconds(250.0) == 150.0   # an older file


def test_crash_loop_records_and_node_marks_survive_a_controller_restart():
    """The new shapes are read back; a state file without them (or a region-keyed mark, the
    shape before marks were a node's) still loads."""
    from islands.orchestrator.owner import saved_marks

    slot = saved_slot({**ROW, "failures": [[48, "died"], [48, "died"]],
                       "crash_loop": "failed 3 times at resume step 48 with: died"}, remote=False)
    assert slot.failures == ((48, "died"), (48, "died")) and "step 48" in slot.crash_loop
    old = saved_slot(ROW, remote=False)
    assert old.failures == () and old.crash_loop is None
    assert saved_marks({"n1": {"gpu": "device check failed: x"}}) == {
        "n1": {"gpu": "device check failed: x"}}
    assert saved_marks({"gpu": "device check failed: x"}) == {
        F.UNKNOWN_NODE: {"gpu": "device check failed: x"}}
    assert saved_marks(None) == {}


def test_a_handover_survives_a_controller_restart():
    """A learner draining off a node announced for preemption when the controller died: the
    restarted controller's fleet (rebuilt from the saved rows) still hands it over once it is
    out, instead of retiring it as a plain drain, and its drain's deadline goes on."""
    import json

    from islands.orchestrator.owner import slot_row

    settings = F.FleetSettings({"a": F.RegionPlan(2, 2)}, drain_timeout_s=60.0)
    fleet = F.step(F.initial(settings), [], 0.0).fleet
    fleet = F.step(fleet, [F.Beat(n, 0, True, 0.1, node_id="n2" if n == "a:1" else "n1")
                           for n in fleet.slots], 1.0).fleet
    fleet = F.step(fleet, [F.Cluster({"a": 2}, frozenset({"n1", "n2"}), {"n2": None})],
                   2.0).fleet
    assert fleet.slots["a:1"].state == F.SlotState.DRAINING
    rows = json.loads(json.dumps([slot_row(x) for x in fleet.slots.values()]))  # the state file
    slots = [saved_slot(row, remote=False) for row in rows]
    restored = F.rebuilt(settings, slots, fleet.targets, fleet.next_index, fleet.next_shard)
    slot = restored.slots["a:1"]
    assert (slot.state, slot.preempted_s, slot.draining_since_s) == (F.SlotState.DRAINING, 2.0,
                                                                     2.0)
    out = F.step(restored, [F.Beat("a:0", 0, True, 0.1), F.RunEnded("a:1", 0)], 5.0)
    assert [t.name for t in out.transitions] == ["learner_restart_scheduled",
                                                 "learner_restarted"]
    assert out.transitions[0].fields["cause"] == "preempted_planned"
    assert out.fleet.slots["a:1"].incarnation == 1
    # A plain drain saved the same way still retires.
    plain = F.rebuilt(settings, [saved_slot({**rows[1], "preempted_s": None}, remote=False),
                                 slots[0]], fleet.targets, fleet.next_index, fleet.next_shard)
    gone = F.step(plain, [F.Beat("a:0", 0, True, 0.1), F.RunEnded("a:1", 0)], 5.0)
    assert [t.name for t in gone.transitions] == ["learner_retired"]
    # An older state file (no drain start saved) reads as no handover and no deadline.
    old = saved_slot({k: v for k, v in rows[1].items()
                      if k not in ("preempted_s", "draining_since_s")}, remote=False)
    assert old.preempted_s is None and old.draining_since_s is None


def test_a_handover_awaiting_placement_at_a_controller_restart_awaits_it_again():
    """Its process was never placed (nothing to re-attach): the restarted controller relaunches
    it as a handover, which waits for placement again instead of being timed as a start."""
    from islands.orchestrator.owner import relaunched

    settings = F.FleetSettings({"far": F.RegionPlan(1, 1)}, startup_timeout_s=60.0)
    slot = relaunched(saved_slot({**ROW, "state": "awaiting_placement", "actor": None},
                                 remote=False), known=1, now=100.0)
    fleet = F.rebuilt(settings, [slot], {"far": 1}, {"far": 1}, 1)
    out = F.step(fleet, [], 100.0)
    (launch,) = out.actions
    assert (launch.learner, launch.incarnation, launch.start_step) == ("far:0", 3, 40)
    assert out.fleet.slots["far:0"].state == F.SlotState.AWAITING_PLACEMENT
    assert [t.name for t in F.step(out.fleet, [], 100.0 + 600.0).transitions] == []
    assert out.fleet.slots["far:0"].restarts == ((Cause.HANG, 1),)   # nothing counted anew


def test_a_handover_caught_in_the_state_saves_gap_is_relaunched_as_a_handover():
    """The fleet launches a handover in the step its drain ends; the state file can be a second
    older, so a controller dying in that gap saved the slot draining with its preemption. Its
    learner is not found (the new process was never placed, and is ended): the relaunch is a
    handover again, waiting for placement, not a start timed by the start-up limit that spends
    the crash budget."""
    from islands.orchestrator.owner import relaunched

    settings = F.FleetSettings({"far": F.RegionPlan(1, 1)}, startup_timeout_s=60.0)
    row = {**ROW, "state": "draining", "actor": None, "preempted_s": 90.0,
           "draining_since_s": 90.0}
    slot = relaunched(saved_slot(row, remote=False), known=2, now=100.0)
    fleet = F.rebuilt(settings, [slot], {"far": 1}, {"far": 1}, 1)
    out = F.step(fleet, [], 100.0)
    (launch,) = out.actions
    assert (launch.learner, launch.incarnation) == ("far:0", 3)
    assert out.fleet.slots["far:0"].state == F.SlotState.AWAITING_PLACEMENT
    assert [t.name for t in F.step(out.fleet, [], 100.0 + 600.0).transitions] == []
    assert out.fleet.slots["far:0"].restarts == ((Cause.HANG, 1), (Cause.PREEMPTED_PLANNED, 1))
    assert out.fleet.slots["far:0"].counted == ((Cause.HANG, 1), (Cause.PREEMPTED_PLANNED, 1))
    # A plain drain saved the same way (no preemption) is relaunched as before.
    plain = relaunched(saved_slot({**row, "preempted_s": None}, remote=False), known=2,
                       now=100.0)
    assert plain.recovery is None
