"""The Prometheus families built from a controller snapshot: names, types, labels, exact values."""

import math

import pytest

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from islands.orchestrator import metrics
from islands.orchestrator.books import BADPUT_CAUSES
from islands.syncer.validate import REJECT_REASONS


def snapshot(**overrides):
    snap = {
        "goodput": {"useful_s": 9.0, "allocated_s": 10.0, "goodput": 0.9,
                    "window": {"label": "5m", "seconds": 300, "ratio": 0.75}},
        "learners": {
            "us-east:0": {"region": "us-east", "state": "training", "steps_total": 120,
                          "compression_relative_error": 0.1},
            "us-east:1": {"region": "us-east", "state": "restarting", "steps_total": 40,
                          "compression_relative_error": 0.9},  # not training: not averaged
            "eu-west:0": {"region": "eu-west", "state": "training", "steps_total": 100,
                          "compression_relative_error": 0.3},
        },
        "tokens": {"applied": 5000, "dropped": 300, "processed": 5600, "in_flight": 300},
        "syncer": {"epoch": 1, "merges_by_fragment": {0: 7, 1: 6}, "quorum_size": {0: 2, 1: 1},
                   "grace_window_s": 0.25},
        "staleness_counts": {0: 3, 2: 1, 40: 1},
        "wire_bytes": {"us-east": {"up": 1000, "down": 4000}, "eu-west": {"up": 500, "down": 0}},
        "recoveries": [{"detect_s": 0.05, "restart_s": 0.5, "restore_s": 1.5,
                        "first_contribution_s": 2.0, "total_s": 4.05}],
        "learner_restarts": {"crash": 2},
        "rejected_total": {"stale_epoch": 4},
        "train_loss": 2.5, "eval_loss": None,
    }
    snap.update(overrides)
    return snap


def scrape(snap):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.SnapshotCollector(lambda: snap))
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(family, sample_name=None):
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples
            if sample_name is None or s.name == sample_name}


def test_every_design_metric_is_exported_with_its_type():
    families = scrape(snapshot())
    assert set(families) == metrics.METRIC_NAMES
    for spec in metrics.METRICS:
        assert families[spec.name].type == spec.kind, spec.name
        for sample in families[spec.name].samples:
            assert set(sample.labels) - {"le"} == set(spec.labels), (spec.name, sample.labels)


def test_values_are_the_snapshot_values():
    f = scrape(snapshot())
    assert values(f["islands_goodput_ratio"]) == {(("window", "run"),): 0.9,
                                                  (("window", "5m"),): 0.75}
    assert values(f["islands_tokens"], "islands_tokens_total") == {
        (("fate", "applied"),): 5000.0, (("fate", "dropped"),): 300.0}
    assert values(f["islands_learner_steps"], "islands_learner_steps_total")[
        (("learner", "us-east:1"), ("region", "us-east"))] == 40.0
    assert values(f["islands_merges"], "islands_merges_total") == {
        (("fragment", "0"),): 7.0, (("fragment", "1"),): 6.0}
    assert values(f["islands_wire_bytes"], "islands_wire_bytes_total")[
        (("direction", "down"), ("region", "us-east"))] == 4000.0
    # Mean over the training learners only: (0.1 + 0.3) / 2.
    assert math.isclose(values(f["islands_compression_relative_error"])[()], 0.2)
    restarts = values(f["islands_learner_restarts"], "islands_learner_restarts_total")
    assert restarts == {(("reason", "crash"),): 2.0, (("reason", "preemption"),): 0.0,
                        (("reason", "preempted_planned"),): 0.0,
                        (("reason", "hang"),): 0.0, (("reason", "straggler"),): 0.0,
                        (("reason", "quarantine"),): 0.0}
    rejected = values(f["islands_rejected_pushes"], "islands_rejected_pushes_total")
    assert rejected[(("reason", "stale_epoch"),)] == 4.0 and len(rejected) == len(REJECT_REASONS)
    learners = values(f["islands_learners"])
    assert learners[(("region", "us-east"), ("state", "restarting"))] == 1.0
    assert learners[(("region", "eu-west"), ("state", "retired"))] == 0.0  # known values read 0
    assert math.isnan(values(f["islands_eval_loss"])[()])


def test_histograms_by_hand():
    f = scrape(snapshot())
    # Staleness {0: 3, 2: 1, 40: 1}: le=0 -> 3, le=1 -> 3, le=2 -> 4, ... le=32 -> 4, +Inf -> 5.
    buckets = values(f["islands_staleness"], "islands_staleness_bucket")
    assert buckets[(("le", "0.0"),)] == 3 and buckets[(("le", "1.0"),)] == 3
    assert buckets[(("le", "2.0"),)] == 4 and buckets[(("le", "32.0"),)] == 4
    assert buckets[(("le", "+Inf"),)] == 5
    assert values(f["islands_staleness"], "islands_staleness_sum")[()] == 42.0
    recovery = values(f["islands_recovery_seconds"], "islands_recovery_seconds_bucket")
    assert recovery[(("le", "2.5"), ("phase", "restore"))] == 1
    assert recovery[(("le", "1.0"), ("phase", "restore"))] == 0
    assert recovery[(("le", "5.0"), ("phase", "total"))] == 1
    assert recovery[(("le", "2.5"), ("phase", "total"))] == 0
    assert values(f["islands_recovery_seconds"], "islands_recovery_seconds_count")[
        (("phase", "detect"),)] == 1


def test_windowed_goodput_by_hand():
    history = [(0.0, 0.0, 0.0), (10.0, 8.0, 10.0), (20.0, 16.0, 20.0), (30.0, 17.0, 30.0)]
    # Window 10 s at t=30: from the sample at t=20 -> (17 - 16) / (30 - 20) = 0.1.
    assert math.isclose(metrics.windowed_ratio(history, 30.0, 10.0), 0.1)
    # Window 30 s: from t=0 -> 17 / 30.
    assert math.isclose(metrics.windowed_ratio(history, 30.0, 30.0), 17 / 30)
    # A run shorter than the window uses its first sample.
    assert math.isclose(metrics.windowed_ratio(history, 30.0, 300.0), 17 / 30)
    assert metrics.windowed_ratio(history[:1], 0.0, 10.0) is None
    assert metrics.window_label(300) == "5m" and metrics.window_label(10) == "10s"
    assert metrics.window_label(90) == "90s" and metrics.window_label(3600) == "1h"


def test_sample_names_cover_counters_and_histograms():
    names = metrics.sample_names()
    assert "islands_tokens_total" in names and "islands_tokens" not in names
    assert {"islands_staleness_bucket", "islands_staleness_sum",
            "islands_staleness_count"} <= names
    assert "islands_goodput_ratio" in names


def test_serve_answers_on_a_free_port():
    import urllib.request

    server, port = metrics.serve(lambda: snapshot(), port=0, addr="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        server.shutdown()
    assert b'islands_goodput_ratio{window="run"} 0.9' in text


def test_goodput_and_badput_seconds_and_the_step_histogram_per_region():
    step_seconds = {}
    for t in (0.002, 0.004, 0.2):
        metrics.observe_step(step_seconds, "us-east", t)
    snap = snapshot(step_seconds=step_seconds)
    snap["goodput"] = {**snap["goodput"], "goodput_s": 9.0,
                       "badput_s": {"program_startup": 0.5, "refused": 0.25}}
    families = scrape(snap)
    assert values(families["islands_goodput_seconds"]) == {(): 9.0}
    bad = values(families["islands_badput_seconds"])
    assert len(bad) == len(BADPUT_CAUSES) == 11
    assert bad[(("cause", "program_startup"),)] == 0.5 and bad[(("cause", "refused"),)] == 0.25
    assert bad[(("cause", "checkpoint_save"),)] == 0.0   # every cause from the start
    buckets = values(families["islands_step_seconds"], "islands_step_seconds_bucket")
    assert buckets[(("le", "0.0025"), ("region", "us-east"))] == 1
    assert buckets[(("le", "0.005"), ("region", "us-east"))] == 2
    assert buckets[(("le", "+Inf"), ("region", "us-east"))] == 3
    assert buckets[(("le", "+Inf"), ("region", "eu-west"))] == 0   # a region with no beats yet
    assert values(families["islands_step_seconds"], "islands_step_seconds_sum")[
        (("region", "us-east"),)] == pytest.approx(0.206)
