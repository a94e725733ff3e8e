"""The run dir's event log and the structured log lines are the same events."""

import json

from islands.orchestrator.job import RunDir, progress_line

EVENTS = [
    {"t": 100.0, "elapsed_s": 1.5, "event": "learner_failed", "learner": "us-east:1",
     "cause": "crash"},
    {"t": 101.0, "elapsed_s": 2.5, "event": "learner_restarted", "learner": "us-east:1",
     "incarnation": 1},
]


def test_json_log_lines_are_the_events_jsonl_lines(tmp_path, capsys):
    run = RunDir(str(tmp_path), log_format="json")
    run.add_events(EVENTS)
    run.close()
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    stored = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert logged == stored == EVENTS


def test_text_log_lines_name_the_event_and_its_fields(tmp_path, capsys):
    run = RunDir(str(tmp_path))
    run.add_events(EVENTS[:1])
    run.close()
    line = capsys.readouterr().err.strip()
    assert line == "event     1.5s learner_failed learner=us-east:1 cause=crash"


def test_progress_line():
    snap = {"elapsed_s": 12.25, "syncer": {"merges": 40}, "tokens": {"applied": 123456},
            "train_loss": 2.5, "eval_loss": None, "goodput": {"goodput": 0.9312},
            "alive": 3, "total": 4, "paused_reason": None}
    assert progress_line(snap) == ("[   12.2s] merges    40  tokens applied   123,456  train 2.500  "
                                   "eval -  goodput 0.931  learners 3/4")
