"""``islands report``: plots and report.md from a synthetic but realistic run dir.

The run (elapsed seconds): syncer up at 0.5, three learners created at 0.6 and training from 2-3;
chaos kills us-east:1 at 9.0, the monitor sees it at 9.3 (crash), restarts it at 10.4, it trains
again from 12.0 and its first contribution is merged at 13.5 (recovery: detect 0.3 + restart 1.1
+ restore 1.4 + first contribution 1.7 = 4.5 s); the syncer fails at 16.0 and is back at 16.8
(epoch 1); eu-west is scaled to 2 at 18.0 (eu-west:1 trains from 20.0); us-east:0 drains at 22.0
and retires at 23.0; the job stops at 26.0.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys

import pytest

from islands.orchestrator import report
from islands.orchestrator.report import Observation, Span

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STOP_S = 26.0
INITIAL_EVAL = 5.538793563842773
RECOVERY = {"cause": "crash", "detect_s": 0.3, "restart_s": 1.1, "restore_s": 1.4,
            "first_contribution_s": 1.7, "total_s": 4.5}


def learner_state(learner: str, t: float):
    """Ground truth of the scenario; None while the learner does not exist yet."""
    if learner == "us-east:0":
        return ("starting" if t < 2.0 else "training" if t < 22.0 else "draining" if t < 23.0
                else "retired")
    if learner == "us-east:1":
        return ("starting" if t < 2.0 else "training" if t < 9.3 else "restarting" if t < 10.4
                else "starting" if t < 12.0 else "training")
    if learner == "eu-west:0":
        return "starting" if t < 2.5 else "training"
    if learner == "eu-west:1":
        return None if t < 18.0 else "starting" if t < 20.0 else "training"
    raise KeyError(learner)


LEARNERS = ("us-east:0", "us-east:1", "eu-west:0", "eu-west:1")
EVENTS = [
    (0.5, "syncer_started", {"epoch": 0, "versions": [0, 0], "restored_from": None}),
    (0.6, "job_started", {"learners": ["us-east:0", "us-east:1", "eu-west:0"],
                          "regions": ["us-east", "eu-west"], "num_params": 17504}),
    (9.0, "chaos", {"action": "kill", "target": "us-east:1", "mode": "ray_kill"}),
    (9.3, "learner_failed", {"learner": "us-east:1", "cause": "crash", "incarnation": 0,
                             "dropped_pushes": 1, "detail": ""}),
    (9.3, "learner_restart_scheduled", {"learner": "us-east:1", "cause": "crash",
                                        "message": "restart 1 of 5 (crash) us-east:1",
                                        "delay_s": 1.0}),
    (10.4, "learner_restarted", {"learner": "us-east:1", "incarnation": 1, "peer": "us-east:0",
                                 "resume_step": 60}),
    (13.5, "learner_recovered", {"learner": "us-east:1", **RECOVERY}),
    (16.0, "syncer_failed", {"epoch": 0}),
    (16.8, "syncer_started", {"epoch": 1, "versions": [120, 121], "restored_from": "syncer/7"}),
    (18.0, "scaled", {"region": "eu-west", "target": 2, "added": ["eu-west:1"], "drained": []}),
    (22.0, "learner_draining", {"learner": "us-east:0"}),
    (23.0, "learner_retired", {"learner": "us-east:0", "reason": "drained"}),
    (STOP_S, "job_stopped", {"goodput": 0.7}),
]


def simulate(dt: float = 0.1):
    """Snapshots at t = 1..25 s, from a small simulation of the scenario's books."""
    t0 = 1_795_394_000.0
    useful = allocated = 0.0
    history = [(0.0, 0.0, 0.0)]
    wire = {"us-east": {"up": 0, "down": 0}, "eu-west": {"up": 0, "down": 0}}
    incarnation_bytes = {name: [0, 0] for name in LEARNERS}  # a learner's own counters
    snapshots, evals = [], []
    t = 0.6
    for snap_t in range(1, int(STOP_S)):
        while t < snap_t - 1e-9:
            for name in LEARNERS:
                state = learner_state(name, t)
                if state in ("starting", "training", "restarting", "draining"):
                    allocated += dt
                if state == "training":
                    useful += 0.9 * dt
                    up, down = 4_000, 28_000
                    region = name.rsplit(":", 1)[0]
                    wire[region]["up"] += up
                    wire[region]["down"] += down
                    incarnation_bytes[name][0] += up
                    incarnation_bytes[name][1] += down
                if name == "us-east:1" and abs(t - 9.3) < dt / 2:
                    incarnation_bytes[name] = [0, 0]  # the new incarnation counts from zero
            t = round(t + dt, 6)
        history.append((snap_t, useful, allocated))
        start = next((h for h in history if h[0] >= snap_t - 10), history[0])
        window = (useful - start[1]) / max(allocated - start[2], 1e-9)
        applied = int(useful * 2048) // 512 * 512
        dropped = 1024 if snap_t >= 10 else 0
        train = [name for name in LEARNERS if learner_state(name, snap_t) == "training"]
        train_loss = 2.0 + 3.5 * math.exp(-applied / 20_000) if train else None
        if snap_t >= 2 and (snap_t - 2) % 5 == 0:  # evaluated at 2 s, then every 5 s
            evals.append(2.1 + (INITIAL_EVAL - 2.1) * math.exp(-applied / 20_000))
        eval_loss = evals[-1] if evals else None
        learners = {}
        for name in LEARNERS:
            state = learner_state(name, snap_t)
            if state is None:
                continue
            restarted = name == "us-east:1" and snap_t >= 9.3
            learners[name] = {
                "region": name.rsplit(":", 1)[0], "state": state,
                "incarnation": 1 if restarted else 0, "step": int(snap_t * 10),
                "tokens_done": int(snap_t * 1000),
                "loss": train_loss if state == "training" else None, "step_time_s": 0.05,
                "restarts": {"crash": 1} if restarted else {}, "last_heartbeat_s": 0.1,
                "wire_bytes_up": incarnation_bytes[name][0],
                "wire_bytes_down": incarnation_bytes[name][1],
                "compression_relative_error": 0.13, "timings": None}
        states = {}
        for info in learners.values():
            states[info["state"]] = states.get(info["state"], 0) + 1
        snapshots.append({
            "t": t0 + snap_t, "elapsed_s": float(snap_t),
            "goodput": {"useful_s": useful, "allocated_s": allocated,
                        "goodput": useful / allocated,
                        "window": {"label": "10s", "ratio": min(1.0, window)}},
            "tokens": {"applied": applied, "dropped": dropped, "processed": applied + dropped + 512,
                       "in_flight": 512},
            "learner_states": states, "learners": learners,
            "alive": states.get("training", 0), "total": sum(
                1 for info in learners.values() if info["state"] != "retired"),
            "train_loss": train_loss, "eval_loss": eval_loss,
            "initial_eval_loss": evals[0] if evals else None,
            "syncer": {"epoch": 0 if snap_t < 16.8 else 1, "versions": [snap_t * 5, snap_t * 5],
                       "merges": snap_t * 10, "merges_by_fragment": {"0": snap_t * 5,
                                                                     "1": snap_t * 5},
                       "quorum_size": {"0": 2, "1": 2}, "grace_window_s": 0.02,
                       "staleness_counts": {"0": snap_t * 20}, "rejected": {},
                       "wire_bytes_up": {}, "wire_bytes_down": {}},
            "wire_bytes": json.loads(json.dumps(wire)),
            "syncer_restarts": 0 if snap_t < 16 else 1,
            "learner_restarts": {"crash": 1} if snap_t >= 9.3 else {},
            "recoveries": [dict(RECOVERY)] if snap_t >= 13.5 else [],
            "paused_reason": None})
    return snapshots


def write_run_dir(path, snapshots=None, events=None, summary=None):
    path.mkdir(parents=True, exist_ok=True)
    snapshots = simulate() if snapshots is None else snapshots
    events = ([{"t": 1_795_394_000.0 + t, "elapsed_s": t, "event": kind, **fields}
               for t, kind, fields in EVENTS] if events is None else events)
    last = snapshots[-1]
    if summary is None:
        regions = {name: {"learners": {"us-east": 1, "eu-west": 2}[name],
                          "wire_bytes_up": last["wire_bytes"][name]["up"],
                          "wire_bytes_down": last["wire_bytes"][name]["down"]}
                   for name in ("us-east", "eu-west")}
        summary = {
            # the summary is taken after the last snapshot, at shutdown: a little further on
            "goodput": 0.712345678, "tokens_applied": last["tokens"]["applied"] + 1_024,
            "tokens_dropped": 1_024, "tokens_in_flight": 512,
            "tokens_processed": last["tokens"]["applied"] + 2_560, "merges": 250,
            "learner_restarts": 1, "learner_restarts_by_reason": {"crash": 1},
            "syncer_restarts": 1, "syncer_epoch": 1,
            "wire_bytes": sum(r["wire_bytes_up"] + r["wire_bytes_down"] for r in regions.values()),
            "initial_eval_loss": INITIAL_EVAL, "final_eval_loss": (
                None if last["eval_loss"] is None else last["eval_loss"] - 0.0123),
            "duration_s": STOP_S + 0.0421, "learners": last["learners"], "regions": regions,
            "recoveries": [dict(RECOVERY)], "rejected_pushes": {"stale_epoch": 2},
            "chaos_fired": [{"index": 0, "at_s": 9.0, "message": "killed us-east:1 (ray_kill)"}]}
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in snapshots)
    with open(path / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which must come first."""
    data = open(path, "rb").read(32)
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def summary_table(markdown: str) -> dict[str, str]:
    """The ``| figure | value |`` rows under "## Summary" (the region table has its own header)."""
    section = markdown.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| ([^|]+?) \| ([^|]*?) \|$", line)
        if match and match[1] not in ("figure", "---"):
            rows[match[1]] = match[2]
    return rows


def first_number(text: str) -> float:
    match = re.search(r"-?[\d,]+(?:\.\d+)?", text)
    assert match, f"no number in {text!r}"
    return float(match[0].replace(",", ""))


@pytest.fixture
def run_dir(tmp_path):
    summary = write_run_dir(tmp_path / "run")
    return tmp_path / "run", summary


def test_write_report_makes_every_plot(run_dir):
    from matplotlib.image import imread

    path, _ = run_dir
    md_path = report.write_report(str(path))
    assert md_path == str(path / "report.md")
    markdown = open(md_path).read()
    for name in report.PLOT_FILES.values():
        png = path / report.PLOTS_DIR / name
        width, height = png_size(png)
        assert 800 <= width <= 2000 and 250 <= height <= 1500, (name, width, height)
        pixels = imread(str(png))
        assert pixels.shape[:2] == (height, width)
        assert pixels[..., :3].std() > 0.05, f"{name} looks blank"
        assert f"]({report.PLOTS_DIR}/{name})" in markdown  # linked from report.md


def test_report_figures_match_summary(run_dir):
    path, summary = run_dir
    markdown = open(report.write_report(str(path))).read()
    rows = summary_table(markdown)
    assert abs(first_number(rows["goodput"]) - summary["goodput"]) <= 5e-5
    assert "71.2 %" in rows["goodput"]
    for name, key in (("tokens applied", "tokens_applied"), ("tokens dropped", "tokens_dropped"),
                      ("merges", "merges"), ("learner restarts", "learner_restarts"),
                      ("syncer restarts", "syncer_restarts"), ("wire bytes", "wire_bytes")):
        assert first_number(rows[name]) == summary[key], name
    assert "crash 1" in rows["learner restarts"]
    dropped_pct = 100 * summary["tokens_dropped"] / summary["tokens_processed"]
    assert f"{dropped_pct:.2f} % of processed" in rows["tokens dropped"]
    assert rows["initial eval loss"] == "5.5388"
    assert abs(first_number(rows["final eval loss"]) - summary["final_eval_loss"]) <= 5e-5
    assert rows["duration"] == "26.0 s"
    assert first_number(rows["learners"]) == 4
    assert "3 training" in rows["learners"] and "1 retired" in rows["learners"]
    assert rows["regions"] == "2: us-east, eu-west"
    up = summary["regions"]["us-east"]["wire_bytes_up"]
    assert f"| us-east | 1 | {up:,} |" in markdown
    # recovery phases: the learner from the event, the phases from the summary
    assert "| us-east:1 | crash | 0.300 | 1.100 | 1.400 | 1.700 | 4.500 |" in markdown
    assert "| learner_failed | 1 |" in markdown and "| syncer_failed | 1 |" in markdown


def test_membership_is_reconstructed_from_events_and_snapshots(run_dir):
    path, _ = run_dir
    data = report.load_run(str(path))
    start_s, end_s = report.timeline_bounds(data.events, data.snapshots)
    assert (start_s, end_s) == (0.5, STOP_S)  # syncer_started .. job_stopped
    spans = report.membership_spans(report.state_observations(data.events, data.snapshots),
                                    start_s, end_s)
    assert spans == {
        # created at 0.6 (job_started); the 2.0 s snapshot is the first to show it training
        "us-east:0": [Span("absent", 0.5, 0.6), Span("restarting", 0.6, 2.0),
                      Span("training", 2.0, 22.0), Span("draining", 22.0, 23.0),
                      Span("absent", 23.0, STOP_S)],
        # failed at 9.3, restarted at 10.4 (still "restarting"), training in the 12 s snapshot;
        # learner_recovered at 13.5 confirms training and adds no span
        "us-east:1": [Span("absent", 0.5, 0.6), Span("restarting", 0.6, 2.0),
                      Span("training", 2.0, 9.3), Span("restarting", 9.3, 12.0),
                      Span("training", 12.0, STOP_S)],
        # training from 2.5, first seen so in the 3 s snapshot
        "eu-west:0": [Span("absent", 0.5, 0.6), Span("restarting", 0.6, 3.0),
                      Span("training", 3.0, STOP_S)],
        # added by the scale event at 18.0
        "eu-west:1": [Span("absent", 0.5, 18.0), Span("restarting", 18.0, 20.0),
                      Span("training", 20.0, STOP_S)],
    }
    for learner_spans in spans.values():  # spans tile the run without gaps
        assert learner_spans[0].start_s == start_s and learner_spans[-1].end_s == end_s
        assert all(a.end_s == b.start_s for a, b in zip(learner_spans, learner_spans[1:]))


def test_membership_spans_merge_clamp_and_handle_unknown_states():
    obs = [Observation(-1.0, "a", "starting"),      # before the window: clamped to 0
           Observation(1.0, "a", "training"),
           Observation(4.0, "a", "restarting"),    # failed and restarted within one instant
           Observation(4.0, "a", "training"),
           Observation(6.0, "a", "paused"),
           Observation(7.0, "a", "hung"),          # a state the report does not know
           Observation(8.0, "a", "retired"),
           Observation(12.0, "a", "training")]     # after the window: clamped to 10
    assert report.membership_spans(obs, 0.0, 10.0) == {"a": [
        Span("restarting", 0.0, 1.0), Span("training", 1.0, 6.0), Span("paused", 6.0, 7.0),
        Span("hung", 7.0, 8.0), Span("absent", 8.0, 10.0)]}
    assert report.membership_spans(obs, 3.0, 3.0) == {"a": []}


def test_state_observations_put_events_before_snapshots_at_a_tie():
    events = [{"elapsed_s": 5.0, "event": "learner_failed", "learner": "a", "cause": "crash"},
              {"elapsed_s": 5.0, "event": "learner_retired", "learner": "a"},
              {"elapsed_s": 1.0, "event": "job_started", "learners": ["a"]}]
    snapshots = [{"elapsed_s": 5.0, "learners": {"a": {"state": "retired"}}},
                 {"elapsed_s": 2.0, "learners": {"a": {"state": "training"}}}]
    obs = report.state_observations(sorted(events, key=lambda e: e["elapsed_s"]),
                                    sorted(snapshots, key=lambda s: s["elapsed_s"]))
    assert obs == [Observation(1.0, "a", "starting"), Observation(2.0, "a", "training"),
                   Observation(5.0, "a", "restarting"), Observation(5.0, "a", "retired"),
                   Observation(5.0, "a", "retired")]


def test_wire_series_falls_back_to_learner_counters_across_a_restart():
    # no controller wire_bytes: learner b's counter restarts from 0 with its new incarnation
    snaps = [{"elapsed_s": 1.0, "learners": {"r:0": {"region": "r", "wire_bytes_up": 10,
                                                     "wire_bytes_down": 100}}},
             {"elapsed_s": 2.0, "learners": {"r:0": {"region": "r", "wire_bytes_up": 20,
                                                     "wire_bytes_down": 200},
                                             "q:0": {"region": "q", "wire_bytes_up": 5,
                                                     "wire_bytes_down": 5}}},
             {"elapsed_s": 3.0, "learners": {"r:0": {"region": "r", "wire_bytes_up": 3,
                                                     "wire_bytes_down": 30},
                                             "q:0": {"region": "q", "wire_bytes_up": 5,
                                                     "wire_bytes_down": 5}}}]
    times, regions = report.wire_series(snaps)
    assert times == [1.0, 2.0, 3.0]
    # r: 110, 220, then 220 + 33 after the reset; q: created at 2 s
    assert regions == {"r": [110.0, 220.0, 253.0], "q": [0.0, 10.0, 10.0]}


def test_loss_series_skips_missing_losses_and_repeated_evals():
    snaps = [{"tokens": {"applied": 0}, "train_loss": None, "eval_loss": None},
             {"tokens": {"applied": 100}, "train_loss": 5.0, "eval_loss": 5.5},
             {"tokens": {"applied": 200}, "train_loss": 4.0, "eval_loss": 5.5},
             {"tokens": {"applied": 300}, "train_loss": float("nan"), "eval_loss": 4.5}]
    assert report.loss_series(snaps) == {"train": [(100.0, 5.0), (200.0, 4.0)],
                                         "eval": [(100.0, 5.5), (300.0, 4.5)]}


def test_single_snapshot_without_events_or_eval(tmp_path):
    snap = simulate()[0]  # t = 1 s: every learner still starting, no loss, no eval
    assert snap["eval_loss"] is None and snap["train_loss"] is None
    summary = write_run_dir(tmp_path / "run", snapshots=[snap], events=[])
    summary.update(initial_eval_loss=None, final_eval_loss=None, recoveries=[])
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    markdown = open(report.write_report(str(tmp_path / "run"))).read()
    rows = summary_table(markdown)
    assert rows["initial eval loss"] == "–" and rows["final eval loss"] == "–"
    assert "No learner recovered during this run." in markdown
    assert "No events recorded." in markdown
    for name in report.PLOT_FILES.values():
        assert png_size(tmp_path / "run" / report.PLOTS_DIR / name)[0] > 0


def test_missing_files(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(report.ReportError, match=r"summary\.json not found"):
        report.write_report(str(tmp_path / "run"))
    # a summary alone is enough (no events.jsonl, no metrics.jsonl), and a torn last line is skipped
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"goodput": 0.5}))
    (tmp_path / "run" / "metrics.jsonl").write_text('{"elapsed_s": 1.0, "goodp')
    markdown = open(report.write_report(str(tmp_path / "run"))).read()
    assert summary_table(markdown)["goodput"] == "0.5000 (50.0 %)"
    assert summary_table(markdown)["merges"] == "–"
    assert "1 unreadable line(s) were skipped." in markdown


def test_missing_matplotlib_says_how_to_install(run_dir, monkeypatch):
    path, _ = run_dir
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(report.ReportError, match=r'pip install "islands\[report\]"'):
        report.write_report(str(path))
    assert not (path / "report.md").exists()
