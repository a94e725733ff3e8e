"""Goodput and badput by cause: every allocated learner-second falls in exactly one place.

A learner's life is played on a hand clock through ``Books`` (allocation and phases) and
``IncarnationFates`` (its tokens' fates): start-up, training with merged, overwritten and
refused pushes, a crash, the wait for the restart, the restore, training again, a pause, and the
job's end. Each cause is checked against what was played, and the sum against the allocation.
"""

import pytest

from islands.learners.fates import IncarnationFates
from islands.orchestrator.books import BADPUT_CAUSES, Books, Fates, badput, phase_of


def play():
    """Two fragments; returns the books at the end (t = 100) and the hand-computed figures."""
    b = Books(num_fragments=2)
    b.allocate("a:0", 0.0)                       # launched: program start-up until t = 10
    b.track({"a:0": "starting"}, 0.0)
    b.track({"a:0": "training"}, 10.0)
    f = IncarnationFates(2)
    for step in range(1, 5):                     # 4 steps of 2 s, 10 tokens each
        f.step(10, 2.0)
    f.pushed(0, step=4); f.merged(0)             # fragment 0: 8 s applied
    f.pushed(1, step=4); f.discarded(1, "refused")  # fragment 1: 8 s refused
    f.step(10, 2.0); f.pushed(0, step=5); f.merged(0)   # 2 s applied (fragment 0)
    f.overwritten(1)                             # fragment 1's 2 s since: overlap
    f.step(10, 2.0)                              # 2 s in both drifts when it crashes at t = 30
    b.track({"a:0": "restarting"}, 30.0)         # the failure seen: recovery until t = 35
    b.close_incarnation("a:0", f.to_json(), merged_steps={}, reason="crash")
    b.track({"a:0": "starting"}, 35.0)           # relaunched: restore until t = 40
    b.track({"a:0": "training"}, 40.0)
    g = IncarnationFates(2)
    for _ in range(10):                          # 10 steps of 3 s
        g.step(10, 3.0)
    g.pushed(0, step=10); g.merged(0); g.pushed(1, step=10); g.merged(1)  # 30 s applied
    b.track({"a:0": "paused"}, 80.0)             # paused t = 80 .. 90
    b.track({"a:0": "training"}, 90.0)
    g.step(10, 3.0)                              # in a drift at the end: unsettled while live
    live = {"a:0": g.to_json()}
    return b, live, g


def test_every_allocated_second_is_goodput_one_badput_cause_or_unsettled():
    b, live, g = play()
    out = b.badput(live, 100.0)
    assert out["allocated_s"] == pytest.approx(100.0) == b.allocated_s(100.0)
    # fragment-seconds / P: (8 + 2) / 2 applied in the first life, (30 + 30) / 2 in the second
    assert out["goodput_s"] == pytest.approx(5.0 + 30.0)
    c = out["badput_s"]
    assert set(c) == set(BADPUT_CAUSES)
    assert c["program_startup"] == pytest.approx(10.0)
    assert c["infrastructure_recovery"] == pytest.approx(5.0)
    assert c["checkpoint_restore"] == pytest.approx(5.0)
    assert c["paused"] == pytest.approx(10.0)
    assert c["refused"] == pytest.approx(8.0 / 2)
    assert c["overlap"] == pytest.approx(2.0 / 2)
    assert c["disruption_wasted_progress"] == pytest.approx((2.0 + 2.0) / 2)  # held at the crash
    assert c["checkpoint_save"] == 0.0 and c["data_loading"] == 0.0
    assert out["unsettled_s"] == pytest.approx(3.0)
    # training phases: 10..30 and 40..80 and 90..100 = 70 s; inner steps 12 + 33 = 45 s of it
    assert c["other"] == pytest.approx(70.0 - 12.0 - 33.0)
    assert out["goodput_s"] + sum(c.values()) + out["unsettled_s"] == pytest.approx(100.0)


def test_at_the_end_of_a_run_goodput_plus_badput_is_the_allocated_time():
    b, live, g = play()
    b.close_incarnation("a:0", live["a:0"], merged_steps={}, reason="stopped")
    b.release("a:0", 100.0)
    out = b.badput({}, 200.0)  # released: later time is nobody's
    assert out["unsettled_s"] == 0.0
    assert out["goodput_s"] + sum(out["badput_s"].values()) == pytest.approx(100.0, abs=1e-9)
    assert out["badput_s"]["other"] == pytest.approx(25.0 + 3.0)  # its last step, dropped by the job's end


def test_phases_survive_the_saved_state_and_a_restarted_controller_keeps_counting():
    b, live, _ = play()
    again = Books.from_json(b.to_json())
    assert again.badput(live, 100.0) == b.badput(live, 100.0)
    again.track({"a:0": "restarting"}, 120.0)
    assert again.phase_s(130.0) == pytest.approx(
        {"startup": 10.0, "training": 90.0, "recovery": 15.0, "restore": 5.0, "paused": 10.0})


def test_a_scale_up_is_a_startup_and_only_a_slot_that_trained_restores():
    assert [phase_of(s, False) for s in ("pending", "starting", "training", "draining", "paused",
                                         "restarting", "retired", "failed")] == [
        "startup", "startup", "training", "training", "paused", "recovery", None, None]
    assert phase_of("starting", True) == "restore"


def test_a_drift_dropped_by_a_drain_is_other_and_a_preemption_is_a_disruption():
    f = Fates(applied_s=0.0, processed_s=6.0,
              dropped_s_by={"drained": 2.0, "preemption": 4.0})
    out = badput({"training": 10.0}, f)
    assert out["badput_s"]["disruption_wasted_progress"] == 4.0
    assert out["badput_s"]["other"] == pytest.approx(2.0 + 4.0)   # the drain and the idle 4 s
    assert out["goodput_s"] + sum(out["badput_s"].values()) + out["unsettled_s"] == 10.0


def test_a_handover_awaiting_placement_is_its_own_badput_cause():
    """A learner handed over off a draining node waits for Ray to place its new process: those
    seconds are ``awaiting_placement``, not a recovery, a start-up or a hang."""
    b = Books(num_fragments=1)
    b.allocate("a:0", 0.0)
    b.track({"a:0": "training"}, 0.0)
    b.track({"a:0": "draining"}, 10.0)
    b.track({"a:0": "restarting"}, 12.0)
    b.track({"a:0": "awaiting_placement"}, 12.0)   # relaunched: no node may take it yet
    b.track({"a:0": "starting"}, 42.0)             # placed: its restore from here
    b.track({"a:0": "training"}, 45.0)
    out = b.badput({}, 50.0)
    assert "awaiting_placement" in BADPUT_CAUSES
    assert out["badput_s"]["awaiting_placement"] == 30.0
    assert out["badput_s"]["checkpoint_restore"] == 3.0
    assert out["badput_s"]["infrastructure_recovery"] == 0.0
    assert out["goodput_s"] + sum(out["badput_s"].values()) + out["unsettled_s"] == 50.0
