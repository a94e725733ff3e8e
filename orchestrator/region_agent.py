"""A region in its own Ray cluster: ``islands region join --home HOST:PORT --region NAME``.

The region agent is the job's controller in region mode (``RegionController``, named
``islands:controller`` in the region's cluster, a ``Controller`` with a ``RegionRole``): the
same fleet state machine and health rules
launch, check, restart and reintegrate the region's learners locally, from a local peer, so a
restart crosses the WAN only for the parameters the new incarnation registers with. Its syncer is
the link (``LinkClient``, named ``islands:syncer`` there): learners push to it unchanged, and the
agent forwards their heartbeats and its slots' states over the same channel.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from typing import Optional

import ray

from islands.learners.messages import Heartbeat
from islands.orchestrator import fleet as fleet_lib
from islands.orchestrator import safety, seam
from islands.orchestrator.controller import Controller
from islands.orchestrator.owner_role import OwnerRole
from islands.orchestrator.runtime import (CONTROLLER_NAME, NAMESPACE, ON_HEAD, SYNCER_NAME,
                                          NOT_INSTALLED, Role, controller_options,
                                          cpu_runtime_env, hold_sigterm, restore_sigterm,
                                          sigterm_interrupts)

log = logging.getLogger("islands.link")


def region_config(config: dict, region: str):
    """The JobConfig the region's agent runs: the home job's, with only ``region`` (local to
    this cluster, its WAN emulated on the link rather than in the learners, with the warm spares
    ``health.spares`` gives it), no chaos plan of its own, no link server and no quorum (the
    home syncer's quorum is the one that counts).

    Raises:
      ValueError: ``region`` is not a remote region of the job.
    """
    from islands.orchestrator.config import JobConfig

    regions = config["regions"]
    if region not in regions or not regions[region].get("remote"):
        remote = sorted(n for n, r in regions.items() if r.get("remote"))
        raise ValueError(f"region {region!r} is not a remote region of job "
                         f"{config.get('name')!r}; its remote regions are {remote}")
    mine = {**regions[region], "remote": False, "latency_ms": 0.0, "bandwidth_gbps": 1e6}
    metrics = {**config.get("metrics", {}), "enabled": False}
    # The region's warm spares are the agent's to keep, as the home keeps its own regions'.
    health = {**config.get("health", {}),
              "spares": JobConfig.model_validate(config).configured_spares(region)}
    return JobConfig.model_validate({**config, "regions": {region: mine}, "chaos": None,
                                     "link": {}, "metrics": metrics, "health": health,
                                     "quorum": {**config["quorum"], "min_learners": 1}})


class RegionRole(OwnerRole):
    """What makes an owner a region's agent (``controller.OwnerRole``): its one syncer shard is
    the link client (``islands:syncer`` in the region's cluster), its data shards are the home's
    share for the region, the home evaluates, and after every step the agent tells the home its
    slots (with each one's last failure cause) and relays its learners' heartbeats.
    """

    owns_syncers = False
    evaluates = False

    def __init__(self, region: str, shard_base: int, num_shards: int):
        self.region, self.shard_base, self.num_shards = region, shard_base, num_shards
        self.last_cause: dict[str, str] = {}
        self.drain_end: dict[str, str] = {}   # how a learner's drain under way ends (books)
        self.controller: Optional[Controller] = None

    def bind(self, controller: Controller) -> None:
        self.controller = controller

    @property
    def link(self):
        """The link client (the region's one syncer), once attached; None before."""
        return self.controller.shards.shard(0)

    def fleet_settings(self, settings: fleet_lib.FleetSettings) -> fleet_lib.FleetSettings:
        return dataclasses.replace(settings, first_shard=self.shard_base,
                                   num_shards=self.num_shards)

    def attach_link(self) -> None:
        controller = self.controller
        ready = controller.shards.attach(0, SYNCER_NAME, controller.settings.placement_timeout_s)
        controller.emit("link_ready", region=self.region, epoch=ready["epoch"])

    def recovery_observations(self) -> list:
        """The home's pause as the link last heard it: the link tells changes only, and the
        rebuilt fleet must hold (or resume) its learners as before the restart."""
        state = ray.get(self.link.home_state.remote(), timeout=30)
        return [fleet_lib.HomePause(state.get("paused"))]

    def heard(self, beat: Heartbeat) -> None:
        if self.link is not None:   # to home over the link, as plain values
            self.link.beat.remote(beat.as_dict())

    def recorded(self, t: fleet_lib.Transition) -> None:
        if t.name == "learner_failed":
            self.last_cause[t.learner] = str(t.fields.get("cause", ""))
        elif t.name == "learner_retired":
            self.last_cause[t.learner] = str(t.fields.get("reason", "")).split(" ")[0]
        elif t.name == "learner_draining":
            self.drain_end[t.learner] = "drained"
        elif t.name == "learner_drain_timeout":
            self.drain_end[t.learner] = fleet_lib.DRAIN_TIMEOUT
        elif (t.name == "learner_restart_scheduled"
              and t.fields.get("cause") == fleet_lib.Cause.PREEMPTED_PLANNED.value):
            # A handover off a draining node of this cluster: the home settles the old
            # incarnation as this fleet did (its Forget's reason), not as a crash.
            self.last_cause[t.learner] = self.drain_end.pop(t.learner, "drained")

    def stepped(self) -> None:
        if self.link is None:
            return
        slots = [{"learner": s.learner, "incarnation": s.incarnation, "state": s.state.value,
                  "shard": s.shard, "last_cause": self.last_cause.get(s.learner, ""),
                  # The home mirrors this count: one restart budget per learner, the agent's.
                  "restarts_json": json.dumps({c.value: n for c, n in s.restarts})}
                 for s in self.controller.owner.fleet.slots.values()]
        self.link.set_slots.remote(slots)

    def handlers(self) -> seam.Table:
        return {fleet_lib.LinkFault: self._do_linkfault,
                fleet_lib.PartitionHome: self._do_partitionhome,
                fleet_lib.RestartRemote: self._do_restartremote}

    def _do_linkfault(self, a) -> None:
        """Chaos on the region's link acts on the real link (the relay), not in the learners."""
        self.link.link_fault.remote(a.fault)

    def _do_partitionhome(self, a) -> None:
        raise RuntimeError("a home partition is the home's chaos: a region agent's fleet has no "
                           "remote regions, so it never asks for one")

    def _do_restartremote(self, a) -> None:
        raise RuntimeError(f"RestartRemote({a.learner}): the region's learners are the agent's "
                           "own; the home's verdicts reach it as Unhealthy (home_verdict)")


# The controller's actor methods the agent answers as the home's controller does: its learners'
# heartbeats, ``join``'s start, events and shutdown, and an operator's reads and commands.
FORWARDED = ("identity", "start", "heartbeat", "events_since", "shutdown", "ping", "emit", "snapshot",
             "summary", "status_table", "tokens", "goodput", "learner_goodput", "evaluate_now",
             "scale", "drain", "drain_node", "pause", "chaos_kill", "chaos_slowdown",
             "chaos_hang", "chaos_region_loss", "chaos_network", "serve_metrics",
             "serve_console", "console_url", "console_view", "clear_misconfigured")


class RegionController:
    """The region agent: the job's owner loop on the region's side of the link, a
    ``Controller`` built with a ``RegionRole`` (composition: it customises the controller only
    through the role's hooks).

    Create with ``ray.remote(RegionController).options(**controller_options(run_dir))`` after
    the ``LinkClient`` is up under ``islands:syncer``. Ray restarts it as it restarts the home's
    controller: the owner's recovery re-attaches the link (its one shard) and the learners still
    running, and relaunches the ones gone; the home sees none of it but a short silence.
    """

    def __init__(self, config, run_dir: str, region: str, shard_base: int, num_shards: int):
        self.role = RegionRole(region, shard_base, num_shards)
        self.controller = Controller(config, run_dir, role=self.role)

    def home_verdict(self, learner: str, incarnation: int, cause: str) -> None:
        """The home found this incarnation hung (its heartbeats stopped reaching home): the same
        verdict as this agent's own check, which usually comes first."""
        self.controller.inbox.put((fleet_lib.Unhealthy(learner, incarnation, cause,
                                                  f"{cause} seen at home"), None))

    def home_pause(self, reason) -> None:
        """Training at home paused (``reason``) or resumed (None): this region's learners
        follow, through the same quorum-floor rule as a pause of its own."""
        self.controller.inbox.put((fleet_lib.HomePause(reason), None))

    def link_status(self) -> dict:

        return ray.get(self.role.link.link_status.remote(), timeout=10)


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.controller, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(Controller, name).__doc__
    return method


for _name in FORWARDED:
    setattr(RegionController, _name, _forward(_name))


def leave_reason(home_ended: Optional[str], since_ok_s: float,
                 home_timeout_s: float) -> Optional[str]:
    """Why the agent leaves now (None: it stays): its home job ended, or the home has not
    answered for ``home_timeout_s`` (``link.agent_home_timeout_s``).

    >>> leave_reason("the home job 'j' has ended", 1.0, 300.0)
    "the home job 'j' has ended"
    >>> leave_reason(None, 299.0, 300.0) is None, leave_reason(None, 301.0, 300.0)
    (True, 'no answer from home for 301s (link.agent_home_timeout_s = 300s)')
    """
    if home_ended:
        return home_ended
    if since_ok_s > home_timeout_s:
        return (f"no answer from home for {since_ok_s:.0f}s "
                f"(link.agent_home_timeout_s = {home_timeout_s:g}s)")
    return None


class AgentLost(RuntimeError):
    """The region agent died and Ray no longer restarts it (its restarts are spent)."""


JOIN_KEY = b"islands:region-join"   # the join this cluster serves, in Ray's GCS key-value store


class ClusterNotOurs(RuntimeError):
    """A region command found actors it must not end (a home job's, a live join's, or actors no
    join is recorded for): the message names them; nothing was ended."""


def _identity(name: str) -> Optional[dict]:
    """What the actor ``name`` says it is (``identity()``), None when no actor has that name,
    ``{"kind": "unknown", "error": ...}`` when it does not say (an older build, a syncer, a
    controller that does not answer within 10 s)."""
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
    try:
        return dict(ray.get(handle.identity.remote(), timeout=10))
    except Exception as exc:   # no such method, or no answer: it is not known to be a region's
        return {"kind": "unknown", "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


class JoinRecordError(RuntimeError):
    """The join record could not be read or written: Ray's key-value store is reached through
    private calls of Ray's (``ray.experimental.internal_kv``), which a Ray upgrade may rename.
    The message is one line naming the call and its error, and what was ended (nothing, unless
    the record could not be cleared after a gone join's leftovers ended)."""


def _join_kv(call: str, *args, **kwargs):
    """``ray.experimental.internal_kv.<call>(*args, **kwargs)`` on the join record's key; any
    failure (the module or the call gone, a changed signature, no answer) is a JoinRecordError."""
    try:
        from ray.experimental import internal_kv

        return getattr(internal_kv, call)(JOIN_KEY, *args, namespace=NAMESPACE, **kwargs)
    except Exception as exc:
        raise JoinRecordError(
            f"cannot reach the region join record in Ray's key-value store "
            f"(ray.experimental.internal_kv.{call}: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})") from exc


def read_join_record() -> Optional[dict]:
    raw = _join_kv("_internal_kv_get")
    return json.loads(raw) if raw else None


def write_join_record(record: dict) -> None:
    _join_kv("_internal_kv_put", json.dumps(record).encode(), overwrite=True)


def clear_join_record(ray_job_id: Optional[str] = None) -> None:
    """Forgets the recorded join (only if it is ``ray_job_id``'s, when given)."""
    record = read_join_record()
    if record is not None and (ray_job_id is None or record.get("ray_job_id") == ray_job_id):
        _join_kv("_internal_kv_del")


def observe(mine: tuple = ()) -> safety.Seen:
    """What the connected cluster holds (``safety.Seen``), leaving out the actors named in
    ``mine`` (this join's own link)."""
    names = tuple(sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a.get("namespace") == NAMESPACE and a["name"].startswith("islands:")
                         and a["name"] not in mine))
    try:
        join = read_join_record()
    except JoinRecordError as exc:   # whose the actors are is unknown: nothing may end
        raise JoinRecordError(f"{exc}: nothing ended") from exc
    return safety.Seen(names=names,
                       controller=_identity(CONTROLLER_NAME) if CONTROLLER_NAME in names else None,
                       link=_identity(SYNCER_NAME) if SYNCER_NAME in names else None,
                       join=join)


def end_actors(names, timeout_s: float = 30.0) -> list[str]:
    """Ends the named actors and waits until their names are free; returns those it ended.

    Raises:
      RuntimeError: a name still held after ``timeout_s``.
    """
    names = sorted(names)
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:   # gone meanwhile
            pass

    def held() -> list[str]:
        listed = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE}
        return [n for n in names if n in listed]

    deadline = time.time() + timeout_s
    while held() and time.time() < deadline:
        time.sleep(0.2)
    if held():
        raise RuntimeError(f"actors of a previous join still hold their names after "
                           f"{timeout_s:.0f}s: {', '.join(held())}")
    return names


def end_leftovers(mine: tuple = (), timeout_s: float = 30.0) -> tuple[safety.Plan, list[str]]:
    """Ends what a join that is gone left in the connected cluster (its learners and spares,
    detached, outlive its process), after ``safety.plan_leftovers`` said whose they are, and
    forgets that join; returns the plan and the names it ended.

    Raises:
      ClusterNotOurs: the plan refused (a home job, a live join, actors no join is recorded
        for): nothing was ended.
      JoinRecordError: Ray's key-value store did not answer (its message says what ended).
    """
    plan = safety.plan_leftovers(observe(mine))
    if plan.refusal:
        raise ClusterNotOurs(plan.refusal)
    ended = end_actors(plan.end, timeout_s)
    if plan.join is not None:
        try:
            clear_join_record(plan.join.get("ray_job_id"))
        except JoinRecordError as exc:
            raise JoinRecordError(f"{ended_text(plan, ended)}, but the join stays recorded: "
                                  f"{exc}") from exc
    return plan, ended


def ended_text(plan: safety.Plan, ended: list) -> str:
    """The line a region command prints for what it ended."""
    if not ended:
        return "nothing to end" + (f" ({safety.describe_join(plan.join)} left no actors)"
                                   if plan.join else ": no islands actors in this cluster")
    text = (f"ended {len(ended)} actors {safety.describe_join(plan.join)} left "
            f"({', '.join(ended)})")
    if plan.others:
        text += f"; left as they are: {', '.join(plan.others)}"
    return text


def join(settings, duration_s: Optional[float] = None, run_dir: Optional[str] = None,
         address: Optional[str] = None, quiet: bool = False) -> dict:
    """Joins the home job as ``settings.region`` and runs until ``duration_s`` (None: until
    Ctrl+C); returns the region agent's summary.

    Raises:
      LinkRefused: the home refused the region (a wrong token, not a remote region).
      ValueError: the job's config does not have this region as remote.
      AgentLost: the agent died and Ray no longer restarts it; its learners were ended.
      ClusterNotOurs: ``address``'s cluster runs a home job or a live join, or holds actors no
        join is recorded for (``safety.plan_leftovers``); nothing was created or ended.
      JoinRecordError: the join record could not be read or written (a Ray upgrade renamed
        ``ray.experimental.internal_kv``): nothing of another join was ended.
    """

    from islands.link.client import LinkClient, LinkShard

    started = False
    previous_term = NOT_INSTALLED   # until its handler is set, after ray.init
    if not ray.is_initialized():
        if address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            started = True
    if not started:
        # Before anything of this join exists: a home job's cluster, or one whose join is alive,
        # is refused here with nothing created and nothing ended.
        plan = safety.plan_leftovers(observe())
        if plan.refusal:
            raise ClusterNotOurs(plan.refusal)
    link = controller = None
    shard_links: list = []
    recorded: Optional[str] = None   # this join's Ray job id, once recorded in the cluster
    summary: dict = {}
    left: Optional[str] = None
    lost: Optional[str] = None
    try:
        if started:  # the link's config says how many region resources to declare
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), namespace=NAMESPACE,
                     include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                     resources={f"region:{settings.region}": 64})
        # After ray.init, which installs its own SIGTERM handler (sys.exit(15), no cleanup).
        previous_term = sigterm_interrupts()
        link = ray.remote(LinkClient).options(
            name=SYNCER_NAME, namespace=NAMESPACE, num_cpus=0.1, max_concurrency=128,
            resources=dict(ON_HEAD), runtime_env=cpu_runtime_env(Role.REGION_AGENT)).remote(
                settings)
        try:
            joined = ray.get(link.hello.remote())
        except ray.exceptions.RayTaskError as exc:
            raise (exc.cause if isinstance(getattr(exc, "cause", None), Exception) else exc)
        config = region_config(joined["config"], settings.region)
        if not started:
            # The home accepted the region: only now may a gone join's leftovers end (a join
            # pointed at the wrong cluster or refused by the home ends nothing).
            plan, ended = end_leftovers(mine=(SYNCER_NAME,))
            if ended and not quiet:
                print(f"islands region: {ended_text(plan, ended)}", flush=True)
        # Recorded before the agent launches anything: whatever it leaves is known as this
        # join's (its link and agent end with this process, as Ray ends a driver's actors).
        recorded = ray.get_runtime_context().get_job_id()
        write_join_record({"region": settings.region, "job": config.name,
                           "home": settings.home, "pid": os.getpid(),
                           "host": socket.gethostname(), "ray_job_id": recorded})
        # The home's other syncer shards, by name (held here: an actor lives while its handle).
        for s in range(1, config.syncer.shards):
            shard_links.append(ray.remote(LinkShard).options(
                name=f"{SYNCER_NAME}-{s}", namespace=NAMESPACE, num_cpus=0, max_concurrency=128,
                resources=dict(ON_HEAD),
                runtime_env=cpu_runtime_env(Role.REGION_AGENT)).remote(s, NAMESPACE, SYNCER_NAME))
        ray.get([h.ping.remote() for h in shard_links])
        home_timeout_s = float(joined["config"].get("link", {}).get("agent_home_timeout_s",
                                                                      300.0))
        run_dir = os.path.abspath(run_dir or os.path.join(
            "runs", f"{config.name}-{settings.region}"))
        os.makedirs(run_dir, exist_ok=True)
        # A state file of an earlier join is not this agent's to recover from (Ray restarts
        # it from the one it saves).
        _remove(os.path.join(run_dir, "controller_state.json"))
        controller = ray.remote(RegionController).options(**controller_options(run_dir)).remote(
            config, run_dir, settings.region, joined["shard_base"], joined["num_shards"])
        ray.get(controller.start.remote())
        # Printed once the agent is up: tools that wait for this line can look it up at once.
        if not quiet:
            print(f"islands region: {settings.region} joined job {config.name!r} at "
                  f"{settings.home} (epoch {joined['epoch']}, data shards {joined['shard_base']}.. of "
                  f"{joined['num_shards']}); Ray cluster at "
                  f"{ray.get_runtime_context().gcs_address}", flush=True)
        t0 = time.time()
        index = 0
        while duration_s is None or time.time() - t0 < duration_s:
            home = ray.get(link.home_state.remote(), timeout=30)
            left = leave_reason(home["ended"], home["since_ok_s"], home_timeout_s)
            if left:
                print(f"islands region: {left}: stopping the learners and leaving", flush=True)
                break
            try:  # waits while Ray restarts the agent; fails once Ray gave up on it
                events, index = ray.get(controller.events_since.remote(index))
            except ray.exceptions.RayActorError:
                lost = "the region agent died and Ray no longer restarts it"
                print(f"islands region: {lost}: stopping the learners and leaving", flush=True)
                break
            if events:   # the agent's own event log, as a home run dir's (one JSON a line)
                with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
                    f.writelines(json.dumps(e, default=str) + "\n" for e in events)
            for event in events:
                if not quiet:
                    print(f"  region event {event['event']} "
                          + " ".join(f"{k}={v}" for k, v in event.items()
                                     if k not in ("t", "event", "elapsed_s")), flush=True)
            time.sleep(0.25)
    except KeyboardInterrupt:
        print("islands region: interrupted, leaving cleanly", flush=True)
    finally:
        hold_sigterm(previous_term)
        try:
            if left and link is not None:  # nobody at home to tell: the agent's calls fail at once
                try:
                    ray.get(link.close.remote(), timeout=10)
                except Exception:
                    pass
            if controller is not None and not lost:
                try:
                    summary = ray.get(controller.shutdown.remote(), timeout=120)
                    summary["link"] = ray.get(link.link_status.remote(), timeout=10)
                    with open(os.path.join(run_dir, "summary.json"), "w") as f:
                        json.dump(summary, f, indent=2, default=str)
                except Exception as exc:
                    log.error("region agent shutdown failed: %s", exc)
            # Only this join's own: its handles, and its agent's learners and spares once it had one.
            _end_own_actors([h for h in (controller, link, *shard_links) if h is not None],
                            settings.region if controller is not None else None)
            if recorded is not None:
                try:
                    clear_join_record(recorded)
                except Exception as exc:
                    log.error("could not clear this join's record: %s", exc)
            if started:
                ray.shutdown()
        finally:  # restored even if a step of the stop raised
            restore_sigterm(previous_term)
    if lost:   # its learners are ended (above): the caller exits with an error
        raise AgentLost(lost)
    if left:
        summary["left"] = left
    return summary


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _end_own_actors(handles: list, region: Optional[str]) -> None:
    """Ends this join's actors: the ones it holds handles to, and (``region`` given) its
    agent's learners and spares still named in the cluster."""
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:
            pass
    if region is None:
        return
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and safety.region_actor(a["name"], region)]
    except Exception:
        names = []
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except Exception:
            pass
