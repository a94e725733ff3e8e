"""Every JobConfig field reaches the object that uses it, through the one translator (build.py).

The test walks every leaf of a few complete configs, changes it to another valid value, and checks
that what ``build`` hands the parts (training spec, syncer settings and spec, fleet settings,
controller settings, a learner's spec, the chaos plan) changes too. A field read only by the job
runner or the CLI is listed in ``build.CLI_ONLY`` and must be read there.
"""

import dataclasses
from pathlib import Path

import pytest

from islands.orchestrator import build
from islands.orchestrator import fleet as fleet_lib
from islands.orchestrator.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "regions": {"a": {"learners": 2, "max_learners": 3}},
    "learner": {"overlap": "blend"},   # merge_alpha only applies with blend (carry is the default)
    "link": {"port": 7000},
    "chaos": {"mtbf_s": 60, "region_mtbf_s": 200, "slowdown_mtbf_s": 60, "network_mtbf_s": 60,
              "syncer_mtbf_s": 100},
}
# The other variants of the unions (outer optimizer, codec).
ALTERNATIVES = [
    {**BASE, "syncer": {"outer_optimizer": {"type": "adam"}}, "compression": {"type": "int8"},
     "downlink_compression": {"type": "int2"}},
    {**BASE, "syncer": {"outer_optimizer": {"type": "sgd"}}, "compression": {"type": "bf16"}},
]

# New values where "another value of the same type" is not enough or not valid.
CHANGES = {
    "name": "another-job",
    "model.d_model": 128,      # n_heads must divide it
    "model.n_heads": 8,
    "model.compute_dtype": "bfloat16",
    "data.corpus": "/some/corpus/dir",
    "regions.a.bandwidth_gbps": 2.5,   # None (no emulation) by default
    "syncer.downlink_max_shadows": 4,  # None (no bound) by default
    "task.path": "my_pkg.tasks:make",
    "task.args": None,         # only with another task.path: test_task_args_reach_the_learners
    "learner.overlap": "carry",
    "learner.sharding": "fsdp",
    "syncer.merge_rule": "mean",
    "syncer.outer_gradient": "pull",
    "syncer.round_step": "per_merge",
    "syncer.schedule_clock": "learner",
    "syncer.max_staleness": 3,
    "syncer.snapshot_min_interval_s": 5.0,
    "syncer.checkpoint_dir": "/somewhere/checkpoints",
    "syncer.outer_optimizer.type": None,   # changes with the variant: covered by ALTERNATIVES
    "syncer.outer_optimizer.lr": 0.5,      # unset (by the rule) in the Nesterov default
    "syncer.outer_optimizer.momentum": 0.5,
    "compression.type": None,
    "downlink_compression.type": None,
    "quorum.min_learners": 2,
    "regions.a.learners": 3,
    "regions.a.max_learners": 4,
    "regions.a.speed_factors": 0.5,
    "regions.a.accelerator": "gpu",
    "regions.a.devices_per_host": 2,
    # Refused alone (more than one host, or TPU keys on a CPU region): test_accelerators.py
    # shows a TPU region's type and topology reach the learner's Ray options.
    "regions.a.hosts_per_learner": None,
    "regions.a.tpu_type": None,
    "regions.a.topology": None,
    "chaos.kill_mode": "exit",
    "chaos.events": [{"type": "kill", "target": "a:0", "at_s": 1.0}],
    "chaos.horizon_s": 30.0,
    "run.run_dir": "elsewhere/{name}",
    "metrics.host": "10.1.2.3",
    "console.host": "10.1.2.4",
    "console.token_file": "/etc/islands/console-token",
    "health.restart.max_preemption_restarts": 7,
    "link.host": "localhost",
    "link.token_file": "/run/secrets/link-token",
    "link.tls": {"cert_file": "server.pem", "key_file": "server-key.pem"},
    # Read by a region's agent (orchestrator/region_agent.py), not by the home's objects: test_link.py shows
    # an agent leaving within it.
    "link.agent_home_timeout_s": None,
    # Read by a region's link client from the job's config (link/client.py premerger):
    # test_premerge.py shows both reach its PreMerger.
    "link.premerge": None,
    "link.premerge_window_s": None,
}


def leaves(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaves(value, path + ".")
        else:
            yield path, value


def with_value(tree, path, value):
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    head, _, rest = path.partition(".")
    if rest:
        tree[head] = with_value(tree[head], rest, value)
    else:
        tree[head] = value
    return tree


def changed(path, value):
    if path in CHANGES:
        return CHANGES[path]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 if value > 0 else 0.5
    raise AssertionError(f"{path}: add a new value for {value!r} to CHANGES")


def observed(config):
    """Everything build hands the parts, as comparable values."""
    fleet = fleet_lib.initial(build.fleet_settings(config))
    launches = fleet_lib.step(fleet, [], 0.0).actions   # none when every region is remote
    first = launches[0] if launches else None
    training = build.training_spec(config)
    plan = build.chaos_plan(config)
    outer = config.syncer.outer_optimizer.model_dump()
    return (training, build.syncer_settings(config), build.fleet_settings(config),
            build.controller_settings(config), build.learner_spec(config, training, first) if first else None,
            build.syncer_options(config, "/runs/x"), outer,
            build.link_server_settings(config, "token"),
            tuple(plan) if plan is not None else None)


def source_of_cli():
    return "".join((ROOT / f).read_text() for f in ("orchestrator/job.py", "orchestrator/cli.py"))


CONFIGS = [BASE] + ALTERNATIVES


@pytest.mark.parametrize("base", CONFIGS, ids=["nesterov-int4", "adam-int8", "sgd-bf16"])
def test_every_field_reaches_its_user(base):
    config = JobConfig.model_validate(base)
    reference = observed(config)
    full = config.model_dump()
    unreached, checked = [], 0
    for path, value in leaves(full):
        new = changed(path, value)
        if new is None:
            continue
        if path.endswith(".remote") and full["downlink_compression"]["type"] != "none":
            continue  # refused together (test_config): the BASE config covers `remote`
        variant = JobConfig.model_validate(with_value(full, path, new))
        assert variant != config, path
        checked += 1
        if path in build.CLI_ONLY:
            attribute = "." + path.rsplit(".", 1)[-1]
            assert attribute in source_of_cli() or path == "name", \
                f"{path} is listed CLI-only but the job runner and the CLI never read it"
            continue
        if observed(variant) == reference:
            unreached.append(path)
    assert checked > 60
    assert not unreached, f"fields that reach nothing: {unreached}"


def test_participation_scale_reaches_the_syncer():
    """It was accepted by JobConfig and dropped before it reached SyncerSettings."""
    off = JobConfig.model_validate({"syncer": {"participation_scale": False}})
    assert build.syncer_settings(off).participation_scale is False
    assert build.syncer_settings(JobConfig()).participation_scale is True


def test_one_list_of_codec_names_and_one_default_block_size():
    from islands.orchestrator import config as config_lib
    from islands.syncer import codec, codec_kinds

    assert config_lib.CODECS is codec.KINDS is codec_kinds.KINDS
    assert (config_lib.Int4Codec().block_size == build.codec_block_size(JobConfig())
            == codec.DEFAULT_BLOCK_SIZE)


def test_the_syncer_decodes_with_the_jobs_codec_only():
    import numpy as np

    from islands.syncer import codec

    job = codec.make_codec("int4", 64)
    foreign = codec.encode_tree(codec.make_codec("int8", 64), {"w": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="job's codec is int4"):
        codec.decode_tree(job, foreign)
    own = codec.encode_tree(job, {"w": np.ones(8, np.float32)})
    assert np.asarray(codec.decode_tree(job, own)["w"]).shape == (8,)


def test_task_args_reach_the_learners():
    config = JobConfig.model_validate({"task": {"path": "my_pkg.tasks:make", "args": {"n": 3}}})
    spec = build.training_spec(config)
    assert (spec.task_path, spec.task_args) == ("my_pkg.tasks:make", {"n": 3})
    assert build.syncer_settings(config).tokens_per_step is None  # the task's own batch size
