"""Property tests over JobConfig: every valid config round-trips (Python and YAML); a config with
one field made invalid fails with a ConfigError naming that field's dotted path."""

import tempfile

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

from islands.orchestrator.config import CODECS, ConfigError, JobConfig, parse  # noqa: E402

# Hypothesis keeps caches in ./.hypothesis; a test run must not leave files in the checkout.
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="islands-hypothesis-"))
SETTINGS = settings(max_examples=50, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

names = st.from_regex(r"[a-z0-9][a-z0-9-]{0,8}", fullmatch=True)
pos_float = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False)
unit_open = st.floats(min_value=0.0, max_value=0.99, allow_nan=False)


@st.composite
def regions(draw):
    keys = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    out = {}
    for key in keys:
        learners = draw(st.integers(0, 4))
        region = {"learners": learners}
        if draw(st.booleans()):
            region["max_learners"] = learners + draw(st.integers(0, 3))
        if learners and draw(st.booleans()):
            region["speed_factors"] = draw(st.lists(pos_float, min_size=learners,
                                                    max_size=learners))
        elif draw(st.booleans()):
            region["speed_factors"] = draw(pos_float)
        if draw(st.booleans()):
            region["bandwidth_gbps"] = draw(pos_float)
            region["latency_ms"] = draw(st.floats(0, 500, allow_nan=False))
        out[key] = region
    if not sum(r["learners"] for r in out.values()):
        out[keys[0]]["learners"] = 1
        out[keys[0]].pop("speed_factors", None)
        if out[keys[0]].get("max_learners", 1) < 1:
            out[keys[0]]["max_learners"] = 1
    return out


@st.composite
def outer_optimizers(draw):
    kind = draw(st.sampled_from(["nesterov", "sgd", "adam"]))
    opt = {"type": kind, "lr": draw(pos_float)}
    if kind == "adam":
        opt.update(b1=draw(unit_open), b2=draw(unit_open))
    else:
        opt["momentum"] = draw(unit_open)
    return opt


@st.composite
def compressions(draw):
    kind = draw(st.sampled_from(CODECS))
    codec = {"type": kind, "error_feedback": draw(st.booleans())}
    if kind in ("int8", "int4"):
        codec["block_size"] = draw(st.integers(1, 256))
    return codec


@st.composite
def chaos_sections(draw, region_map):
    learners = [f"{n}:{i}" for n, r in region_map.items() for i in range(r["learners"])]
    region_names = list(region_map)
    events = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["kill", "region_loss", "slowdown", "network", "partition"]))
        at_s = draw(st.floats(0, 100, allow_nan=False))
        if kind == "kill":
            events.append({"type": "kill", "target": draw(st.sampled_from(learners + ["syncer"])),
                           "at_s": at_s, "repair_s": draw(st.floats(0, 10, allow_nan=False))})
        elif kind == "region_loss":
            events.append({"type": kind, "target": draw(st.sampled_from(region_names)),
                           "at_s": at_s})
        elif kind == "slowdown":
            events.append({"type": kind, "target": draw(st.sampled_from(learners + region_names)),
                           "at_s": at_s, "duration_s": draw(pos_float),
                           "factor": 1 + draw(pos_float)})
        else:
            events.append({"type": kind, "target": draw(st.sampled_from(region_names)),
                           "at_s": at_s, "duration_s": draw(pos_float)})
    chaos = {"seed": draw(st.integers(0, 2 ** 31)), "events": events}
    if draw(st.booleans()):
        chaos["mtbf_s"] = draw(pos_float)
    return chaos


@st.composite
def valid_raw(draw):
    n_heads = draw(st.integers(1, 4))
    sync_every = draw(st.integers(1, 16))
    region_map = draw(regions())
    total = sum(r["learners"] for r in region_map.values())
    heartbeat = draw(st.floats(0.05, 5, allow_nan=False))
    raw = {
        "name": draw(names),
        "seed": draw(st.integers(0, 10 ** 6)),
        "model": {"vocab_size": draw(st.integers(1, 300)), "n_heads": n_heads,
                  "d_model": n_heads * draw(st.integers(1, 16)),
                  "n_layers": draw(st.integers(1, 3)), "d_ff": draw(st.integers(1, 128)),
                  "seq_len": draw(st.integers(2, 128))},
        "data": {"eval_fraction": draw(st.floats(0.01, 0.5, allow_nan=False)),
                 "max_bytes": draw(st.none() | st.integers(1, 10 ** 7)),
                 "batch_size": draw(st.integers(1, 64)), "eval_batches": draw(st.integers(1, 8))},
        "learner": {"inner_optimizer": {"lr": draw(pos_float),
                                        "warmup_steps": draw(st.integers(0, 100)),
                                        "b1": draw(unit_open)},
                    **draw(st.sampled_from([{"overlap": "carry"}]) | st.builds(
                        lambda a: {"overlap": "blend", "merge_alpha": a},
                        st.floats(0, 1, allow_nan=False)))},
        "syncer": {"fragments": draw(st.integers(1, 8)), "sync_every_steps": sync_every,
                   "overlap_steps": draw(st.integers(0, sync_every - 1)),
                   "outer_optimizer": draw(outer_optimizers()),
                   "max_staleness": draw(st.none() | st.integers(0, 10)),
                   "merge_rule": draw(st.sampled_from(["rda", "mean"])),
                   "checkpoint_dir": draw(st.none() | st.just("ckpt"))},
        "quorum": {"min_learners": draw(st.integers(1, total)),
                   "grace_gamma": draw(unit_open)},
        "compression": draw(compressions()),
        "regions": region_map,
        "health": {"heartbeat_s": heartbeat,
                   "timeout_s": heartbeat + draw(st.floats(0.01, 60, allow_nan=False))},
        "metrics": {"enabled": draw(st.booleans()), "port": draw(st.integers(0, 65535)),
                    "host": draw(st.none() | st.sampled_from(["127.0.0.1", "0.0.0.0"]))},
        "run": {"duration_s": draw(pos_float), "dashboard": draw(st.booleans())},
    }
    if draw(st.booleans()):
        raw["chaos"] = draw(chaos_sections(region_map))
    return raw


@SETTINGS
@given(valid_raw())
def test_valid_configs_round_trip(raw):
    config = parse(raw)
    assert JobConfig.model_validate(config.model_dump()) == config
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    assert JobConfig.from_yaml_text(text) == config
    assert config.total_learners >= config.quorum.min_learners


def _set(raw, path, value):
    node = raw
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


# (dotted path, strategy of bad values): each names a rule of the schema.
NON_POSITIVE = st.sampled_from([0, -1, -0.5, -1e9])
NEGATIVE = st.sampled_from([-1, -0.001, -1e9])
BAD_FIELDS = [
    ("data.batch_size", NON_POSITIVE), ("data.eval_batches", NON_POSITIVE),
    ("data.max_bytes", NON_POSITIVE), ("data.eval_fraction", st.sampled_from([0, 1, -0.2, 1.5])),
    ("model.seq_len", st.sampled_from([1, 0, -4])), ("model.d_model", st.sampled_from([0, -8])),
    ("learner.inner_optimizer.lr", NON_POSITIVE),
    ("learner.inner_optimizer.warmup_steps", NEGATIVE.map(lambda v: int(v) or -1)),
    ("learner.merge_alpha", st.sampled_from([-0.1, 1.5])),
    ("syncer.fragments", st.sampled_from([0, -2])),
    ("syncer.outer_optimizer.lr", NON_POSITIVE),
    ("syncer.snapshot_every_merges", st.sampled_from([0, -1])),
    ("quorum.grace_gamma", st.sampled_from([-0.1, 1, 2])),
    ("health.heartbeat_s", NON_POSITIVE),
    ("metrics.port", st.sampled_from([-1, 65536, 10 ** 6])),
    ("run.duration_s", NON_POSITIVE), ("run.progress_every_s", NON_POSITIVE),
]


@st.composite
def invalid_raw(draw):
    raw = draw(valid_raw())
    kind = draw(st.sampled_from(["field", "unknown", "quorum", "overlap", "region"]))
    if kind == "field":
        path, values = draw(st.sampled_from(BAD_FIELDS))
        _set(raw, path.split("."), draw(values))
    elif kind == "unknown":
        section = draw(st.sampled_from(["", "model", "data", "learner", "learner.inner_optimizer",
                                        "syncer", "syncer.outer_optimizer", "quorum", "health",
                                        "metrics", "run", "compression"]))
        key = draw(st.from_regex(r"x_[a-z]{1,6}", fullmatch=True))
        _set(raw, (section.split(".") if section else []) + [key], 1)
        path = f"{section}.{key}" if section else key
    elif kind == "quorum":
        total = sum(r["learners"] for r in raw["regions"].values())
        raw["quorum"]["min_learners"] = total + draw(st.integers(1, 5))
        raw.pop("chaos", None)  # its targets are checked after the quorum; keep one problem
        path = "quorum.min_learners"
    elif kind == "overlap":
        raw["syncer"]["overlap_steps"] = raw["syncer"]["sync_every_steps"] + draw(
            st.integers(0, 4))
        path = "syncer.overlap_steps"
    else:
        region = draw(st.sampled_from(sorted(raw["regions"])))
        raw["regions"][region] = {"learners": draw(NEGATIVE.map(lambda v: int(v) or -1))}
        path = f"regions.{region}.learners"
    return raw, path


@SETTINGS
@given(invalid_raw())
def test_one_invalid_field_is_named_by_its_dotted_path(case):
    raw, path = case
    with pytest.raises(ConfigError) as info:
        parse(raw)
    lines = str(info.value).splitlines()
    assert any(line.startswith(f"{path}:") for line in lines), (path, lines)
    # The same through YAML text.
    with pytest.raises(ConfigError) as info:
        JobConfig.from_yaml_text(yaml.safe_dump(raw, sort_keys=False))
    assert any(line.startswith(f"{path}:") for line in str(info.value).splitlines())

