"""Surviving a restart of the controller's actor: what it saves (about once a second) and how a
restarted controller (or region agent) re-attaches the live syncer shards and the learners that
kept training meanwhile. The fleet's and the books' half of the state is the owner's
(``owner.Owner.save`` / ``restore``); this is the controller's half and the re-attach.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from . import fleet as fleet_lib
from .controller_records import ControllerRecords
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


def save_state(controller: Any) -> None:
    """What a restarted controller cannot ask anyone else for: its owner's state (the books,
    the slots' states and restart counts) and its own (evals, the chaos plan's progress, the
    goodput window), written atomically, about once a second."""
    now = time.time()
    state = {
        **controller.owner.save(now),
        **controller.records.to_json(now, controller.settings.goodput_window_s),
        "job_started_s": controller.job_started_s, "started_s": controller.started_s,
        "restarts": getattr(controller, "restarts", 0)}
    os.makedirs(controller.run_dir, exist_ok=True)
    tmp = controller.state_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(state), f, default=str, allow_nan=False)
    os.replace(tmp, controller.state_path)


def recover(controller: Any) -> None:
    """Rebuilds the controller after Ray restarted it: its saved state, the live syncer shards
    (or restored ones), and the learners that kept training meanwhile — none of them is
    stopped. Learners that died while it was away are relaunched by the first step."""
    from islands.syncer.shards import syncer_shard_name

    from . import build

    c = controller
    with open(c.state_path) as f:
        saved = json.load(f)
    # The evals and the sliding goodput window go on from what they held (not from 1.0 at zero).
    c.records = ControllerRecords.from_json(saved)
    c.started_s, c.job_started_s = saved["started_s"], saved["job_started_s"]
    c.restarts = saved["restarts"] + 1
    if c.chaos_plan is not None and c.job_started_s is not None:
        c.chaos_plan.due(time.time() - c.job_started_s)  # fired before: not again
    c.build_task()
    c.jax_cache_dir = os.path.join(c.run_dir, "jax_cache")
    enable_compile_cache(c.jax_cache_dir)
    c.syncer_spec = build.syncer_spec(c.config, c.template, c.run_dir, c.task.is_embedding)
    c.init_shards()
    epochs = saved.get("syncer_epochs") or [saved["syncer_epoch"]]
    missed = 0
    for s in range(c.shards.count):
        try:
            live_epoch = int(c.shards.attach(s, syncer_shard_name(s), 30)["epoch"])
            # A restart between the last save and this controller's death (the state is
            # up to a second old) left the shard at a newer epoch than saved: count it.
            missed += missed_restarts(saved.get("started_epochs"), s, live_epoch)
            c.owner.started_epochs[s] = live_epoch
        except Exception:  # it died too: the usual syncer restart
            missed += 1
            epoch = epochs[s] if s < len(epochs) else max(epochs)
            c.owner.start_syncer(s, epoch=epoch + 1, restore=True)
    c.owner.refresh_syncer_status()
    # Still running? then it keeps training under the new controller. An actor under its
    # name that does not answer (one Ray has not placed: a handover or a start launched
    # since the last save) is ended there: it holds the name its relaunch needs.
    observed = {}
    for row in saved["slots"]:
        region = c.config.regions[row["region"]]
        if region.remote or fleet_lib.SlotState(row["state"]) in fleet_lib.GONE:
            continue
        observed[row["learner"]] = c.groups.reattach(row["learner"],
                                                     row.get("actor") or row["learner"],
                                                     region.devices().hosts)
    paused = c.owner.restore(saved, observed, time.time(), syncer_restarts_missed=missed)
    slots = c.owner.fleet.slots.values()
    # Spares waiting for promotion are not worth a recovery: end them; the fleet starts
    # new ones once nobody is starting.
    c.groups.end_stray_spares({x.actor for x in slots if x.actor})
    c.emit("controller_restarted", restarts=c.restarts,
           learners_kept=sorted(c.owner.running),
           relaunched=sorted(x.learner for x in slots
                             if x.state == fleet_lib.SlotState.RESTARTING))
    # The rebuilt fleet is not paused: its first step pauses the learners again if a reason
    # still holds; else those found paused resume (nothing else would ever resume them).
    c.step(c.role.recovery_observations())
    if c.owner.fleet.paused_reason is None:
        for learner in paused:
            c.groups.pause(learner, False)
    c.start_threads()
