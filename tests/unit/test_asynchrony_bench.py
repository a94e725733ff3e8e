"""``benchmarks/asynchrony.py``'s output: the keys BENCHMARKS.md quotes, and the one command that
regenerates ``benchmarks/results/asynchrony_1000.json``.

The summary is pure (losses in, JSON out): checked on hand-made run records whose gaps are
worked by hand. A real run of 30 steps (slow: each training compiles its step) checks that
what the script writes has the same keys."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)

import asynchrony  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    base = dict(steps=1000, seeds=3, seed=0, rules=["today", "defaults"], fleets=None,
                quorums=["1"], no_references=True, quick=False, model_size="tiny",
                ablation=["rebased", "all"])
    return argparse.Namespace(**{**base, **kw})


def _records(jobs: list[dict], loss) -> list[dict]:
    return [{**j, "loss": loss(j), "merges": 10, "mean_staleness": 0.5, "joined": 1,
             "params": 119_000} for j in jobs]


def test_the_plan_runs_each_training_once_and_the_ablation_on_the_first_seed():
    steps, seeds, rules, fleets, jobs = asynchrony.plan(_args())
    assert (steps, seeds, rules, fleets) == (1000, [0, 1, 2], ["today", "defaults"],
                                             ["lockstep", "noisy", "mixed"])
    keys = [tuple(sorted(j.items())) for j in jobs]
    assert len(keys) == len(set(keys))
    # today and defaults on 3 fleets × 3 seeds at K = 1; rebased and all on 2 fleets, seed 0.
    assert len(jobs) == 2 * 3 * 3 + 2 * 2
    assert {j["seed"] for j in jobs if j["rules"] in ("rebased", "all")} == {0}


def test_the_summary_has_every_key_benchmarks_md_reads():
    _, seeds, rules, fleets, jobs = asynchrony.plan(_args())
    # Lockstep 2.0 at every seed; noisy +1 %, +2 %, +3 % by seed with the defaults and +10 %
    # with today's rules; mixed +4 % (defaults), +8 % (today); the ablation +5 %.
    bump = {("noisy", "defaults"): lambda s: 0.01 * (s + 1), ("noisy", "today"): lambda s: 0.10,
            ("mixed", "defaults"): lambda s: 0.04, ("mixed", "today"): lambda s: 0.08}

    def loss(j):
        extra = bump.get((j["fleet"], j["rules"]), lambda s: 0.05 if j["fleet"] != "lockstep"
                         else 0.0)(j["seed"])
        return 2.0 * (1 + extra)

    result = asynchrony.summarize(_records(jobs, loss), seeds, rules, fleets, 1000, _args())
    result = json.loads(json.dumps(result))   # what the file holds
    for key in asynchrony.HEADLINE_KEYS:
        assert key in result, key
    assert result["gap_noisy_k1"] == pytest.approx(0.02)
    assert result["gap_noisy_k1_worst"] == pytest.approx(0.03)
    assert result["gap_mixed_k1"] == pytest.approx(0.04)
    assert result["gap_noisy_k1_today"] == pytest.approx(0.10)
    assert result["gap_mixed_k1_today"] == pytest.approx(0.08)
    assert result["ablation_noisy_k1_seed0"]["rebased"] == pytest.approx(2.1)
    assert set(result["ablation_mixed_k1_seed0"]) == {"today", "defaults", "rebased", "all"}
    # The rules each figure ran with, the defaults resolved (not "None").
    assert set(result["rules"]) == {"today", "rebased", "all", "defaults"}
    assert set(result["rules"]["defaults"]) == set(asynchrony.RULES["today"])
    row = next(r for r in result["rows"] if (r["fleet"], r["K"], r["rules"])
               == ("noisy", "1", "defaults"))
    assert row["per_seed"] == pytest.approx([2.02, 2.04, 2.06])
    assert {"seed", "kind", "fleet", "k", "rules", "loss", "merges", "mean_staleness",
            "joined"} <= set(result["runs"][0])


def test_benchmarks_md_names_the_command_and_only_keys_the_script_writes():
    with open(os.path.join(REPO, "BENCHMARKS.md")) as f:
        text = f.read()
    section = text.split("## Quality under asynchrony", 1)[1].split("\n## ", 1)[0]
    assert asynchrony.REGENERATE in section.replace("\n", " ")
    quoted = set(re.findall(r"`(gap_[a-z0-9_]+)`", section))
    assert quoted and quoted <= set(asynchrony.HEADLINE_KEYS), quoted


@pytest.mark.slow
def test_a_tiny_run_writes_the_headline_keys(tmp_path):
    """Two trainings of 30 steps (the fewest above the inner warm-up; lockstep and noisy, the
    defaults, K = 1): the file the script writes has the keys a consumer reads for them."""
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "asynchrony.py"), "--steps", "30", "--seeds", "1",
         "--rules", "defaults", "--fleets", "lockstep", "noisy", "--quorums", "1",
         "--no-references", "--out", str(tmp_path), "--name", "tiny"],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "tiny.json") as f:
        result = json.load(f)
    assert result == json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"gap_noisy_k1", "gap_noisy_k1_worst"} <= set(result)
    assert result["rules"]["defaults"]["round_step"] in ("per_round", "per_merge")
    assert [r["rules"] for r in result["runs"]] == ["defaults", "defaults"]
