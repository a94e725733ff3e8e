"""Limits that depend on the built model and corpus fail before Ray starts, naming the field."""

import pytest

from islands.orchestrator.config import ConfigError, parse
from islands.orchestrator.preflight import (corpus_size, learner_memory_bytes, model_tensors,
                                            preflight)


@pytest.fixture
def corpus_dir(tmp_path):
    """A tiny corpus: 40 small .py files (some land in eval by the name hash)."""
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(f"x_{i} = {i}\n" * 20)
    return tmp_path


def test_default_and_deploy_configs_pass():
    preflight(parse({}))


def test_tensors_are_counted_from_shapes():
    # embed tokens + positions, 8 per block, ln_f.
    assert model_tensors(parse({}))[0] == 2 + 8 * 2 + 1
    import jax

    from islands.learners.model import ModelConfig, init_params, num_params

    real = init_params(ModelConfig(n_layers=1), jax.random.PRNGKey(0))
    assert model_tensors(parse({"model": {"n_layers": 1}})) == (
        len(jax.tree_util.tree_leaves(real)), num_params(real))


def test_more_fragments_than_tensors():
    with pytest.raises(ConfigError) as info:
        preflight(parse({"syncer": {"fragments": 50}}))
    assert "syncer.fragments: 50 fragments but the model has 19 parameter tensors" in str(info.value)
    preflight(parse({"syncer": {"fragments": 19}}))


def test_a_batch_larger_than_the_train_split(corpus_dir):
    size = corpus_size(parse({"data": {"corpus": str(corpus_dir)}}))
    assert size.train > 0 and size.eval > 0
    batch = size.train // 65 + 1
    config = parse({"data": {"corpus": str(corpus_dir), "batch_size": batch}})
    with pytest.raises(ConfigError) as info:
        preflight(config)
    assert f"data.batch_size: a batch of {batch} × (model.seq_len + 1 = 65)" in str(info.value)
    assert f"({size.train:,d} bytes)" in str(info.value)
    preflight(parse({"data": {"corpus": str(corpus_dir), "batch_size": batch - 1}}))


def test_shards_shorter_than_a_window(corpus_dir):
    size = corpus_size(parse({"data": {"corpus": str(corpus_dir)}}))
    learners = size.train // 65 + 1
    config = parse({"data": {"corpus": str(corpus_dir), "batch_size": 1},
                    "regions": {"a": {"learners": 1, "max_learners": learners}}})
    with pytest.raises(ConfigError, match=f"cut into {learners} learner shards"):
        preflight(config)


def test_max_bytes_caps_the_train_split():
    config = parse({"data": {"max_bytes": 100, "batch_size": 2}})
    with pytest.raises(ConfigError, match=r"data.batch_size: .* exceeds the corpus's train split "
                                          r"\(100 bytes\)"):
        preflight(config)


def test_a_missing_corpus_directory(tmp_path):
    with pytest.raises(ConfigError, match="data.corpus: directory .* does not exist"):
        preflight(parse({"data": {"corpus": str(tmp_path / "nope")}}))


def test_a_batch_over_the_memory_limit():
    config = parse({"data": {"batch_size": 4096},
                    "model": {"d_model": 512, "n_heads": 8, "d_ff": 2048, "seq_len": 1024}})
    need = learner_memory_bytes(config)
    with pytest.raises(ConfigError, match="data.batch_size: a learner needs about"):
        preflight(config, memory_limit_bytes=need - 1, check_corpus=False)
    preflight(config, memory_limit_bytes=need, check_corpus=False)


def test_every_problem_is_listed():
    config = parse({"syncer": {"fragments": 40}, "data": {"max_bytes": 10}})
    with pytest.raises(ConfigError) as info:
        preflight(config)
    lines = str(info.value).splitlines()
    assert any(line.startswith("syncer.fragments:") for line in lines)
    assert any(line.startswith("data.batch_size:") for line in lines)


def test_cli_run_prints_a_preflight_error_like_a_config_error(tmp_path, capsys):
    import ray

    from islands.orchestrator import cli

    bad = tmp_path / "job.yaml"
    bad.write_text("syncer: {fragments: 50}\n")
    assert cli.main(["run", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"invalid config {bad}" in err and "syncer.fragments: 50 fragments" in err
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists()


def test_run_job_runs_preflight_before_ray(tmp_path, monkeypatch):
    from islands.orchestrator import job

    monkeypatch.setattr(job, "start_ray", lambda *a, **k: pytest.fail("Ray must not start"))
    with pytest.raises(ConfigError, match="syncer.fragments"):
        job.run_job(parse({"syncer": {"fragments": 50}}), run_dir=str(tmp_path), quiet=True)
