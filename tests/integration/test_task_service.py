"""A task defined in this test module trains through the Ray service (imported inside the
learners), and the job's export restores with plain orbax to the eval loss the job logged."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("ray")
# On the shared cluster, whose workers have this folder on their PYTHONPATH (clusters.py).
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from islands.learners.task import Task  # noqa: E402



def regression_task(dim: int = 4, batch_size: int = 16, seed: int = 0) -> Task:
    """y = x·w* + 0.5; batch k of shard s is drawn from rng (seed, s, num_shards, k)."""
    w_true = np.linspace(-1.0, 1.0, dim).astype(np.float32)

    def make(rng):
        x = rng.normal(size=(batch_size, dim)).astype(np.float32)
        return {"x": x, "y": (x @ w_true + 0.5).astype(np.float32)}

    def batches(shard, num_shards, start_step):
        step = start_step
        while True:
            yield make(np.random.default_rng((seed, shard, num_shards, step)))
            step += 1

    def init_params(rng):
        k1, k2 = jax.random.split(rng)
        return {"hidden": {"w": jax.random.normal(k1, (dim, 16)) / np.sqrt(dim),
                           "b": jnp.zeros((16,))},
                "out": {"w": jax.random.normal(k2, (16,)) / 4.0, "b": jnp.zeros(())}}

    def loss(params, batch, rng):
        h = jax.nn.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"][None, :])
        return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - batch["y"]) ** 2)

    return Task(init_params=init_params, loss=loss, batches=batches,
                eval_batches=lambda: [make(np.random.default_rng((seed, 99, i)))
                                      for i in range(4)],
                tokens=lambda batch: int(batch["x"].shape[0]))


def test_a_test_module_task_trains_in_the_service_and_exports(tmp_path):
    from islands.orchestrator.config import parse
    from islands.orchestrator.job import run_job

    config = parse({
        "name": "task-itest", "task": {"path": "test_task_service:regression_task",
                                       "args": {"dim": 4}},
        "learner": {"min_step_time_s": 0.02, "eval_every_s": 3.0,
                    "inner_optimizer": {"lr": 3e-2, "warmup_steps": 5, "total_steps": 400,
                                        "weight_decay": 0.0}},
        "syncer": {"fragments": 2, "sync_every_steps": 8, "overlap_steps": 1},
        "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
        "regions": {"a": {"learners": 2}}, "metrics": {"enabled": False},
        "run": {"dashboard": False}})
    run_dir = str(tmp_path / "run")
    # Ends once an eval saw the loss fall well below the bar the test asserts (12 s is the cap).
    summary = run_job(config, duration_s=12, run_dir=run_dir, quiet=True,
                      until=lambda snap: (snap["syncer"]["merges"] or 0) > 0
                      and snap.get("final_eval_loss") is not None
                      and snap.get("initial_eval_loss")
                      and snap["final_eval_loss"] < 0.4 * snap["initial_eval_loss"])
    print({k: summary.get(k) for k in ("merges", "initial_eval_loss", "final_eval_loss")})
    assert summary["merges"] > 0 and summary["tokens_applied"] > 0
    assert summary["final_eval_loss"] < 0.5 * summary["initial_eval_loss"]

    # The export: plain orbax restores the params; the task's own loss gives the logged eval.
    import orbax.checkpoint as ocp

    out = summary["export_dir"]
    meta = json.load(open(os.path.join(out, "task.json")))
    assert meta["task"] == {"path": "test_task_service:regression_task", "args": {"dim": 4}}
    params = ocp.StandardCheckpointer().restore(os.path.join(out, "params"))
    task = regression_task(**meta["task"]["args"])
    losses = [float(task.loss(params, b, None)) for b in task.eval_batches()]
    assert np.mean(losses) == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert meta["eval_loss"] == summary["final_eval_loss"]


def flaky_task(marker: str, fail_at_step: int = 3, **kwargs) -> Task:
    """The regression task whose data reader raises once, at ``fail_at_step`` of whichever
    learner gets there first (a user's bug): the learner's loop raises, its actor stays alive."""
    task = regression_task(**kwargs)

    def batches(shard, num_shards, start_step):
        for step, batch in enumerate(task.batches(shard, num_shards, start_step), start_step):
            if step == fail_at_step:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass
                else:
                    raise RuntimeError("the user's data reader failed")
            yield batch

    return task._replace(batches=batches)


def test_a_learner_whose_loop_raises_is_restarted_and_trains_again(tmp_path):
    """The loop raised but the actor lived on, holding the learner's name: every relaunch was
    postponed ("name already taken") for the rest of the job. Now its actor is killed."""
    from islands.orchestrator.config import parse
    from islands.orchestrator.job import run_job

    config = parse({
        "name": "flaky-itest", "task": {"path": "test_task_service:flaky_task",
                                        "args": {"marker": str(tmp_path / "failed-once")}},
        "learner": {"min_step_time_s": 0.02, "eval_every_s": 3.0},
        "syncer": {"fragments": 2, "sync_every_steps": 4, "overlap_steps": 1},
        "quorum": {"min_learners": 1, "grace_cap_s": 0.5},
        "health": {"restart": {"backoff_initial_s": 0.1}},
        "regions": {"a": {"learners": 2}}, "metrics": {"enabled": False},
        "run": {"dashboard": False}})
    run_dir = str(tmp_path / "run")
    # Ends once a learner's second incarnation trains (a restart takes ~10 s here; 35 s cap).
    run_job(config, duration_s=35, run_dir=run_dir, quiet=True,
            until=lambda snap: any(row["incarnation"] >= 1 and row["state"] == "training"
                                   for row in snap["learners"].values()))
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    failed = [e for e in events if e["event"] == "learner_failed"]
    assert len(failed) == 1 and failed[0]["cause"] == "crash", failed
    assert "data reader failed" in failed[0]["detail"]
    who = failed[0]["learner"]
    ready = [e for e in events if e["event"] == "learner_ready" and e["learner"] == who]
    # The restart trains again. Incarnation 0 may fail before its first beat says it trains
    # (step 3 comes within a beat on an idle machine): then only incarnation 1 is ready.
    assert [e["incarnation"] for e in ready] in ([0, 1], [1]), ready
