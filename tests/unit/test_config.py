"""JobConfig: every example loads; bad input fails at load with a message naming the field."""

import glob
import os

import pytest

from islands.orchestrator import build

from islands.orchestrator.config import ConfigError, JobConfig, load_config, parse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# deploy/helm/ holds Helm values files, not job configs (tests/unit/test_helm_chart.py checks the
# job configs the chart renders from them); deploy/prometheus/ holds alert rules
# (tests/unit/test_alert_rules.py).
NOT_JOB_CONFIGS = ("helm", "prometheus")


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(os.path.join(REPO, "deploy", "**", "*.yaml"), recursive=True)
    if not any(os.sep + os.path.join("deploy", d) + os.sep in p for d in NOT_JOB_CONFIGS)))
def test_every_deploy_yaml_loads(path):
    config = load_config(path)
    assert config.total_learners >= config.quorum.min_learners


def test_defaults_and_helpers():
    config = parse({"regions": {"us-east": {"learners": 2, "max_learners": 3,
                                            "speed_factors": [1.0, 0.5]},
                                "eu-west": {"learners": 1}}})
    assert config.learner_ids() == ["us-east:0", "us-east:1", "eu-west:0"]
    assert config.region_resources() == {"region:us-east": 3.0, "region:eu-west": 1.0}
    assert config.speed_factor("us-east:1") == 0.5 and config.speed_factor("eu-west:0") == 1.0
    assert (config.compression.type, config.compression.block_size) == ("nf2", 64)
    assert (config.downlink_compression.type, config.downlink_compression.block_size) == (
        "nf2", 256)
    assert config.syncer.outer_optimizer.lr is None
    # unset outer values come from the rule for H (syncer/outer.py): averaging at the default H = 8
    options = build.syncer_options(config, "/runs/x")
    assert (options["outer_kind"], options["outer_kwargs"]) == ("nesterov", {"lr": 1.0,
                                                                             "momentum": 0.0})
    long = parse({"regions": {"a": {"learners": 1}}, "syncer": {
        "sync_every_steps": 512, "outer_optimizer": {"type": "nesterov", "lr": 0.5}}})
    assert build.syncer_options(long, "/runs/x")["outer_kwargs"] == {"lr": 0.5, "momentum": 0.9}
    with pytest.raises(Exception):
        config.seed = 3  # frozen


@pytest.mark.parametrize("raw,message", [
    ({"foo": 1}, "foo: unknown key"),
    ({"learner": {"lr_typo": 1}}, "learner.lr_typo: unknown key"),
    ({"regions": {"a": {"learners": -1}}}, "regions.a.learners: Input should be greater than or "
                                           "equal to 0, got -1"),
    ({"quorum": {"min_learners": 5}, "regions": {"a": {"learners": 4}}},
     "quorum.min_learners: quorum (5) exceeds learners (4)"),
    ({"compression": {"type": "int3"}},
     "compression.type: unknown codec 'int3'; choose one of none, bf16, int8, int4"),
    ({"syncer": {"overlap_steps": 8, "sync_every_steps": 8}},
     "syncer.overlap_steps: overlap_steps (8) must be below sync_every_steps (8)"),
    ({"regions": {"Bad_Name": {"learners": 1}}}, "region name 'Bad_Name' must match"),
    ({"regions": {"a": {"learners": 2, "speed_factors": [1.0]}}},
     "regions.a.speed_factors: 1 entries for 2 learners"),
    ({"regions": {"a": {"learners": 1}}, "chaos": {"events": [
        {"type": "kill", "target": "eu:7", "at_s": 1}]}},
     "chaos.events.0.target: kill cannot target 'eu:7'"),
    ({"health": {"heartbeat_s": 5, "timeout_s": 2}},
     "health.timeout_s: timeout_s (2.0) must exceed heartbeat_s (5.0)"),
    ({"health": {"restart": {"reset_after_s": 0}}},
     "health.restart.reset_after_s: Input should be greater than 0, got 0"),
    ({"health": {"restart": {"crash_loop_after": 1}}},
     "health.restart.crash_loop_after: Input should be greater than or equal to 2"),
])
def test_bad_input_names_the_field(raw, message):
    with pytest.raises(ConfigError) as info:
        parse(raw)
    assert message in str(info.value)


def test_yaml_errors():
    with pytest.raises(ConfigError, match="must be a mapping"):
        JobConfig.from_yaml_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        JobConfig.from_yaml_text("a: [1, 2\n")


def test_cli_refuses_a_bad_config_before_starting_anything(tmp_path, capsys):
    from islands.orchestrator import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text("regions: {us-east: {learners: 2}}\nquorum: {min_learners: 3}\n")
    assert cli.main(["run", str(bad)]) == 2
    assert "quorum.min_learners: quorum (3) exceeds learners (2)" in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()


def test_duplicate_keys_are_refused_with_their_lines():
    text = ("name: demo\n"
            "regions:\n"
            "  us-east: {learners: 2}\n"
            "  eu-west: {learners: 1}\n"
            "  us-east: {learners: 3}\n"
            "syncer: {fragments: 2, fragments: 4}\n")
    with pytest.raises(ConfigError) as info:
        JobConfig.from_yaml_text(text)
    message = str(info.value)
    assert "regions.us-east: duplicate key 'us-east' (lines 3 and 5)" in message
    assert "syncer.fragments: duplicate key 'fragments' (lines 6 and 6)" in message


def test_yaml_merge_keys_and_aliases_are_not_duplicates():
    text = ("x-region: &region {learners: 1, latency_ms: 5}\n"
            "regions:\n"
            "  us-east: *region\n"
            "  eu-west:\n"
            "    <<: *region\n"
            "    learners: 2\n")
    from islands.orchestrator.config import load_yaml

    raw = load_yaml(text)
    assert raw["regions"]["eu-west"] == {"learners": 2, "latency_ms": 5}
    assert parse({"regions": raw["regions"]}).total_learners == 3


def test_metrics_host_defaults_to_none_and_must_not_be_empty():
    assert parse({}).metrics.host is None
    assert parse({"metrics": {"host": "10.0.0.5"}}).metrics.host == "10.0.0.5"
    with pytest.raises(ConfigError, match="metrics.host"):
        parse({"metrics": {"host": ""}})


@pytest.mark.parametrize("raw,message", [
    # A union's tag is not a key the YAML has: the path is the one the user wrote.
    ({"syncer": {"outer_optimizer": {"type": "sgd", "lr": -1}}},
     "syncer.outer_optimizer.lr: Input should be greater than 0, got -1"),
    ({"compression": {"type": "int8", "block_size": 0}}, "compression.block_size: Input should"),
    ({"regions": {"a": {"learners": 1}}, "chaos": {"events": [
        {"type": "kill", "target": "a:0", "at_s": 1, "bogus": 1}]}},
     "chaos.events.0.bogus: unknown key"),
    ({"syncer": {"outer_optimizer": {"lr": 0.5}}},
     "syncer.outer_optimizer.type: required; choose one of nesterov, sgd, adam"),
])
def test_union_errors_name_the_yaml_path(raw, message):
    with pytest.raises(ConfigError) as info:
        parse(raw)
    assert message in str(info.value)


def test_a_remote_region_takes_any_downlink_codec():
    """The encoded downlink crosses the link (its codes do; the shadow stays at home and the
    learner applies the codes to its own copy), so remote regions are not refused one."""
    from islands.orchestrator.config import parse

    job = parse({"regions": {"a": {"learners": 1, "remote": True}}, "link": {"port": 7000},
                 "downlink_compression": {"type": "int4"}})
    assert job.downlink_compression.type == "int4"


def test_a_region_agent_keeps_the_warm_spares_the_home_gives_its_region():
    """health.spares as written applies to remote regions too, but their agent keeps them: the
    home's fleet keeps none for a remote region, the agent's config (its region local) does."""
    from islands.orchestrator.region_agent import region_config

    for spares, far in ((1, 1), ({"home": 2}, 0), ({"far": 2}, 2)):
        home = {"name": "j", "quorum": {"min_learners": 1}, "health": {"spares": spares},
                "link": {"port": 50051},
                "regions": {"home": {"learners": 2}, "far": {"learners": 2, "remote": True}}}
        assert parse(home).spares_of("far") == 0   # the home runs none there
        agent = region_config(home, "far")
        assert agent.spares_of("far") == far and not agent.regions["far"].remote


def test_the_downlink_default_is_the_same_with_remote_regions_and_premerge():
    """nf2:256 replies everywhere: remote regions and pre-merge no longer fall back to fp32."""
    remote = {"regions": {"a": {"learners": 1}, "far": {"learners": 1, "remote": True}},
              "link": {"port": 7443}}
    premerge = {"regions": {"a": {"learners": 2}}, "link": {"premerge": True},
                "syncer": {"merge_rule": "mean"}}
    for raw in (remote, premerge):
        down = parse(raw).downlink_compression
        assert (down.type, down.block_size) == ("nf2", 256)
        assert parse({**raw, "downlink_compression": {"type": "none"}}).downlink_compression.type \
            == "none"


def test_the_emulated_wan_is_off_unless_asked_for(tiny_job):
    """No emulated latency or bandwidth cap by default (a real cluster's network is all a
    message takes); 0 is accepted and means none; the demo asks for it."""
    import math

    from islands.faults import emulated_bytes_per_s
    from islands.orchestrator import fleet

    config = tiny_job("wan")
    region = config.regions["a"]
    assert region.bandwidth_gbps is None and region.latency_ms == 0.0
    launch = fleet.Launch("a:0", "a", incarnation=0, shard=0, num_shards=2, speed_factor=1.0,
                          peer=None, start_step=0)
    spec = build.learner_spec(config, build.training_spec(config), launch)
    assert spec.bandwidth_gbps == 0.0 and spec.latency_ms == 0.0
    assert emulated_bytes_per_s(spec.bandwidth_gbps) == math.inf
    zero = parse({**config.model_dump(mode="json"),
                  "regions": {"a": {"learners": 2, "bandwidth_gbps": 0, "latency_ms": 0}}})
    assert emulated_bytes_per_s(zero.regions["a"].bandwidth_gbps) == math.inf
    with pytest.raises(ConfigError, match="bandwidth_gbps"):
        parse({**config.model_dump(mode="json"), "regions": {"a": {"learners": 2,
                                                                   "bandwidth_gbps": -1}}})
    demo = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "deploy",
                                    "examples", "local.yaml"))
    assert demo.regions["us-east"].bandwidth_gbps == 1.0 and demo.regions["us-east"].latency_ms > 0


def test_writing_the_downlinks_nf2_out_keeps_its_default_block():
    assert parse({}).downlink_compression.block_size == 256
    assert parse({"downlink_compression": {"type": "nf2"}}).downlink_compression.block_size == 256
    assert parse({"downlink_compression": {"type": "nf2", "block_size": 32}}
                 ).downlink_compression.block_size == 32
    assert parse({"compression": {"type": "nf2"}}).compression.block_size == 64


def test_the_restart_policy_defaults_are_the_configs():
    """The fleet's own default policy (tests, the in-process driver) is the config's: a crash
    backoff reset after 10 minutes of training, crash loops retired at their third time."""
    import dataclasses

    from islands.orchestrator.build import restart_policy
    from islands.orchestrator.health import RestartPolicy

    config = parse({"regions": {"a": {"learners": 1}}})
    assert restart_policy(config) == RestartPolicy()
    assert RestartPolicy().reset_after_s == 600.0 and RestartPolicy().crash_loop_after == 3
    assert {f.name for f in dataclasses.fields(RestartPolicy)} == set(
        config.health.restart.model_dump())
