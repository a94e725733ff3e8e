"""Scale simulator (docs/operations.md#scale-simulator): hand-worked goodputs on scripted traces, equivalences, seeds."""

import doctest
import json

import numpy as np
import pytest

from islands.orchestrator import simulate as sim
from islands.orchestrator.simulate import FailureTrace, Fleet, Timings

# One failure on 4 slices over a 1000 s window: slice 0 is down from t=100 to t=400.
# member_u = 0.1 < 3/4, so with one spare the failure hits a job member.
ONE_FAILURE = FailureTrace.scripted(4, 1000.0, [(0, 100.0, 400.0, 0.1)])


def test_no_failures_is_full_goodput():
    quiet = FailureTrace.scripted(4, 1000.0, [])
    assert sim.data_parallel_goodput(quiet, restart_s=50, checkpoint_interval_s=30) == 1.0
    assert sim.elastic_goodput(quiet, reconfig_s=20) == 1.0
    for m in (2, 4):
        assert sim.elastic_goodput(quiet, reconfig_s=20, learners=m) == 1.0
    # One idle spare of four slices is allocated but never trains: 3/4.
    assert sim.data_parallel_goodput(quiet, 50, 30, spares=1) == 0.75


def test_data_parallel_one_failure_by_hand():
    # No spare: everyone stops at 100 and waits for the repair (400), restarts 50 s → runs from 450.
    # Run [0, 100) keeps ⌊100/30⌋·30 = 90 s; run [450, 1000) is cut by the window: keeps 550 s.
    # goodput = 4 slices · (90 + 550) / (4 · 1000) = 0.64.
    assert sim.data_parallel_goodput(ONE_FAILURE, 50, 30) == pytest.approx(0.64)
    runs = sim.data_parallel_runs(ONE_FAILURE, 50)
    np.testing.assert_allclose(runs.length_s, [100.0, 550.0])
    assert runs.truncated.tolist() == [False, True]
    # One spare: it is swapped in at once, runs from 150; 3 job slices of 4 allocated:
    # 3 · (90 + 850) / (4 · 1000) = 0.705.
    assert sim.data_parallel_goodput(ONE_FAILURE, 50, 30, spares=1) == pytest.approx(0.705)
    # Checkpoint every step (interval 0): nothing is lost: 3 · (100 + 850) / 4000 = 0.7125.
    assert sim.data_parallel_goodput(ONE_FAILURE, 50, 0, spares=1) == pytest.approx(0.7125)


def test_elastic_one_failure_by_hand():
    # Pauses [100, 120) (shrink) and [400, 420) (re-grow); 4 slices before, 3 between, 4 after:
    # 4·100 + 3·(400 − 120) + 4·(1000 − 420) = 400 + 840 + 2320 = 3560 slice-s of 4000 → 0.89.
    assert sim.elastic_goodput(ONE_FAILURE, 20) == pytest.approx(0.89)


def test_diloco_one_failure_stops_only_its_learner():
    # M = 2, learners {0, 1} and {2, 3}: learner 0 gets 2·100 + 1·280 + 2·580 = 1640 slice-s,
    # learner 1 never stops: 2000. (1640 + 2000) / 4000 = 0.91.
    assert sim.elastic_goodput(ONE_FAILURE, 20, learners=2) == pytest.approx(0.91)
    # M = 4: learner 0 is slice 0 alone: 1·100 + 0 + 1·580 = 680; the others 3000 → 0.92.
    assert sim.elastic_goodput(ONE_FAILURE, 20, learners=4) == pytest.approx(0.92)


def test_events_inside_a_pause_join_it():
    # Slices 0, 1 fail at 100 and 110 (the second inside the first pause), are back at 400 and 405.
    trace = FailureTrace.scripted(4, 1000.0, [(0, 100.0, 400.0), (1, 110.0, 405.0)])
    # Pauses [100, 120) and [400, 420) only; 2 slices on [120, 400), 4 after 420:
    # 4·100 + 2·280 + 4·580 = 3280 → 0.82.
    assert sim.elastic_goodput(trace, 20) == pytest.approx(0.82)
    # Non-elastic, no spare: stop at 100, wait for both (405), restart 50 → 455; keep 100 + 545.
    assert sim.data_parallel_goodput(trace, 50, 0) == pytest.approx(0.645)


def test_data_parallel_waits_for_repair_when_spares_run_out():
    # 2 slices, a 1-slice job and 1 spare. The spare fails first (member_u 0.9 ≥ 1/2: not a member)
    # at 50, back at 300; the member fails at 100 with no healthy spare → wait for 300, restart 50:
    # runs [0, 100) and [350, 1000): 1 · (100 + 650) / (2 · 1000) = 0.375; with 30 s checkpoints the
    # first run keeps 90 s: 0.37.
    trace = FailureTrace.scripted(2, 1000.0, [(1, 50.0, 300.0, 0.9), (0, 100.0, 600.0, 0.2)])
    assert sim.data_parallel_goodput(trace, 50, 0, spares=1) == pytest.approx(0.375)
    assert sim.data_parallel_goodput(trace, 50, 30, spares=1) == pytest.approx(0.37)


def test_restart_that_leaves_the_job_short_waits_again():
    # Member slice 0 fails at 100, the spare is swapped in, but it fails at 120 during the 50 s
    # pause and is back at 250: the job resumes at 250 + 50 = 300. (100 + 700) / 2000 = 0.4.
    trace = FailureTrace.scripted(2, 1000.0, [(0, 100.0, 600.0, 0.2), (1, 120.0, 250.0, 0.2)])
    assert sim.data_parallel_goodput(trace, 50, 0, spares=1) == pytest.approx(0.4)


def test_slice_down_at_start_does_not_pause():
    # Slice 0 was down before the window and is back at 200: 3 slices until the re-grow pause
    # [200, 220), then 4: 3·200 + 4·780 = 3720 → 0.93.
    trace = FailureTrace.scripted(4, 1000.0, [(0, -50.0, 200.0)])
    assert sim.elastic_goodput(trace, 20) == pytest.approx(0.93)


def _random_trace(seed=3, chips=256 * 24, repair_s=4 * 3600.0, days=30.0):
    fleet = Fleet(chips, 256)
    return sim.generate_trace(fleet, repair_s, days * sim.DAY_S, seed)


def test_diloco_one_learner_is_elastic_data_parallel_and_learners_decompose():
    trace = _random_trace()
    # M = 1 is dp_elastic by definition; M learners = the size-weighted mean of each learner run
    # alone as an elastic job on its own slices (nobody waits for anybody).
    m, reconfig = 5, 30.0
    group = sim.learner_of_slice(trace.n_slices, m)
    parts = []
    for k in range(m):
        ids = np.nonzero(group == k)[0]
        sel = np.isin(trace.slice_id, ids)
        sub = FailureTrace(len(ids), trace.horizon_s, np.searchsorted(ids, trace.slice_id[sel]),
                           trace.down_s[sel], trace.up_s[sel], trace.member_u[sel])
        parts.append(len(ids) * sim.elastic_goodput(sub, reconfig))
    assert sim.elastic_goodput(trace, reconfig, learners=m) == pytest.approx(
        sum(parts) / trace.n_slices, rel=1e-12)


def test_zero_pauses_reduce_to_availability():
    trace = _random_trace()
    h = trace.horizon_s
    down = np.clip(trace.up_s, 0, h) - np.clip(trace.down_s, 0, h)
    available = 1.0 - down.sum() / (trace.n_slices * h)
    for m in (1, 4, trace.n_slices):
        assert sim.elastic_goodput(trace, 0.0, learners=m) == pytest.approx(available, rel=1e-12)
    # Non-elastic with no spare, no restart and no rollback trains exactly while every slice is up.
    grid = np.linspace(0, h, 200_001)[:-1] + h / 400_000
    all_up = np.ones_like(grid, dtype=bool)
    for d, u in zip(trace.down_s, trace.up_s):
        all_up &= ~((grid >= d) & (grid < u))
    assert sim.data_parallel_goodput(trace, 0.0, 0.0) == pytest.approx(all_up.mean(), abs=2e-4)


def test_more_learners_never_lower_goodput_here():
    trace = _random_trace()
    g = [sim.elastic_goodput(trace, 60.0, learners=m) for m in (1, 2, 4, 8)]
    assert g == sorted(g)


def test_trace_is_deterministic_per_seed_and_stationary():
    fleet = Fleet(256 * 2000)
    a = sim.generate_trace(fleet, 3600.0, 5 * sim.DAY_S, seed=7)
    b = sim.generate_trace(fleet, 3600.0, 5 * sim.DAY_S, seed=7)
    c = sim.generate_trace(fleet, 3600.0, 5 * sim.DAY_S, seed=8)
    for name in ("slice_id", "down_s", "up_s", "member_u"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert len(a.down_s) != len(c.down_s) or not np.array_equal(a.down_s, c.down_s)
    # Starts stationary: p = 3600 / (YEAR/256 + 3600) ≈ 2.84 % of 2000 slices down at t = 0, and
    # Λ·H = 2000·256/YEAR · 5 days ≈ 7010 failures in the window (both within 5 σ).
    p = sim.down_fraction(fleet, 3600.0)
    assert p == pytest.approx(3600.0 / (sim.YEAR_S / 256 + 3600.0))
    down0 = np.sum(a.down_s < 0)
    assert abs(down0 - 2000 * p) < 5 * np.sqrt(2000 * p)
    expected = 2000 * fleet.slice_failure_rate_hz * (1 - p) * 5 * sim.DAY_S
    assert abs(np.sum(a.down_s >= 0) - expected) < 5 * np.sqrt(expected)


def test_spares_and_horizon_by_hand():
    # m = 586 · 0.05 = 29.3 in repair; 29.3 + 3·√29.3 = 45.5 → 46 spares.
    assert sim.spare_slices(586, 0.05) == 46
    assert sim.spare_slices(586, 0.0) == 0
    # 100 slices of 256 chips, MTBI 256·100 h per chip → one slice failure per hour in the fleet.
    fleet = Fleet(256 * 100, 256, chip_mtbi_s=256 * 100 * 3600.0)
    assert sim.horizon_for(fleet, failures=10, min_horizon_s=1.0) == pytest.approx(36_000.0)
    assert sim.horizon_for(fleet, failures=10, min_horizon_s=50_000.0) == 50_000.0
    # 150k chips round to 586 slices of 256 (150 016 chips).
    assert Fleet.nominal(150_000).slices == 586


@pytest.mark.parametrize("build,name", [
    (lambda: Fleet(1000, 256), "chips"),
    (lambda: Fleet(0, 256), "chips"),
    (lambda: Fleet(512, 0), "slice_chips"),
    (lambda: Fleet(512, 256, chip_mtbi_s=0.0), "chip_mtbi_s"),
    (lambda: sim.elastic_goodput(ONE_FAILURE, 20, learners=0), "learners"),
    (lambda: sim.elastic_goodput(ONE_FAILURE, 20, learners=5), "learners"),
    (lambda: sim.elastic_goodput(ONE_FAILURE, -1.0), "reconfig_s"),
    (lambda: sim.data_parallel_goodput(ONE_FAILURE, -5.0, 0.0), "restart_s"),
    (lambda: sim.data_parallel_goodput(ONE_FAILURE, 5.0, float("nan")), "checkpoint_interval_s"),
    (lambda: sim.data_parallel_goodput(ONE_FAILURE, 5.0, 0.0, spares=4), "spares"),
    (lambda: Timings(10.0, 0.0, 5.0, repair_mean_s=-1.0), "repair_mean_s"),
    (lambda: FailureTrace.scripted(4, 1000.0, [(0, 200.0, 100.0)]), "up_s"),
    (lambda: FailureTrace.scripted(4, 1000.0, [(4, 100.0, 200.0)]), "slice_id"),
    (lambda: FailureTrace.scripted(4, 1000.0, [(0, 100.0, 300.0), (0, 200.0, 400.0)]), "overlap"),
    (lambda: FailureTrace.scripted(4, 0.0, []), "horizon_s"),
    (lambda: sim.SimConfig(seeds=()), "seeds"),
    (lambda: sim.generate_trace(Fleet(512), -1.0, 100.0, 0), "repair_mean_s"),
])
def test_bad_input_names_the_argument(build, name):
    with pytest.raises(ValueError, match=name):
        build()


TINY = sim.SimConfig(failures_per_run=300, min_horizon_s=3600.0, seeds=(0,))


def test_study_is_deterministic_and_cli_prints_json_last(monkeypatch, capsys):
    a = sim.study_json(sim.run_study(TINY, iters=2))
    b = sim.study_json(sim.run_study(TINY, iters=2))
    a.pop("elapsed_s"), b.pop("elapsed_s")
    assert a == b
    assert set(a["table"]["150000"]) == {"dp", "dp_elastic", "diloco_2", "diloco_4", "diloco_8",
                                         "diloco_16"}
    assert a["fit"]["rmse_pp"] >= 0 and len(a["fit"]["errors_pp"]["dp"]) == 5
    monkeypatch.setattr(sim, "QUICK", TINY)
    assert sim.main(["--quick"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    record = json.loads(last)
    assert set(record) >= {"calibrated", "table", "fit", "elapsed_s"}
    assert record["calibrated"]["restart_s"] >= 0


def test_doctests():
    assert doctest.testmod(sim).failed == 0
