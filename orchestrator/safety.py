"""What an operator command may end, decided before it ends anything (pure: no Ray here).

- ``islands region leave`` and ``islands region join --address`` end a region join's
  leftovers only: ``plan_leftovers`` reads what the cluster holds (``Seen``, gathered by
  ``region_agent.observe``) and returns the actors to end, or why nothing may be ended.
- ``islands drain-node`` (and the console's action) must not drain the head node or the last
  nodes a region's learners can run on, which Ray cannot undo: ``drain_refusal``, checked and
  acted on as one step by ``DrainGuard``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from .accelerators import LearnerDevices, gang_strategy

HEAD_MARKER = "node:__internal_head__"   # the resource Ray gives the head node only


# -- a region join's leftovers ------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """What a Ray cluster's ``islands`` namespace holds, as a region command found it.

    ``controller``/``link``: what ``islands:controller`` / ``islands:syncer`` said they are
    (``identity()``: ``{"kind": "home"|"region", "job", "region"}`` for a controller,
    ``{"kind": "link", "region", "home"}`` for a region's link client; ``{"kind": "unknown",
    "error"}`` when the actor did not say), None when no such actor is there. ``join``: the join
    recorded in the cluster (``region_agent.JOIN_KEY``: region, job, home, pid, host), None when
    none is.
    """

    names: tuple[str, ...] = ()
    controller: Optional[dict] = None
    link: Optional[dict] = None
    join: Optional[dict] = None


@dataclass(frozen=True)
class Plan:
    """``end``: the actors to end (a previous join's learners and spares); ``refusal``: why
    nothing may be ended (then ``end`` is empty); ``others``: actors left as they are."""

    end: tuple[str, ...] = ()
    refusal: Optional[str] = None
    join: Optional[dict] = None
    others: tuple[str, ...] = ()


def region_actor(name: str, region: str) -> bool:
    """Whether ``name`` is an actor a region agent of ``region`` starts and leaves behind when
    its join dies: a learner (``islands:R:<n>``) or a warm spare (``islands:spare:R:<n>``).

    >>> [region_actor(n, "eu") for n in ("islands:eu:0", "islands:spare:eu:3", "islands:eu-west:0",
    ...                                  "islands:syncer", "islands:controller", "islands:eu:x")]
    [True, True, False, False, False, False]
    """
    return re.fullmatch(rf"islands:(spare:)?{re.escape(region)}:\d+", name) is not None


def describe_join(join: Optional[dict], region: Optional[str] = None) -> str:
    """"the join of region 'far' into job 'demo' (pid 4242 on host-a)", from a join record (or
    only a region, when none is recorded).

    >>> describe_join({"region": "far", "job": "demo", "pid": 42, "host": "h"})
    "the join of region 'far' into job 'demo' (pid 42 on h)"
    >>> describe_join(None, "far")
    "the join of region 'far'"
    """
    join = join or {}
    text = f"the join of region {join.get('region') or region!r}"
    if join.get("job"):
        text += f" into job {join['job']!r}"
    if join.get("pid"):
        text += f" (pid {join['pid']} on {join.get('host') or 'an unknown host'})"
    return text


def plan_leftovers(seen: Seen) -> Plan:
    """What a region command may end in the cluster ``seen`` describes.

    Never a home job's actors, never a live join's, never actors no join is recorded for:

    - a home job's controller there: refused, naming the job;
    - a region agent, or a region's link client, there: its join is alive (both are the join
      process's own actors, which Ray ends when that process ends): refused, naming the join;
    - an ``islands:controller`` or ``islands:syncer`` that does not say what it is: refused;
    - nothing there: nothing to end;
    - actors but no join recorded: refused (they are not known to be a region's);
    - else the recorded (and gone) join's learners and spares; anything else stays.

    >>> plan_leftovers(Seen(("islands:controller", "islands:a:0"),
    ...                     controller={"kind": "home", "job": "demo"})).refusal
    "this cluster runs the home job 'demo' (islands:controller): a region command never ends a home job's actors"
    >>> plan_leftovers(Seen(("islands:far:0", "islands:spare:far:1", "islands:x"),
    ...                     join={"region": "far", "job": "demo"}))
    Plan(end=('islands:far:0', 'islands:spare:far:1'), refusal=None, join={'region': 'far', 'job': 'demo'}, others=('islands:x',))
    """
    controller, link, join = seen.controller, seen.link, seen.join
    if controller is not None:
        kind = controller.get("kind")
        if kind == "home":
            return Plan(refusal=f"this cluster runs the home job {controller.get('job')!r} "
                                "(islands:controller): a region command never ends a home "
                                "job's actors")
        if kind == "region":
            record = join if (join or {}).get("region") == controller.get("region") else None
            return Plan(refusal=_live_join(record or {"region": controller.get("region"),
                                                      "job": controller.get("job")},
                                           "its agent islands:controller answers"))
        return Plan(refusal="islands:controller is here but does not say whose it is "
                            f"({controller.get('error') or 'no answer'}): nothing ended")
    if link is not None:
        if link.get("kind") == "link":
            record = join if (join or {}).get("region") == link.get("region") else None
            return Plan(refusal=_live_join(record or {"region": link.get("region")},
                                           "its link islands:syncer answers"))
        return Plan(refusal="islands:syncer is here and is not a region's link (a home job's "
                            f"syncer?) ({link.get('error') or 'no answer'}): nothing ended")
    if not seen.names:
        return Plan(join=join)
    if join is None or not join.get("region"):
        return Plan(refusal=f"no region join is recorded in this cluster, so its islands actors "
                            f"({', '.join(sorted(seen.names))}) are not known to be a region "
                            "agent's: nothing ended")
    mine = tuple(sorted(n for n in seen.names if region_actor(n, join["region"])))
    return Plan(end=mine, join=join,
                others=tuple(sorted(n for n in seen.names if n not in mine)))


def _live_join(join: dict, how: str) -> str:
    return (f"{describe_join(join)} is still running ({how}): stop that join (Ctrl+C or "
            "SIGTERM), which ends its learners itself; nothing ended")


# -- drain-node ---------------------------------------------------------------------------------
class DrainRefused(ValueError):
    """A drain of a node the job cannot lose (the head, a region's last node, a node whose
    loss cannot be judged because Ray cannot say which nodes are draining); ``force`` drains
    it anyway."""


@dataclass(frozen=True)
class NodeView:
    """One Ray node as ``drain_refusal`` needs it."""

    node_id: str
    alive: bool
    resources: Mapping[str, float]

    @property
    def head(self) -> bool:
        return self.resources.get(HEAD_MARKER, 0.0) > 0


def drain_refusal(node_id: str, nodes: Iterable[NodeView], regions: Iterable[str],
                  draining: Optional[Iterable[str]] = (),
                  units: Optional[Mapping[str, LearnerDevices]] = None,
                  unknown: Optional[str] = None) -> Optional[str]:
    """Why draining ``node_id`` would leave the job stranded (None: it may be drained): it is
    the head node (the controller, the syncer and the link run there), or, for a region R of
    ``regions`` whose ``region:<R>`` it carries, the alive nodes left carrying it that are not
    draining cannot host one whole learner unit of R (``units``: R's ``LearnerDevices``, one
    host when not given): none is left, or a unit of H hosts, placed on H distinct nodes as
    ``accelerators.gang_strategy`` does once the region has H nodes, finds fewer than H (packed
    onto fewer nodes, they have fewer than H units of the region between them).

    ``draining`` None: Ray could not say which nodes are draining (``unknown``: why), so a node
    carrying a region of the job is refused (the others may all be draining). A node that is not
    alive is Ray's to refuse.

    >>> head = NodeView("h", True, {HEAD_MARKER: 1.0, "region:a": 2})
    >>> w1, w2 = NodeView("w1", True, {"region:b": 1}), NodeView("w2", True, {"region:b": 1})
    >>> drain_refusal("h", [head, w1, w2], ["a", "b"])
    'node h is the head node (the controller, the syncer and the link run there)'
    >>> drain_refusal("w1", [head, w1, w2], ["a", "b"]) is None
    True
    >>> drain_refusal("w1", [head, w1, w2], ["a", "b"], draining=["w2"])
    "node w1 is the last node where region 'b''s learners can run (region:b; the others are draining or gone)"
    >>> drain_refusal("w1", [head, w1, w2], ["a", "b"], draining=None, unknown="no such call")
    "Ray cannot say which nodes are draining (no such call), so whether region 'b''s learners could run elsewhere after node w1 is unknown"
    """
    nodes = list(nodes)
    target = next((n for n in nodes if n.node_id == node_id), None)
    if target is None or not target.alive:
        return None
    if target.head:
        return f"node {node_id} is the head node (the controller, the syncer and the link run there)"
    units = units or {}
    for region in sorted(set(regions)):
        marker = f"region:{region}"
        if target.resources.get(marker, 0.0) <= 0:
            continue
        if draining is None:
            return (f"Ray cannot say which nodes are draining ({unknown or 'no answer'}), so "
                    f"whether region {region!r}'s learners could run elsewhere after node "
                    f"{node_id} is unknown")
        gone = set(draining) | {node_id}
        carrying = [n for n in nodes if n.alive and n.resources.get(marker, 0.0) > 0]
        left = [n.resources[marker] for n in carrying if n.node_id not in gone]
        if not left:
            return (f"node {node_id} is the last node where region {region!r}'s learners can run "
                    f"({marker}; the others are draining or gone)")
        devices = units.get(region) or LearnerDevices()
        # Ray counts every alive node carrying the marker (this one, draining, included) when
        # it picks how a unit's hosts are placed (runtime.reserve_unit).
        if gang_strategy(devices, len(carrying)) == "STRICT_SPREAD":
            fits, room = len(left) >= devices.hosts, f"{len(left)} node(s)"
        else:
            units_left = int(sum(left) + 1e-9)
            fits, room = units_left >= devices.hosts, f"{units_left} unit(s) of {marker}"
        if not fits:
            return (f"node {node_id} is one of the last nodes where a whole learner of region "
                    f"{region!r} can run: a learner spans {devices.hosts} hosts "
                    f"(hosts_per_learner), and only {room} not draining would be left")
    return None


class DrainGuard:
    """Check-and-drain as one step, for a controller that serves commands concurrently (the
    console's action and the CLI at once): a lock holds the check and the drain together, and
    the nodes this guard asked Ray to drain count as draining from then on, before Ray's
    draining table says so (Ray cannot undo a drain, so they never stop counting)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requested: set[str] = set()

    def drain(self, node_id: str, look: Callable[[], tuple], regions: Iterable[str],
              drain: Callable[[], None], force: bool = False,
              units: Optional[Mapping[str, LearnerDevices]] = None) -> None:
        """Drains ``node_id`` (``drain()``) unless ``drain_refusal`` refuses it and not
        ``force``. ``look()`` -> (the nodes as ``NodeView``, the ids Ray says are draining or
        None when it cannot say, why it cannot).

        Raises:
          DrainRefused: refused; nothing was asked of Ray.
        """
        with self.lock:
            if not force:
                nodes, draining, unknown = look()
                if draining is not None:
                    draining = set(draining) | self.requested
                refusal = drain_refusal(node_id, nodes, regions, draining, units, unknown)
                if refusal:
                    raise DrainRefused(f"{refusal}: not drained (Ray cannot undo a drain); "
                                       "force it with --force (the console: force)")
            drain()
            self.requested.add(node_id)
