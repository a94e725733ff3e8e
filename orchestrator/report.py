"""Run report (``islands report RUN_DIR``): PNG plots and ``report.md`` from a run dir.

A run dir holds ``summary.json`` (the final books), ``events.jsonl`` (one controller event per line)
and ``metrics.jsonl`` (one ``Controller.snapshot()`` per line); see ``orchestrator/job.py``. The
figures of the report come from ``summary.json``; the plots come from the snapshots and events.

The reconstruction of learner membership over time is pure (``state_observations``,
``membership_spans``) and testable without matplotlib. Plotting uses matplotlib's Agg canvas
directly (no pyplot, so no global backend is switched), imported only when a report is written.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

SUMMARY_FILE = "summary.json"
EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.md"
PLOTS_DIR = "plots"
PLOT_FILES = {"loss": "loss.png", "goodput": "goodput.png", "membership": "membership.png",
              "wire_bytes": "wire_bytes.png"}
RECOVERY_PHASES = ("detect_s", "restart_s", "restore_s", "first_contribution_s", "total_s")

# Membership categories drawn on the timeline, in legend order. A learner is "absent" before it is
# created and after it is retired; "restarting" covers a first start as well as a restart.
TIMELINE_STATES = ("training", "restarting", "paused", "draining", "absent")
STATE_CATEGORY = {"training": "training", "starting": "restarting", "restarting": "restarting",
                  "unreachable": "restarting", "awaiting_placement": "restarting",
                  "paused": "paused", "draining": "draining",
                  "retired": "absent", "absent": "absent"}
TIMELINE_LABELS = {"training": "training", "restarting": "starting / restarting",
                   "paused": "paused (below quorum)", "draining": "draining",
                   "absent": "absent (not created or retired)"}
TIMELINE_COLORS = {"training": "#2ca02c", "restarting": "#ff7f0e", "paused": "#7f9fbf",
                   "draining": "#9467bd", "absent": "#e6e6e6"}
# What a learner event says about that learner's state from then on. A learner that failed is
# down until its restart succeeds; one whose first contribution was merged is training.
EVENT_STATE = {"learner_failed": "restarting", "learner_restart_scheduled": "restarting",
               "learner_unreachable": "restarting",
               "learner_restarted": "starting", "learner_recovered": "training",
               "learner_draining": "draining", "learner_retired": "retired",
               "learner_placed": "starting"}
FAILURE_EVENTS = ("learner_failed", "syncer_failed")
RESTART_EVENTS = ("learner_restarted",)


class ReportError(RuntimeError):
    """The run dir cannot be reported on (missing summary, matplotlib not installed)."""


class RunData(NamedTuple):
    """Everything read from one run dir."""

    run_dir: str
    summary: dict
    events: list[dict]
    snapshots: list[dict]
    skipped_lines: int  # unreadable JSON lines (e.g. a line cut short when the job was killed)


class Observation(NamedTuple):
    """Learner ``learner`` was in ``state`` from ``t_s`` (elapsed seconds since the job started)."""

    t_s: float
    learner: str
    state: str


class Span(NamedTuple):
    """A learner stayed in timeline category ``state`` over ``[start_s, end_s)``."""

    state: str
    start_s: float
    end_s: float


# -- reading ------------------------------------------------------------------------------------
def read_jsonl(path: str) -> tuple[list[dict], int]:
    """Rows of a JSON-lines file and how many lines could not be read; a missing file is empty."""
    rows, skipped = [], 0
    if not os.path.exists(path):
        return rows, skipped
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                skipped += 1
    return rows, skipped


def load_run(run_dir: str) -> RunData:
    """Reads a run dir written by ``islands run``.

    Raises:
      ReportError: ``summary.json`` is missing or is not a JSON object.
    """
    summary_path = os.path.join(run_dir, SUMMARY_FILE)
    if not os.path.isfile(summary_path):
        raise ReportError(f"{summary_path} not found: is {run_dir!r} a run dir written by "
                          "`islands run`? (the summary is written when the job stops)")
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{summary_path} is not valid JSON: {exc}") from exc
    if not isinstance(summary, dict):
        raise ReportError(f"{summary_path} should hold a JSON object, got {type(summary).__name__}")
    events, skipped_events = read_jsonl(os.path.join(run_dir, EVENTS_FILE))
    snapshots, skipped_snaps = read_jsonl(os.path.join(run_dir, METRICS_FILE))
    events.sort(key=lambda e: _elapsed(e))
    snapshots.sort(key=lambda s: _elapsed(s))
    return RunData(run_dir, summary, events, snapshots, skipped_events + skipped_snaps)


def _elapsed(row: Mapping[str, Any]) -> float:
    value = row.get("elapsed_s")
    return float(value) if isinstance(value, (int, float)) else 0.0


# -- membership timeline (pure) ------------------------------------------------------------------
def state_observations(events: Sequence[Mapping[str, Any]],
                       snapshots: Sequence[Mapping[str, Any]]) -> list[Observation]:
    """Every known (time, learner, state) point of a run, oldest first.

    Events give exact transition times (creation, failure, restart, recovery, draining, retirement);
    snapshots fill in what no event records, chiefly ``starting -> training`` and pauses. At equal
    times an event comes before a snapshot.

    Args:
      events: events.jsonl rows (``elapsed_s``, ``event`` and the event's fields).
      snapshots: metrics.jsonl rows (``elapsed_s``, ``learners{id: {state}}``).

    Returns:
      Observations sorted by time (stable: events first at a tie, then file order).
    """
    tagged = []
    for event in events:
        t = _elapsed(event)
        kind = event.get("event")
        if kind == "job_started":
            for learner in event.get("learners") or []:
                tagged.append((t, 0, Observation(t, str(learner), "starting")))
        elif kind == "scaled":
            for learner in event.get("added") or []:
                tagged.append((t, 0, Observation(t, str(learner), "starting")))
        elif kind in EVENT_STATE and event.get("learner") is not None:
            tagged.append((t, 0, Observation(t, str(event["learner"]), EVENT_STATE[kind])))
    for snap in snapshots:
        t = _elapsed(snap)
        for learner, info in (snap.get("learners") or {}).items():
            state = (info or {}).get("state")
            if state:
                tagged.append((t, 1, Observation(t, str(learner), str(state))))
    tagged.sort(key=lambda item: (item[0], item[1]))  # sort is stable: file order within a tie
    return [obs for _, _, obs in tagged]


def membership_spans(observations: Iterable[Observation], start_s: float,
                     end_s: float) -> dict[str, list[Span]]:
    """Per learner, the timeline categories (``TIMELINE_STATES``) it went through, as spans.

    A learner is ``absent`` until its first observation; each observation holds until the next one
    (or ``end_s``). Raw states map to categories through ``STATE_CATEGORY`` (starting and
    restarting are both "restarting", retired is "absent"); an unknown state is its own category.
    Consecutive spans of one category merge and empty spans are dropped.

    Args:
      observations: from ``state_observations``, oldest first.
      start_s, end_s: the drawn interval (elapsed seconds); observations outside are clamped.

    Returns:
      ``{learner: [Span, ...]}`` in order of first appearance; the spans of a learner tile
      ``[start_s, end_s]`` without gaps (an empty list when ``end_s <= start_s``).

    >>> obs = [Observation(1, "a", "starting"), Observation(2, "a", "training"),
    ...        Observation(5, "a", "restarting"), Observation(6, "a", "starting"),
    ...        Observation(7, "a", "training")]
    >>> for span in membership_spans(obs, 0, 10)["a"]:
    ...     print(span.state, span.start_s, span.end_s)
    absent 0 1
    restarting 1 2
    training 2 5
    restarting 5 7
    training 7 10
    """
    by_learner: dict[str, list[Observation]] = {}
    for obs in observations:
        by_learner.setdefault(obs.learner, []).append(obs)
    out: dict[str, list[Span]] = {}
    for learner, points in by_learner.items():
        spans: list[Span] = []
        current, since = "absent", start_s
        for obs in points:
            t = min(max(obs.t_s, start_s), end_s)
            category = STATE_CATEGORY.get(obs.state, obs.state)
            if category == current:
                continue
            _append_span(spans, Span(current, since, t))
            current, since = category, t
        _append_span(spans, Span(current, since, end_s))
        out[learner] = spans
    return out


def _append_span(spans: list[Span], span: Span) -> None:
    if span.end_s <= span.start_s:
        return
    if spans and spans[-1].state == span.state and spans[-1].end_s >= span.start_s:
        # e.g. training, then a failure and a restart in the same millisecond, then training
        spans[-1] = Span(span.state, spans[-1].start_s, span.end_s)
        return
    spans.append(span)


def timeline_bounds(events: Sequence[Mapping[str, Any]],
                    snapshots: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """``(first, last)`` elapsed seconds seen in the events and snapshots; ``(0, 0)`` if none."""
    times = [_elapsed(row) for row in list(events) + list(snapshots)]
    return (min(times), max(times)) if times else (0.0, 0.0)


def learner_sort_key(learner: str) -> tuple:
    """Orders ``"us-east:10"`` after ``"us-east:2"``: by region, then by numeric index."""
    region, _, index = learner.rpartition(":")
    return (region, int(index)) if index.isdigit() else (learner, -1)


def paused_intervals(events: Sequence[Mapping[str, Any]],
                     end_s: float) -> list[tuple[float, float]]:
    """``(start, end)`` of each ``training_paused`` .. ``training_resumed`` interval."""
    out, since = [], None
    for event in events:
        if event.get("event") == "training_paused" and since is None:
            since = _elapsed(event)
        elif event.get("event") == "training_resumed" and since is not None:
            out.append((since, _elapsed(event)))
            since = None
    if since is not None:
        out.append((since, max(end_s, since)))
    return out


# -- series (pure) ---------------------------------------------------------------------------------
def cumulative_total(values: Sequence[float]) -> list[float]:
    """Running total of a counter that may reset to a lower value (a restarted process).

    >>> cumulative_total([5, 9, 2, 4])
    [5.0, 9.0, 11.0, 13.0]
    """
    out, offset, previous = [], 0.0, 0.0
    for value in values:
        value = float(value)
        if value < previous:
            offset += previous
        previous = value
        out.append(offset + value)
    return out


def wire_bytes_by_region(snap: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """Raw wire-byte counters of one snapshot, keyed ``(region, source)``.

    Prefers the controller's ``wire_bytes{region: {up, down}}``; older snapshots without it fall
    back to the learners' own counters (``source`` is then the learner and direction, since each
    learner incarnation counts from 0 and resets must be tracked per counter).
    """
    wire = snap.get("wire_bytes")
    out: dict[tuple[str, str], float] = {}
    if isinstance(wire, Mapping) and wire:
        for region, by_direction in wire.items():
            for direction in ("up", "down"):
                out[(str(region), direction)] = float((by_direction or {}).get(direction) or 0)
        return out
    for learner, info in (snap.get("learners") or {}).items():
        region = (info or {}).get("region") or learner.rpartition(":")[0] or learner
        for direction in ("up", "down"):
            nbytes = info.get(f"wire_bytes_{direction}") or 0
            out[(region, f"{learner}/{direction}")] = float(nbytes)
    return out


def wire_series(snapshots: Sequence[Mapping[str, Any]]
                ) -> tuple[list[float], dict[str, list[float]]]:
    """Elapsed times and, per region, cumulative bytes up + down at each snapshot."""
    times = [_elapsed(s) for s in snapshots]
    raw = [wire_bytes_by_region(s) for s in snapshots]
    keys = sorted({key for row in raw for key in row})
    regions: dict[str, list[float]] = {}
    for key in keys:
        values, last = [], 0.0
        for row in raw:  # a counter missing from a snapshot (learner not created yet) holds still
            last = row.get(key, last)
            values.append(last)
        totals = cumulative_total(values)
        region = regions.setdefault(key[0], [0.0] * len(times))
        regions[key[0]] = [a + b for a, b in zip(region, totals)]
    return times, regions


def loss_series(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``{"train": [(tokens applied, loss)], "eval": [...]}``, skipping missing (None) losses.

    ``eval_loss`` in a snapshot is the latest evaluation, repeated until the next one, so only its
    changes are kept.
    """
    train, evals = [], []
    for snap in snapshots:
        tokens = float(((snap.get("tokens") or {}).get("applied")) or 0)
        loss = _finite(snap.get("train_loss"))
        if loss is not None:
            train.append((tokens, loss))
        loss = _finite(snap.get("eval_loss"))
        if loss is not None and (not evals or evals[-1][1] != loss):
            evals.append((tokens, loss))
    return {"train": train, "eval": evals}


def goodput_series(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``{"run": [(elapsed, ratio)], "<window label>": [...]}`` from the snapshots' goodput."""
    out: dict[str, list[tuple[float, float]]] = {"run": []}
    for snap in snapshots:
        goodput = snap.get("goodput") or {}
        t = _elapsed(snap)
        ratio = _finite(goodput.get("goodput"))
        if ratio is not None:
            out["run"].append((t, ratio))
        window = goodput.get("window") or {}
        ratio = _finite(window.get("ratio"))
        if ratio is not None:
            out.setdefault(str(window.get("label") or "window"), []).append((t, ratio))
    return out


def _finite(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


# -- plotting ------------------------------------------------------------------------------------
def _figure(width_in: float = 9.0, height_in: float = 4.5):
    """A matplotlib Figure on an Agg canvas, without pyplot (no global backend is changed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError('islands report needs matplotlib: pip install "islands[report]"') from exc
    fig = Figure(figsize=(width_in, height_in), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _no_data(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center",
            color="0.4", fontsize=11)


def _style(line_count: int) -> dict:
    """Markers when there are few points, so a run with one snapshot still shows its value."""
    return {"marker": "o", "markersize": 4} if line_count <= 30 else {}


def plot_loss(data: RunData, path: str) -> str:
    from matplotlib.ticker import EngFormatter

    series = loss_series(data.snapshots)
    fig = _figure()
    ax = fig.add_subplot()
    if series["train"]:
        xs, ys = zip(*series["train"])
        ax.plot(xs, ys, label="train loss (mean of training learners)", color="#1f77b4",
                **_style(len(xs)))
    if series["eval"]:
        xs, ys = zip(*series["eval"])
        ax.plot(xs, ys, label="eval loss (global parameters)", color="#d62728",
                **{"marker": "o", "markersize": 4, **_style(len(xs))})
    final = _finite(data.summary.get("final_eval_loss"))
    tokens = _finite(data.summary.get("tokens_applied"))
    if final is not None and tokens is not None and (
            not series["eval"] or series["eval"][-1] != (tokens, final)):
        ax.plot([tokens], [final], linestyle="none", marker="*", markersize=12, color="#d62728",
                label="final eval loss (summary)")
    if ax.lines:
        ax.legend(loc="best")
        ax.xaxis.set_major_formatter(EngFormatter())
        xs = [x for line in ax.lines for x in line.get_xdata()]
        if max(xs) - min(xs) < 1000:  # e.g. one snapshot: no ticks in milli-tokens
            middle = (max(xs) + min(xs)) / 2
            ax.set_xlim(middle - 600, middle + 600)
    else:
        _no_data(ax, "no loss recorded (train_loss and eval_loss are empty)")
    ax.set_xlabel("tokens applied (in merges)")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("Loss vs tokens applied")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return path


def _event_label(event: Mapping[str, Any]) -> str:
    kind = event.get("event")
    if kind == "syncer_failed":
        return f"syncer (epoch {event.get('epoch', '?')})"
    text = str(event.get("learner", ""))
    if kind == "learner_failed" and event.get("cause"):
        text += f" {event['cause']}"
    return text


def plot_goodput(data: RunData, path: str) -> str:
    series = goodput_series(data.snapshots)
    start_s, end_s = timeline_bounds(data.events, data.snapshots)
    fig = _figure()
    ax = fig.add_subplot()
    colors = iter(["#1f77b4", "#17becf", "#bcbd22", "#8c564b"])
    for label, points in series.items():
        if not points:
            continue
        xs, ys = zip(*points)
        name = "run (cumulative)" if label == "run" else f"window {label}"
        ax.plot(xs, ys, label=f"goodput, {name}", color=next(colors, None),
                linewidth=2 if label == "run" else 1.5, **_style(len(xs)))
    plotted = bool(ax.lines)
    for i, (a, b) in enumerate(paused_intervals(data.events, end_s)):
        ax.axvspan(a, b, color="0.85", alpha=0.6, label="training paused" if i == 0 else None)
    markers = [e for e in data.events if e.get("event") in FAILURE_EVENTS + RESTART_EVENTS]
    styles = {"learner_failed": ("#d62728", "--", "learner failed"),
              "syncer_failed": ("#7b0000", "-.", "syncer failed"),
              "learner_restarted": ("#2ca02c", ":", "learner restarted")}
    seen = set()
    for event in markers:
        color, linestyle, label = styles[event["event"]]
        ax.axvline(_elapsed(event), color=color, linestyle=linestyle, linewidth=1.2,
                   label=None if event["event"] in seen else label)
        seen.add(event["event"])
        if len(markers) <= 12:  # name the learner while the chart stays readable
            ax.text(_elapsed(event), 0.98, _event_label(event), rotation=90, fontsize=7,
                    color=color, ha="right", va="top", transform=ax.get_xaxis_transform(),
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1})
    if not plotted:
        _no_data(ax, "no goodput recorded (metrics.jsonl is empty)")
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # below the axes, so it never hides a line or an event label
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 3),
                   fontsize=8, frameon=False)
    ax.set_ylim(-0.02, 1.05)  # a goodput of 0 (start-up) stays visible above the axis
    if end_s > start_s:
        ax.set_xlim(start_s, end_s + 0.02 * (end_s - start_s))
    ax.set_xlabel("elapsed (s)")
    ax.set_ylabel("goodput (applied ÷ allocated learner time)")
    ax.set_title("Goodput over time, with failures and restarts")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return path


def plot_membership(data: RunData, path: str) -> str:
    from matplotlib.patches import Patch

    start_s, end_s = timeline_bounds(data.events, data.snapshots)
    single = end_s <= start_s and bool(data.events or data.snapshots)
    if end_s <= start_s:  # a single snapshot: draw the states it shows over a nominal second
        end_s = start_s + 1.0
    spans = membership_spans(state_observations(data.events, data.snapshots), start_s, end_s)
    learners = sorted(spans, key=learner_sort_key)
    fig = _figure(9.0, max(2.6, 1.4 + 0.4 * len(learners)))
    ax = fig.add_subplot()
    if not learners:
        _no_data(ax, "no learners recorded")
    used = set()
    for row, learner in enumerate(learners):
        for span in spans[learner]:
            ax.broken_barh([(span.start_s, span.end_s - span.start_s)], (row - 0.38, 0.76),
                           facecolors=TIMELINE_COLORS.get(span.state, "#bbbbbb"),
                           edgecolor="white", linewidth=0.5)
            used.add(span.state)
    rows = {learner: row for row, learner in enumerate(learners)}
    failed = [(e, rows[e["learner"]]) for e in data.events
              if e.get("event") == "learner_failed" and e.get("learner") in rows]
    if failed:
        ax.plot([_elapsed(e) for e, _ in failed], [r for _, r in failed], linestyle="none",
                marker="x", color="#d62728", markersize=8, markeredgewidth=2)
    for event in data.events:
        if event.get("event") == "syncer_failed":
            ax.axvline(_elapsed(event), color="#7b0000", linestyle="-.", linewidth=1)
    if learners:
        ax.set_yticks(range(len(learners)), learners)
        ax.set_ylim(len(learners) - 0.5, -0.5)  # first learner on top
    else:
        ax.set_yticks([])
    ax.set_xlim(start_s, end_s)
    ax.set_xlabel("elapsed (s)" + (" (a single snapshot)" if single else ""))
    ax.set_title("Learner membership")
    handles = [Patch(color=TIMELINE_COLORS[s], label=TIMELINE_LABELS[s])
               for s in TIMELINE_STATES if s in used or s in ("training", "restarting", "absent")]
    handles += [Patch(color=TIMELINE_COLORS.get(s, "#bbbbbb"), label=s)
                for s in sorted(used - set(TIMELINE_STATES))]
    if failed:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], linestyle="none", marker="x", color="#d62728",
                              markeredgewidth=2, label="learner failed"))
    if any(e.get("event") == "syncer_failed" for e in data.events):
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="#7b0000", linestyle="-.", label="syncer failed"))
    if learners:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4),
                   fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path)
    return path


def plot_wire_bytes(data: RunData, path: str) -> str:
    from matplotlib.ticker import EngFormatter

    times, regions = wire_series(data.snapshots)
    final = _final_region_bytes(data)
    fig = _figure()
    ax = fig.add_subplot()
    for region in sorted(regions):
        label = region
        if region in final:
            up, down = final[region]
            label += f" (final: {_human_bytes(up)} up, {_human_bytes(down)} down)"
        ax.plot(times, regions[region], label=label, linewidth=2, **_style(len(times)))
    if ax.lines:
        ax.legend(loc="upper left", fontsize=8)
        ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
        top = max(max(values) for values in regions.values()) if regions else 0.0
        ax.set_ylim(0, max(1.05 * top, 1000.0))  # nothing sent yet: no ticks in milli-bytes
    else:
        _no_data(ax, "no wire bytes recorded")
    ax.set_xlabel("elapsed (s)")
    ax.set_ylabel("cumulative bytes, up + down")
    ax.set_title("Wire bytes per region (emulated WAN)")
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return path


def _final_region_bytes(data: RunData) -> dict[str, tuple[float, float]]:
    out = {}
    for name, region in (data.summary.get("regions") or {}).items():
        if isinstance(region, Mapping):
            out[name] = (float(region.get("wire_bytes_up") or 0),
                         float(region.get("wire_bytes_down") or 0))
    return out


# -- report.md -------------------------------------------------------------------------------------
def _human_bytes(n: float) -> str:
    """Bytes in SI units for a reader.

    >>> _human_bytes(15_899_872)
    '15.9 MB'
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _int(value: Any) -> str:
    return f"{int(value):,}" if isinstance(value, (int, float)) and math.isfinite(value) else "–"


def _float(value: Any, digits: int = 4) -> str:
    value = _finite(value)
    return "–" if value is None else f"{value:.{digits}f}"


def summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The report's summary table: ``(figure, value)``, every number taken from summary.json."""
    rows = []
    goodput = _finite(summary.get("goodput"))
    rows.append(("goodput", "–" if goodput is None else f"{goodput:.4f} ({100 * goodput:.1f} %)"))
    rows.append(("tokens applied", _int(summary.get("tokens_applied"))))
    dropped = _int(summary.get("tokens_dropped"))
    processed = _finite(summary.get("tokens_processed"))
    if dropped != "–" and processed:
        dropped += f" ({100 * summary['tokens_dropped'] / processed:.2f} % of processed)"
    rows.append(("tokens dropped", dropped))
    by_fate = summary.get("tokens_dropped_by") or {}
    if by_fate:
        rows.append(("tokens dropped, by reason", ", ".join(
            f"{reason} {_int(n)}" for reason, n in sorted(by_fate.items(), key=lambda x: -x[1]))))
    if "tokens_in_flight" in summary:
        rows.append(("tokens in flight at the end", _int(summary.get("tokens_in_flight"))))
    rows.append(("merges", _int(summary.get("merges"))))
    restarts = _int(summary.get("learner_restarts"))
    by_reason = summary.get("learner_restarts_by_reason") or {}
    if restarts != "–" and by_reason:
        restarts += " (" + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) + ")"
    rows.append(("learner restarts", restarts))
    rows.append(("syncer restarts", _int(summary.get("syncer_restarts"))))
    wire = _finite(summary.get("wire_bytes"))
    rows.append(("wire bytes", "–" if wire is None else f"{int(wire):,} ({_human_bytes(wire)})"))
    rows.append(("initial eval loss", _float(summary.get("initial_eval_loss"))))
    rows.append(("final eval loss", _float(summary.get("final_eval_loss"))))
    duration = _finite(summary.get("duration_s"))
    rows.append(("duration", "–" if duration is None else f"{duration:.1f} s"))
    learners = summary.get("learners")
    if isinstance(learners, Mapping):
        states = collections.Counter(str((l or {}).get("state")) for l in learners.values())
        detail = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
        rows.append(("learners", f"{len(learners)} ({detail} at the end)" if learners else "0"))
    else:
        rows.append(("learners", _int(learners)))
    regions = summary.get("regions")
    if isinstance(regions, Mapping):
        rows.append(("regions", f"{len(regions)}: " + ", ".join(regions) if regions else "0"))
    else:
        rows.append(("regions", "–"))
    return rows


def recovery_rows(summary: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Recoveries from summary.json; the learner names come from the ``learner_recovered`` events
    (the summary's entries carry the phases and cause, the events carry the learner)."""
    recoveries = [r for r in (summary.get("recoveries") or []) if isinstance(r, Mapping)]
    recovered = [e for e in events if e.get("event") == "learner_recovered"]
    if not recoveries:
        recoveries = recovered  # an old summary without the list: the events say the same
    # The summary keeps the newest rows (a long job's are counted in its histogram): they are
    # the newest events' too.
    names = ([e.get("learner") for e in recovered[len(recovered) - len(recoveries):]]
             if len(recovered) >= len(recoveries) else [None] * len(recoveries))
    rows = []
    for rec, name in zip(recoveries, names):
        rows.append({"learner": rec.get("learner") or name or "–",
                     "cause": rec.get("cause") or "–",
                     **{phase: _finite(rec.get(phase)) for phase in RECOVERY_PHASES}})
    return rows


def render_markdown(data: RunData, plots: Mapping[str, str]) -> str:
    """report.md: summary table, recovery phases, events by kind, and the plots (relative links)."""
    summary = data.summary
    lines = [f"# Run report: {os.path.basename(os.path.abspath(data.run_dir))}", "",
             f"From `{SUMMARY_FILE}`, `{EVENTS_FILE}` ({len(data.events)} events) and "
             f"`{METRICS_FILE}` ({len(data.snapshots)} snapshots)."]
    if data.skipped_lines:
        lines.append(f"{data.skipped_lines} unreadable line(s) were skipped.")
    lines += ["", "## Summary", "", "| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in summary_rows(summary)]
    regions = summary.get("regions")
    if isinstance(regions, Mapping) and regions:
        lines += ["", "| region | learners (target) | wire bytes up | wire bytes down |",
                  "|---|---|---|---|"]
        for name, region in regions.items():
            region = region if isinstance(region, Mapping) else {}
            lines.append(f"| {name} | {_int(region.get('learners'))} | "
                         f"{_int(region.get('wire_bytes_up'))} | "
                         f"{_int(region.get('wire_bytes_down'))} |")

    lines += ["", "## Recovery phases (seconds)", ""]
    rows = recovery_rows(summary, data.events)
    if rows:
        header = ["learner", "cause", "detect", "restart", "restore", "first contribution", "total"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            lines.append(f"| {row['learner']} | {row['cause']} | "
                         + " | ".join(_float(row[p], 3) for p in RECOVERY_PHASES) + " |")
        if len(rows) > 1:
            means = []
            for phase in RECOVERY_PHASES:
                values = [row[phase] for row in rows if row[phase] is not None]
                means.append(_float(sum(values) / len(values), 3) if values else "–")
            lines.append("| **mean** | | " + " | ".join(means) + " |")
    else:
        lines.append("No learner recovered during this run.")

    lines += ["", "## Events", ""]
    counts = collections.Counter(str(e.get("event")) for e in data.events)
    if counts:
        lines += ["| event | count |", "|---|---|"]
        lines += [f"| {kind} | {n} |" for kind, n in sorted(counts.items())]
    else:
        lines.append("No events recorded.")
    paused = [e for e in data.events if e.get("event") == "training_paused"]
    for event in paused:
        lines.append(f"- training paused at {_elapsed(event):.1f} s: {event.get('reason', '')}")

    titles = {"loss": "Loss vs tokens applied", "goodput": "Goodput over time",
              "membership": "Learner membership", "wire_bytes": "Wire bytes per region"}
    lines += ["", "## Plots", ""]
    for key, plot_path in plots.items():
        rel = os.path.relpath(plot_path, data.run_dir).replace(os.sep, "/")
        lines += [f"### {titles.get(key, key)}", "", f"![{titles.get(key, key)}]({rel})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: str) -> str:
    """Writes ``plots/*.png`` and ``report.md`` into ``run_dir``.

    Returns:
      The path of report.md.

    Raises:
      ReportError: no ``summary.json`` in ``run_dir``, or matplotlib is not installed.
    """
    data = load_run(run_dir)
    _figure()  # fail before writing anything when matplotlib is missing
    plots_dir = os.path.join(run_dir, PLOTS_DIR)
    os.makedirs(plots_dir, exist_ok=True)
    drawers = {"loss": plot_loss, "goodput": plot_goodput, "membership": plot_membership,
               "wire_bytes": plot_wire_bytes}
    plots = {key: drawers[key](data, os.path.join(plots_dir, name))
             for key, name in PLOT_FILES.items()}
    path = os.path.join(run_dir, REPORT_FILE)
    with open(path, "w") as f:
        f.write(render_markdown(data, plots))
    return path

