"""``benchmarks/syncer_throughput.py`` builds its rounds with the service's rules: its pushes must
pass the service's checks (a default job's tokens per step), or the benchmark measures nothing."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import syncer_throughput  # noqa: E402


def test_a_round_of_the_service_rules_is_accepted_and_merged():
    bench = syncer_throughput.build_bench(20_000, 3, "nf2")
    version = bench.core.slots[0].version
    push_s, merge_s = syncer_throughput.one_round(bench, 3)
    assert push_s > 0 and merge_s > 0
    assert bench.core.slots[0].version == version + 1   # the round merged
