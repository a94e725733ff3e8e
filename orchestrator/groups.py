"""LearnerGroups: the one place the job's learner units and warm spares meet Ray.

The controller decides (the fleet state machine) and keeps the books; this object carries its
decisions out: it starts a unit (one process, or a multi-host gang in its placement group,
learners/gang.py), promotes a spare, calls a unit's control methods, kills it, polls which runs
have ended and frees what an ended unit held. A one-process learner and a many-host unit are the
same thing here: a learner id with an incarnation and one handle (the unit's host 0). The
pattern is Ray Train v2's WorkerGroup, which makes every Ray call for its controller.

Every method is called from the controller's owner thread. What it polls is already the
fleet's observations (``fleet.RunEnded``, ``fleet.Placed``, ``fleet.SpareReady``/``SpareEnded``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Iterable, Optional, Sequence

import ray

from . import fleet
from .groups_api import ShardEnded, SyncerStatus
from .runtime import (NAMESPACE, learner_actor_name, learner_options, release_unit,
                      reserve_unit)

log = logging.getLogger("islands.controller")


@functools.cache
def learner_unit_class():
    """The learner's Ray actor class, made once per process: a job launches thousands of
    learners and spares over its life, each from the same class."""
    from islands.learners.unit import LearnerUnit

    return ray.remote(LearnerUnit)


SPARE_PREFIX = "islands:spare:"
# A placed learner slow to answer a restarted controller's ping gets this many times the ping's
# timeout before it is ended as wedged.
SLOW_PING_FACTOR = 6


def placed(handle, timeout_s: float = 1.0) -> bool:
    """Whether Ray has placed and created the actor ``handle`` (its ``__ray_ready__`` answers;
    a threaded learner answers it beside a long call)."""
    ready, _ = ray.wait([handle.__ray_ready__.remote()], timeout=timeout_s)
    return bool(ready)


def release_unit_groups(learner: str) -> list[str]:
    """Removes every placement group of ``learner``'s unit incarnations
    (``islands-unit:<learner>:<incarnation>``); returns their names."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    prefix = f"islands-unit:{learner}:"
    removed = []
    for pg_id, info in ray.util.placement_group_table().items():
        if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
                removed.append(info["name"])
            except Exception as exc:   # removed meanwhile
                log.warning("placement group %s: %s", info.get("name"), exc)
    return removed


@dataclasses.dataclass
class _Unit:
    incarnation: int
    handle: Any
    run_ref: Any          # ``run`` (or, re-attached, ``wait_done``): resolves when it ends
    hosts: int = 1        # > 1: a gang whose placement group is freed when it ends
    placed_ref: Any = None   # its ``ping`` while Ray may not have placed its process yet


@dataclasses.dataclass
class _Spare:
    handle: Any
    prepare_ref: Any      # None once seen


def error_text(exc: Exception, limit: int) -> str:
    """What a learner's failed call says: a failed device check as its own one line (it names
    the configuration to fix, or the backend that did not start), anything else as Ray's
    error, cut to ``limit``."""
    from islands.learners.devices import DeviceFault

    cause = getattr(exc, "cause", None)
    if isinstance(cause, DeviceFault):
        return str(cause)
    return repr(exc)[:limit]


class LearnerGroups:
    """The Ray body of ``groups_api.LearnerGroup``."""

    def __init__(self):
        self.units: dict[str, _Unit] = {}
        self.spares: dict[str, _Spare] = {}

    # -- start ----------------------------------------------------------------------------------
    def launch(self, learner: str, incarnation: int, region: str, devices, spec,
               link_faults: Iterable = (), spare: Optional[str] = None,
               identity: Optional[dict] = None) -> Optional[str]:
        """Starts one incarnation: a new unit, or the spare ``spare`` promoted to ``identity``
        (if it died meanwhile its run fails, and the fleet restarts the slot). Returns why it
        could not start (the last incarnation's name is not released yet), or None."""

        if spare is not None:
            handle = self.spares.pop(spare).handle
            handle.promote.remote(identity)
        else:
            # A multi-host unit: one bundle per host, reserved as a gang; host 0 starts the rest.
            group = (reserve_unit(learner, incarnation, region, devices)
                     if devices.hosts > 1 else None)
            try:
                handle = learner_unit_class().options(
                    **learner_options(learner, region, devices, group)).remote(spec)
            except ValueError as exc:
                if group is not None:
                    release_unit(learner, incarnation)
                return str(exc)
        for fault in link_faults:
            handle.link_fault.remote(fault)
        self._forget(learner)   # an earlier incarnation not reported ended: free what it held
        # (a promoted spare is placed already; a new process answers once Ray placed it)
        placed_ref = handle.ping.remote() if spare is None else None
        self.units[learner] = _Unit(incarnation, handle, handle.run.remote(), devices.hosts,
                                    placed_ref)
        return None

    def placed(self) -> "list[fleet.Placed]":
        """The units whose new process Ray placed since the last poll (its ``ping``
        answered), on which node."""

        waiting = {u.placed_ref: name for name, u in self.units.items()
                   if u.placed_ref is not None}
        if not waiting:
            return []
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        out = []
        for ref in ready:
            unit = self.units[waiting[ref]]
            unit.placed_ref = None
            try:
                node = ray.get(ref, timeout=0).get("node_id")
            except Exception:   # it died before answering: its run's end says so
                continue
            out.append(fleet.Placed(waiting[ref], unit.incarnation, node))
        return out

    def reattach(self, learner: str, actor: str, hosts: int = 1,
                 timeout_s: float = 10) -> Optional[dict]:
        """A restarted controller takes over a unit still running under ``actor``'s name: its
        ``ping`` (incarnation, state, start step), or None when it is gone. An actor under that
        name that Ray has not placed (a handover, or a start launched after the last save) is
        ended, with a unit's placement groups: it holds the name the relaunch needs, and would
        train as an orphan once placed. One that is placed but slow to answer (a compile, a
        loaded host) gets ``SLOW_PING_FACTOR`` times longer before it is ended as wedged."""

        name = learner_actor_name(actor)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except Exception:
            return None
        try:
            info = ray.get(handle.ping.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            info = None
            if placed(handle):
                try:
                    info = ray.get(handle.ping.remote(), timeout=SLOW_PING_FACTOR * timeout_s)
                except Exception:
                    info = None
            if info is None:
                self.end_unplaced(actor, learner)
                return None
        except Exception:   # it died meanwhile: its name is released with it
            self.end_unplaced(actor, learner)
            return None
        if info["state"] in ("training", "paused", "draining", "starting"):
            self.units[learner] = _Unit(info["incarnation"], handle, handle.wait_done.remote(),
                                        hosts)
        return info

    def end_unplaced(self, actor: str, learner: Optional[str] = None) -> None:
        """Ends the learner actor named ``actor`` that does not answer (Ray has not placed it):
        it holds the learner's name, so its relaunch could never take it. A unit's detached
        placement groups (``islands-unit:<learner>:<incarnation>``) go with it: left, they would
        take the capacity its relaunch waits for."""

        try:
            ray.kill(ray.get_actor(learner_actor_name(actor), namespace=NAMESPACE),
                     no_restart=True)
        except ValueError:   # gone meanwhile
            pass
        if learner is not None:
            release_unit_groups(learner)

    def launch_spare(self, name: str, region: str, devices, spec) -> Optional[str]:
        """Starts a warm spare (a learner's devices, held ready); why not, or None."""

        try:
            handle = learner_unit_class().options(
                **learner_options(name, region, devices)).remote(spec)
        except ValueError as exc:   # an earlier spare's name is not released yet
            return str(exc)
        self.spares[name] = _Spare(handle, handle.prepare.remote())
        return None

    def hurry_spare(self, name: str) -> None:
        """A restart waits for this spare: it finishes preparing at normal priority."""
        spare = self.spares.get(name)
        if spare is not None:
            spare.handle.hurry.remote()

    def end_spare(self, name: str) -> None:

        spare = self.spares.pop(name, None)
        if spare is not None:
            ray.kill(spare.handle, no_restart=True)

    def end_stray_spares(self, keep: set) -> None:
        """Ends every spare actor of the job but those in ``keep`` (actor names without the
        ``islands:`` prefix): a restarted controller does not recover waiting spares."""

        try:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a.get("namespace") == NAMESPACE and a["name"].startswith(SPARE_PREFIX)]
        except Exception:
            return
        for name in names:
            if name.split("islands:", 1)[1] not in keep:
                try:
                    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                except Exception:
                    pass

    # -- control --------------------------------------------------------------------------------
    def _call(self, learner: str, method: str, *args) -> bool:
        """Fire-and-forget control call on a running unit; False when it has none."""
        unit = self.units.get(learner)
        if unit is None:
            return False
        getattr(unit.handle, method).remote(*args)
        return True

    def drain(self, learner: str) -> bool:
        return self._call(learner, "drain")

    def pause(self, learner: str, paused: bool) -> bool:
        # Ordered: the learner applies the newest call only (LearnerUnit.pause).
        return self._call(learner, "pause", paused, time.time_ns())

    def hang(self, learner: str, duration_s: float) -> bool:
        return self._call(learner, "hang", duration_s)

    def apply_fault(self, learners: Sequence[str], fault) -> None:
        """A slowdown (its factor for its duration) or a link fault, on each running unit."""
        from .chaos import FaultKind

        for learner in learners:
            if fault.kind == FaultKind.SLOWDOWN:
                self._call(learner, "slowdown", fault.factor, fault.duration_s)
            else:
                self._call(learner, "link_fault", fault)

    def partition_home(self, fault) -> None:
        """The link server (the home's side of every region's link) goes down for the window."""
        from islands.link.server import LINK_SERVER_NAME

        ray.get_actor(LINK_SERVER_NAME, namespace=NAMESPACE).partition.remote(fault.duration_s)

    def kill(self, learner: str, incarnation: int, mode: str, fault=None,
             reason: str = "") -> bool:
        """Ends a unit's incarnation: ``exit`` (a hard exit inside it, chaos), ``kill``
        (``ray.kill``; its run future then reports it) or ``bury`` (decided dead: forgotten at
        once, what it held freed). True when the unit is gone from this group."""

        unit = self.units.get(learner)
        if unit is None or unit.incarnation != incarnation:
            return False
        if mode == "exit":
            unit.handle.crash.remote()
            return False
        ray.kill(unit.handle, no_restart=True)
        if mode == "bury":
            self._forget(learner)
            return True
        return False

    # -- poll -----------------------------------------------------------------------------------
    def ended(self) -> "list[fleet.RunEnded]":
        """The units whose runs ended since the last poll, forgotten here and their actors
        and placement groups freed (a returned or crashed run leaves a live actor holding the
        learner's name: a restart could never take it)."""

        refs = {u.run_ref: name for name, u in self.units.items() if u.run_ref is not None}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            name = refs[ref]
            unit = self.units[name]
            final, error, preempted, crashed = None, None, False, False
            try:
                final = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                error = str(exc)[:300] or "actor died"
                preempted = bool(getattr(exc, "preempted", False))
            except Exception as exc:  # the training loop raised: a crash of the learner
                error, crashed = error_text(exc, 500), True
            if error is None or crashed:
                try:
                    ray.kill(unit.handle, no_restart=True)
                except Exception:  # already gone: its name is free anyway
                    pass
            self._forget(name)
            out.append(fleet.RunEnded(name, unit.incarnation, error, preempted, crashed,
                                      final=final))
        return out

    def spare_results(self) -> "list[fleet.SpareReady | fleet.SpareEnded]":
        """Spares whose ``prepare`` returned (ready, on their node) or failed (ended)."""

        pending = {s.prepare_ref: name for name, s in self.spares.items()
                   if s.prepare_ref is not None}
        if not pending:
            return []
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        out = []
        for ref in ready:
            name = pending[ref]
            self.spares[name].prepare_ref = None
            try:
                info = ray.get(ref)
            except Exception as exc:
                out.append(fleet.SpareEnded(name, error_text(exc, 300)))
                continue
            out.append(fleet.SpareReady(name, time.time(), info.get("node_id")))
        return out

    def wait(self, other_refs: list, timeout_s: float) -> bool:
        """Blocks until a unit's run ends, a spare is ready, one of ``other_refs`` resolves, or
        ``timeout_s``; False at once when there is nothing to wait on."""

        refs = [u.run_ref for u in self.units.values() if u.run_ref is not None]
        refs += [s.prepare_ref for s in self.spares.values() if s.prepare_ref is not None]
        refs += [r for r in other_refs if r is not None]
        if not refs:
            return False
        ray.wait(refs, num_returns=1, timeout=timeout_s)
        return True

    def stop_all(self, timeout_s: float) -> None:
        """Asks every unit to stop and waits for their runs, at most ``timeout_s``."""

        for unit in self.units.values():
            try:
                unit.handle.stop.remote()
            except Exception:
                pass
        refs = [u.run_ref for u in self.units.values() if u.run_ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def _forget(self, learner: str) -> None:
        unit = self.units.pop(learner, None)
        if unit is not None and unit.hosts > 1:
            release_unit(learner, unit.incarnation)   # its actors have ended: free its hosts


class SyncerShards:
    """The Ray side of the job's syncer shards (shard 0 is ``islands:syncer``; with
    ``syncer.shards`` = S, shard s > 0 is ``islands:syncer-<s>``): started, re-attached after a
    controller restart, asked for status, refusals and the global parameters, told to forget a
    learner or to snapshot, and watched for their end. A region agent attaches its link client
    as its one shard (orchestrator/region_agent.py)."""

    def __init__(self, count: int):
        self.handles: list = [None] * count
        self.closing: list = [None] * count   # ``wait_closed``: resolves when a shard ends

    @property
    def count(self) -> int:
        return len(self.handles)

    def start(self, s: int, spec, epoch: int, restore: bool, options: dict,
              timeout_s: float) -> dict:
        """Starts shard ``s`` and waits for it; its ``ready`` answer (epoch, versions, ...)."""

        from islands.syncer.actor import Syncer

        handle = ray.remote(Syncer).options(**options).remote(spec, epoch, restore=restore)
        ready = ray.get(handle.ready.remote(), timeout=timeout_s)
        self.handles[s], self.closing[s] = handle, handle.wait_closed.remote()
        return ready

    def attach(self, s: int, name: str, timeout_s: float) -> dict:
        """Takes over the running actor ``name`` as shard ``s``; its ``ready`` answer. Raises
        when it is gone or does not answer in ``timeout_s``."""

        handle = ray.get_actor(name, namespace=NAMESPACE)
        ready = ray.get(handle.ready.remote(), timeout=timeout_s)
        self.handles[s], self.closing[s] = handle, handle.wait_closed.remote()
        return ready

    def ended(self) -> list[ShardEnded]:
        """The shards whose actor has ended since they were started or attached."""

        return [ShardEnded(s) for s, ref in enumerate(self.closing)
                if ref is not None and ray.wait([ref], timeout=0)[0]]

    def closed_refs(self) -> list:
        """Each shard's ``wait_closed`` (None: not started), for ``LearnerGroups.wait``."""
        return list(self.closing)

    def shard(self, s: int) -> Any:
        """Shard ``s``'s actor handle (None before it is started or attached)."""
        return self.handles[s] if s < len(self.handles) else None

    def kill(self, s: int, fault=None) -> None:

        ray.kill(self.handles[s], no_restart=True)

    def refusals_since(self, seen: list[int], timeout_s: float = 10) -> list:
        """Every shard's refusals after the ``seen[s]`` it has already reported (``seen`` is
        advanced in place); a shard that cannot answer is asked again next time."""

        out = []
        for s, handle in enumerate(self.handles):
            try:
                new, seen[s] = ray.get(handle.refusals_since.remote(seen[s]), timeout=timeout_s)
            except Exception:
                continue
            out += new
        return out

    def forget(self, learner: str, incarnation: int, reason: str,
               timeout_s: float = 10) -> None:
        """Every shard forgets this incarnation (one that is down forgets at its restart)."""

        refs = [h.forget.remote(learner, incarnation, reason) for h in self.handles]
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s)
            except Exception:
                pass

    def statuses(self, slowest_step_s: float, paused: bool,
                 timeout_s: float = 10) -> dict[int, SyncerStatus]:
        """Tells every shard the fleet's pace and pause, and returns the statuses that came
        back (a shard that cannot answer is left out)."""

        refs = {}
        for s, handle in enumerate(self.handles):
            try:
                handle.set_fleet.remote(slowest_step_s, paused)
                refs[s] = handle.status.remote()
            except Exception:
                continue
        out = {}
        for s, ref in refs.items():
            try:
                out[s] = SyncerStatus.of(ray.get(ref, timeout=timeout_s))
            except Exception:
                continue
        return out

    def global_params(self, timeout_s: float = 30) -> dict:
        """The global parameters, flat: each shard holds its own fragments' tensors."""

        flat = {}
        for part, _ in ray.get([h.global_params.remote() for h in self.handles],
                               timeout=timeout_s):
            flat.update(part)
        return flat

    def snapshot_now(self, timeout_s: float = 60) -> None:

        ray.get([h.snapshot_now.remote() for h in self.handles], timeout=timeout_s)


def share(value: Any) -> Any:
    """Puts ``value`` in Ray's object store once; learners map it from there."""

    return ray.put(value)


def restarted_actor() -> bool:
    """Whether the calling actor is a restart of an earlier one (Ray restarted it)."""

    return ray.get_runtime_context().was_current_actor_reconstructed


def cluster_view(regions) -> tuple[dict, frozenset, dict]:
    """(resources by name, alive node ids, {region: its alive node ids}) of the cluster, for
    the fleet's membership."""

    total = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    alive = frozenset(n["NodeID"] for n in nodes)
    return total, alive, region_nodes(regions, nodes)


def region_nodes(regions, nodes: list) -> dict:
    """{region: the ids of the ``nodes`` (``ray.nodes()`` entries) carrying ``region:<name>``}.

    >>> region_nodes(["a", "b"], [{"NodeID": "n1", "Resources": {"region:a": 2.0}}])
    {'a': frozenset({'n1'}), 'b': frozenset()}
    """
    return {r: frozenset(n["NodeID"] for n in nodes
                         if n.get("Resources", {}).get(f"region:{r}", 0.0) > 0) for r in regions}


class DrainQuery:
    """How the draining-node query fares: its failures, counted (exported as
    ``islands_drain_query_failures_total``), and logged once per run of failures rather than
    at every poll (once again after it answered in between). While it fails, planned
    preemption is blind: a draining node looks like any other until it goes."""

    def __init__(self):
        self.failures = 0
        self.failing = False
        self.last_error: Optional[str] = None   # the latest failure, for a refusal to name

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        if not self.failing:
            self.failing = True
            log.error("Ray's draining-node query failed (%s: %s): planned preemption is off "
                      "until it answers again (islands_drain_query_failures_total counts the "
                      "failed polls)", type(exc).__name__, exc)

    def answered(self) -> None:
        if self.failing:
            self.failing = False
            log.warning("Ray's draining-node query answers again after %d failed polls",
                        self.failures)


def draining_nodes(query: Optional[DrainQuery] = None) -> Optional[dict]:
    """The nodes Ray is draining (``ray drain-node``, an autoscaler, a platform's announced
    preemption): node id -> deadline in wall-clock seconds (None: no deadline); None when Ray
    cannot say (told to ``query``). The GCS's draining table, as Ray Train v2's preemption
    watcher polls it: a private call of Ray's, so a failure is counted and logged, not hidden."""

    try:
        raw = ray._private.state.state.get_draining_nodes()
    except Exception as exc:
        (query or DrainQuery()).failed(exc)
        return None
    if query is not None:
        query.answered()
    return {node: (ms / 1000.0 if ms else None) for node, ms in (raw or {}).items()}


def node_views() -> list:
    """Every node Ray knows, as ``safety.NodeView`` (id, alive, resources)."""
    from .safety import NodeView

    return [NodeView(n["NodeID"], bool(n.get("Alive")), dict(n.get("Resources") or {}))
            for n in ray.nodes()]


def drain_node(node_id: str, deadline_s: Optional[float], message: str) -> None:
    """Asks Ray to drain ``node_id`` as a preemption with ``deadline_s`` seconds left (None: no
    deadline): what ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` does. Ray then
    places nothing new there, and the node leaves once idle. Raises ValueError when the node is
    not a live node of this cluster or Ray refuses."""
    import time

    from ray.core.generated import autoscaler_pb2

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if node_id not in alive:
        raise ValueError(f"no live node {node_id!r}; live nodes are {sorted(alive)}")
    deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        message, deadline_ms)
    if not accepted:
        raise ValueError(f"Ray refused to drain node {node_id}: {why}")


def cluster_observation(regions, query: Optional["DrainQuery"] = None) -> "fleet.Cluster":
    """What the cluster holds now, as the fleet's observation: per region its whole units (a
    unit of H hosts takes H of its region's resource), the alive nodes, the draining ones."""
    total, alive, by_region = cluster_view(regions)
    return fleet.Cluster({r: float(int(total.get(f"region:{r}", 0.0)
                                       / regions[r].devices().hosts + 1e-9)) for r in regions},
                         alive, draining_nodes(query), region_nodes=by_region)


def guarded_drain(guard, query: "DrainQuery", regions, node_id: str,
                  deadline_s: Optional[float], message: str, force: bool) -> None:
    """Asks Ray to drain ``node_id`` after ``guard``'s check (``safety.DrainGuard``), as one
    step under its lock: a controller serves many calls at once (the console and the CLI), and
    Ray's draining table lags the drains it asked for."""
    def look() -> tuple:
        draining = draining_nodes(query)
        return node_views(), draining, query.last_error

    guard.drain(node_id, look, regions, lambda: drain_node(node_id, deadline_s, message),
                force=force, units={r: c.devices() for r, c in regions.items()})
