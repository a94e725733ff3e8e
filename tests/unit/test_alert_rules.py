"""deploy/prometheus/islands-alerts.yaml: a valid Prometheus rule file (promtool's structural
checks, without promtool) whose every metric is one the controller exports."""

import os
import re

import pytest
import yaml

from islands.orchestrator import metrics
from test_docs import anchors  # tests/unit is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(REPO, "deploy", "prometheus", "islands-alerts.yaml")
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# PromQL's functions, aggregations and keywords that may appear as bare words in an expression.
PROMQL_WORDS = {
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bool", "bottomk", "by",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "count", "count_over_time", "delta",
    "deriv", "floor", "group", "group_left", "group_right", "histogram_quantile", "idelta",
    "ignoring", "increase", "irate", "label_replace", "max", "max_over_time", "min",
    "min_over_time", "offset", "on", "quantile", "quantile_over_time", "rate", "resets", "round",
    "scalar", "sort", "sort_desc", "stddev", "sum", "sum_over_time", "time", "topk", "vector",
    "without", "and", "or", "unless"}


def load() -> dict:
    with open(RULES, encoding="utf-8") as f:
        return yaml.safe_load(f)


def rules() -> list:
    return [rule for group in load()["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set:
    """The bare identifiers of a PromQL expression that are not functions or keywords: its
    metric names. Strings, label matchers, ranges and grouping label lists are removed first."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {w for w in words if w not in PROMQL_WORDS and not re.match(r"^\d", w)}


def test_metric_names_of_an_expression():
    assert metric_names('sum by (reason) (increase(islands_x_total{reason=~"a|b"}[15m])) > 5') \
        == {"islands_x_total"}
    assert metric_names("absent(up) or rate(foo[5m]) == 0") == {"up", "foo"}


def test_the_file_is_a_prometheus_rule_file():
    data = load()
    assert set(data) == {"groups"}, "a rule file has only `groups` at its top"
    names = [g["name"] for g in data["groups"]]
    assert len(names) == len(set(names)) and all(names), "group names are unique"
    for group in data["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"}, set(group)
        assert "interval" not in group or DURATION.match(group["interval"])
        assert group["rules"], f"group {group['name']} has no rules"
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels",
                                 "annotations"}, set(rule)
            assert NAME.match(rule.get("alert") or rule.get("record")), rule
            assert isinstance(rule["expr"], str) and rule["expr"].strip(), rule
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]
            assert rule["expr"].count("{") == rule["expr"].count("}"), rule["expr"]
            if "for" in rule:
                assert DURATION.match(rule["for"]), rule["for"]
            for key in ("labels", "annotations"):
                values = rule.get(key, {})
                assert isinstance(values, dict), f"{key} is a mapping"
                for k, v in values.items():
                    assert NAME.match(k) and isinstance(v, str), (k, v)
            if "alert" in rule:
                assert rule["annotations"].get("summary"), f"{rule['alert']} has no summary"


def test_the_alerts_cover_what_operators_need():
    exprs = " ".join(r["expr"] for r in rules())
    for metric in ("islands_goodput_ratio", 'islands_learners{state="failed"}',
                   "islands_merges_total", "islands_rejected_pushes_total",
                   "islands_learner_restarts_total", "islands_syncer_epoch"):
        assert metric in exprs, metric


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("alert") or r.get("record"))
def test_every_metric_is_exported(rule):
    exported = set(metrics.sample_names())
    names = metric_names(rule["expr"])
    assert names, f"{rule['expr']!r} names no metric"
    unknown = sorted(names - exported)
    assert not unknown, (f"{rule.get('alert')}: {unknown} are not metrics the controller exports "
                         f"(orchestrator/metrics.py)")
    labels = {spec.name + ("_total" if spec.kind == "counter" else ""): set(spec.labels)
              for spec in metrics.METRICS}
    for name, matchers in re.findall(r"(islands_[a-z0-9_]+)\{([^}]*)\}", rule["expr"]):
        used = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", matchers))
        assert used <= labels[name], f"{name} has labels {labels[name]}, not {used - labels[name]}"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("alert") or r.get("record"))
def test_every_doc_it_points_to_exists(rule):
    for page, anchor in re.findall(r"(docs/[\w-]+\.md)(?:#([\w-]+))?",
                                   " ".join(rule.get("annotations", {}).values())):
        path = os.path.join(REPO, page)
        assert os.path.isfile(path), page
        assert not anchor or anchor in anchors(path), f"{page}#{anchor}"


def test_the_metrics_page_points_to_the_rules():
    with open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8") as f:
        assert "deploy/prometheus/islands-alerts.yaml" in f.read()
