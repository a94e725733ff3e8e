"""Mesh: a learner unit on 1, 2 and 4 devices of one process, on the same global batch.

Per device count, the learner the Ray actor builds (``learners/unit.py``: layout, placed params
and inner state, the meshed train step, ``LearnerCore`` pushes with error feedback) runs against
an in-process ``SyncerCore``; the steps of the device counts alternate in rounds, so they share
the machine's state (side by side, in one run). Reported:

* step rate (1 / the median step) as a ratio to the 1-device learner (a step: the batch, the
  train step, waiting for the loss, and encoding and copying to the host every due push; the
  syncer's merge is off the clock, as it is another process in the service);
* bytes each device holds of the parameters and the inner optimizer state, replicated vs FSDP,
  read from the arrays' addressable shards.

On CPU the devices are virtual (``--xla_force_host_platform_device_count``): they share the
machine's cores, so the step-rate ratio measures the SPMD program's overhead (partitioning,
collectives), not an accelerator speed-up.

    python benchmarks/mesh.py --quick

Prints a table, then one JSON object as the last line; writes mesh.png and mesh.json.
"""

from __future__ import annotations

import os
import sys
import time

DEVICE_COUNTS = (1, 2, 4)
# Before JAX starts its backend: the virtual CPU devices the learners are laid over.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           f"{max(DEVICE_COUNTS)}").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from islands.learners import mesh as mesh_lib  # noqa: E402
from islands.learners.loop import LearnerLoop  # noqa: E402
from islands.learners.task import TaskStream  # noqa: E402
from islands.learners.unit import (TrainingSpec, learner_core, build_task,  # noqa: E402
                                   build_training, learner_layout, make_error_feedback,
                                   meshed_steps, place_learner_state)
from islands.syncer import codec as codec_lib  # noqa: E402
from islands.syncer import fragments as fragments_lib  # noqa: E402
from islands.syncer import outer as outer_lib  # noqa: E402
from islands.syncer.core import SyncerCore, SyncerSettings  # noqa: E402

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32}
DEFAULT = {}   # the built-in model's defaults (d_model 64, 2 layers, 119k parameters)


class Unit:
    """One learner on ``devices`` with its own in-process syncer."""

    def __init__(self, spec: TrainingSpec, devices):
        task = build_task(spec)
        task, template, optimizer, train_step = build_training(spec, abstract=True, task=task)
        init = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32),
                                      jax.jit(task.init_params)(jax.random.PRNGKey(spec.seed)))
        stream = TaskStream(task, 0, 1)
        first = stream.batch_at(0).batch
        self.layout = learner_layout(spec, task, template, optimizer, first, devices)
        train_step, batch_at = meshed_steps(self.layout, train_step, stream.batch_at)
        params, opt_state = place_learner_state(self.layout, optimizer, init)
        plan = fragments_lib.partition(template, spec.fragments)
        codec, _ = make_error_feedback(spec)
        decode = lambda codes: codec_lib.decode_tree(codec, codes)  # noqa: E731
        frags = [{k: np.asarray(v) for k, v in fragments_lib.extract(init, plan, p).items()}
                 for p in range(plan.num_fragments)]
        settings = SyncerSettings(overlap_steps=spec.overlap_steps)   # the service's rules
        C.note_rules(settings)
        self.syncer = SyncerCore(frags, settings, outer_lib.build("nesterov"), decode,
                                 is_embedding=task.is_embedding)
        self.epoch, registered = self.syncer.register("bench:0", 0)
        self.core = learner_core(spec, "bench:0", params, opt_state,
                                  [v for _, v in registered], layout=self.layout)
        self.loop = LearnerLoop(self.core, train_step, batch_at, int(task.tokens(first)),
                                spec.fragments, spec.sync_every_steps)
        self.arrived: list = []
        self.step_s: list[float] = []

    def step(self, timed: bool) -> float:
        core, loop = self.core, self.loop
        for item in self.arrived:
            core.offer_reply(*item)
        self.arrived = []
        t0 = time.perf_counter()
        loop.adopt()
        loss = float(loop.train(loop.batch()))
        loop.record(0.0)
        plans = [plan.on_host() for plan in loop.pushes(self.epoch)]
        if timed:
            self.step_s.append(time.perf_counter() - t0)
        for plan in plans:   # the syncer's side: another process in the service
            assert self.syncer.accept_push(plan.push, 0.0).ok
            result = self.syncer.merge(plan.push.fragment, "all_live_in", live_count=1)
            self.arrived.append((result.fragment, result.params, result.version))
        return loss


def held_bytes(unit: Unit) -> dict:
    """Most bytes any one device holds of the params and of the inner state."""
    core = unit.core
    if unit.layout is None:
        leaves = lambda t: jax.tree_util.tree_leaves(t)  # noqa: E731
        return {"params": sum(np.asarray(x).nbytes for x in leaves(core.params)),
                "opt_state": sum(np.asarray(x).nbytes for x in leaves(core.opt_state))}
    return {"params": max(mesh_lib.bytes_per_device(core.params).values()),
            "opt_state": max(mesh_lib.bytes_per_device(core.opt_state).values())}


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="timed steps per device count")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    watch_s = time.perf_counter()
    steps = args.steps or (60 if args.quick else 200)
    model = TINY if args.quick else DEFAULT
    devices = jax.devices()
    rows = []
    units = {}
    for sharding in mesh_lib.SHARDINGS:
        spec = TrainingSpec(model=model, batch_size=args.batch_size, max_bytes=300_000,
                            fragments=2, sync_every_steps=4, overlap_steps=1, carry_overlap=True,
                            sharding=sharding, seed=args.seed)
        # One device has no layout whatever the sharding: one 1-device reference for both.
        units[sharding] = {n: (units[mesh_lib.REPLICATED][1] if n == 1 and units
                               else Unit(spec, devices[:n])) for n in DEVICE_COUNTS}
    distinct = list({id(u): u for group in units.values() for u in group.values()}.values())
    for unit in distinct:   # compile and warm up (not timed)
        for _ in range(5):
            unit.step(timed=False)
    for _ in range(steps):   # rounds: every learner one step, so they share the machine's state
        for unit in distinct:
            unit.step(timed=True)
    # The median step: other work on a shared machine lands on a few steps, not on the median.
    rate_of = lambda unit: 1.0 / float(np.median(unit.step_s))  # noqa: E731
    for sharding, group in units.items():
        base_rate = rate_of(group[1])
        for n, unit in group.items():
            rate = rate_of(unit)
            held = held_bytes(unit)
            rows.append({"sharding": sharding, "devices": n, "steps_per_s": rate,
                         "rate_vs_1_device": rate / base_rate,
                         "params_bytes_per_device": held["params"],
                         "opt_state_bytes_per_device": held["opt_state"]})
    print(C.table(rows, list(rows[0])))
    png = plot(args.out, rows)
    result = {"rows": rows, "timed_steps": steps, "batch_size": args.batch_size,
              "model": model or "default", "virtual_cpu_devices": len(devices),
              "note": "virtual CPU devices share the cores: the rate ratio is SPMD overhead, "
                      "not an accelerator speed-up",
              "runtime_s": time.perf_counter() - watch_s, "png": png, "machine": C.machine()}
    C.finish("mesh", result, args.out)


def plot(out_dir: str, rows: list) -> str:
    plt = C.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.38
    for i, sharding in enumerate(mesh_lib.SHARDINGS):
        mine = [r for r in rows if r["sharding"] == sharding]
        x = np.arange(len(mine)) + (i - 0.5) * width
        ax1.bar(x, [r["rate_vs_1_device"] for r in mine], width, label=sharding)
        ax2.bar(x, [(r["params_bytes_per_device"] + r["opt_state_bytes_per_device"]) / 1024
                    for r in mine], width, label=sharding)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(DEVICE_COUNTS)), [f"{n} device(s)" for n in DEVICE_COUNTS])
        ax.legend()
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("step rate ÷ 1-device step rate")
    ax1.set_title("unit step rate, same global batch (virtual CPU devices)")
    ax2.set_ylabel("KiB per device (params + inner state)")
    ax2.set_title("memory per device")
    fig.tight_layout()
    return C.save_figure(fig, out_dir, "mesh.png")


if __name__ == "__main__":
    main()
