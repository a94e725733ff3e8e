"""A learner over several devices (learners/mesh.py): the sharding choices by hand, and real
multi-device learners on 4 virtual CPU devices against a 1-device learner.

The multi-device runs happen in a subprocess (tests/unit/mesh_learner.py): the virtual devices
must exist before JAX starts its backend, and this process's JAX already runs on one device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from islands.learners import mesh
from islands.learners.inner import inner_optimizer
from islands.learners.model import ModelConfig, init_params

SCRIPT = Path(__file__).with_name("mesh_learner.py")
# Same init, same global batches: the 4-device learner differs from the 1-device one only in the
# order float32 sums are reduced (each device sums its rows of the loss and gradient, then the
# all-reduce adds the four partial sums). That moves the last bits (~1e-7 relative per step);
# over 12 steps with 6 int4 pushes and merges the observed gap is below 1e-6 (losses) and 1e-7
# (parameters). 1e-5 leaves room for that and still fails on any real difference: one int4 code
# flipped by a changed drift, a wrong shard of the batch or a skipped all-reduce all move
# parameters by 1e-3 or more.
TOLERANCE = 1e-5


def run_learners(**args) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=600)


def learner_runs(**args) -> list[dict]:
    done = run_learners(**args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_follows(one: dict, many: dict) -> None:
    np.testing.assert_allclose(many["losses"], one["losses"], atol=TOLERANCE, rtol=0)
    assert many["merges"] == one["merges"] > 0
    for key in ("params", "global"):
        for path, value in one[key].items():
            np.testing.assert_allclose(np.asarray(many[key][path]), np.asarray(value),
                                       atol=TOLERANCE, rtol=0, err_msg=f"{key} {path}")
    # It trained: the loss moved far more than the tolerance.
    assert one["losses"][0] - one["losses"][-1] > 100 * TOLERANCE


# -- the sharding choices, by hand ---------------------------------------------------------------
def test_fsdp_axis_takes_the_largest_divisible_axis():
    assert mesh.fsdp_axis((32, 64), 4) == 1        # the larger one
    assert mesh.fsdp_axis((64, 32), 4) == 0
    assert mesh.fsdp_axis((8, 8), 4) == 0          # ties: the first
    assert mesh.fsdp_axis((6, 12), 4) == 1         # 6 does not divide, 12 does
    assert mesh.fsdp_axis((6, 3), 4) is None       # nothing divides: replicated
    assert mesh.fsdp_axis((2,), 4) is None         # smaller than the device count
    assert mesh.fsdp_axis((), 4) is None           # a scalar
    assert mesh.fsdp_axis((5, 7), 1) == 1          # one device divides everything


def test_fsdp_spec_names_the_mesh_axis_on_that_axis():
    assert mesh.fsdp_spec((32, 64), 4) == P(None, "data")
    assert mesh.fsdp_spec((64, 32, 3), 4) == P("data")
    assert mesh.fsdp_spec((6, 3), 4) == P()


def test_fit_spec_replicates_what_the_device_count_does_not_divide():
    assert mesh.fit_spec(P("data", None), (8, 6), 4) == P("data", None)
    assert mesh.fit_spec(P("data", None), (6, 8), 4) == P(None, None)
    assert mesh.fit_spec(P(None, "data"), (6, 8), 4) == P(None, "data")
    assert mesh.fit_spec(P(), (6, 8), 4) == P()
    with pytest.raises(ValueError, match="more entries"):
        mesh.fit_spec(P(None, None, "data"), (8, 8), 4)


def test_param_specs_by_mode():
    params = {"w": np.zeros((32, 64)), "scale": np.zeros(32), "odd": np.zeros((6, 3))}
    assert mesh.param_specs(params, "replicated", 4) == {"w": P(), "scale": P(), "odd": P()}
    assert mesh.param_specs(params, "fsdp", 4) == {"w": P(None, "data"), "scale": P("data"),
                                                   "odd": P()}
    # A task's specs win, fitted to the device count.
    task_specs = lambda tree: {"w": P("data", None), "scale": P(), "odd": P("data")}  # noqa: E731
    assert mesh.param_specs(params, "fsdp", 4, task_specs) == {
        "w": P("data", None), "scale": P(), "odd": P(None)}
    with pytest.raises(ValueError, match="learner.sharding"):
        mesh.param_specs(params, "tensor", 4)


def test_matrix_specs_of_the_builtin_model():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32)
    specs = mesh.matrix_specs(jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))))
    assert specs["embed"]["tokens"] == P("data")          # [256, 32]: by vocabulary row
    assert specs["embed"]["positions"] == P("data")       # [32, 32]
    assert specs["blocks"]["0"]["attn"]["wq"] == P("data")
    assert specs["blocks"]["0"]["mlp"]["w_in"] == P(None, "data")   # [32, 64]: along d_ff
    assert specs["blocks"]["0"]["mlp"]["w_out"] == P("data")        # [64, 32]
    assert specs["ln_f"]["scale"] == P()


def test_opt_state_specs_follow_the_params_and_replicate_counts():
    params = {"w": np.zeros((8, 4), np.float32), "scale": np.zeros(4, np.float32)}
    specs = {"w": P("data"), "scale": P()}
    state_specs = mesh.opt_state_specs(inner_optimizer(), params, specs)
    adam = state_specs[1][0]
    assert adam.mu == specs and adam.nu == specs
    assert adam.count == P()
    leaves = jax.tree_util.tree_leaves(state_specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(jax.tree_util.tree_leaves(
        jax.eval_shape(inner_optimizer().init, params)))


def test_check_batch_names_batch_size_and_device_count():
    mesh.check_batch(np.zeros((8, 33), np.int32), 4)
    with pytest.raises(mesh.BatchSplitError, match=r"data\.batch_size.*6 rows.*4 devices"):
        mesh.check_batch(np.zeros((6, 33), np.int32), 4)


def test_one_device_gets_no_layout():
    params = {"w": np.zeros((8, 4), np.float32)}
    assert mesh.learner_layout(params, optax.sgd(0.1), "fsdp", jax.devices()[:1]) is None


def test_the_builtin_tasks_give_partition_specs():
    from islands.tasks import bytelm

    assert bytelm.task().partition_specs is mesh.matrix_specs


# -- real learners on 4 virtual devices ----------------------------------------------------------
@pytest.fixture(scope="module")
def runs() -> dict:
    """One subprocess, three learners: on one device (it has no layout whatever the sharding:
    test_one_device_gets_no_layout), and on four, replicated and FSDP."""
    one, replicated, fsdp = learner_runs(runs=[[1, "replicated"], [4, "replicated"],
                                               [4, "fsdp"]], steps=12)
    return {"one": one, "replicated": replicated, "fsdp": fsdp}


def test_replicated_learner_on_4_devices_follows_one_device(runs):
    one, four = runs["one"], runs["replicated"]
    assert_follows(one, four)
    # Data-parallel: every device holds whole params and a quarter of the batch's rows.
    assert four["param_shards"]["embed/tokens"] == [[256, 32]] * 4
    assert four["batch_shards"] == [[1, 33]] * 4
    assert one["batch_shards"] == [[4, 33]]


def test_fsdp_learner_holds_a_quarter_of_each_sharded_tensor_and_follows_one_device(runs):
    one, four = runs["one"], runs["fsdp"]
    assert_follows(one, four)
    whole = {path: np.shape(value) for path, value in one["params"].items()}
    specs = mesh.matrix_specs({path: np.zeros(shape) for path, shape in whole.items()})
    sliced = 0
    for path, shape in whole.items():
        axis = next((i for i, a in enumerate(specs[path]) if a == "data"), None)
        quarter = list(shape)
        if axis is not None:
            quarter[axis] //= 4
            sliced += 1
        for shards in ("param_shards", "moment_shards", "residual_shards",
                       "peer_moment_shards"):
            assert four[shards][path] == [quarter] * 4, (shards, path)
    assert sliced == 8   # every matrix; the three norm scales stay whole
    assert four["peer_exact"] and one["peer_exact"]   # a peer's numpy state, laid out unchanged


@pytest.mark.slow  # three JAX processes, two joined over gloo: ~20 s (test_units.py runs a
# two-host unit through Ray in the default suite)
def test_a_two_process_unit_follows_the_one_process_unit():
    """Two processes of one device each, joined by jax.distributed with gloo collectives (a
    2-host unit, learners/gang.py), against one process of two devices and one of one device:
    the same trajectory within the same TOLERANCE (only where the float sums meet differs)."""
    from islands.learners.gang import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(
        {"devices": [2], "processes": 2, "process": i, "coordinator": coordinator,
         "steps": 12})], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    [unit] = json.loads(outs[0][0].strip().splitlines()[-1])
    one, two = learner_runs(devices=[1, 2], sharding="replicated", steps=12)
    assert unit["devices"] == 2
    assert_follows(two, unit)
    assert_follows(one, unit)
    # Host 0 holds whole params on its one device and its half of the batch's rows.
    assert unit["param_shards"]["embed/tokens"] == [[256, 32]]
    assert unit["batch_shards"] == [[2, 33]]


def test_batch_not_divisible_by_devices_is_a_clear_error():
    done = run_learners(devices=[4], sharding="replicated", steps=1, batch_size=6)
    assert done.returncode != 0
    assert "BatchSplitError" in done.stderr
    assert "data.batch_size: a batch of 6 rows" in done.stderr
    assert "4 devices" in done.stderr
