"""The run's files stay strict JSON, and the sliding goodput window survives a controller restart.

Strict: Python's json writes NaN as a bare ``NaN`` that JSON parsers (jq, JavaScript, Go) refuse;
a diverged loss must be ``null``. The window: a restarted controller goes on from the samples it
saved rather than starting an empty history (which read 1.0 after one sample pair).
"""

import json

import numpy as np

from islands.orchestrator.job import RunDir
from islands.orchestrator.metrics import window_to_save, windowed_ratio


def strict_load(text):
    def refuse(name):
        raise ValueError(f"non-JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_loss_is_written_as_null_in_events_metrics_and_the_summary(tmp_path):
    run = RunDir(str(tmp_path), log_format="text")
    run.add_events([{"t": 1.0, "elapsed_s": 0.1, "event": "learner_error", "loss": float("nan")}])
    run.add_snapshot({"train_loss": float("nan"), "eval_loss": np.float32("inf"),
                      "learners": {"a:0": {"loss": np.float64("nan"), "step": 3}}})
    run.write_summary({"final_eval_loss": float("-inf"), "goodput": 0.5,
                       "eval": [(1.0, 2, float("nan"))]})
    run.close()
    event = strict_load((tmp_path / "events.jsonl").read_text().splitlines()[0])
    assert event["loss"] is None and event["event"] == "learner_error"
    snap = strict_load((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert snap == {"train_loss": None, "eval_loss": None,
                    "learners": {"a:0": {"loss": None, "step": 3}}}
    summary = strict_load((tmp_path / "summary.json").read_text())
    assert summary == {"final_eval_loss": None, "goodput": 0.5, "eval": [[1.0, 2, None]]}


def test_the_goodput_window_goes_on_from_the_saved_samples_after_a_restart():
    # 400 s of samples every 10 s; goodput 0.8 until t = 300, then nothing useful (0.0).
    history, useful = [], 0.0
    for t in range(0, 401, 10):
        history.append((float(t), useful, float(t)))
        useful += 8.0 if t < 300 else 0.0
    window = 120.0
    before = windowed_ratio(history, 400.0, window)
    saved = json.loads(json.dumps(window_to_save(history, 400.0, window)))  # through the file
    restored = [tuple(x) for x in saved]
    assert len(restored) < len(history)  # only what the window needs
    assert windowed_ratio(restored, 400.0, window) == before
    # The restarted controller appends new samples: the window keeps its memory of the stall.
    after = restored + [(410.0, history[-1][1], 410.0)]
    full = history + [(410.0, history[-1][1], 410.0)]
    assert windowed_ratio(after, 410.0, window) == windowed_ratio(full, 410.0, window)
    assert windowed_ratio(after, 410.0, window) < 0.2
    # Without them it could only start over: one sample, no window.
    assert windowed_ratio([(410.0, history[-1][1], 410.0)], 410.0, window) is None
