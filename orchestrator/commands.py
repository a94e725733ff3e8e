"""Operator commands as the fleet's observations: what the controller's public commands (the CLI,
the console and a region's agent call them by name) put in its inbox, with the reply the caller
gets once the owner accepts it. Pure: no Ray, no controller; a bad argument raises here, before
anything is queued.

>>> obs, reply = chaos_kill("a:0", "exit", now=5.0)
>>> obs.fault.kind.value, obs.fault.at_s, obs.mode, reply
('exit', 5.0, 'exit', 'killed a:0 (exit)')
"""

from __future__ import annotations

from typing import Optional

from . import fleet as fleet_lib
from .chaos import HOME_TARGET, Fault, FaultKind

Command = tuple   # (fleet observation, the reply once the owner accepts it)


def scale(region: str, n: int) -> Command:
    return fleet_lib.Scale(region, n), f"{region}: {n} learners"


def drain(learner: str) -> Command:
    return fleet_lib.Drain(learner), f"draining {learner}"


def pause(paused: bool, origin: str) -> Command:
    return fleet_lib.PauseJob(bool(paused), origin), "paused" if paused else "resumed"


def clear_misconfigured(node_id: Optional[str], origin: str) -> Command:
    return (fleet_lib.ClearMisconfigured(node_id, origin),
            f"cleared node {node_id}" if node_id else "cleared every marked node")


def drain_node_reply(node_id: str, deadline_s: Optional[float]) -> str:
    """Checks a node drain's deadline (None: none) and says what was asked."""
    if deadline_s is not None and not deadline_s >= 0:
        raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
    return f"draining node {node_id}" + ("" if deadline_s is None else
                                         f" (deadline in {deadline_s:g}s)")


def chaos(kind: FaultKind, target: str, now: float, mode: str = "ray_kill",
          **fault) -> fleet_lib.Chaos:
    return fleet_lib.Chaos(Fault(now, kind, target, **fault), mode)


def chaos_kill(target: str, mode: str, now: float) -> Command:
    """A learner killed (``ray.kill``, or ``exit``: a hard exit inside it), or a syncer shard
    (``syncer`` is shard 0, ``syncer:<s>`` shard s)."""
    if mode not in ("ray_kill", "exit"):
        raise ValueError(f"unknown kill mode {mode!r}; choose ray_kill or exit")
    if target.split(":")[0] == "syncer":   # (a shard is ended by ray.kill either way)
        return chaos(FaultKind.SYNCER_KILL, target, now), f"killed {target}"
    kind = FaultKind.KILL if mode == "ray_kill" else FaultKind.EXIT
    return chaos(kind, target, now, mode), f"killed {target} ({mode})"


def chaos_slowdown(target: str, factor: float, duration_s: float, now: float) -> Command:
    return (chaos(FaultKind.SLOWDOWN, target, now, duration_s=duration_s, factor=factor),
            f"slowed {target} x{factor} for {duration_s}s")


def chaos_hang(target: str, duration_s: float) -> Command:
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return fleet_lib.HangCommand(target, duration_s), f"hung {target} for {duration_s}s"


def chaos_region_loss(region: str, repair_s: float, now: float) -> Command:
    return (chaos(FaultKind.REGION_LOSS, region, now, duration_s=repair_s),
            f"lost region {region}")


def chaos_network(region: str, duration_s: float, extra_latency_ms: float,
                  bandwidth_gbps: Optional[float], partition: bool, loss_rate: float,
                  now: float) -> Command:
    """A region's link degraded, or silenced (``partition``); ``HOME_TARGET`` partitions every
    remote region's link at once and cannot be degraded."""
    kind = FaultKind.PARTITION if partition else FaultKind.NETWORK
    if region == HOME_TARGET and not partition:
        raise ValueError("a network fault targets one region; the home can be partitioned "
                         "(islands chaos partition --home), not degraded")
    obs = chaos(kind, region, now, duration_s=duration_s, extra_latency_ms=extra_latency_ms,
                bandwidth_gbps=bandwidth_gbps, loss_rate=loss_rate)
    if region == HOME_TARGET:
        return obs, f"partition of the home (every remote region's link) for {duration_s}s"
    return obs, f"{kind.value} on {region} for {duration_s}s"
