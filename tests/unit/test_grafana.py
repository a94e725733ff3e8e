"""deploy/grafana/islands.json: a Grafana dashboard whose queries name only exported metrics."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from islands.orchestrator.metrics import METRIC_NAMES, METRICS, sample_names

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "islands.json"
METRIC_ID = re.compile(r"\bislands_[A-Za-z0-9_:]*")
# Labels Prometheus adds at scrape time, or that histograms carry, beside each metric's own.
SCRAPE_LABELS = {"job", "instance", "le"}
# The samples a scrape shows for each kind of metric (as ``metrics.sample_names()`` builds them).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def all_panels(panels):
    """Every panel, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels") or [])


def queries(dashboard: dict) -> list[str]:
    """Every PromQL text: panel targets and templating variable queries."""
    out = [target["expr"] for panel in all_panels(dashboard["panels"])
           for target in panel.get("targets") or [] if "expr" in target]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" and query:
            out.append(query)
    return out


def test_is_a_dashboard(dashboard):
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    panels = list(all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for panel in panels:
        assert panel["type"] and panel["title"], panel
        pos = panel["gridPos"]
        assert {"x", "y", "w", "h"} <= set(pos), panel["title"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["w"] > 0 and pos["h"] > 0
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps another panel"
                cells.add((x, y))
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']!r} has no query"


def test_datasource_is_templated(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for panel in all_panels(dashboard["panels"]):
        for holder in [panel] + list(panel.get("targets") or []):
            if "datasource" in holder:
                assert holder["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, \
                    panel["title"]


def test_queries_name_only_exported_samples(dashboard):
    exported = sample_names()
    texts = queries(dashboard)
    assert len(texts) >= 16
    for text in texts:
        names = METRIC_ID.findall(text)
        assert names, f"query names no islands metric: {text}"
        unknown = set(names) - exported
        assert not unknown, f"{sorted(unknown)} are not exported (query: {text})"


def test_every_metric_has_a_panel(dashboard):
    used = {name for text in queries(dashboard) for name in METRIC_ID.findall(text)}
    by_metric = {spec.name: {spec.name + s for s in SUFFIXES[spec.kind]} for spec in METRICS}
    assert set(by_metric) == METRIC_NAMES
    assert set().union(*by_metric.values()) == sample_names()
    unused = sorted(name for name, samples in by_metric.items() if not samples & used)
    assert not unused, f"no panel shows {unused}"


def test_queries_use_only_known_labels(dashboard):
    """A label in a selector or a ``by (...)`` clause must be one the metric (or a scrape) has."""
    labels = {sample: set(spec.labels) for spec in METRICS
              for sample in (spec.name + suffix for suffix in SUFFIXES[spec.kind])}
    for text in queries(dashboard):
        known = set(SCRAPE_LABELS)
        for name in METRIC_ID.findall(text):
            known |= labels.get(name, set())  # an unknown name fails the test above
        for selector in re.findall(r"\{([^}]*)\}", text):
            for label in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", selector):
                assert label in known, f"label {label!r} unknown in {text}"
        for clause in re.findall(r"\bby\s*\(([^)]*)\)", text):
            for label in (part.strip() for part in clause.split(",")):
                assert label in known, f"label {label!r} unknown in {text}"


def test_panels_the_issue_asks_for(dashboard):
    texts = {panel["title"]: " ".join(t["expr"] for t in panel.get("targets") or [])
             for panel in all_panels(dashboard["panels"])}
    joined = "\n".join(texts.values())
    assert 'islands_goodput_ratio{job=~"$job", window="run"}' in joined
    assert 'window!="run"' in joined  # the sliding window, "5m" by default
    assert "histogram_quantile(0.9, sum by (le) (rate(islands_staleness_bucket" in joined
    assert "rate(islands_wire_bytes_total" in joined and "by (region, direction)" in joined
    assert "by (phase)" in texts["Recovery phases (since the job started)"]
    assert "by (reason)" in texts["Learner restarts by reason"]
    assert "by (reason)" in texts["Refused pushes by reason"]
    assert "by (fragment)" in texts["Merges per fragment"]
