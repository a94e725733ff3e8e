"""A user's own task, outside the islands package: a small MLP regression on a CSV file.

islands imports ``my_task:make`` inside every learner; ``ray job submit --working-dir .`` ships
this directory (module and data) to the cluster. Only ``islands.learners.task.Task`` comes from
islands: everything else is plain JAX and numpy.
"""

import csv
import os

import jax
import jax.numpy as jnp
import numpy as np

from islands.learners.task import Task

HERE = os.path.dirname(os.path.abspath(__file__))


def read_csv(path):
    """Our own data reader: feature columns and the ``target`` column as float32 arrays."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    names = [k for k in rows[0] if k != "target"]
    x = np.array([[float(r[k]) for k in names] for r in rows], np.float32)
    y = np.array([float(r["target"]) for r in rows], np.float32)
    return x, y


def make(file="measurements.csv", hidden=32, batch_size=32, eval_rows=100, seed=0):
    """The task: rows after the first ``eval_rows`` are train, split into learner shards by row."""
    x, y = read_csv(os.path.join(HERE, file))
    x_eval, y_eval, x_train, y_train = x[:eval_rows], y[:eval_rows], x[eval_rows:], y[eval_rows:]

    def batches(shard, num_shards, start_step):
        rows = np.arange(shard, len(x_train), num_shards)   # this learner's rows
        step = start_step
        while True:   # batch k depends only on (seed, shard, num_shards, k): resumable anywhere
            pick = np.random.default_rng((seed, shard, num_shards, step)).choice(rows, batch_size)
            yield {"x": x_train[pick], "y": y_train[pick]}
            step += 1

    def init_params(rng):
        k1, k2 = jax.random.split(rng)
        return {"layer1": {"w": jax.random.normal(k1, (x.shape[1], hidden)) / np.sqrt(x.shape[1]),
                           "b": jnp.zeros((hidden,))},
                "layer2": {"w": jax.random.normal(k2, (hidden,)) / np.sqrt(hidden),
                           "b": jnp.zeros(())}}

    def loss(params, batch, rng):
        h = jax.nn.gelu(batch["x"] @ params["layer1"]["w"] + params["layer1"]["b"][None, :])
        mse = jnp.mean((h @ params["layer2"]["w"] + params["layer2"]["b"] - batch["y"]) ** 2)
        return mse, {"mse": mse}

    return Task(init_params=init_params, loss=loss, batches=batches,
                eval_batches=lambda: [{"x": x_eval, "y": y_eval}],
                tokens=lambda batch: len(batch["y"]))   # one "token" per row
