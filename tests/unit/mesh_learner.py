"""A one-learner unit on the first N devices of this process against an in-process SyncerCore,
with the learner unit's own helpers (layout, placement, meshed step). Prints one JSON object.

Run in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (virtual CPU
devices must exist before JAX starts its backend; tests/unit/test_mesh.py does so)::

    python tests/unit/mesh_learner.py '{"devices": [1, 4], "sharding": "fsdp", "steps": 12}'
    python tests/unit/mesh_learner.py '{"runs": [[1, "replicated"], [4, "fsdp"]], "steps": 12}'

For every device count, the same job from the same init on the same global batches: per-step
losses, the final local and global parameters, and the per-device shard shapes.

With ``"processes": N, "process": i, "coordinator": "127.0.0.1:PORT"`` it is host i of an
N-process unit (learners/gang.py's ``join_unit``: jax.distributed over gloo) training on every
device of the unit; process 0 prints.
"""

import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402

from islands.learners.loop import LearnerLoop  # noqa: E402
from islands.learners.task import TaskStream  # noqa: E402
from islands.learners.unit import (TrainingSpec, learner_core, build_task,  # noqa: E402
                                   build_training, learner_layout, make_error_feedback,
                                   meshed_steps, place_learner_state)
from islands.syncer import codec as codec_lib  # noqa: E402
from islands.syncer import fragments as fragments_lib  # noqa: E402
from islands.syncer import outer as outer_lib  # noqa: E402
from islands.syncer.core import SyncerCore, SyncerSettings  # noqa: E402

TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32}


def tiny_spec(sharding: str, batch_size: int = 4, codec: str = "int4") -> TrainingSpec:
    return TrainingSpec(model=TINY_MODEL, batch_size=batch_size, max_bytes=300_000, fragments=2,
                        sync_every_steps=4, overlap_steps=1, carry_overlap=True,
                        sharding=sharding, codec_kind=codec)


def shard_shapes(tree) -> dict:
    """{path: [shape of each device's shard]} of a tree of jax arrays."""
    return {path: [list(s.data.shape) for s in jax.numpy.asarray(leaf).addressable_shards]
            for path, leaf in fragments_lib.flatten(tree).items()}


def train(spec: TrainingSpec, devices, steps: int) -> dict:
    task = build_task(spec)
    task, template, optimizer, train_step = build_training(spec, abstract=True, task=task)
    init = jax.jit(task.init_params)(jax.random.PRNGKey(spec.seed))
    init = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), init)
    stream = TaskStream(task, 0, 1)
    first_batch = stream.batch_at(0).batch
    layout = learner_layout(spec, task, template, optimizer, first_batch, devices)
    train_step, batch_at = meshed_steps(layout, train_step, stream.batch_at)
    params, opt_state = place_learner_state(layout, optimizer, init)

    plan = fragments_lib.partition(template, spec.fragments)
    codec, _ = make_error_feedback(spec)
    decode = lambda codes: codec_lib.decode_tree(codec, codes)  # noqa: E731
    frags = [{k: np.asarray(v, np.float32) for k, v in fragments_lib.extract(init, plan, p).items()}
             for p in range(plan.num_fragments)]
    syncer = SyncerCore(frags, SyncerSettings(overlap_steps=spec.overlap_steps),
                        outer_lib.build("nesterov"), decode, is_embedding=task.is_embedding)
    epoch, registered = syncer.register("mesh:0", 0)
    core = learner_core(spec, "mesh:0", params, opt_state, [v for _, v in registered],
                         layout=layout)
    loop = LearnerLoop(core, train_step, batch_at, int(task.tokens(first_batch)),
                       spec.fragments, spec.sync_every_steps)
    losses, arrived, merges = [], [], 0
    for _ in range(steps):
        for p, fragment, version in arrived:
            core.offer_reply(p, fragment, version)
        arrived = []
        loop.adopt()
        losses.append(float(loop.train(loop.batch())))
        loop.record(0.0)
        for push_plan in loop.pushes(epoch):
            push = push_plan.on_host().push
            assert syncer.accept_push(push, 0.0).ok
            result = syncer.merge(push.fragment, "all_live_in", live_count=1)
            arrived.append((result.fragment, result.params, result.version))
            merges += 1
    # A restarting peer gets this state as numpy (LearnerUnit.inner_state) and lays it out.
    peer_state = jax.tree_util.tree_map(np.asarray, core.opt_state)
    _, placed = place_learner_state(layout, optimizer, init, peer_state)
    peer_exact = all(np.array_equal(np.asarray(a), b) for a, b in zip(
        jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(peer_state)))
    residuals = {path: leaf for track in core.tracks
                 for path, leaf in track.ef_state.residual.items()}
    return {"devices": len(devices), "losses": losses, "merges": merges,
            "params": {k: np.asarray(v).tolist() for k, v in fragments_lib.flatten(core.params).items()},
            "global": {k: np.asarray(v).tolist() for k, v in syncer.params_flat().items()},
            "param_shards": shard_shapes(core.params),
            "moment_shards": shard_shapes(core.opt_state[1][0].mu),
            "peer_moment_shards": shard_shapes(placed[1][0].mu), "peer_exact": peer_exact,
            "residual_shards": shard_shapes(residuals),
            "batch_shards": [list(s.data.shape) for s in
                             jax.numpy.asarray(loop.batch().batch).addressable_shards]}


def main(args: dict) -> None:
    if args.get("processes", 1) > 1:
        from islands.learners.gang import join_unit

        join_unit(args["coordinator"], args["processes"], args["process"])
    # "devices": [n, ...] with one "sharding", or "runs": [[n, sharding], ...]: one process
    # (one JAX start, one compile cache) for several layouts.
    pairs = args.get("runs") or [[n, args.get("sharding", "replicated")] for n in args["devices"]]
    runs = [train(tiny_spec(sharding, args.get("batch_size", 4), args.get("codec", "int4")),
                  jax.devices()[:n], args.get("steps", 12)) for n, sharding in pairs]
    if jax.process_index() == 0:
        print(json.dumps(runs))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
