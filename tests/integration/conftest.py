"""Shared by the integration tests that run a whole job through `run_job`."""

import pytest

# A job small enough for 2 cores: one region of two learners of a 17k-parameter model.
TINY_JOB = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
    "data": {"max_bytes": 300_000, "batch_size": 4, "eval_batches": 2},
    "learner": {"min_step_time_s": 0.05, "eval_every_s": 5.0},
    "syncer": {"fragments": 2, "sync_every_steps": 4, "overlap_steps": 1},
    "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
    "regions": {"a": {"learners": 2}},
    "metrics": {"enabled": False},
    "run": {"dashboard": False},
}


@pytest.fixture
def tiny_job():
    """``tiny_job(name)`` -> a validated JobConfig of TINY_JOB under that job name."""
    from islands.orchestrator.config import parse

    return lambda name: parse({**TINY_JOB, "name": name})
