"""Surviving a restart of the owner's actor: what it saves (about once a second) and how a
restarted controller (or region agent) rebuilds itself from that, the live syncer shards and the
learners that kept training meanwhile. Functions over the owner (``controller.Controller``), as
``snapshot.job_snapshot`` reads it; the owner's loop itself is not here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Optional

from . import fleet as fleet_lib
from .books import Books
from .groups_api import Incarnation
from .logs import RecoveryLog
from .metrics import window_to_save
from .runtime import enable_compile_cache
from .snapshot import finite


def missed_restarts(saved_started: Optional[list], shard: int, live_epoch: int) -> int:
    """Syncer restarts a restarted controller's saved state does not know of: each restart starts
    the shard at the epoch after the dead one's, so the live shard's epoch less the one it was
    last started with (as saved) counts them. No saved epoch (an older state file): none.

    >>> missed_restarts([3, 5], 1, 6), missed_restarts([3], 0, 3), missed_restarts(None, 0, 9)
    (1, 0, 0)
    """
    if not saved_started or shard >= len(saved_started):
        return 0
    return max(0, live_epoch - int(saved_started[shard]))


def saved_slot(row: dict, remote: bool) -> "fleet_lib.Slot":
    """A slot as ``save_state`` wrote it. ``remote``: its region runs in its own cluster, and its
    learner stays mirrored from the region's agent (lost, the home took the learner for its own:
    found it hung, restarted it at home, even prestarted it on resources only the region has).
    """
    from .health import Cause

    return fleet_lib.Slot(
        learner=row["learner"], region=row["region"], index=row["index"],
        shard=row["shard"], speed_factor=row["speed_factor"],
        state=fleet_lib.SlotState(row["state"]), incarnation=row["incarnation"],
        start_step=row["start_step"], actor=row.get("actor"), remote=remote,
        slow_tolerated=int(row.get("slow_tolerated", 0)),
        restarts=tuple(sorted((Cause(c), n) for c, n in row["restarts"].items())),
        # A state file from before ``counted``: every restart counts (the old rule).
        counted=tuple(sorted((Cause(c), n) for c, n in row.get("counted",
                                                                 row["restarts"]).items())),
        training_since_s=row.get("training_since_s"),
        # Its paused time so far, an open pause folded in at the save (a state file from before
        # it was saved: none). The restarted fleet pauses it again from its first step if a
        # reason still holds.
        paused_s=float(row.get("paused_s") or 0.0),
        failures=tuple((int(step), str(error)) for step, error in row.get("failures", [])),
        crash_loop=row.get("crash_loop"),
        # A handover in progress (its node is draining): it restarts elsewhere once out, not
        # retired as a plain drain would be. Its drain's deadline goes on from when it began.
        preempted_s=row.get("preempted_s"), draining_since_s=row.get("draining_since_s"))


def slot_row(x: "fleet_lib.Slot", now_s: Optional[float] = None) -> dict:
    """A slot as ``save_state`` writes it at ``now_s`` (the fleet's clock; ``saved_slot`` reads
    it back). Paused time is saved with the pause it is in counted up to ``now_s``: paused time
    is not training time (``Slot.trained_seconds``), across a controller restart too.

    >>> slot = fleet_lib.Slot("a:0", "a", 0, 0, training_since_s=100.0, paused_s=20.0,
    ...                       paused_since_s=150.0)
    >>> slot_row(slot, 200.0)["paused_s"], slot_row(slot)["paused_s"]
    (70.0, 20.0)
    """
    paused_s = x.paused_s + (now_s - x.paused_since_s
                             if now_s is not None and x.paused_since_s is not None else 0.0)
    return {"learner": x.learner, "region": x.region, "index": x.index,
            "shard": x.shard, "speed_factor": x.speed_factor, "state": x.state.value,
            "incarnation": x.incarnation, "start_step": x.start_step,
            "restarts": {c.value: n for c, n in x.restarts},
            "counted": {c.value: n for c, n in x.counted},
            "training_since_s": x.training_since_s, "paused_s": paused_s, "actor": x.actor,
            "slow_tolerated": x.slow_tolerated, "preempted_s": x.preempted_s,
            "draining_since_s": x.draining_since_s,
            "failures": [list(f) for f in x.failures], "crash_loop": x.crash_loop}


def relaunched(slot: "fleet_lib.Slot", known: int, now: float) -> "fleet_lib.Slot":
    """A saved slot whose learner a restarted controller did not find running: restarted now,
    after the newest incarnation the syncer's ledger knows (``known``). A handover stays one
    (its relaunch waits for placement, not timed as a start, spending no crash budget): one that
    was awaiting placement, and one saved draining off a preempted node (``preempted_s``): the
    fleet launches the handover in the step its drain ends, and the state file may be a second
    older than that launch.

    >>> row = {"learner": "a:0", "region": "a", "index": 0, "shard": 0, "speed_factor": 1.0,
    ...        "state": "awaiting_placement", "incarnation": 2, "start_step": 9, "restarts": {}}
    >>> slot = relaunched(saved_slot(row, remote=False), known=1, now=5.0)
    >>> slot.state.value, slot.incarnation, slot.restart_at_s, dict(slot.recovery)["cause"]
    ('restarting', 2, 5.0, 'preempted_planned')
    >>> row.update(state="draining", preempted_s=3.0, draining_since_s=3.0)
    >>> slot = relaunched(saved_slot(row, remote=False), known=2, now=5.0)
    >>> dict(slot.recovery)["cause"], slot.preempted_s, slot.restart_counts
    ('preempted_planned', None, {<Cause.PREEMPTED_PLANNED: 'preempted_planned'>: 1})
    """
    from .health import Cause

    recovery = slot.recovery
    if slot.state == fleet_lib.SlotState.AWAITING_PLACEMENT:
        recovery = (("failed_s", now), ("detected_s", now),
                    ("cause", Cause.PREEMPTED_PLANNED.value))
    elif slot.state == fleet_lib.SlotState.DRAINING and slot.preempted_s is not None:
        # As ``hand_over`` does (its step was not saved): one planned restart, timed from the
        # preemption's notice, which no failure budget counts.
        since = slot.preempted_s
        slot = slot.with_restart(Cause.PREEMPTED_PLANNED)
        recovery = (("failed_s", since), ("detected_s", since),
                    ("cause", Cause.PREEMPTED_PLANNED.value))
    return dataclasses.replace(slot, state=fleet_lib.SlotState.RESTARTING,
                               incarnation=max(slot.incarnation, known), restart_at_s=now,
                               recovery=recovery, preempted_s=None, draining_since_s=None)


def saved_marks(saved) -> dict:
    """The fleet's misconfigured marks as ``save_state`` wrote them ({node: {region: line}});
    the older shape {region: line} (a region's mark, its node not known) becomes the marks of
    ``fleet.UNKNOWN_NODE``, which block their regions as before; none saved: none.

    >>> saved_marks({"n1": {"gpu": "device check failed: x"}}), saved_marks({"gpu": "device check failed: x"})
    ({'n1': {'gpu': 'device check failed: x'}}, {'unknown': {'gpu': 'device check failed: x'}})
    """
    out: dict = {}
    for key, value in (saved or {}).items():
        if isinstance(value, str):
            out.setdefault(fleet_lib.UNKNOWN_NODE, {})[key] = value
        else:
            out.setdefault(key, {}).update({r: str(m) for r, m in value.items()})
    return out


def save_state(owner: Any) -> None:
    """What a restarted controller cannot ask anyone else for: the books, the slots' states and
    restart counts, the chaos plan's progress (written atomically, about once a second)."""
    fleet = owner.fleet
    state = {
        "books": owner.books.to_json(), "closed": owner.closed,
        "slots": [slot_row(x, time.time()) for x in fleet.slots.values()],
        "targets": dict(fleet.targets), "next_index": dict(fleet.next_index),
        "next_shard": fleet.next_shard, "next_spare": fleet.next_spare,
        "lost_regions": dict(fleet.lost_regions),
        "misconfigured": {node: dict(regions) for node, regions in fleet.misconfigured.items()},
        "operator_paused": fleet.operator_paused,
        "recoveries": owner.recoveries.to_json(),
        "eval_history": owner.eval_history[-1000:], "initial_eval_loss": owner.initial_eval_loss,
        "syncer_restarts": owner.syncer_restarts, "syncer_closed": owner.syncer_closed,
        "chaos_fired": owner.chaos_fired, "job_started_s": owner.job_started_s,
        "started_s": owner.started_s, "restarts": getattr(owner, "restarts", 0),
        "syncer_epoch": int(owner.syncer_status.epoch),
        "syncer_epochs": [int(st.epoch) if st is not None else 0 for st in owner.shard_status],
        "started_epochs": list(owner.started_epochs),
        "goodput_history": window_to_save(owner.goodput_history, time.time(),
                                          owner.settings.goodput_window_s),
        "step_seconds": owner.step_seconds}
    os.makedirs(owner.run_dir, exist_ok=True)
    tmp = owner.state_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(state), f, default=str, allow_nan=False)
    os.replace(tmp, owner.state_path)


def recover(owner: Any) -> None:
    """Rebuilds the controller after Ray restarted it: its saved books and slots, the live
    syncer (or a restored one), and the learners that kept training meanwhile — none of them
    is stopped. Learners that died while it was away are relaunched by the first step."""
    from . import build

    with open(owner.state_path) as f:
        saved = json.load(f)
    owner.books = Books.from_json(saved["books"])
    owner.closed = saved["closed"]
    owner.recoveries = RecoveryLog.from_json(saved["recoveries"])
    owner.chaos_fired = saved["chaos_fired"]
    owner.eval_history = [tuple(e) for e in saved["eval_history"]]
    owner.initial_eval_loss = saved["initial_eval_loss"]
    owner.syncer_restarts, owner.syncer_closed = saved["syncer_restarts"], saved["syncer_closed"]
    owner.started_s, owner.job_started_s = saved["started_s"], saved["job_started_s"]
    owner.restarts = saved["restarts"] + 1
    # The sliding goodput window goes on from the samples it held (not from 1.0 at zero).
    owner.goodput_history = collections.deque(tuple(x) for x in saved.get("goodput_history") or [])
    owner.step_seconds = saved.get("step_seconds") or {}
    if owner.chaos_plan is not None and owner.job_started_s is not None:
        owner.chaos_plan.due(time.time() - owner.job_started_s)  # fired before: not again
    owner._build_task()
    owner.jax_cache_dir = os.path.join(owner.run_dir, "jax_cache")
    enable_compile_cache(owner.jax_cache_dir)
    owner.syncer_spec = build.syncer_spec(owner.config, owner.template, owner.run_dir,
                                         owner.task.is_embedding)
    owner._init_shards()
    epochs = saved.get("syncer_epochs") or [saved["syncer_epoch"]]
    for s in range(owner.shards.count):
        from islands.syncer.shards import syncer_shard_name

        try:
            live_epoch = int(owner.shards.attach(s, syncer_shard_name(s), 30)["epoch"])
            # A restart between the last save and this controller's death (the state is
            # up to a second old) left the shard at a newer epoch than saved: count it.
            owner.syncer_restarts += missed_restarts(saved.get("started_epochs"), s,
                                                    live_epoch)
            owner.started_epochs[s] = live_epoch
        except Exception:  # it died too: the usual syncer restart
            owner.syncer_restarts += 1
            epoch = epochs[s] if s < len(epochs) else max(epochs)
            owner._start_syncer(epoch=epoch + 1, restore=True, syncer_shard=s)
    owner._refresh_syncer_status()
    ledger = owner.syncer_status.ledger
    now = time.time()
    slots, paused = [], []
    for row in saved["slots"]:
        slot = saved_slot(row, owner.config.regions[row["region"]].remote)
        if slot.state in fleet_lib.GONE:
            slots.append(slot)
            continue
        if owner.config.regions[slot.region].remote:
            # Its agent runs it in the region's own cluster: nothing here to re-attach or
            # relaunch. It is kept as saved; the agent's next report (every second) says
            # how it is, and its beats time from now.
            slots.append(dataclasses.replace(slot, last_beat_s=now))
            owner.running[slot.learner] = Incarnation(slot.incarnation, remote=True)
            continue
        # Still running? then it keeps training under the new controller. An actor under its
        # name that does not answer (one Ray has not placed: a handover or a start launched
        # since the last save) is ended there: it holds the name its relaunch needs.
        info = owner.groups.reattach(slot.learner, slot.actor or slot.learner,
                                    owner.config.regions[slot.region].devices().hosts)
        if info is not None and info["state"] in ("training", "paused", "draining",
                                                  "starting"):
            running_state = {"training": fleet_lib.SlotState.TRAINING,
                             "paused": fleet_lib.SlotState.TRAINING,  # the floor decides again
                             "draining": fleet_lib.SlotState.DRAINING,
                             "starting": fleet_lib.SlotState.STARTING}[info["state"]]
            if slot.state == fleet_lib.SlotState.DRAINING:
                running_state = fleet_lib.SlotState.DRAINING
            if info["state"] == "paused":
                paused.append(slot.learner)
            since = slot.draining_since_s
            if running_state == fleet_lib.SlotState.DRAINING and since is None:
                since = now   # (a state file from before the drain's deadline was saved)
            slots.append(dataclasses.replace(
                slot, state=running_state, incarnation=info["incarnation"],
                start_step=info["start_step"], launched_s=now, last_beat_s=now,
                draining_since_s=since if running_state == fleet_lib.SlotState.DRAINING
                else None))
            owner.running[slot.learner] = Incarnation(info["incarnation"],
                                                     info["start_step"])
            continue
        # Gone while the controller was away: relaunched, as a newer incarnation.
        known = int(ledger.get(slot.learner, {}).get("incarnation", slot.incarnation))
        slots.append(relaunched(slot, known, now))
    owner.fleet = fleet_lib.rebuilt(owner.fleet.settings, slots, saved["targets"],
                                   saved["next_index"], saved["next_shard"],
                                   saved.get("next_spare", 0),
                                   bool(saved.get("operator_paused", False)))
    # A region still in its repair after a region loss starts no spare before it is over.
    owner.fleet = dataclasses.replace(owner.fleet, lost_regions={
        region: float(until) for region, until in saved.get("lost_regions", {}).items()},
        misconfigured=saved_marks(saved.get("misconfigured")))
    # Spares waiting for promotion are not worth a recovery: end them; the fleet starts
    # new ones once nobody is starting.
    owner.groups.end_stray_spares({x.actor for x in slots if x.actor})
    owner.emit("controller_restarted", restarts=owner.restarts,
              learners_kept=sorted(owner.running),
              relaunched=sorted(s.learner for s in slots
                                if s.state == fleet_lib.SlotState.RESTARTING))
    # The rebuilt fleet is not paused: its first step pauses the learners again if a reason
    # still holds; else those found paused resume (nothing else would ever resume them).
    owner._step(owner.role.recovery_observations())
    if owner.fleet.paused_reason is None:
        for learner in paused:
            owner.groups.call(learner, "pause", False, time.time_ns())
    owner._start_threads()
