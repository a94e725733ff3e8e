"""Turns a validated JobConfig into the plain specs the actors are built from (no Ray here)."""

from __future__ import annotations

import os

from islands.learners.unit import TrainingSpec
from islands.syncer import fragments as fragments_lib
from islands.syncer.actor import SyncerSpec
from islands.syncer.core import SyncerSettings
from islands.syncer.merge import MergeRule


def training_spec(config) -> TrainingSpec:
    inner = config.learner.inner_optimizer
    syncer = config.syncer
    compression = config.compression
    return TrainingSpec(
        model=config.model.model_dump(),
        batch_size=config.data.batch_size,
        corpus=config.data.corpus,
        eval_fraction=config.data.eval_fraction,
        max_bytes=config.data.max_bytes,
        inner=inner.model_dump(),
        fragments=syncer.fragments,
        sync_every_steps=syncer.sync_every_steps,
        overlap_steps=syncer.overlap_steps,
        merge_alpha=config.learner.merge_alpha,
        codec_kind=compression.type,
        codec_block_size=getattr(compression, "block_size", 64),
        error_feedback=compression.error_feedback,
        seed=config.seed,
    )


def syncer_settings(config) -> SyncerSettings:
    s, q = config.syncer, config.quorum
    return SyncerSettings(
        min_learners=q.min_learners, grace_gamma=q.grace_gamma, grace_cap_s=q.grace_cap_s,
        overlap_steps=s.overlap_steps, history_versions=s.history_versions,
        max_staleness=s.max_staleness, outlier_norm_factor=s.outlier_norm_factor,
        staleness_discount=s.staleness_discount, merge_rule=MergeRule(s.merge_rule))


def syncer_spec(config, template, run_dir: str) -> SyncerSpec:
    """The syncer's spec; snapshots go to ``syncer.checkpoint_dir`` or ``<run_dir>/syncer``."""
    plan = fragments_lib.partition(template, config.syncer.fragments)
    frags = [{k: _np(v) for k, v in fragments_lib.extract(template, plan, p).items()}
             for p in range(plan.num_fragments)]
    outer = config.syncer.outer_optimizer.model_dump()
    kind = outer.pop("type")
    checkpoint_dir = config.syncer.checkpoint_dir or os.path.join(run_dir, "syncer")
    return SyncerSpec(fragments=frags, settings=syncer_settings(config), outer_kind=kind,
                      outer_kwargs=outer, codec_kind=config.compression.type,
                      codec_block_size=getattr(config.compression, "block_size", 64),
                      checkpoint_dir=os.path.abspath(checkpoint_dir),
                      snapshot_every_merges=config.syncer.snapshot_every_merges)


def _np(x):
    import numpy as np

    return np.asarray(x, dtype=np.float32)
