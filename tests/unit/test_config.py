"""JobConfig: every example loads; bad input fails at load with a message naming the field."""

import glob
import os

import pytest

from islands.orchestrator.config import ConfigError, JobConfig, load_config, parse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "deploy", "**", "*.yaml"),
                                               recursive=True)))
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
    assert config.compression.type == "int4" and config.syncer.outer_optimizer.lr == 0.7
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
