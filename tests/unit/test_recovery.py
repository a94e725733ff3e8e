"""A restarted controller's slots from its saved state (orchestrator/recovery.py)."""

from islands.orchestrator import fleet as F
from islands.orchestrator.health import Cause
from islands.orchestrator.recovery import saved_slot

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


def test_crash_loop_records_and_node_marks_survive_a_controller_restart():
    """The new shapes are read back; a state file without them (or a region-keyed mark, the
    shape before marks were a node's) still loads."""
    from islands.orchestrator.recovery import saved_marks

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
