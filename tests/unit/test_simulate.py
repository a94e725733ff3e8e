"""Scale simulator (docs/operations.md#scale-simulator): hand-worked goodputs on scripted traces, equivalences, seeds."""

import doctest
import json

import numpy as np
import pytest

from islands.studies import simulate as sim
from islands.studies.simulate import FailureTrace, Fleet, Timings

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



# The spare pool. Three slices, two places (slices 0 and 1) and one spare (slice 2); a spare takes
# 30 s to join. Slice 0 fails at 100 and is in repair until 400.
POOL_ONE = FailureTrace.scripted(3, 1000.0, [(0, 100.0, 400.0)])


def _outages(trace):
    return [(int(k), d, u) for k, d, u in zip(trace.slice_id, trace.down_s, trace.up_s)]


def test_one_failure_one_spare_by_hand():
    places = sim.pool_position_trace(POOL_ONE, positions=2, reschedule_s=30.0)
    # The spare is taken at 100 and trains in place 0 from 130: the place is vacant 30 s, not the
    # 300 s repair; slice 0 comes back to the pool at 400 and nobody notices.
    assert _outages(places) == [(0, 100.0, 130.0)]
    # Elastic, 20 s pauses: [100, 120) on the failure and [130, 150) on the spare's arrival;
    # 2 places until 100, 1 on [120, 130), 2 from 150: 200 + 10 + 1700 = 1910 place-s.
    # Allocated: 3 slices (the idle spare included) · 1000 s → 1910 / 3000.
    assert sim.elastic_goodput(places, 20.0) * 2 / 3 == pytest.approx(1910 / 3000)
    # Without the pool the same failure keeps the slice out until 400: 300 s of vacancy.
    assert _outages(sim.pool_position_trace(POOL_ONE, 3, 30.0)) == [(0, 100.0, 400.0)]
    # Non-elastic DP swaps inside its restart (no reschedule): runs [0, 100) and [150, 1000)
    # with a 50 s restart: 2 · 950 / 3000.
    dp_places = sim.pool_position_trace(POOL_ONE, 2, 0.0)
    assert _outages(dp_places) == [(0, 100.0, 100.0)]
    assert sim.data_parallel_goodput(dp_places, 50.0, 0.0) * 2 / 3 == pytest.approx(1900 / 3000)


def test_pool_runs_dry_then_a_slice_returns_home_or_is_rescheduled():
    # Slice 1 fails at 200 while the only spare already holds place 0: place 1 waits.
    # (a) Its own slice is back first (300): it returns at once, no reschedule.
    a = FailureTrace.scripted(3, 1000.0, [(0, 100.0, 500.0), (1, 200.0, 300.0)])
    assert _outages(sim.pool_position_trace(a, 2, 30.0)) == [(0, 100.0, 130.0), (1, 200.0, 300.0)]
    # (b) Slice 0 is back first (250) and its place is taken: it joins the pool and goes to
    # place 1, arriving 30 s later (280); slice 1, back at 300, becomes the idle spare.
    b = FailureTrace.scripted(3, 1000.0, [(0, 100.0, 250.0), (1, 200.0, 300.0)])
    assert _outages(sim.pool_position_trace(b, 2, 30.0)) == [(0, 100.0, 130.0), (1, 200.0, 280.0)]


def test_spare_that_fails_on_its_way_is_replaced():
    # Four slices, two places, spares 2 and 3. Slice 0 fails at 100; spare 2, due at 130, fails
    # at 110; spare 3 is sent at 110 and arrives at 140.
    trace = FailureTrace.scripted(4, 1000.0, [(0, 100.0, 900.0), (2, 110.0, 800.0)])
    assert _outages(sim.pool_position_trace(trace, 2, 30.0)) == [(0, 100.0, 140.0)]


def test_ample_pool_hides_the_repair_time():
    # Four places and four spares; three failures of distinct slices. Whether repairs take 300 s
    # or 30 000 s, the learners see the same vacancies: zero-length with no reschedule, 30 s with.
    fails = [(0, 100.0), (5, 150.0), (2, 400.0)]
    short = FailureTrace.scripted(8, 1000.0, [(s, d, d + 300.0) for s, d in fails])
    long = FailureTrace.scripted(8, 1000.0, [(s, d, d + 30_000.0) for s, d in fails])
    for reschedule_s in (0.0, 30.0):
        a = sim.pool_position_trace(short, 4, reschedule_s)
        b = sim.pool_position_trace(long, 4, reschedule_s)
        assert _outages(a) == _outages(b)
        np.testing.assert_allclose(a.up_s - a.down_s, reschedule_s)
        for m in (1, 2, 4):
            assert sim.elastic_goodput(a, 20.0, m) == sim.elastic_goodput(b, 20.0, m)
    # Slice 5 was an idle spare: only the two failures in places (0 and 2) open vacancies.
    assert [k for k, _, _ in _outages(a)] == [0, 2]


def test_no_spares_is_the_old_model_exactly():
    trace = _random_trace()
    for reschedule_s in (0.0, 300.0):     # with nothing to swap in, the delay never applies
        places = sim.pool_position_trace(trace, trace.n_slices, reschedule_s)
        for m in (1, 4):
            assert sim.elastic_goodput(places, 30.0, m) == pytest.approx(
                sim.elastic_goodput(trace, 30.0, m), rel=1e-12)
        assert sim.data_parallel_goodput(places, 60.0, 20.0) == pytest.approx(
            sim.data_parallel_goodput(trace, 60.0, 20.0), rel=1e-12)
    # And through the pipeline: spare_scale = 0 gives the old elastic table on the same seeds.
    config = sim.SimConfig(failures_per_run=300, min_horizon_s=3600.0, seeds=(0,), learners=(4,),
                           failure=sim.FailureModel(spare_scale=0.0))
    prepared = sim.prepare_fleet(150_000, config)
    assert prepared.pool == 0
    fleet = Fleet.nominal(150_000)
    old = sim.generate_trace(fleet, config.failure.repair_mean_s,
                             sim.horizon_for(fleet, 300, 3600.0), 0)
    got = sim.prepared_goodput(prepared, Timings(60.0, 0.0, 10.0), (4,))
    assert got["diloco_4"] == pytest.approx(sim.elastic_goodput(old, 10.0, 4), rel=1e-12)


def test_instant_swaps_leave_places_empty_only_when_too_few_slices_are_healthy():
    # With no reschedule delay a vacancy is filled the moment any slice is healthy and idle, so at
    # every instant: empty places = max(0, places − healthy slices). Checked on a random trace
    # with a pool small enough to run dry (4 spares for 20 places, 4 h repairs).
    trace = _random_trace(chips=256 * 24, repair_s=4 * 3600.0, days=30.0)
    places = sim.pool_position_trace(trace, 20, 0.0)
    t = np.linspace(0, trace.horizon_s, 20_001)[:-1] + 0.37
    down = ((trace.down_s[:, None] <= t) & (t < trace.up_s[:, None])).sum(axis=0)
    empty = ((places.down_s[:, None] <= t) & (t < places.up_s[:, None])).sum(axis=0)
    np.testing.assert_array_equal(empty, np.maximum(0, 20 - (trace.n_slices - down)))
    assert empty.max() > 0          # the pool did run dry here, so the check means something


def test_pool_holds_every_slice_in_repair_in_the_mean():
    # Little's law on a long random trace: with the ⌈m + 3√m⌉ pool and a 5 min reschedule, the
    # places are vacant about λ·D of the time (each failure of a place costs D), far below the
    # p = T_r/(1/λ + T_r) they would lose without the pool.
    fleet = Fleet(256 * 200)
    fm = sim.FailureModel(repair_mean_s=3600.0, reschedule_s=300.0)
    trace = sim.generate_trace(fleet, fm.repair_mean_s, 20 * sim.DAY_S, seed=5)
    pool = fm.pool_slices(fleet)
    places = sim.pool_position_trace(trace, fleet.slices - pool, fm.reschedule_s)
    h = trace.horizon_s
    vacant = (np.clip(places.up_s, 0, h) - np.clip(places.down_s, 0, h)).sum() / (places.n_slices * h)
    lam_d = fleet.slice_failure_rate_hz * fm.reschedule_s
    assert vacant == pytest.approx(lam_d, rel=0.15)
    assert vacant < sim.down_fraction(fleet, fm.repair_mean_s) / 5


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
    (lambda: Timings(10.0, 0.0, -5.0), "reconfig_s"),
    (lambda: sim.FailureModel(repair_mean_s=-1.0), "repair_mean_s"),
    (lambda: sim.FailureModel(reschedule_s=float("inf")), "reschedule_s"),
    (lambda: sim.FailureModel(chip_mtbi_s=0.0), "chip_mtbi_s"),
    (lambda: sim.FailureModel(spare_scale=-1.0), "spare_scale"),
    (lambda: sim.SimConfig(failure=None), "failure"),
    (lambda: sim.pool_position_trace(ONE_FAILURE, 0, 10.0), "positions"),
    (lambda: sim.pool_position_trace(ONE_FAILURE, 5, 10.0), "positions"),
    (lambda: sim.pool_position_trace(ONE_FAILURE, 3, -1.0), "reschedule_s"),
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
    assert set(record) >= {"calibrated", "pinned", "table", "fit", "elapsed_s"}
    assert record["calibrated"]["restart_s"] >= 0
    assert record["pinned"]["repair_mean_s"] == sim.DEFAULT_REPAIR_MEAN_S
    assert "sensitivity" not in record


def test_sensitivity_moves_every_diloco_cell(monkeypatch, capsys):
    study = sim.run_study(TINY, iters=2)
    rows = sim.sensitivity(study, iters=2)
    names = sim.PINNED_ASSUMPTIONS + sim.FITTED_ASSUMPTIONS
    assert [(r.assumption, r.factor) for r in rows] == [(n, f) for n in names for f in (0.5, 2.0)]
    by = {(r.assumption, r.factor): r for r in rows}
    for r in rows:
        assert set(r.delta_pp) == set(sim.PAPER_CHIPS)
        assert all(set(cells) == {"diloco_2", "diloco_4", "diloco_8", "diloco_16"}
                   for cells in r.delta_pp.values())
    # The restart pause is the non-elastic job's alone: DiLoCo does not move at all.
    for f in (0.5, 2.0):
        assert all(v == 0.0 for cells in by["restart_s", f].delta_pp.values() for v in cells.values())
    # Shorter reconfiguration pauses can only help a learner; longer ones only hurt.
    assert all(v >= 0 for cells in by["reconfig_s", 0.5].delta_pp.values() for v in cells.values())
    assert all(v <= 0 for cells in by["reconfig_s", 2.0].delta_pp.values() for v in cells.values())
    assert by["repair_mean_s", 2.0].value == 2 * sim.DEFAULT_REPAIR_MEAN_S
    # Moving nothing moves nothing: the baseline reproduces itself on the same seeds.
    same = sim.sensitivity(study, factors=(1.0,), assumptions=("chip_mtbi_s",), iters=2)
    assert all(abs(v) < 1e-9 for cells in same[0].delta_pp.values() for v in cells.values())
    with pytest.raises(ValueError, match="assumption"):
        sim.sensitivity(study, assumptions=("slice_chips",))
    with pytest.raises(ValueError, match="factor"):
        sim.sensitivity(study, factors=(0.0,))
    text = sim.format_sensitivity(rows)
    assert "repair_mean_s" in text and "+0.0/+0.0/+0.0/+0.0" in text
    monkeypatch.setattr(sim, "QUICK", TINY)
    monkeypatch.setattr(sim, "sensitivity", lambda s, **kw: rows)
    assert sim.main(["--quick", "--sensitivity"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(record["sensitivity"]) == len(rows)
    assert record["sensitivity"][0]["assumption"] == "repair_mean_s"


def test_doctests():
    assert doctest.testmod(sim).failed == 0
