"""The job's snapshot: one typed object that metrics, ``islands status``, the progress line, the
run dir's metrics.jsonl and the summary all read.
"""

from __future__ import annotations

import collections
import math
import numbers
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .logs import RECOVERIES_IN_SNAPSHOT, RECOVERIES_KEPT
from .runtime import learner_actor_name


@dataclass(frozen=True)
class LearnerRow:
    region: str
    state: str
    incarnation: int
    step: int
    tokens_done: int
    loss: Optional[float]
    step_time_s: Optional[float]
    restarts: dict
    last_heartbeat_s: Optional[float]
    wire_bytes_up: int
    wire_bytes_down: int
    compression_relative_error: Optional[float]
    timings: Optional[dict]
    steps_total: int
    wire_bytes_up_total: int
    wire_bytes_down_total: int
    slow_tolerated: int = 0      # incarnations let train on slow (after one straggler restart)
    unit: str = "1×1 cpu"        # hosts × devices per host, and the accelerator
    devices: Optional[dict] = None   # what JAX gave it at start (learners/devices.py)
    node: Optional[str] = None       # the Ray node its incarnation runs on (from its beats)
    # The Ray actor of its incarnation: ``islands:<id>``, or the spare's it was promoted into.
    actor: Optional[str] = None
    # Retired as a crash loop: its resume step and error.
    crash_loop: Optional[str] = None


def unit_shape(controller: Any, region: str) -> str:
    """"2×4 tpu": a region's learner unit as hosts × devices per host."""
    try:
        d = controller.config.regions[region].devices()
    except KeyError:   # a region scaled away
        return "-"
    return f"{d.hosts}×{d.devices_per_host:g} {d.accelerator}"


@dataclass(frozen=True)
class JobSnapshot:
    t: float
    elapsed_s: float
    goodput: dict
    tokens: dict
    learner_states: dict
    learners: dict            # learner id -> LearnerRow
    alive: int
    total: int
    train_loss: Optional[float]
    eval_loss: Optional[float]
    initial_eval_loss: Optional[float]
    syncer: dict
    syncer_restarts: int
    learner_restarts: dict
    recoveries: list          # the newest few (summary.json: the newest logs.RECOVERIES_KEPT)
    paused_reason: Optional[str]
    wire_bytes: dict
    rejected_total: dict
    staleness_counts: dict
    extra: dict = field(default_factory=dict)
    link: dict = field(default_factory=dict)   # per remote region: link bytes, reconnects, age
    spares: dict = field(default_factory=dict)  # warm spares: name -> region, state
    step_seconds: dict = field(default_factory=dict)  # per region: a histogram of step times
    # Merges that replaced Θ by "participants/live" (syncer/core.py participation_key).
    participation_counts: dict = field(default_factory=dict)
    drain_query_failures: int = 0   # failed polls of Ray's draining-node table
    # Every recovery, per phase: a histogram (logs.RecoveryLog), and how many there were.
    recovery_seconds: dict = field(default_factory=dict)
    recoveries_total: int = 0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out

    def summary(self, controller: Any) -> dict:
        regions = {name: {"learners": controller.owner.fleet.targets[name],
                          "wire_bytes_up": self.wire_bytes[name]["up"],
                          "wire_bytes_down": self.wire_bytes[name]["down"]}
                   for name in controller.config.regions}
        return {
            "goodput": self.goodput["goodput"],
            "tokens_applied": self.tokens["applied"],
            "tokens_dropped": self.tokens["dropped"],
            "tokens_in_flight": self.tokens["in_flight"],
            "tokens_processed": self.tokens["processed"],
            "tokens_dropped_by": self.tokens.get("dropped_by", {}),
            "fragment_tokens": self.tokens.get("fragment_tokens", {}),
            "books_balanced": self.tokens.get("balanced"),
            "merges": self.syncer["merges"] or 0,
            "learner_restarts": sum(self.learner_restarts.values()),
            "learner_restarts_by_reason": self.learner_restarts,
            "syncer_restarts": self.syncer_restarts,
            "syncer_epoch": self.syncer["epoch"],
            "wire_bytes": sum(r["wire_bytes_up"] + r["wire_bytes_down"] for r in regions.values()),
            "initial_eval_loss": self.initial_eval_loss,
            "final_eval_loss": self.eval_loss,
            "duration_s": self.elapsed_s,
            "learners": {k: asdict(v) for k, v in self.learners.items()},
            "regions": regions,
            "recoveries": controller.owner.recoveries.newest(RECOVERIES_KEPT),
            "recoveries_total": self.recoveries_total,
            "rejected_pushes": self.rejected_total,
            "goodput_window": self.goodput["window"],
            "chaos_fired": list(controller.records.chaos_fired),
            "spares": self.spares,
        }


SYNCER_KEYS = ("epoch", "versions", "merges", "merges_by_fragment", "quorum_size",
               "live_learners", "grace_window_s", "staleness_counts", "rejected", "wire_bytes_up",
               "wire_bytes_down", "shards")


def job_snapshot(controller: Any) -> JobSnapshot:
    """Reads the controller's fleet (an immutable value), books and last syncer status."""
    now = time.time()
    fleet = controller.owner.fleet
    with controller.lock:
        status = controller.owner.syncer_status.as_dict()
        closed_syncer = {k: dict(v) for k, v in controller.owner.syncer_closed.items()}
        eval_loss = controller.records.eval_history[-1][2] if controller.records.eval_history else None
        initial_eval_loss = controller.records.initial_eval_loss
        recoveries = controller.owner.recoveries.newest(RECOVERIES_IN_SNAPSHOT)
        recovery_seconds = controller.owner.recoveries.histogram()
        step_seconds = {r: {"counts": list(h["counts"]), "sum": h["sum"], "count": h["count"]}
                        for r, h in controller.records.step_seconds.items()}
    learners = {}
    for name, slot in fleet.slots.items():
        run = controller.owner.running.get(name)
        closed = controller.owner.closed.get(name, {})
        beat = run.counters() if run is not None else closed.get("beat", {})
        current_steps = (max(0, int(beat.get("step", slot.start_step) or 0) - slot.start_step)
                         if run is not None else 0)
        up_now = int(beat.get("wire_bytes_up", 0) or 0) if run is not None else 0
        down_now = int(beat.get("wire_bytes_down", 0) or 0) if run is not None else 0
        learners[name] = LearnerRow(
            region=slot.region, state=slot.state.value, incarnation=slot.incarnation,
            step=int(beat.get("step", 0) or 0), tokens_done=int(beat.get("tokens_done", 0) or 0),
            loss=beat.get("loss"), step_time_s=beat.get("step_time_s"),
            restarts={c.value: n for c, n in slot.restarts},
            last_heartbeat_s=now - slot.last_beat_s if slot.last_beat_s else None,
            wire_bytes_up=int(beat.get("wire_bytes_up", 0) or 0),
            wire_bytes_down=int(beat.get("wire_bytes_down", 0) or 0),
            compression_relative_error=beat.get("compression_relative_error"),
            timings=beat.get("timings"), steps_total=closed.get("steps", 0) + current_steps,
            wire_bytes_up_total=closed.get("up", 0) + up_now,
            wire_bytes_down_total=closed.get("down", 0) + down_now,
            slow_tolerated=slot.slow_tolerated, unit=unit_shape(controller, slot.region),
            node=slot.node_id, actor=learner_actor_name(slot.actor or name),
            devices=beat.get("devices"), crash_loop=slot.crash_loop)
    states = collections.Counter(row.state for row in learners.values())
    wire = {region: {"up": 0, "down": 0} for region in controller.config.regions}
    restarts: collections.Counter = collections.Counter()
    for row in learners.values():
        wire[row.region]["up"] += row.wire_bytes_up_total
        wire[row.region]["down"] += row.wire_bytes_down_total
        restarts.update(row.restarts)
    rejected = collections.Counter(closed_syncer["rejected"])
    rejected.update(status.get("rejected") or {})
    staleness = collections.Counter(closed_syncer["staleness_counts"])
    staleness.update(status.get("staleness_counts") or {})
    participation = collections.Counter(closed_syncer.get("participation_counts") or {})
    participation.update(status.get("participation_counts") or {})
    losses = [r.loss for r in learners.values() if r.loss is not None and r.state == "training"]
    return JobSnapshot(
        t=now, elapsed_s=now - controller.started_s, goodput=controller.goodput(),
        tokens=controller.tokens(), learner_states=dict(states), learners=learners,
        alive=states.get("training", 0) + states.get("paused", 0),
        total=sum(1 for r in learners.values() if r.state not in ("retired", "failed")),
        train_loss=statistics.fmean(losses) if losses else None, eval_loss=eval_loss,
        initial_eval_loss=initial_eval_loss, syncer={k: status.get(k) for k in SYNCER_KEYS},
        syncer_restarts=controller.owner.syncer_restarts, learner_restarts=dict(restarts),
        recoveries=recoveries, recovery_seconds=recovery_seconds,
        recoveries_total=controller.owner.recoveries.total, paused_reason=fleet.paused_reason,
        wire_bytes=wire,
        rejected_total=dict(rejected), staleness_counts=dict(staleness),
        link=_link_rows(controller, now), step_seconds=step_seconds,
        drain_query_failures=getattr(getattr(controller, "drain_query", None), "failures", 0),
        participation_counts=dict(participation),
        spares={name: {"region": x.region, "state": x.state.value,
                       "age_s": now - x.launched_s, "for": x.for_learner}
                for name, x in fleet.spares.items()})


def status_table(snap: dict, fleet) -> dict:
    """``islands status``'s table: from a snapshot (``JobSnapshot.as_dict``) and the fleet."""
    return {"learners": snap["learners"],
            "syncer": {k: snap["syncer"].get(k) for k in ("epoch", "versions", "merges", "shards",
                                                         "snapshot_failures", "snapshot_error")},
            "paused_reason": snap["paused_reason"], "spares": snap.get("spares") or {},
            "misconfigured": fleet.marks()}


# -- views of the controller (the home's or a region agent's) its actor methods return -----------
def live_fates(controller: Any) -> dict:
    """Each running incarnation's own books, from its newest heartbeat."""
    return {name: inc.beat.fates if inc.beat is not None else None
            for name, inc in list(controller.owner.running.items())}


def goodput_view(controller: Any) -> dict:
    """The job's goodput now, its sliding window and its badput by cause (never going back)."""
    from .metrics import window_label, windowed_ratio
    from .books import goodput

    now = time.time()
    useful = controller.owner.books.useful_s(live_fates(controller))
    allocated = controller.owner.books.allocated_s(now)
    window_s = controller.settings.goodput_window_s
    history = list(controller.records.goodput_history) + [(now, useful, allocated)]
    split = controller.owner.books.badput(live_fates(controller), now)
    badput_s = controller.records.ratchet_badput(split["badput_s"])   # never going back
    return {"useful_s": useful, "allocated_s": allocated, "goodput": goodput(useful, allocated),
            "window": {"label": window_label(window_s), "seconds": window_s,
                       "ratio": windowed_ratio(history, now, window_s)},
            "goodput_s": split["goodput_s"], "badput_s": badput_s,
            "unsettled_s": split["unsettled_s"]}


def learner_goodput(controller: Any, learner: str) -> float:
    """One learner slot's goodput: its applied inner-step seconds (every incarnation) over
    the seconds its slot was allocated (restarts included)."""
    from .books import goodput

    live, books = live_fates(controller).get(learner), controller.owner.books
    useful = books.learner_tokens(learner, live).applied_s / books.num_fragments
    return goodput(useful, books.allocated_s(time.time(), learner))


def console_view(controller: Any) -> dict:
    """What the console shows, read once under the lock: the snapshot and what only the
    fleet and the beats know (the console reads this view, never the controller's fields)."""
    snap = controller.snapshot()
    with controller.lock:
        events = controller.events.newest(2000)
        profilers = {name: run.beat.profiler if run.beat is not None else None
                     for name, run in controller.owner.running.items()}
    return {"snapshot": snap, "events": events, "profilers": profilers,
            "job": controller.config.name, "goodput_window_s": controller.settings.goodput_window_s,
            "goodput_history": list(controller.records.goodput_history),
            "misconfigured": controller.owner.fleet.marks(),
            "operator_paused": controller.owner.fleet.operator_paused,
            "regions": {name: {"target": controller.owner.fleet.targets.get(name, 0),
                               "max_learners": region.max_learners, "remote": region.remote}
                        for name, region in controller.config.regions.items()}}


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so the run's files stay strict
    JSON (``json.dumps(finite(x), allow_nan=False)``; a diverged loss is written as ``null``).

    >>> finite({"loss": float("nan"), "xs": [1.0, float("inf")], "t": (2, 3)})
    {'loss': None, 'xs': [1.0, None], 't': [2, 3]}
    """
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = float(value)   # a numpy float32 too
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _link_rows(controller: Any, now: float) -> dict:
    """Every remote region of the job, with what its link last reported (zeros until then)."""
    reports = dict(getattr(controller, "link_regions", {}) or {})
    out = {}
    for name, region in controller.config.regions.items():
        if not getattr(region, "remote", False):
            continue
        r = reports.get(name, {})
        last = r.get("last_report_s")
        out[name] = {"up": int((r.get("bytes") or {}).get("up", 0)),
                     "down": int((r.get("bytes") or {}).get("down", 0)),
                     "reconnects": int(r.get("reconnects", 0)),
                     "report_age_s": None if last is None else now - last}
    return out
