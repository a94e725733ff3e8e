"""The reliability soak (slow): `python benchmarks/soak.py --quick` on the real service —
≥ 100 learner failures of mixed kinds, ≥ 2 syncer kills and a controller kill — and its verdicts.
The full run (≥ 1,000 failures, ≥ 10 syncer and ≥ 3 controller kills) is the same command
without --quick; its figures are in BENCHMARKS.md."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_soak_keeps_the_books_and_the_model(tmp_path):
    proc = subprocess.run([sys.executable, "soak.py", "--quick", "--out", str(tmp_path)],
                          cwd=os.path.join(ROOT, "benchmarks"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["learner_failures"] >= 100, result
    assert result["syncer_kills"] >= 2 and result["controller_kills"] >= 1, result
    assert result["books_balanced"] and result["versions_monotonic"], result
    assert result["merged_versions_lost"] == 0, result
    # what leaked, named (pytest cuts a long dict short), by a check that saw the learners run
    assert result["leaked_actors"] == 0 and result["leaked_processes"] == 0, result["leaked"]
    assert result["leak_check_saw_learners"], result["older_titled_processes"]
    assert result["final_eval_loss"] < result["initial_eval_loss"], result
    assert os.path.exists(tmp_path / "soak.png")
