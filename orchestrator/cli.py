"""``islands`` command line: run, status, console, scale, drain, drain-node, pause, resume, chaos,
report, export, simulate, config."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from islands.faults import HOME_TARGET


# Seconds a CLI command may spend reaching the cluster: a TCP probe of the address, then
# ray.init and the controller lookup as a whole (Ray itself retries a dead GCS for minutes).
PROBE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = float(os.environ.get("ISLANDS_CONNECT_TIMEOUT_S", "30"))


def _resolve_auto() -> str:
    """What Ray's "auto" would join (the last `ray start` cluster), or "auto" if unknown."""
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None) or "auto"
    except Exception:
        return "auto"


def _address_argument(argv: list) -> Optional[str]:
    """The value of ``--address`` in ``argv`` (``--address X`` or ``--address=X``), or None."""
    for i, arg in enumerate(argv):
        if arg == "--address" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--address="):
            return arg.split("=", 1)[1]
    return None


def _on_loopback(address: Optional[str]) -> bool:
    """Whether ``address`` (None: the embedded cluster) is a cluster on this machine's loopback.

    >>> [_on_loopback(a) for a in (None, "127.0.0.1:6379", "localhost:1", "10.0.0.2:6379",
    ...                            "auto", "ray://127.0.0.1:10001")]
    [True, True, True, False, False, True]
    """
    if address is None:
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _connect(address):
    """The running job's controller; a bad or stale address fails within seconds, exit 1."""
    import threading

    import ray

    from .controller import CONTROLLER_NAME, NAMESPACE

    from .job import embedded_address, probe_address

    if not ray.is_initialized():
        target = address or os.environ.get("RAY_ADDRESS") or embedded_address() or "auto"
        probed = _resolve_auto() if target == "auto" else target
        problem = probe_address(probed, PROBE_TIMEOUT_S)
        if problem:
            sys.exit(f"islands: {problem} Start a job with `islands run`, or pass --address")

        def give_up():  # ray.init has no deadline of its own: a wrong port can hang for minutes
            print(f"islands: could not connect to the Ray cluster at {target!r} within "
                  f"{CONNECT_TIMEOUT_S:g}s (set ISLANDS_CONNECT_TIMEOUT_S to wait longer)",
                  file=sys.stderr, flush=True)
            os._exit(1)

        watchdog = threading.Timer(CONNECT_TIMEOUT_S, give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            ray.init(address=target, namespace=NAMESPACE, log_to_driver=False)
        except ConnectionError as exc:
            sys.exit(f"islands: no Ray cluster to talk to at {target!r} ({exc}); start a job "
                     "with `islands run`, or pass --address")
        finally:
            watchdog.cancel()
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        sys.exit("islands: no running job found (no actor 'islands:controller' in namespace "
                 "'islands' on this cluster)")


def _number(kind: str, low: float, inclusive: bool, what: str):
    """An argparse type: a finite float above ``low`` (or at least ``low``), as the config checks
    the same parameter, so a bad value stops before anything connects to Ray."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {low:g} ({what}), got {text}")
        return value

    parse.__name__ = kind  # argparse names the type in its "invalid <name> value" message
    return parse


positive_seconds = _number("seconds", 0.0, False, "a duration in seconds")
slowdown_factor = _number("factor", 1.0, False, "a slowdown multiplies step time")
non_negative_ms = _number("milliseconds", 0.0, True, "extra latency")
positive_gbps = _number("gbps", 0.0, False, "a bandwidth cap")
non_negative_seconds = _number("seconds", 0.0, True, "a delay in seconds")


def loss_rate(text: str) -> float:
    """An argparse type: a segment loss probability, 0 <= x < 1 (1 would deliver nothing)."""
    value = non_negative_fraction(text)
    if value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be < 1 (a loss probability), got {text}")
    return value


non_negative_fraction = _number("loss_rate", 0.0, True, "a loss probability")


def devices_text(devices: Optional[dict]) -> str:
    """What a learner reported JAX gave it: "gpu 1× NVIDIA H200" ("-" before its first beat).

    >>> devices_text({"backend": "gpu", "kind": "NVIDIA H200", "count": 1}), devices_text(None)
    ('gpu 1× NVIDIA H200', '-')
    """
    if not devices or devices.get("backend") is None:
        return "-"
    return f"{devices['backend']} {devices.get('count', 0)}× {devices.get('kind')}"


def format_status(table: dict) -> str:
    rows = [("LEARNER", "REGION", "UNIT", "DEVICES", "STATE", "STEP", "TOKENS", "RESTARTS",
             "LAST BEAT")]
    for name, l in sorted(table["learners"].items()):
        beat = l.get("last_heartbeat_s")
        rows.append((name, l["region"], l.get("unit") or "-", devices_text(l.get("devices")),
                     l["state"], str(l.get("step") or 0),
                     f"{int(l.get('tokens_done') or 0):,d}", str(sum(l["restarts"].values())),
                     "-" if beat is None else f"{beat:.1f}s ago"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    s = table["syncer"]
    lines.append(f"syncer: epoch {s.get('epoch')}  merges {s.get('merges')}  "
                 f"versions {s.get('versions')}")
    shards = s.get("shards") or []
    if len(shards) > 1:  # one line per syncer shard: its fragments, epoch and merges
        for row in shards:
            lines.append(f"  syncer shard {row['shard']}: fragments {row['fragments']}  "
                         f"epoch {row['epoch']}  merges {row['merges']}  "
                         f"versions {row['versions']}")
    if s.get("snapshot_error"):   # merging goes on; a restart would restore an older snapshot
        lines.append(f"SNAPSHOTS FAILING ({s.get('snapshot_failures')} so far): "
                     f"{s['snapshot_error']}")
    for name, spare in sorted((table.get("spares") or {}).items()):
        reserved = f"  for {spare['for']}'s restart" if spare.get("for") else ""
        lines.append(f"spare {name}: region {spare['region']}  {spare['state']}{reserved}")
    if table.get("paused_reason"):
        lines.append(f"PAUSED: {table['paused_reason']}")
    lines += misconfigured_lines(table.get("misconfigured"))
    for name, l in sorted(table["learners"].items()):
        if l.get("crash_loop"):   # retired: where and of what it kept dying
            lines.append(f"CRASH LOOP {name}: {l['crash_loop']}")
    return "\n".join(lines)


def misconfigured_lines(marks) -> list:
    """One line per node marked misconfigured for a region (``FleetState.marks``); a dict
    {region: message} is what an older controller reports.

    >>> misconfigured_lines([{"node": "n1", "region": "gpu", "message": "device check failed: x",
    ...                       "blocked": True}])
    ['MISCONFIGURED region gpu on node n1 (region blocked: every node of it is marked): device check failed: x']
    """
    if isinstance(marks, dict):
        return [f"MISCONFIGURED region {r}: {m}" for r, m in sorted(marks.items())]
    return [f"MISCONFIGURED region {m['region']} on node {m['node']}"
            + (" (region blocked: every node of it is marked)" if m.get("blocked") else "")
            + f": {m['message']}" for m in marks or []]


def _config_command(args) -> int:
    """``islands config schema`` and ``islands config check FILE`` (see docs/config.md)."""
    from .config import ConfigError, JobConfig, load_config

    if args.action == "schema":
        print(json.dumps(JobConfig.model_json_schema(), indent=2))
        return 0
    try:
        config = load_config(args.file)
    except (ConfigError, OSError) as exc:
        print(f"islands: invalid config {args.file}:\n{exc}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def main(argv=None) -> int:
    # The CLI (``islands run`` and ``islands region join`` included) is a driver: it may build
    # the model on the CPU to check a config, but never opens an accelerator or preallocates
    # its memory; the learners get their own platform (runtime.process_env).
    from islands.learners.devices import apply_env

    from .runtime import Role, process_env

    apply_env(process_env(Role.DRIVER))
    parser = argparse.ArgumentParser(
        prog="islands", description=__doc__,
        epilog="Documentation: docs/README.md (architecture, configuration, metrics, operations).")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job from a YAML config")
    run.add_argument("config")
    run.add_argument("--duration", type=positive_seconds, default=None,
                     help="seconds (default: config)")
    run.add_argument("--run-dir", default=None)
    run.add_argument("--address", default=None, help="Ray address to join (default: embedded)")
    run.add_argument("--log-format", choices=("text", "json"), default="text")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in --run-dir (append to its logs, restore the "
                            "syncer from its newest snapshot)")
    again.add_argument("--force", action="store_true",
                       help="--run-dir holds an earlier run: start a new one in a timestamped "
                            "subdirectory of it (nothing is deleted)")
    again.add_argument("--resume-or-start", action="store_true",
                       help="for unattended restarts (a RayJob's retries): continue the run in "
                            "--run-dir if it holds one, else start one there")

    for name, help_text in (("status", "learners and syncer of the running job"),):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--address", default=None)
        p.add_argument("--json", action="store_true")
    for name, help_text in (("console", "print the running job's console address"),
                            ("pause", "pause every learner (they stay up, holding their state)"),
                            ("resume", "resume a job paused with `islands pause` or the console")):
        sub.add_parser(name, help=help_text).add_argument("--address", default=None)

    scale = sub.add_parser("scale", help="set a region's learner count while the job runs")
    scale.add_argument("region")
    scale.add_argument("n", type=int)
    scale.add_argument("--address", default=None)

    drain = sub.add_parser("drain", help="let a learner finish its pushes and leave")
    drain.add_argument("learner")
    drain.add_argument("--address", default=None)

    drain_node = sub.add_parser(
        "drain-node", help="announce a node's preemption: Ray drains it, its learners hand over "
                           "to other nodes and leave")
    drain_node.add_argument("node_id", help="the Ray node id (hex), as `ray list nodes` shows it")
    drain_node.add_argument("--deadline-s", type=non_negative_seconds, default=None,
                            help="seconds until the node goes (default: none)")
    drain_node.add_argument("--force", action="store_true",
                            help="drain it even if it is the head node or the last node a "
                                 "region's learners can run on (refused without: Ray cannot "
                                 "undo a drain)")
    drain_node.add_argument("--address", default=None)

    clear = sub.add_parser(
        "clear-misconfigured", help="clear a node's misconfigured marks (its device check "
                                    "failed) once it is fixed: its regions may use it again")
    clear_what = clear.add_mutually_exclusive_group(required=True)
    clear_what.add_argument("node_id", nargs="?", help="the Ray node id, as `islands status` "
                                                       "shows it")
    clear_what.add_argument("--all", action="store_true", help="every marked node")
    clear.add_argument("--address", default=None)

    chaos = sub.add_parser("chaos", help="inject a fault on purpose")
    chaos_sub = chaos.add_subparsers(dest="action", required=True)
    kill = chaos_sub.add_parser("kill", help="kill a learner (us-east:0), the syncer, or one "
                                "syncer shard (syncer:1)")
    kill.add_argument("target")
    kill.add_argument("--mode", choices=("ray_kill", "exit"), default="ray_kill")
    kill.add_argument("--address", default=None)
    slow = chaos_sub.add_parser("slowdown", help="multiply a learner's step time for a while")
    slow.add_argument("target")
    slow.add_argument("--factor", type=slowdown_factor, default=4.0, help="> 1")
    slow.add_argument("--duration", type=positive_seconds, default=30.0)
    slow.add_argument("--address", default=None)
    hang = chaos_sub.add_parser("hang", help="wedge a learner (no steps, no heartbeats)")
    hang.add_argument("target")
    hang.add_argument("--duration", type=positive_seconds, default=60.0)
    hang.add_argument("--address", default=None)
    lose = chaos_sub.add_parser("region-loss", help="kill every learner of a region at once")
    lose.add_argument("target", metavar="REGION")
    lose.add_argument("--repair", type=non_negative_seconds, default=0.0,
                      help="seconds before they may restart")
    lose.add_argument("--address", default=None)
    net = chaos_sub.add_parser("network", help="degrade a region's link for a while")
    net.add_argument("target", metavar="REGION")
    net.add_argument("--latency-ms", type=non_negative_ms, default=200.0,
                     help="extra one-way latency")
    net.add_argument("--bandwidth-gbps", type=positive_gbps, default=None, help="bandwidth cap")
    net.add_argument("--loss-rate", type=loss_rate, default=0.0,
                     help="probability a segment is lost (0 <= x < 1; a TCP retransmit delay)")
    net.add_argument("--duration", type=positive_seconds, default=30.0)
    net.add_argument("--address", default=None)
    part = chaos_sub.add_parser("partition", help="cut a region (or, with --home, every remote "
                                                  "region) off the syncer for a while")
    part.add_argument("target", metavar="REGION", nargs="?")
    part.add_argument("--home", action="store_true",
                      help="partition the home: its link server drops every region's link "
                           "(run it in the home cluster)")
    part.add_argument("--duration", type=positive_seconds, default=30.0)
    part.add_argument("--address", default=None)

    sub.add_parser("simulate", add_help=False,
                   help="chaos simulation of goodput at 150k-2.4M chips (docs/operations.md); "
                        "islands simulate --help")

    region = sub.add_parser("region", help="run a region in its own Ray cluster, joined to a "
                                           "home job over the link (docs/regions.md)")
    region_sub = region.add_subparsers(dest="action", required=True)
    join = region_sub.add_parser("join", help="join the home job at HOST:PORT as REGION")
    join.add_argument("--home", required=True, metavar="HOST:PORT", help="the home's link")
    join.add_argument("--region", required=True, help="a region the home config marks remote")
    join.add_argument("--token-file", default=None,
                      help="the link's bearer token (default: $ISLANDS_LINK_TOKEN)")
    join.add_argument("--ca-cert", default=None, help="CA that signed the home's certificate "
                                                      "(default: the system's roots)")
    join.add_argument("--client-cert", default=None, help="this region's certificate (mTLS)")
    join.add_argument("--client-key", default=None, help="its key (mTLS)")
    join.add_argument("--server-name", default=None,
                      help="the name in the home's certificate (default: HOST)")
    join.add_argument("--insecure", action="store_true",
                      help="plaintext link (loopback trials only; the token is still sent)")
    join.add_argument("--latency-ms", type=non_negative_ms, default=0.0,
                      help="emulated one-way WAN latency on the link")
    join.add_argument("--bandwidth-gbps", type=positive_gbps, default=None,
                      help="emulated WAN bandwidth of the link")
    join.add_argument("--loss-rate", type=loss_rate, default=0.0,
                      help="emulated WAN segment loss (0 <= x < 1), played as TCP's "
                           "retransmission delay")
    join.add_argument("--duration", type=positive_seconds, default=None,
                      help="seconds (default: until Ctrl+C)")
    join.add_argument("--run-dir", default=None)
    join.add_argument("--address", default=None,
                      help="the region's Ray cluster (default: start an embedded one); a "
                           "cluster running a home job or a live join is refused, and a killed "
                           "join's leftovers are ended once the home accepted the region")

    leave = region_sub.add_parser(
        "leave", help="end the learners and spares a killed `islands region join` left in the "
                      "region's Ray cluster; refuses (exit 1, nothing ended) a cluster that runs "
                      "a home job, a join still running, or actors no join is recorded for")
    leave.add_argument("--address", default=None,
                       help="the region's Ray cluster (required: --address or $RAY_ADDRESS)")

    report = sub.add_parser("report", help="plots and report.md from a run dir")
    report.add_argument("run_dir")

    export = sub.add_parser("export", help="the run's global parameters as an orbax checkpoint "
                                           "(OUT/params) plus OUT/task.json (docs/tasks.md)")
    export.add_argument("run_dir")
    export.add_argument("--out", default=None, help="export directory (default: RUN_DIR/export)")

    config_cmd = sub.add_parser("config", help="the job config: JSON schema, or check a file",
                                epilog="Every key is described in docs/config.md.")
    config_sub = config_cmd.add_subparsers(dest="action", required=True)
    config_sub.add_parser("schema", help="print the JobConfig JSON schema")
    check = config_sub.add_parser("check", help="validate a YAML config and print it with every "
                                                "default filled in (exit 2 when invalid)")
    check.add_argument("file")

    argv = sys.argv[1:] if argv is None else list(argv)
    if _on_loopback(_address_argument(argv) or os.environ.get("RAY_ADDRESS")):
        # A cluster on this machine's loopback: the embedded one, or a region cluster that
        # `islands region join` started (it prints its 127.0.0.1 address). A client of it must
        # not "resolve" 127.0.0.1 to the network address (Ray reads this when imported)...
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # ...and such clusters use token auth (Ray >= 2.59); a client sends the token only in
        # that mode.
        if os.path.exists(os.path.join(os.path.expanduser("~"), ".ray", "auth_token")):
            os.environ.setdefault("RAY_AUTH_MODE", "token")
    if argv[:1] == ["simulate"]:  # its own options (--quick, --chips, ...) pass through as they are
        from islands.studies.simulate import main as simulate_main

        return simulate_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "chaos" and args.action == "partition" \
            and (args.target is None) == (not args.home):
        parser.error("islands chaos partition: give a REGION or --home (not both)")

    if args.command == "config":  # no Ray: it only reads the file
        return _config_command(args)
    if args.command == "run":
        from .config import ConfigError, load_config
        from .job import CapacityError, RunDirError, run_job
        from .preflight import preflight

        try:
            config = load_config(args.config)
            preflight(config)  # limits that need the built model and corpus, before Ray
        except (ConfigError, OSError) as exc:
            print(f"islands: invalid config {args.config}:\n{exc}", file=sys.stderr)
            return 2
        try:
            summary = run_job(config, args.duration, args.run_dir, args.address, args.log_format,
                              resume=args.resume, force=args.force,
                              resume_or_start=args.resume_or_start, sigterm_stops=True)
        except (ConfigError, RunDirError) as exc:
            print(f"islands: {exc}", file=sys.stderr)
            return 2
        except (ConnectionError, CapacityError) as exc:   # the cluster, not the config
            print(f"islands: {exc}", file=sys.stderr)
            return 1
        keys = ("goodput", "merges", "tokens_applied", "tokens_dropped", "learner_restarts",
                "initial_eval_loss", "final_eval_loss", "wire_bytes")
        print(json.dumps({k: summary.get(k) for k in keys}))
        # 128 + SIGTERM, as a process ended by it: a supervisor that restarts a failed run (a
        # RayJob's retries, with --resume-or-start) continues a stopped one rather than
        # taking it for finished.
        return 143 if summary.get("stopped_by") == "sigterm" else 0
    if args.command == "region":
        return _region_leave(args) if args.action == "leave" else _region_join(args)
    if args.command == "export":  # no Ray: it reads the run dir's snapshots
        from .export import ExportError, export_run
        from islands.learners.task import TaskError

        try:
            out = export_run(args.run_dir, args.out)
        except (ExportError, TaskError, OSError) as exc:
            print(f"islands: {exc}", file=sys.stderr)
            return 2
        print(os.path.join(out, "params"))
        return 0
    if args.command == "report":
        from .report import write_report

        print(write_report(args.run_dir))
        return 0

    import ray

    controller = _connect(args.address)
    try:
        if args.command == "status":
            table = ray.get(controller.status_table.remote())
            print(json.dumps(table, indent=2, default=str) if args.json else format_status(table))
        elif args.command == "scale":
            print(ray.get(controller.scale.remote(args.region, args.n)))
        elif args.command == "drain":
            print(ray.get(controller.drain.remote(args.learner)))
        elif args.command == "drain-node":
            print(ray.get(controller.drain_node.remote(args.node_id, args.deadline_s, "cli",
                                                       args.force)))
        elif args.command == "clear-misconfigured":
            print(ray.get(controller.clear_misconfigured.remote(
                None if args.all else args.node_id, "cli")))
        elif args.command in ("pause", "resume"):
            print(ray.get(controller.pause.remote(args.command == "pause", "cli")))
        elif args.command == "console":
            url = ray.get(controller.console_url.remote())
            if url is None:
                print("islands: this job serves no console (console.enabled: false, or it "
                      "could not start: see the controller's log)", file=sys.stderr)
                return 1
            print(url)
        elif args.command == "chaos":
            if args.action == "kill":
                print(ray.get(controller.chaos_kill.remote(args.target, args.mode)))
            elif args.action == "slowdown":
                print(ray.get(controller.chaos_slowdown.remote(args.target, args.factor,
                                                               args.duration)))
            elif args.action == "region-loss":
                print(ray.get(controller.chaos_region_loss.remote(args.target, args.repair)))
            elif args.action == "network":
                print(ray.get(controller.chaos_network.remote(
                    args.target, args.duration, args.latency_ms, args.bandwidth_gbps,
                    loss_rate=args.loss_rate)))
            elif args.action == "partition":
                print(ray.get(controller.chaos_network.remote(
                    HOME_TARGET if args.home else args.target, args.duration, partition=True)))
            else:
                print(ray.get(controller.chaos_hang.remote(args.target, args.duration)))
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) else exc
        print(f"islands: {cause}", file=sys.stderr)
        return 2
    return 0


def _region_leave(args) -> int:
    """Ends what a join that is gone left in the region's cluster, and nothing else: a home
    job's actors, a live join's, and actors no join is recorded for are refused (exit 1)."""
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:   # never a guessed cluster: "auto" may be the home's
        print("islands region leave: give the region's Ray cluster with --address HOST:PORT "
              "(or $RAY_ADDRESS); it never guesses one", file=sys.stderr)
        return 2
    import ray

    from .job import probe_address
    from .region_agent import ClusterNotOurs, end_leftovers, ended_text

    problem = probe_address(_resolve_auto() if address == "auto" else address, PROBE_TIMEOUT_S)
    if problem:
        print(f"islands region leave: {problem}", file=sys.stderr)
        return 1
    ray.init(address=address, namespace="islands", log_to_driver=False)
    try:
        plan, ended = end_leftovers()
    except (ClusterNotOurs, RuntimeError) as exc:
        print(f"islands region leave: refused: {exc}" if isinstance(exc, ClusterNotOurs)
              else f"islands region leave: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"islands region leave: {ended_text(plan, ended)}")
    return 0


def _region_join(args) -> int:
    # Before gRPC starts: its own handshake logs would bury the one line that names the cause.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from islands.link.client import ClientSettings, LinkRefused
    from islands.orchestrator.region_agent import AgentLost, ClusterNotOurs, JoinRecordError, join
    from islands.link.security import read_token

    try:
        settings = ClientSettings(
            home=args.home, region=args.region, token=read_token(args.token_file, option="--token-file"),
            ca_file=args.ca_cert, cert_file=args.client_cert, key_file=args.client_key,
            tls=not args.insecure, server_name=args.server_name, latency_ms=args.latency_ms,
            bandwidth_gbps=args.bandwidth_gbps, loss_rate=args.loss_rate)
        settings.host_port  # noqa: B018 - validates HOST:PORT now
    except (ValueError, OSError) as exc:
        print(f"islands region: {exc}", file=sys.stderr)
        return 2
    from islands.link.client import preflight

    try:  # a link that cannot come up is named in one line, before any Ray cluster starts
        preflight(settings)
    except LinkRefused as exc:
        print(f"islands region: cannot join {args.home} as {args.region}: {exc}",
              file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # unreadable certificate files, a key without a cert
        print(f"islands region: {exc}", file=sys.stderr)
        return 2
    try:
        summary = join(settings, args.duration, args.run_dir, args.address)
    except LinkRefused as exc:
        print(f"islands region: the home refused {args.region}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"islands region: {exc}", file=sys.stderr)
        return 2
    except AgentLost as exc:   # a failure for whatever restarts this command (a RayJob's retry)
        print(f"islands region: {exc}", file=sys.stderr)
        return 1
    except ClusterNotOurs as exc:   # nothing created, nothing ended
        print(f"islands region: not joining into {args.address or '$RAY_ADDRESS'}: {exc}",
              file=sys.stderr)
        return 1
    except JoinRecordError as exc:   # Ray's private key-value calls failed: one line
        print(f"islands region: not joining into {args.address or '$RAY_ADDRESS'}: {exc}",
              file=sys.stderr)
        return 1
    print(json.dumps({k: summary.get(k) for k in ("tokens_applied", "learner_restarts",
                                                   "link")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
