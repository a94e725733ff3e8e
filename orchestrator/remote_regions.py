"""Regions in their own Ray clusters, as the home's controller sees them (link/): a region's
report (its slots, its learners' heartbeats, its link's counters) becomes observations and
books, and the reply carries the home syncer's view of the region's learners, the home's pause
and the restarts the home decided. The region's own side is ``region_agent.py``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from islands.learners.messages import Heartbeat

from . import fleet as fleet_lib

log = logging.getLogger("islands.controller")


def remote_heartbeats(beats: list) -> dict[str, Heartbeat]:
    """A region report's beats (the link's JSON), parsed: per learner its newest. A beat that
    does not parse is left out (and logged)."""
    out = {}
    for beat in beats:
        if not isinstance(beat, dict):
            continue
        try:
            parsed = Heartbeat.from_dict(beat)
        except ValueError as exc:
            log.warning("%s", exc)
            continue
        out[parsed.learner] = parsed
    return out


def take_report(controller: Any, report: dict) -> dict:
    """A remote region's report, relayed by the home's link server to the home's
    ``controller``: its learners' states become ``RemoteReport`` observations and their heartbeats
    (books included) are kept as a local learner's are. Returns the home syncer's view of the
    region's learners."""
    region, now = report["region"], time.time()
    beats = remote_heartbeats(report.get("beats", []))
    with controller.lock:
        controller.link_regions[region] = {"bytes": dict(report.get("link_bytes") or {}),
                                           "reconnects": int(report.get("reconnects") or 0),
                                           "last_report_s": now}
    # Under the owner's lock: its thread takes a waiting beat when it records the launch (a beat
    # stored between its look and its launch was never taken, and stayed for good).
    with controller.lock:
        for learner, beat in beats.items():
            inc = controller.owner.running.get(learner)
            number = beat.incarnation
            if inc is not None and inc.remote and inc.number == number:
                inc.beat = beat
            elif inc is None or number > inc.number:  # not known here yet: kept for when it is
                controller.owner.remote_beats[(learner, number)] = beat
            # (else a closed incarnation's late beat: its counters were folded when it closed)
    # The agent is alive when it updated its slots lately (the link client outlives it).
    age = float(report.get("agent_age_s") or 0.0)
    owner = controller.owner
    agent_alive = fleet_lib.agent_reporting(now, now - age,
                                            owner.fleet.settings.heartbeat_timeout_s)
    for s in report.get("slots", []):
        beat = beats.get(s["learner"])
        controller.inbox.put((fleet_lib.RemoteReport(
            s["learner"], region, int(s["incarnation"]), s["state"], int(s.get("shard", 0)),
            beat.step_time_s if beat is not None else None, s.get("last_cause") or "",
            beat=beat is not None and beat.incarnation == int(s["incarnation"]),
            agent_alive=agent_alive, restarts=fleet_lib.restart_counts(s.get("restarts_json"))),
            None))
    with controller.lock:
        status = controller.owner.syncer_status
        restarts = controller.owner.remote_restarts.pop(region, [])
    mine = lambda table: {k: v for k, v in (table or {}).items()  # noqa: E731
                          if k.rsplit(":", 1)[0] == region}
    return {"epoch": status.epoch, "versions": list(status.versions),
            "merges": status.merges, "ledger": mine(status.ledger),
            "registered": mine(status.registered),
            "quarantined": mine(status.quarantined), "restart": restarts,
            "paused": owner.fleet.paused_reason,   # the region's learners pause with home
            **({"ended": f"the home job {controller.config.name!r} is stopping"}
               if owner.fleet.stopping else {})}
