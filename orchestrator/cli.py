"""``islands`` command line: run, status, scale, drain, chaos, report, simulate."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _connect(address):
    import ray

    from .controller import CONTROLLER_NAME, NAMESPACE

    from .job import embedded_address

    if not ray.is_initialized():
        target = address or os.environ.get("RAY_ADDRESS") or embedded_address() or "auto"
        try:
            ray.init(address=target, namespace=NAMESPACE, log_to_driver=False)
        except ConnectionError as exc:
            sys.exit(f"islands: no Ray cluster to talk to at {target!r} ({exc}); start a job "
                     "with `islands run`, or pass --address")
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        sys.exit("islands: no running job found (no actor 'islands:controller' in namespace "
                 "'islands' on this cluster)")


def format_status(table: dict) -> str:
    rows = [("LEARNER", "REGION", "STATE", "STEP", "TOKENS", "RESTARTS", "LAST BEAT")]
    for name, l in sorted(table["learners"].items()):
        beat = l.get("last_heartbeat_s")
        rows.append((name, l["region"], l["state"], str(l.get("step") or 0),
                     f"{int(l.get('tokens_done') or 0):,d}", str(sum(l["restarts"].values())),
                     "-" if beat is None else f"{beat:.1f}s ago"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    s = table["syncer"]
    lines.append(f"syncer: epoch {s.get('epoch')}  merges {s.get('merges')}  "
                 f"versions {s.get('versions')}")
    if table.get("paused_reason"):
        lines.append(f"PAUSED: {table['paused_reason']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="islands", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job from a YAML config")
    run.add_argument("config")
    run.add_argument("--duration", type=float, default=None, help="seconds (default: config)")
    run.add_argument("--run-dir", default=None)
    run.add_argument("--address", default=None, help="Ray address to join (default: embedded)")
    run.add_argument("--log-format", choices=("text", "json"), default="text")

    for name, help_text in (("status", "learners and syncer of the running job"),):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--address", default=None)
        p.add_argument("--json", action="store_true")

    scale = sub.add_parser("scale", help="set a region's learner count while the job runs")
    scale.add_argument("region")
    scale.add_argument("n", type=int)
    scale.add_argument("--address", default=None)

    drain = sub.add_parser("drain", help="let a learner finish its pushes and leave")
    drain.add_argument("learner")
    drain.add_argument("--address", default=None)

    chaos = sub.add_parser("chaos", help="inject a fault on purpose")
    chaos_sub = chaos.add_subparsers(dest="action", required=True)
    kill = chaos_sub.add_parser("kill", help="kill a learner (us-east:0) or the syncer")
    kill.add_argument("target")
    kill.add_argument("--mode", choices=("ray_kill", "exit"), default="ray_kill")
    kill.add_argument("--address", default=None)
    slow = chaos_sub.add_parser("slowdown", help="multiply a learner's step time for a while")
    slow.add_argument("target")
    slow.add_argument("--factor", type=float, default=4.0)
    slow.add_argument("--duration", type=float, default=30.0)
    slow.add_argument("--address", default=None)
    hang = chaos_sub.add_parser("hang", help="wedge a learner (no steps, no heartbeats)")
    hang.add_argument("target")
    hang.add_argument("--duration", type=float, default=60.0)
    hang.add_argument("--address", default=None)
    lose = chaos_sub.add_parser("region-loss", help="kill every learner of a region at once")
    lose.add_argument("target", metavar="REGION")
    lose.add_argument("--repair", type=float, default=0.0, help="seconds before they may restart")
    lose.add_argument("--address", default=None)
    net = chaos_sub.add_parser("network", help="degrade a region's link for a while")
    net.add_argument("target", metavar="REGION")
    net.add_argument("--latency-ms", type=float, default=200.0, help="extra one-way latency")
    net.add_argument("--bandwidth-gbps", type=float, default=None, help="bandwidth cap")
    net.add_argument("--duration", type=float, default=30.0)
    net.add_argument("--address", default=None)
    part = chaos_sub.add_parser("partition", help="cut a region off the syncer for a while")
    part.add_argument("target", metavar="REGION")
    part.add_argument("--duration", type=float, default=30.0)
    part.add_argument("--address", default=None)

    sub.add_parser("simulate", add_help=False,
                   help="chaos simulation of goodput at 150k-2.4M chips (DESIGN §9); "
                        "islands simulate --help")

    report = sub.add_parser("report", help="plots and report.md from a run dir")
    report.add_argument("run_dir")

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--address" not in argv and not os.environ.get("RAY_ADDRESS"):
        # The embedded cluster is this machine's alone: it binds loopback, and a client of it
        # must not "resolve" 127.0.0.1 to the network address (Ray reads this when imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # Local clusters use token auth (Ray >= 2.59); a client sends the token only in that mode.
        if os.path.exists(os.path.join(os.path.expanduser("~"), ".ray", "auth_token")):
            os.environ.setdefault("RAY_AUTH_MODE", "token")
    if argv[:1] == ["simulate"]:  # its own options (--quick, --chips, ...) pass through as they are
        from .simulate import main as simulate_main

        return simulate_main(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "run":
        from .config import ConfigError, load_config
        from .job import run_job

        try:
            config = load_config(args.config)
        except (ConfigError, OSError) as exc:
            print(f"islands: invalid config {args.config}:\n{exc}", file=sys.stderr)
            return 2
        summary = run_job(config, args.duration, args.run_dir, args.address, args.log_format)
        keys = ("goodput", "merges", "tokens_applied", "tokens_dropped", "learner_restarts",
                "initial_eval_loss", "final_eval_loss", "wire_bytes")
        print(json.dumps({k: summary.get(k) for k in keys}))
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
                    args.target, args.duration, args.latency_ms, args.bandwidth_gbps)))
            elif args.action == "partition":
                print(ray.get(controller.chaos_network.remote(args.target, args.duration,
                                                              partition=True)))
            else:
                print(ray.get(controller.chaos_hang.remote(args.target, args.duration)))
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) else exc
        print(f"islands: {cause}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
