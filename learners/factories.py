"""What a learner builds from its spec, outside any Ray actor: the task, the model and its jitted
step, the layout over its devices, the placed state, the ``LearnerCore`` and the push codec.
The learner actor (``unit.py``), a unit's other hosts (``gang.py``), the controller and the
benchmarks all build through these, so each traces exactly the same programs."""

from __future__ import annotations

import functools
from typing import Optional

from .spec import LearnerSpec, TrainingSpec  # noqa: F401 (re-exported for callers)


BUILTIN_TASK = "islands.tasks.bytelm:task"


def is_builtin(spec: TrainingSpec) -> bool:
    """Whether the job trains the built-in byte LM (whose corpus the controller shares)."""
    return spec.task_path == BUILTIN_TASK


def load_corpus(spec: TrainingSpec):
    from islands.tasks import bytelm

    return bytelm.load_corpus(spec.corpus, spec.eval_fraction, spec.max_bytes)


def build_task(spec: TrainingSpec, train_bytes=None):
    """The job's Task, imported and built here (in the learner, so shipped user code is found).

    ``train_bytes``: the built-in task's train split, already loaded by the controller.
    """
    from .task import load_task

    args = dict(spec.task_args)
    if is_builtin(spec):
        if not args:  # a spec built by hand (benchmarks): the built-in task from its fields
            args = dict(model=spec.model, corpus=spec.corpus, eval_fraction=spec.eval_fraction,
                        max_bytes=spec.max_bytes, batch_size=spec.batch_size, seed=spec.seed)
        if train_bytes is not None:
            args["train_bytes"] = train_bytes
    return load_task(spec.task_path, args)


def build_training(spec: TrainingSpec, abstract: bool = False, task=None):
    """(task, initial params, inner optimizer, jitted train step) for a TrainingSpec.

    The optimizer is ``learner.inner_optimizer`` unless the task brings its own. With
    ``abstract`` the params are shapes only (``jax.eval_shape``): a learner takes its values
    from the syncer, and computing an init it throws away costs seconds of eager dispatch.
    """
    import jax

    from . import inner
    from .task import make_train_step

    task = task if task is not None else build_task(spec)
    init = lambda: task.init_params(jax.random.PRNGKey(spec.seed))  # noqa: E731
    params = jax.eval_shape(init) if abstract else jax.jit(init)()
    optimizer = task.optimizer if task.optimizer is not None else inner.inner_optimizer(
        **spec.inner)
    return task, params, optimizer, make_train_step(task, optimizer, spec.seed)


def eval_loss_fn(spec: TrainingSpec, template, task=None):
    """``flat {path: array} -> float``: the eval loss of flat global parameters on the task's
    fixed held-out batches (so every evaluation of a job is comparable)."""
    from islands.syncer.fragments import assembler

    from .task import make_eval_fn

    task = task if task is not None else build_task(spec)
    batches = list(task.eval_batches())
    evaluate, assemble = make_eval_fn(task), assembler(template)
    return lambda flat: float(evaluate(assemble(flat), batches))


def warm_compile_cache(spec: TrainingSpec, params, task=None) -> None:
    """Compiles the train step and every fragment's push encoder once, so learners load them
    from JAX's persistent cache instead of each compiling them at start (seconds on 2 cores,
    all learners at once)."""
    from .task import TaskStream

    task, _, optimizer, train_step = build_training(spec, abstract=True, task=task)
    opt_state = optimizer.init(params)
    _, _, loss = train_step(params, opt_state, TaskStream(task, 0, 1).batch_at(0))
    float(loss)
    learner_core(spec, "warmup", params, opt_state, [0] * spec.fragments).compile_pushes()


def learner_layout(spec: TrainingSpec, task, template, optimizer, first_batch, devices=None):
    """This learner's layout over its devices (learners/mesh.py; default: every device the
    process sees), or None on one device (the program stays as it was).

    Raises:
      mesh.BatchSplitError: naming ``data.batch_size`` and the device count, when the batch's
        rows do not split evenly over the devices.
    """
    from . import mesh

    layout = mesh.learner_layout(template, optimizer, spec.sharding, devices,
                                 task.partition_specs)
    if layout is not None:
        mesh.check_batch(first_batch, layout.num_devices)
    return layout


def place_learner_state(layout, optimizer, params, opt_state=None,
                        start_step: Optional[int] = None):
    """(params, inner state) where the learner keeps them: on its mesh when it has a layout
    (a peer's numpy state is laid out like its own; without one a fresh state is made there).
    ``start_step``: the schedule's count is set to it: the fleet's count the syncer gave at
    registration under ``schedule_clock: fleet``, else where the learner resumes (a fresh state
    or a peer's alike; docs/architecture.md#failures-and-reintegration); None: the state's own
    counts are kept."""
    from .inner import at_schedule_step

    if layout is None:
        opt_state = opt_state if opt_state is not None else optimizer.init(params)
    else:
        params = layout.place_params(params)
        opt_state = (layout.place_opt_state(opt_state) if opt_state is not None
                     else layout.init_opt_state(optimizer, params))
    return params, (opt_state if start_step is None else at_schedule_step(opt_state, start_step))


def meshed_steps(layout, train_step, batch_at):
    """(train step, ``step -> Step``) of a learner: as given on one device; with a layout, the
    step's outputs pinned to it and each batch split by rows over the mesh."""
    if layout is None:
        return train_step, batch_at
    return layout.jit_step(train_step), lambda step: layout.place_step(batch_at(step))


def learner_core(spec: TrainingSpec, learner: str, params, opt_state, versions,
                  incarnation: int = 0, start_step: int = 0, session: str = "", layout=None):
    """The LearnerCore a learner of ``spec`` runs (also built by the cache warm-up, which must
    trace exactly the same push encoder)."""
    from islands.syncer import codec as codec_lib
    from islands.syncer import fragments as fragments_lib

    from .core import LearnerCore

    _, ef, decode = push_codec(spec.codec_kind, spec.codec_block_size, spec.error_feedback)
    return LearnerCore(learner, params, opt_state, fragments_lib.partition(params, spec.fragments),
                       versions, ef, codec_lib.tree_wire_bytes, decode,
                       overlap_steps=spec.overlap_steps, merge_alpha=spec.merge_alpha,
                       incarnation=incarnation, start_step=start_step, session=session,
                       carry_overlap=spec.carry_overlap,
                       place=layout.place_fragment if layout is not None else None)


def make_error_feedback(spec: TrainingSpec):
    codec, ef, _ = push_codec(spec.codec_kind, spec.codec_block_size, spec.error_feedback)
    return codec, ef


@functools.lru_cache(maxsize=8)
def push_codec(kind: str, block_size: int, with_feedback: bool):
    """(codec, error feedback, decode) of a job, the same objects for every LearnerCore of this
    process: the push encoder is compiled once per (error feedback, decode) pair
    (``core._compiled_encode_drift``), so a warm spare's encoders compiled at ``prepare`` are
    the ones its promoted core runs (new objects per core traced and compiled every fragment's
    encoder again at promotion: 6.5 s of the 25M model's takeover on 2 cores)."""
    from islands.syncer import codec as codec_lib

    codec = codec_lib.make_codec(kind, block_size=block_size)
    ef = codec_lib.error_feedback(codec) if with_feedback else codec_lib.no_error_feedback(codec)
    return codec, ef, lambda codes: codec_lib.decode_tree(codec, codes)
