"""The operator console: one web page served by the controller (docs/operations.md#the-console).

aiohttp (installed with ``ray[default]``; Ray's dashboard runs on it) in a daemon thread of the
controller actor, not Ray Serve: Serve would start its own controller and proxy actors and hold
CPU on every node of what is often a small cluster, to serve one page to a few operators. The
page and its script are files beside this module (no CDN: clusters are often offline), the state
is polled as JSON once a second, and every action goes through the same controller methods as the
CLI (``scale``, ``drain``, ``chaos_kill``, ``pause``), after the token check.

Reads (the page, ``/api/state``) need no token, like ``/metrics``: the console binds loopback by
default. Every action does: ``Authorization: Bearer <token>``; none is 401, a wrong one 403, and
nothing is done either way. Each action, done or refused, is a ``console_action`` event with the
client's address.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger("islands.console")

STATIC = Path(__file__).resolve().parent / "console_static"
ASSETS = {"console.js": "application/javascript", "console.css": "text/css"}
TOKEN_ENV = "ISLANDS_CONSOLE_TOKEN"
TOKEN_FILE = "console_token"       # in the run dir, when the token was generated for the job
EVENTS_SHOWN = 40
REFUSALS_SHOWN = 15
# Actions; the chaos ones only with console.allow_chaos.
ACTIONS = ("scale", "drain", "drain_node", "restart", "pause", "resume", "clear_misconfigured")
CHAOS_ACTIONS = ("chaos_kill", "chaos_hang", "chaos_slowdown", "chaos_region_loss")


class ActionError(ValueError):
    """A malformed action: the message names what was wrong (HTTP 400, nothing done)."""


# -- the token ---------------------------------------------------------------------------------------
def _read_token_file(path: str, what: str) -> str:
    try:
        with open(os.path.expanduser(path)) as f:
            token = f.read().strip()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    if not token:
        raise ValueError(f"{what} {path} is empty")
    return token


def resolve_token(token_file: Optional[str], run_dir: str,
                  environ: Optional[dict] = None) -> tuple[str, str]:
    """The console's token and where it came from, in this order: ``console.token_file`` (a
    mounted secret), ``$ISLANDS_CONSOLE_TOKEN``, the Ray cluster's auth token when Ray's token
    auth is on (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``, where Ray
    keeps it), else a new random one written to ``RUN_DIR/console_token`` (mode 0600).

    Raises:
      ValueError: a named token file that cannot be read or is empty.
    """
    env = os.environ if environ is None else environ
    if token_file:
        return _read_token_file(token_file, "console.token_file"), token_file
    if env.get(TOKEN_ENV, "").strip():
        return env[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    if env.get("RAY_AUTH_MODE", "").lower() == "token":
        if env.get("RAY_AUTH_TOKEN", "").strip():
            return env["RAY_AUTH_TOKEN"].strip(), "$RAY_AUTH_TOKEN (the Ray cluster's token)"
        path = env.get("RAY_AUTH_TOKEN_PATH") or os.path.join("~", ".ray", "auth_token")
        if os.path.exists(os.path.expanduser(path)):
            return _read_token_file(path, "Ray's auth token file"), f"{path} (the Ray cluster's token)"
    path = os.path.join(run_dir, TOKEN_FILE)
    if os.path.exists(path):   # a resumed run keeps its token
        return _read_token_file(path, "the job's console token"), path
    token = secrets.token_urlsafe(24)
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def check_token(header: Optional[str], token: str) -> Optional[int]:
    """None when ``header`` carries ``token``; else the HTTP status: 401 none, 403 a wrong one.

    >>> check_token("Bearer s3cret", "s3cret"), check_token(None, "s3cret")
    (None, 401)
    >>> check_token("Bearer guess", "s3cret"), check_token("Basic s3cret", "s3cret")
    (403, 401)
    """
    if not header or not header.startswith("Bearer "):
        return 401
    given = header[len("Bearer "):].strip()
    return None if hmac.compare_digest(given.encode(), token.encode()) else 403


# -- actions -------------------------------------------------------------------------------------------
def _str(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ActionError(f"{key!r} must be a non-empty string, got {value!r}")
    return value


def _number(body: dict, key: str, integer: bool = False) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)) or value != value:
        kind = "an integer" if integer else "a number"
        raise ActionError(f"{key!r} must be {kind}, got {value!r}")
    return value


def plan_action(body: Any, allow_chaos: bool, origin: str) -> tuple[str, Callable, dict]:
    """Checks an action's body; returns its name, a call on the controller, and its arguments
    (for the event). Nothing is done here.

    Raises:
      ActionError: not an object, an unknown action, a missing or mistyped argument.
      PermissionError: a chaos action with ``console.allow_chaos`` off.

    >>> name, call, args = plan_action({"action": "scale", "region": "a", "n": 3}, False, "x")
    >>> name, args
    ('scale', {'region': 'a', 'n': 3})
    >>> for bad in ({"action": "scale", "region": "a", "n": "3"}, {"action": "chaos_kill"}):
    ...     try:
    ...         plan_action(bad, False, "x")
    ...     except (ActionError, PermissionError) as exc:
    ...         print(exc)
    'n' must be an integer, got '3'
    chaos_kill is a chaos action and console.allow_chaos is off
    """
    if not isinstance(body, dict):
        raise ActionError("the body must be a JSON object with an \"action\"")
    action = body.get("action")
    if action in CHAOS_ACTIONS and not allow_chaos:
        raise PermissionError(f"{action} is a chaos action and console.allow_chaos is off")
    if action == "scale":
        args = {"region": _str(body, "region"), "n": int(_number(body, "n", integer=True))}
        return action, lambda c: c.scale(args["region"], args["n"]), args
    if action == "drain":
        args = {"learner": _str(body, "learner")}
        return action, lambda c: c.drain(args["learner"]), args
    if action == "drain_node":   # a planned preemption of the node (islands drain-node)
        args = {"node_id": _str(body, "node_id")}
        if body.get("deadline_s") is not None:
            args["deadline_s"] = float(_number(body, "deadline_s"))
            if not args["deadline_s"] >= 0:
                raise ActionError("'deadline_s' must be >= 0")
        if body.get("force") is not None:   # the head node or a region's last one (--force)
            if not isinstance(body["force"], bool):
                raise ActionError(f"'force' must be true or false, got {body['force']!r}")
            args["force"] = body["force"]
        return action, lambda c: c.drain_node(args["node_id"], args.get("deadline_s"),
                                              origin, args.get("force", False)), args
    if action in ("restart", "chaos_kill"):
        # A restart is a kill the fleet answers with a relaunch: the same path as
        # `islands chaos kill` (it counts as a crash restart and spends the crash budget).
        args = {"learner": _str(body, "learner")}
        return action, lambda c: c.chaos_kill(args["learner"], "ray_kill"), args
    if action in ("pause", "resume"):
        return action, lambda c: c.pause(action == "pause", origin), {}
    if action == "clear_misconfigured":   # islands clear-misconfigured NODE (no node: --all)
        args = {"node_id": _str(body, "node_id") if body.get("node_id") is not None else None}
        return action, lambda c: c.clear_misconfigured(args["node_id"], origin), args
    if action == "chaos_hang":
        args = {"learner": _str(body, "learner"),
                "duration_s": float(_number(body, "duration_s"))}
        return action, lambda c: c.chaos_hang(args["learner"], args["duration_s"]), args
    if action == "chaos_slowdown":
        args = {"target": _str(body, "target"), "factor": float(_number(body, "factor")),
                "duration_s": float(_number(body, "duration_s"))}
        if not args["factor"] >= 1 or not args["duration_s"] > 0:
            raise ActionError("'factor' must be >= 1 and 'duration_s' > 0")
        return action, lambda c: c.chaos_slowdown(args["target"], args["factor"],
                                                   args["duration_s"]), args
    if action == "chaos_region_loss":
        args = {"region": _str(body, "region")}
        return action, lambda c: c.chaos_region_loss(args["region"]), args
    known = ACTIONS + (CHAOS_ACTIONS if allow_chaos else ())
    raise ActionError(f"unknown action {action!r}; actions are {list(known)}")


# -- the state the page shows -----------------------------------------------------------------------
def goodput_series(history: list, now_s: float, span_s: float, window_s: float,
                   points: int = 120) -> list:
    """``[[seconds ago, run ratio, window ratio or None], …]`` over the last ``span_s``, at most
    ``points`` of them, from the controller's ``(t, useful_s, allocated_s)`` samples.

    >>> goodput_series([(0, 0, 0), (10, 5, 10), (20, 5, 20)], 20, 60, 10)
    [[10, 0.5, 0.5], [0, 0.25, 0.0]]
    """
    from .metrics import windowed_ratio

    # Only what the span and one window before it need: the full history can hold 100 000.
    recent = [x for x in history if x[0] >= now_s - span_s - window_s]
    shown = [x for x in recent if x[0] >= now_s - span_s]
    stride = max(1, -(-len(shown) // points))
    out = []
    for i, (t, useful, allocated) in enumerate(shown):
        if i % stride and i != len(shown) - 1:
            continue
        if allocated <= 0:
            continue
        upto = [x for x in recent if x[0] <= t]
        out.append([round(now_s - t, 3), min(1.0, useful / allocated),
                    windowed_ratio(upto, t, window_s)])
    return out


def participation(syncer: dict, counts: dict) -> dict:
    """What the syncer card shows of merge participation: per fragment, the learners of its last
    merge and the live learners then (``"n/M"``), and over every merge that replaced Θ the mean
    participants and the mean share of the live learners.

    >>> participation({"quorum_size": {"0": 16, "1": 15}, "live_learners": {"0": 30, "1": 30}},
    ...               {"16/30": 3, "15/30": 1})
    {'last': {'0': '16/30', '1': '15/30'}, 'merges': 4, 'mean_participants': 15.75, 'mean_ratio': 0.525}
    """
    from islands.syncer.core import parse_participation_key

    quorum = syncer.get("quorum_size") or {}
    live = syncer.get("live_learners") or {}
    last = {str(p): f"{n}/{live.get(p, live.get(str(p), '?'))}"
            for p, n in sorted(quorum.items(), key=lambda kv: int(kv[0]))}
    merges = n_sum = 0
    ratios: list = []
    for key, times in counts.items():
        n, m = parse_participation_key(key)
        merges += int(times)
        n_sum += n * int(times)
        if m:
            ratios += [n / m] * int(times)
    return {"last": last, "merges": merges,
            "mean_participants": n_sum / merges if merges else None,
            "mean_ratio": round(sum(ratios) / len(ratios), 4) if ratios else None}


def console_state(view: dict, allow_chaos: bool) -> dict:
    """Everything the page shows, from the controller's ``console_view()`` (one snapshot and
    what the fleet knows beside it; strict JSON: NaN is null). Pure: no controller here."""
    import time

    from .snapshot import finite

    snap, events = view["snapshot"], view["events"]
    refusals = [e for e in events if e.get("event") == "push_refused"][-REFUSALS_SHOWN:]
    recent = [e for e in events if e.get("event") not in ("push_refused",)][-EVENTS_SHOWN:]
    now = time.time()
    window_s = view["goodput_window_s"]
    learners = {name: {**row, "profiler": view["profilers"].get(name)}
                for name, row in snap["learners"].items()}
    return finite({
        "job": view["job"], "t": now, "elapsed_s": snap["elapsed_s"],
        "allow_chaos": allow_chaos, "paused_reason": snap["paused_reason"],
        "misconfigured": view["misconfigured"], "operator_paused": view["operator_paused"],
        "regions": view["regions"],
        "learners": learners, "spares": snap.get("spares") or {}, "syncer": snap["syncer"],
        "syncer_restarts": snap["syncer_restarts"], "goodput": snap["goodput"],
        "participation": participation(snap["syncer"], snap.get("participation_counts") or {}),
        "goodput_series": goodput_series(view["goodput_history"], now,
                                         max(600.0, window_s), window_s),
        "tokens": snap["tokens"], "train_loss": snap["train_loss"],
        "eval_loss": snap["eval_loss"], "events": recent, "refusals": refusals})


# -- the server -------------------------------------------------------------------------------------
class ConsoleServer:
    """aiohttp on its own event loop in a daemon thread; controller calls run in its executor
    (a command waits for the owner thread's verdict, which must not stall the loop)."""

    def __init__(self, controller: Any, token: str, allow_chaos: bool = False):
        self.controller, self.token, self.allow_chaos = controller, token, allow_chaos
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.runner = None
        self.port: Optional[int] = None

    # handlers
    async def _index(self, request):
        from aiohttp import web

        return web.Response(body=(STATIC / "index.html").read_bytes(),
                            content_type="text/html", headers=_HEADERS)

    async def _asset(self, request):
        from aiohttp import web

        name = request.match_info["name"]
        if name not in ASSETS:   # only the known files: no path ever reaches the disk
            raise web.HTTPNotFound()
        return web.Response(body=(STATIC / name).read_bytes(), content_type=ASSETS[name],
                            headers=_HEADERS)

    async def _state(self, request):
        from aiohttp import web

        state = await self.loop.run_in_executor(
            None, lambda: console_state(self.controller.console_view(), self.allow_chaos))
        return web.Response(text=json.dumps(state, allow_nan=False, default=str),
                            content_type="application/json", headers=_HEADERS)

    async def _action(self, request):

        client = request.remote or "unknown"
        origin = f"console {client}"
        status = check_token(request.headers.get("Authorization"), self.token)
        if status is not None:
            self.controller.emit("console_action", origin="console", client=client,
                                 result="refused", status=status,
                                 reason="no token" if status == 401 else "wrong token")
            return _json({"ok": False, "error": "this action needs the console token"
                          if status == 401 else "the token is not the console's"}, status)
        try:
            body = await request.json()
        except Exception:
            return _json({"ok": False, "error": "the body must be JSON"}, 400)
        try:
            name, call, args = plan_action(body, self.allow_chaos, origin)
        except (ActionError, PermissionError) as exc:
            code = 403 if isinstance(exc, PermissionError) else 400
            self.controller.emit("console_action", origin="console", client=client,
                                 action=body.get("action") if isinstance(body, dict) else None,
                                 result="refused", status=code, reason=str(exc))
            return _json({"ok": False, "error": str(exc)}, code)
        try:
            message = await self.loop.run_in_executor(None, call, self.controller)
        except ValueError as exc:   # the fleet refused it (fleet.CommandError): nothing done
            self.controller.emit("console_action", origin="console", client=client,
                                 action=name, **args, result="refused", status=409,
                                 reason=str(exc))
            from .safety import DrainRefused

            # A drain the guard refused may be forced (the page asks the operator first).
            return _json({"ok": False, "error": str(exc),
                          "forceable": isinstance(exc, DrainRefused)}, 409)
        self.controller.emit("console_action", origin="console", client=client, action=name,
                             **args, result="done", message=message)
        return _json({"ok": True, "message": message}, 200)

    # lifecycle
    def start(self, host: str, port: int) -> int:
        """Serves on ``host:port`` (0: a free port); returns the bound port."""
        ready: dict = {}
        started = threading.Event()

        def serve():
            from aiohttp import web

            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            app = web.Application(client_max_size=64 * 1024)
            app.add_routes([web.get("/", self._index), web.get("/static/{name}", self._asset),
                            web.get("/api/state", self._state),
                            web.post("/api/action", self._action)])
            self.runner = web.AppRunner(app, access_log=None)
            try:
                self.loop.run_until_complete(self.runner.setup())
                site = web.TCPSite(self.runner, host, port)
                self.loop.run_until_complete(site.start())
                ready["port"] = self.runner.addresses[0][1]
            except Exception as exc:
                ready["error"] = exc
                started.set()
                return
            started.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True, name="console").start()
        started.wait(30)
        if "error" in ready:
            raise ready["error"]
        self.port = ready["port"]
        return self.port

    def stop(self) -> None:
        if self.loop is None:
            return
        loop, runner = self.loop, self.runner

        async def close():
            await runner.cleanup()
            loop.stop()

        asyncio.run_coroutine_threadsafe(close(), loop)


# No framing by other sites, no inline script, nothing fetched from elsewhere.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                       "frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


def _json(payload: dict, status: int):
    from aiohttp import web

    return web.Response(text=json.dumps(payload), status=status,
                        content_type="application/json", headers=_HEADERS)
