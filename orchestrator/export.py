"""Export: a run's global parameters as a plain orbax checkpoint, restorable without islands.

``OUT/params`` is the task's params pytree saved with ``orbax.checkpoint.StandardCheckpointer``;
``OUT/task.json`` names the task (``path``, ``args``), the merge count it was taken at and the
job's last logged eval loss. Restore (docs/tasks.md#export)::

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore(os.path.abspath("OUT/params"))
"""

from __future__ import annotations

import json
import os
from typing import Optional

JOB_FILE = "job.json"         # the run dir's copy of the JobConfig (written when a job starts)
EXPORT_DIR = "export"         # the default OUT inside the run dir


class ExportError(ValueError):
    """A run dir that cannot be exported; the message names the path and what is missing."""


def write_job_file(run_dir: str, config) -> str:
    """Saves the JobConfig next to the run's logs, so ``islands export`` needs only the run dir."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, JOB_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config.model_dump(mode="json"), f, indent=2)
    os.replace(tmp, path)
    return path


def latest_params(directory: str) -> tuple[dict, int]:
    """``({path: array}, merges)`` of the newest syncer snapshot in ``directory``.

    Raises:
      ExportError: no snapshot there.
    """
    import orbax.checkpoint as ocp

    from islands.syncer.state import snapshot_steps

    if not snapshot_steps(directory):
        raise ExportError(f"no syncer snapshot in {directory!r} to export")
    with ocp.CheckpointManager(os.path.abspath(directory)) as manager:
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    flat: dict = {}
    for fragment in restored["arrays"]["params"].values():
        flat.update(fragment)
    return flat, int(step)


def export_run(run_dir: str, out: Optional[str] = None) -> str:
    """Writes ``OUT/params`` (orbax) and ``OUT/task.json`` from the run's newest snapshot.

    Args:
      run_dir: a run directory of ``islands run`` (it holds ``job.json`` and the snapshots).
      out: the export directory (default ``RUN_DIR/export``); it must not hold ``params`` yet.

    Returns:
      The export directory.

    Raises:
      ExportError: naming what is missing (``job.json``, a snapshot) or already there.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from islands.learners.unit import build_task
    from islands.syncer.fragments import assembler
    from islands.syncer.state import snapshot_directory

    from . import build
    from .config import parse

    job_path = os.path.join(run_dir, JOB_FILE)
    if not os.path.exists(job_path):
        raise ExportError(f"{job_path!r} not found: is {run_dir!r} the run dir of an "
                          "`islands run` job?")
    with open(job_path) as f:
        config = parse(json.load(f))
    out = os.path.abspath(out or os.path.join(run_dir, EXPORT_DIR))
    if os.path.exists(os.path.join(out, "params")):
        raise ExportError(f"{os.path.join(out, 'params')!r} already exists; choose another --out")
    directory = snapshot_directory(config.syncer.checkpoint_dir, run_dir, config.name)
    flat, merges = latest_params(directory)
    spec = build.training_spec(config)
    task = build_task(spec)
    template = jax.eval_shape(task.init_params, jax.random.PRNGKey(config.seed))
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32),
                                    assembler(template)(flat))
    os.makedirs(out, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(out, "params"), params)
    checkpointer.wait_until_finished()
    meta = {"task": {"path": spec.task_path, "args": spec.task_args}, "merges": merges,
            "seed": config.seed, "eval_loss": _logged_eval_loss(run_dir)}
    with open(os.path.join(out, "task.json"), "w") as f:
        json.dump(meta, f, indent=2, default=str)
    return out


def _logged_eval_loss(run_dir: str) -> Optional[float]:
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f).get("final_eval_loss")
    except (OSError, ValueError):
        return None
