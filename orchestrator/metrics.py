"""Prometheus metrics (docs/metrics.md): every exported series, computed from the controller's snapshot.

The controller keeps the books; this module only turns one ``snapshot()`` dict into metric
families. It is a custom prometheus-client collector rather than a set of live ``Counter`` objects:
the controller already holds exact cumulative totals (the syncer ledger, per-incarnation counters
that it carries over restarts), so a scrape reads them as they are and nothing is counted twice.
``families(snapshot)`` is pure and testable without Ray or a server.

Names are the contract (docs/metrics.md): base units, ``_total`` on counters (prometheus-client adds
the suffix to a counter family), ``_ratio`` for 0–1. Labels are bounded.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

# Recovery phases run from a fraction of a second (detect) to minutes (a slow restart): the
# controller counts them as it goes (logs.RecoveryLog), so the buckets are defined there.
from .logs import RECOVERY_BUCKETS_S, RECOVERY_PHASES

log = logging.getLogger("islands.metrics")

DEFAULT_METRICS_PORT = 9400
# Staleness in fragment versions: 0 is the common case, a few with K < M, more after an outage.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
# Learners in one merge: one, a few with K < M, up to a large fleet.
PARTICIPANTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Participants ÷ live learners of one merge (1: every live learner took part).
PARTICIPATION_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
LEARNER_STATES = ("pending", "starting", "training", "paused", "draining", "restarting", "failed",
                  "retired", "unreachable", "awaiting_placement")
RESTART_REASONS = ("crash", "preemption", "preempted_planned", "hang", "straggler", "quarantine")
TOKEN_FATES = ("applied", "dropped")
# Inner-step seconds: a millisecond toy step to a minutes-long step of a big model.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  30.0, 60.0)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric. ``name`` is the family name; a counter's samples end in ``_total``."""

    name: str
    kind: str                  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("islands_goodput_ratio", "gauge", ("window",),
               "Applied inner-step seconds / allocated learner seconds (docs/architecture.md#goodput), over the run "
               "and over a sliding window"),
    MetricSpec("islands_goodput_seconds", "counter", (),
               "Allocated learner seconds that became part of the model (applied inner-step "
               "seconds)"),
    MetricSpec("islands_badput_seconds", "counter", ("cause",),
               "Allocated learner seconds that did not, by cause (ml-goodput-measurement's badput "
               "types, plus refused, overlap and paused)"),
    MetricSpec("islands_step_seconds", "histogram", ("region",),
               "Inner-step seconds of the region's training learners, one observation per "
               "heartbeat"),
    MetricSpec("islands_learner_steps", "counter", ("region", "learner"),
               "Inner steps taken, summed over the learner's incarnations"),
    MetricSpec("islands_tokens", "counter", ("fate",),
               "Tokens by fate (docs/architecture.md#token-ledger): applied in a merge, dropped "
               "(overwritten, refused, or held by an incarnation that ended)"),
    MetricSpec("islands_merges", "counter", ("fragment",), "Merges of each fragment"),
    MetricSpec("islands_quorum_size", "gauge", ("fragment",),
               "Distinct learners in the fragment's last merge"),
    MetricSpec("islands_grace_window_seconds", "gauge", (),
               "Grace window of the last merge (paper Eq. 3)"),
    MetricSpec("islands_merge_live_learners", "gauge", ("fragment",),
               "Live learners when the fragment last merged (its participants are "
               "islands_quorum_size)"),
    MetricSpec("islands_merge_participants", "histogram", (),
               "Learners that took part in each merge that replaced Θ"),
    MetricSpec("islands_merge_participation_ratio", "histogram", (),
               "Participants ÷ live learners of each merge that replaced Θ"),
    MetricSpec("islands_staleness", "histogram", (),
               "Staleness of merged contributions, in fragment versions"),
    MetricSpec("islands_wire_bytes", "counter", ("direction", "region"),
               "Encoded bytes on the emulated WAN, learner->syncer (up) and syncer->learner (down)"),
    MetricSpec("islands_recovery_seconds", "histogram", ("phase",),
               "Seconds per recovery phase of a failed learner (detect, restart, restore, "
               "first_contribution, total)"),
    MetricSpec("islands_learner_restarts", "counter", ("reason",), "Learner restarts by cause"),
    MetricSpec("islands_slow_learners_tolerated", "counter", ("region",),
               "Incarnations found slow again after their one straggler restart, let train on at "
               "their pace instead of being restarted"),
    MetricSpec("islands_rejected_pushes", "counter", ("reason",), "Refused pushes by reason"),
    MetricSpec("islands_compression_relative_error", "gauge", (),
               "Mean over live learners of the last push's ||decode(code) - drift|| / ||drift||"),
    MetricSpec("islands_syncer_epoch", "gauge", (), "Syncer incarnation (bumped on restart)"),
    MetricSpec("islands_syncer_shard_epoch", "gauge", ("shard",),
               "A syncer shard's incarnation (bumped when that shard restarts)"),
    MetricSpec("islands_syncer_shard_merges", "counter", ("shard",),
               "Merges of the fragments a syncer shard owns (the sum of their versions)"),
    MetricSpec("islands_syncer_shard_snapshot_failures", "counter", ("shard",),
               "Snapshot saves of a syncer shard that raised (merging went on; a restart would "
               "restore an older snapshot)"),
    MetricSpec("islands_learners", "gauge", ("state", "region"),
               "Learners by state and region; state=\"spare\" counts warm spares"),
    MetricSpec("islands_learner_devices", "gauge", ("region", "kind"),
               "Devices the region's live learners train on, by the kind JAX reports (e.g. "
               "\"NVIDIA H200\", \"cpu\"); each learner proves them at start (a learner whose "
               "devices differ from its region's request does not train)"),
    MetricSpec("islands_train_loss", "gauge", (), "Mean training loss of the training learners"),
    MetricSpec("islands_eval_loss", "gauge", (), "Held-out loss of the global parameters"),
    MetricSpec("islands_link_wire_bytes", "counter", ("direction", "region"),
               "Bytes on a remote region's gRPC link as its sockets counted them (TLS, HTTP/2 "
               "and keepalive included), region->home (up) and home->region (down)"),
    MetricSpec("islands_link_reconnects", "counter", ("region",),
               "Times a remote region's link connected again after losing its connection"),
    MetricSpec("islands_link_report_age_seconds", "gauge", ("region",),
               "Seconds since a remote region's agent last reported over the link"),
    MetricSpec("islands_drain_query_failures", "counter", (),
               "Failed polls of Ray's draining-node table: while they fail, planned preemption "
               "is off (a draining node looks like any other until it goes)"),
)

METRIC_NAMES: frozenset[str] = frozenset(spec.name for spec in METRICS)


def sample_names() -> frozenset[str]:
    """Every sample name a scrape can show (``_total`` for counters, ``_bucket``/``_sum``/``_count``
    for histograms); a dashboard query may name only these."""
    names = set()
    for spec in METRICS:
        if spec.kind == "counter":
            names.add(spec.name + "_total")
        elif spec.kind == "histogram":
            names.update(spec.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(spec.name)
    return frozenset(names)


def window_label(window_s: float) -> str:
    """The ``window`` label of a sliding goodput window: 300 -> "5m", 30 -> "30s", 5400 -> "90m".

    >>> window_label(300), window_label(30), window_label(7200)
    ('5m', '30s', '2h')
    """
    window_s = float(window_s)
    for unit, size in (("h", 3600), ("m", 60)):
        if window_s >= size and window_s % size == 0:
            return f"{int(window_s // size)}{unit}"
    return f"{window_s:g}s"


def windowed_ratio(history: list[tuple[float, float, float]], now_s: float,
                   window_s: float) -> Optional[float]:
    """Goodput over the last ``window_s``: Δuseful ÷ Δallocated between the newest sample and the
    oldest one inside the window (or just before it, so a short run still has two points).

    Args:
      history: ``(t_s, useful_s, allocated_s)`` samples, oldest first, both totals non-decreasing.

    Returns:
      The ratio clamped to [0, 1], or None with fewer than two samples or no allocated time.

    >>> windowed_ratio([(0, 0, 0), (10, 5, 10), (20, 5, 20)], 20, 10)
    0.0
    """
    if len(history) < 2:
        return None
    start = history[0]
    for sample in history:
        if sample[0] <= now_s - window_s:
            start = sample
        else:
            break
    end = history[-1]
    allocated = end[2] - start[2]
    if allocated <= 0:
        return None
    return min(1.0, max(0.0, (end[1] - start[1]) / allocated))


def observe_step(hist: dict, region: str, seconds: float) -> None:
    """Adds one step time to ``hist[region]`` (``{"counts": [per bucket, +Inf last], "sum",
    "count"}``, JSON-serialisable so the controller's saved state carries it)."""
    h = hist.setdefault(region, {"counts": [0] * (len(STEP_BUCKETS_S) + 1), "sum": 0.0,
                                 "count": 0})
    i = next((i for i, b in enumerate(STEP_BUCKETS_S) if seconds <= b), len(STEP_BUCKETS_S))
    h["counts"][i] += 1
    h["sum"] += seconds
    h["count"] += 1


def window_to_save(history, now_s: float, window_s: float) -> list:
    """The goodput samples a restarted controller needs to go on with the sliding window: those
    inside it and the newest one before it (``windowed_ratio`` starts there).

    >>> window_to_save([(0, 0, 0), (5, 1, 5), (12, 3, 12), (20, 5, 20)], 20, 10)
    [(5, 1, 5), (12, 3, 12), (20, 5, 20)]
    >>> import collections   # the controller keeps its samples in a deque
    >>> window_to_save(collections.deque([(0, 0, 0), (12, 3, 12)]), 20, 10)
    [(0, 0, 0), (12, 3, 12)]
    """
    start = 0
    for i, sample in enumerate(history):
        if sample[0] <= now_s - window_s:
            start = i
        else:
            break
    return [tuple(x) for x in itertools.islice(history, start, None)]


def _histogram(values: Iterable[float], bounds: Iterable[float]) -> tuple[list, float]:
    """Cumulative buckets ``[(le, count), …, ("+Inf", n)]`` and the sum, for HistogramMetricFamily."""
    values = list(values)
    buckets = [(str(float(b)), sum(1 for v in values if v <= b)) for b in bounds]
    buckets.append(("+Inf", len(values)))
    return buckets, float(sum(values))


def _counted_histogram(counts: Mapping[Any, int], bounds: Iterable[float]) -> tuple[list, float]:
    """Like ``_histogram`` for ``{value: how many}`` (the syncer's staleness counts)."""
    items = [(float(v), int(n)) for v, n in counts.items()]
    buckets = [(str(float(b)), sum(n for v, n in items if v <= b)) for b in bounds]
    buckets.append(("+Inf", sum(n for _, n in items)))
    return buckets, float(sum(v * n for v, n in items))


def participation_families(counts: Mapping[str, int], spec: Mapping[str, MetricSpec]) -> list:
    """islands_merge_participants and islands_merge_participation_ratio from the syncer's
    ``participation_counts`` (``{"n/M": merges}``; a merge whose M is unknown is left out of the
    ratio)."""
    from prometheus_client.core import HistogramMetricFamily

    from islands.syncer.core import parse_participation_key

    by_n: dict = {}
    by_ratio: dict = {}
    for key, merges in counts.items():
        n, m = parse_participation_key(key)
        by_n[n] = by_n.get(n, 0) + int(merges)
        if m:
            by_ratio[n / m] = by_ratio.get(n / m, 0) + int(merges)
    out = []
    for name, values, bounds in (("islands_merge_participants", by_n, PARTICIPANTS_BUCKETS),
                                 ("islands_merge_participation_ratio", by_ratio,
                                  PARTICIPATION_BUCKETS)):
        buckets, total = _counted_histogram(values, bounds)
        family = HistogramMetricFamily(name, spec[name].help)
        family.add_metric([], buckets, total)
        out.append(family)
    return out


LIVE_STATES = ("starting", "training", "paused", "draining")


def device_counts(learners: Mapping[str, Mapping]) -> dict:
    """``{(region, kind): devices}`` over the live learners that reported their devices.

    >>> device_counts({"a:0": {"region": "a", "state": "training",
    ...                        "devices": {"kind": "NVIDIA H200", "count": 1}},
    ...                "a:1": {"region": "a", "state": "failed",
    ...                        "devices": {"kind": "NVIDIA H200", "count": 1}}})
    {('a', 'NVIDIA H200'): 1}
    """
    out: dict = {}
    for learner in learners.values():
        devices = learner.get("devices") or {}
        if learner.get("state") in LIVE_STATES and devices.get("kind") is not None:
            key = (learner["region"], str(devices["kind"]))
            out[key] = out.get(key, 0) + int(devices.get("count") or 0)
    return out


def device_family(family, learners: Mapping[str, Mapping]):
    for (region, kind), n in sorted(device_counts(learners).items()):
        family.add_metric([region, kind], float(n))
    return family


def families(snap: Mapping[str, Any]) -> list:
    """All metric families of docs/metrics.md for one controller snapshot (pure).

    Every known label value is present from the start (reads 0), so a dashboard never shows gaps.
    """
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily)

    spec = {s.name: s for s in METRICS}

    def gauge(name):
        return GaugeMetricFamily(name, spec[name].help, labels=list(spec[name].labels))

    def counter(name):
        return CounterMetricFamily(name, spec[name].help, labels=list(spec[name].labels))

    out = []
    goodput = gauge("islands_goodput_ratio")
    goodput.add_metric(["run"], float(snap["goodput"]["goodput"]))
    window = snap["goodput"].get("window")
    if window is not None and window.get("ratio") is not None:
        goodput.add_metric([window["label"]], float(window["ratio"]))
    out.append(goodput)

    good = counter("islands_goodput_seconds")
    good.add_metric([], float(snap["goodput"].get("goodput_s") or 0.0))
    bad = counter("islands_badput_seconds")
    from .books import BADPUT_CAUSES

    for cause in BADPUT_CAUSES:
        bad.add_metric([cause], float((snap["goodput"].get("badput_s") or {}).get(cause, 0.0)))
    out += [good, bad]

    step_hist = HistogramMetricFamily("islands_step_seconds",
                                      spec["islands_step_seconds"].help, labels=["region"])
    regions_seen = sorted(snap["wire_bytes"]) or sorted(
        {l["region"] for l in snap["learners"].values()})
    for region in regions_seen:
        h = (snap.get("step_seconds") or {}).get(region) or {
            "counts": [0] * (len(STEP_BUCKETS_S) + 1), "sum": 0.0}
        running, buckets = 0, []
        for b, n in zip(STEP_BUCKETS_S, h["counts"]):
            running += n
            buckets.append((str(float(b)), running))
        buckets.append(("+Inf", sum(h["counts"])))
        step_hist.add_metric([region], buckets, float(h["sum"]))
    out.append(step_hist)

    out.append(device_family(gauge("islands_learner_devices"), snap["learners"]))

    steps = counter("islands_learner_steps")
    for name, learner in sorted(snap["learners"].items()):
        steps.add_metric([learner["region"], name], float(learner.get("steps_total") or 0))
    out.append(steps)

    tokens = counter("islands_tokens")
    for fate in TOKEN_FATES:
        tokens.add_metric([fate], float(snap["tokens"][fate]))
    out.append(tokens)

    syncer = snap["syncer"]
    merges = counter("islands_merges")
    quorum = gauge("islands_quorum_size")
    for p, n in sorted((int(k), v) for k, v in (syncer.get("merges_by_fragment") or {}).items()):
        merges.add_metric([str(p)], float(n))
    for p, n in sorted((int(k), v) for k, v in (syncer.get("quorum_size") or {}).items()):
        quorum.add_metric([str(p)], float(n))
    live = gauge("islands_merge_live_learners")
    for p, n in sorted((int(k), v) for k, v in (syncer.get("live_learners") or {}).items()):
        live.add_metric([str(p)], float(n))
    out += [merges, quorum, live]
    out += participation_families(snap.get("participation_counts") or {}, spec)

    grace = gauge("islands_grace_window_seconds")
    grace.add_metric([], float(syncer.get("grace_window_s") or 0.0))
    out.append(grace)

    buckets, total = _counted_histogram(snap.get("staleness_counts") or {}, STALENESS_BUCKETS)
    staleness = HistogramMetricFamily("islands_staleness", spec["islands_staleness"].help)
    staleness.add_metric([], buckets, total)
    out.append(staleness)

    wire = counter("islands_wire_bytes")
    for region, by_direction in sorted(snap["wire_bytes"].items()):
        for direction in ("up", "down"):
            wire.add_metric([direction, region], float(by_direction[direction]))
    out.append(wire)

    link_bytes, reconnects = counter("islands_link_wire_bytes"), counter("islands_link_reconnects")
    age = gauge("islands_link_report_age_seconds")
    for region, row in sorted((snap.get("link") or {}).items()):
        for direction in ("up", "down"):
            link_bytes.add_metric([direction, region], float(row[direction]))
        reconnects.add_metric([region], float(row["reconnects"]))
        if row.get("report_age_s") is not None:
            age.add_metric([region], float(row["report_age_s"]))
    out += [link_bytes, reconnects, age]

    recovery = HistogramMetricFamily("islands_recovery_seconds",
                                     spec["islands_recovery_seconds"].help, labels=["phase"])
    counted = snap.get("recovery_seconds") or {}
    for phase in RECOVERY_PHASES:
        if phase in counted:   # every recovery of the job (the rows are only the newest)
            h = counted[phase]
            buckets = [(str(float(b)), n) for b, n in zip(h["bounds"], h["buckets"])]
            buckets.append(("+Inf", h["buckets"][-1]))
            recovery.add_metric([phase], buckets, float(h["sum"]))
            continue
        buckets, total = _histogram((r[f"{phase}_s"] for r in snap.get("recoveries") or []),
                                    RECOVERY_BUCKETS_S)
        recovery.add_metric([phase], buckets, total)
    out.append(recovery)

    restarts = counter("islands_learner_restarts")
    by_reason = snap.get("learner_restarts") or {}
    for reason in RESTART_REASONS:
        restarts.add_metric([reason], float(by_reason.get(reason, 0)))
    out.append(restarts)

    tolerated = counter("islands_slow_learners_tolerated")
    for region in sorted(snap["wire_bytes"]) or sorted(
            {l["region"] for l in snap["learners"].values()}):
        tolerated.add_metric([region], float(sum(
            int(l.get("slow_tolerated") or 0) for l in snap["learners"].values()
            if l["region"] == region)))
    out.append(tolerated)

    from islands.syncer.validate import REJECT_REASONS

    rejected = counter("islands_rejected_pushes")
    by_reason = snap.get("rejected_total") or {}
    for reason in REJECT_REASONS:
        rejected.add_metric([reason], float(by_reason.get(reason, 0)))
    out.append(rejected)

    errors = [l["compression_relative_error"] for l in snap["learners"].values()
              if l.get("compression_relative_error") is not None and l["state"] == "training"]
    compression = gauge("islands_compression_relative_error")
    compression.add_metric([], float(sum(errors) / len(errors)) if errors else 0.0)
    out.append(compression)

    epoch = gauge("islands_syncer_epoch")
    epoch.add_metric([], float(syncer.get("epoch") or 0))
    out.append(epoch)

    shard_epoch, shard_merges = gauge("islands_syncer_shard_epoch"), counter(
        "islands_syncer_shard_merges")
    snapshot_failures = counter("islands_syncer_shard_snapshot_failures")
    for row in syncer.get("shards") or []:
        shard_epoch.add_metric([str(row["shard"])], float(row["epoch"]))
        shard_merges.add_metric([str(row["shard"])], float(row["merges"]))
        snapshot_failures.add_metric([str(row["shard"])], float(row.get("snapshot_failures", 0)))
    out += [shard_epoch, shard_merges, snapshot_failures]

    learners = gauge("islands_learners")
    regions = sorted(snap["wire_bytes"]) or sorted({l["region"] for l in snap["learners"].values()})
    for region in regions:
        for state in LEARNER_STATES:
            n = sum(1 for l in snap["learners"].values()
                    if l["region"] == region and l["state"] == state)
            learners.add_metric([state, region], float(n))
        learners.add_metric(["spare", region], float(sum(
            1 for x in (snap.get("spares") or {}).values() if x["region"] == region)))
    out.append(learners)

    drain_failures = counter("islands_drain_query_failures")
    drain_failures.add_metric([], float(snap.get("drain_query_failures") or 0))
    out.append(drain_failures)

    for name, key in (("islands_train_loss", "train_loss"), ("islands_eval_loss", "eval_loss")):
        family = gauge(name)
        value = snap.get(key)
        family.add_metric([], float(value) if value is not None else math.nan)
        out.append(family)
    return out


class SnapshotCollector:
    """A prometheus-client collector that reads a fresh snapshot on every scrape."""

    def __init__(self, snapshot_fn):
        self.snapshot_fn = snapshot_fn

    def collect(self):
        try:
            snap = self.snapshot_fn()
        except Exception as exc:  # a scrape must never take the controller down
            log.warning("metrics snapshot failed: %s", exc)
            return []
        return families(snap)


def serve(snapshot_fn, port: int = DEFAULT_METRICS_PORT,
          addr: str = "127.0.0.1") -> tuple[Any, int]:
    """Starts ``/metrics`` on ``addr:port`` (0 picks a free port) in a daemon thread. Loopback by
    default; a real cluster passes the node's address (``metrics.host``), never 0.0.0.0 unasked.

    Returns:
      ``(server, port)``; ``server.shutdown()`` stops it.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot_fn))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, server.server_address[1]


class RayMetricsMirror:
    """The same values through ``ray.util.metrics`` so the Ray dashboard shows them beside Ray's own.

    Ray's Counter takes increments, so counters are mirrored as the difference from the last
    snapshot (our totals never decrease). Histograms are left to Prometheus: their exact buckets
    are already exported there, and Ray would re-bucket each observation.
    """

    def __init__(self):
        from ray.util import metrics as ray_metrics

        self._ray = ray_metrics
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        self._last: dict[tuple, float] = {}

    def update(self, snap: Mapping[str, Any]) -> None:
        for family in families(snap):
            spec = next(s for s in METRICS if s.name == family.name)
            if spec.kind == "histogram":
                continue
            for sample in family.samples:
                tags = dict(sample.labels)
                if spec.kind == "gauge":
                    if math.isnan(sample.value):
                        continue
                    metric = self._gauges.get(spec.name)
                    if metric is None:
                        metric = self._gauges[spec.name] = self._ray.Gauge(
                            spec.name, _ascii(spec.help), tag_keys=spec.labels)
                    metric.set(sample.value, tags=tags)
                else:
                    key = (spec.name, tuple(sorted(tags.items())))
                    delta = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if delta <= 0:
                        continue
                    metric = self._counters.get(spec.name)
                    if metric is None:
                        metric = self._counters[spec.name] = self._ray.Counter(
                            spec.name, _ascii(spec.help), tag_keys=spec.labels)
                    metric.inc(delta, tags=tags)


def _ascii(text: str) -> str:
    """Ray's metric descriptions must be ASCII ("Σ applied ÷ allocated" -> "? applied ? allocated")."""
    return text.replace("§", "S").encode("ascii", "replace").decode()
