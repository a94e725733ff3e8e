"""The controller's records stay bounded however many failures a job sees, and lose no count."""

import json

import pytest

from islands.orchestrator import metrics
from islands.orchestrator.logs import (RECOVERY_BUCKETS_S, EventLog, RecoveryLog, keep_span_s,
                                       trim_before)


def test_a_reader_keeps_its_place_while_old_events_fall_off():
    log = EventLog(keep=3)
    got, index = [], 0
    for n in range(10):
        log.append({"n": n})
        if n % 2:   # a reader that polls every other event never misses one
            rows, index = log.since(index)
            got += [r["n"] for r in rows]
    assert got == list(range(10)) and index == 10 and len(log) == 3
    assert log.since(10) == ([], 10)


def test_a_reader_from_before_a_restart_starts_from_the_oldest_kept():
    log = EventLog(keep=3)
    log.append({"n": 0})
    assert log.since(500) == ([{"n": 0}], 1)


def test_a_reader_far_behind_gets_what_is_kept_and_the_true_next_index():
    log = EventLog(keep=2)
    for n in range(5):
        log.append({"n": n})
    assert log.since(1) == ([{"n": 3}, {"n": 4}], 5)
    assert log.newest(1) == [{"n": 4}] and log.newest(9) == [{"n": 3}, {"n": 4}]


@pytest.mark.parametrize("keep", [0, -1])
def test_a_log_that_keeps_nothing_is_refused(keep):
    with pytest.raises(ValueError, match="keep must be >= 1"):
        EventLog(keep)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        RecoveryLog(keep)


def rec(total, detect=0.1):
    return {"cause": "crash", "detect_s": detect, "restart_s": 0.0, "restore_s": 0.0,
            "first_contribution_s": total - detect, "total_s": total}


def test_the_histogram_counts_every_recovery_while_rows_keep_the_newest():
    log = RecoveryLog(keep=2)
    for total in (0.2, 3.0, 700.0):
        log.append(rec(total))
    h = log.histogram()["total"]
    # Worked by hand: bounds 0.1 0.25 0.5 1 2.5 5 ...600, cumulative; 700 lands in +Inf only.
    assert h["bounds"] == list(RECOVERY_BUCKETS_S)
    assert h["buckets"] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3]
    assert h["sum"] == pytest.approx(703.2) and h["count"] == 3 and log.total == 3
    assert [r["total_s"] for r in log.rows] == [3.0, 700.0]


def test_the_exported_histogram_is_the_running_one_not_the_kept_rows():
    log = RecoveryLog(keep=1)
    for total in (0.2, 3.0):
        log.append(rec(total))
    from test_metrics import scrape, snapshot, values

    fams = scrape(snapshot(recoveries=log.newest(1), recovery_seconds=log.histogram()))
    count = values(fams["islands_recovery_seconds"], "islands_recovery_seconds_count")
    assert count[(("phase", "total"),)] == 2   # both, though one row is kept
    total = values(fams["islands_recovery_seconds"], "islands_recovery_seconds_sum")
    assert total[(("phase", "total"),)] == pytest.approx(3.2)


def test_a_saved_log_comes_back_with_its_counts_and_an_old_saved_list_is_counted():
    log = RecoveryLog(keep=2)
    for total in (0.2, 3.0, 9.0):
        log.append(rec(total))
    back = RecoveryLog.from_json(json.loads(json.dumps(log.to_json())), keep=2)
    assert back.histogram() == log.histogram() and list(back.rows) == list(log.rows)
    assert back.total == 3
    old = RecoveryLog.from_json([rec(0.2), rec(3.0)])
    assert old.total == 2 and old.histogram()["total"]["count"] == 2


def test_goodput_samples_older_than_the_console_span_and_a_window_are_dropped():
    import collections

    history = collections.deque((t, 0.0, 0.0) for t in range(0, 2000, 100))
    trim_before(history, 1900 - keep_span_s(300.0))
    assert keep_span_s(300.0) == 900.0 and keep_span_s(3600.0) == 7200.0
    assert history[0][0] == 1000 and history[-1][0] == 1900
    assert metrics.RECOVERY_BUCKETS_S is RECOVERY_BUCKETS_S
