"""Shared test setup: loopback-only Ray, CPU JAX with strict rank promotion, and a leaf-by-leaf
tree comparison."""

import os
import shutil
import tempfile

# Before anything imports Ray: local clusters (ray.init, `ray start` in a subprocess) bind
# 127.0.0.1 instead of the machine's network address, so tests talk to loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tests run on CPU even where an accelerator is visible; set before any backend starts.
jax.config.update("jax_platforms", "cpu")
# An accidental [B, L, D] + [L, D] broadcast is an error, not a silent shape bug (STYLE, Tests).
jax.config.update("jax_numpy_rank_promotion", "raise")
# One persistent compilation cache for the session's tests (a fresh directory per session):
# the many tests that build the same tiny programs load them instead of compiling each again.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="islands-tests-jax-cache-")
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def assert_trees_close(a, b, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    """Asserts two pytrees have the same structure and element-wise close leaves.

    The failure message names the leaf's key path.
    """
    leaves_a, treedef_a = jax.tree_util.tree_flatten_with_path(a)
    leaves_b, treedef_b = jax.tree_util.tree_flatten_with_path(b)
    assert treedef_a == treedef_b, f"tree structures differ:\n{treedef_a}\n{treedef_b}"
    for (path, leaf_a), (_, leaf_b) in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(leaf_a), np.asarray(leaf_b), atol=atol, rtol=rtol,
                                   err_msg=f"leaf {jax.tree_util.keystr(path)}")

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


# -- one Ray cluster for the integration modules that fit on it (tests/integration/clusters.py) --

def _clusters():
    import sys

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")
    if here not in sys.path:
        sys.path.insert(0, here)
    import clusters

    return clusters


@pytest.fixture(scope="module")
def shared_ray():
    """The session's shared local Ray cluster for this module; at its end every actor the
    module's jobs left is ended, so the next module starts on an empty cluster."""
    clusters = _clusters()
    clusters.shared_cluster()
    yield
    clusters.end_job_actors()


@pytest.fixture(scope="module", autouse=True)
def _own_ray_for_other_modules(request):
    """A module that does not use ``shared_ray`` gets no shared cluster: it is stopped before
    its first test (the module starts or joins a cluster of its own, or none)."""
    if "shared_ray" not in request.fixturenames:
        _clusters().leave_shared_cluster()
    yield


def pytest_collection_modifyitems(session, config, items):
    """Runs the modules on the shared cluster one after another (after the unit tests, before
    the integration modules with clusters of their own), so it starts once."""
    def group(item) -> int:
        if "integration" not in item.path.parts:
            return 0
        return 1 if "shared_ray" in item.fixturenames else 2

    items.sort(key=group)   # stable: the order within each group is unchanged


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)
    if "clusters" in __import__("sys").modules:
        _clusters().leave_shared_cluster()
