"""A long run: thousands of real learner process failures in one run of the real Ray service, with
syncer, controller and link-server kills among them; then the books, the versions and leaks.

The soak's job (``soak.py``: 2 regions × 2 learners of the tiny model, a 0.1 s restart backoff,
an unlimited crash budget) with the link server on (``link.port: 0``, loopback). One driver
thread kills learners through the controller's chaos commands (``chaos_kill``, ``ray_kill`` and
hard ``exit`` in turn), always the learner that has trained longest at its incarnation, at most
one every ``--gap-s`` (default: the failures spread over the time cap). At set failure counts
it also kills the syncer (``ray.kill`` of its actor: the controller restarts it), the controller
(``ray.kill`` with Ray's restart) and the link server (the same). It counts the learners'
failures from the job's own events (``learner_failed``) until ``--failures`` or the time cap.

Checked at the end:
  - books balanced term by term: processed = applied + dropped + in flight in exact
    fragment-tokens, each term ≥ 0, and the dropped reasons sum to the dropped total;
  - versions monotonic: per fragment the merged version never goes below the highest seen
    (outside the 3 s catch-up after a syncer restart), and none lost (``soak.versions_check``);
  - nothing lost: nothing left in flight once the job ended;
  - nothing leaks: the controller's and the syncer's resident memory (RSS of their actor
    processes, sampled every second) over the last W learner failures within 10 % of that over
    the first W (W = 100, or a quarter of the failures in a shorter run). The bar is read per
    process: each actor's process at the end (the service kills fall in 30-60 % of the run, so
    it lived through the last 40 %), its last W failures against its first W; the figures for
    the role over the whole run (first process against last) are reported beside it. Open file
    descriptors, each process's less up to two established connections per pair of live
    processes (the driver, the service processes, the training learners, and the node's own
    Ray processes as peers: one each way is kept once either called the other, as a restarted
    learner with the peer it copied from, a restarted controller with the restarted link
    server, a promoted prestarted learner with the raylet; connections to processes that are
    gone or not listed, and past two per pair, still count), the whole counts beside: the driver's,
    the controller's, the syncer's and the link server's back to their counts at the start, and
    each learner's no more than any learner's at the start or at a steady moment of the first
    window (``fds_verdict``), and live
    Ray actors back to their count, all read once every learner trains and no spare is
    starting; after the job no job actor and none of the processes it used alive.

    python benchmarks/long_run.py                  # ≥ 2,000 failures within 60 minutes
    python benchmarks/long_run.py --quick          # 60 failures: the same checks, minutes
    python benchmarks/long_run.py --driver inprocess   # 10,000 failures, in-process driver

``--driver inprocess``: the same cores (``LearnerCore``, ``SyncerCore``, the fleet state machine,
the books) on the in-process driver's virtual clock, with a seeded plan of learner kills, hard
exits, region losses and syncer kills long enough for ``--failures`` (default 10,000 there).

Prints progress lines, then one JSON object as the last line; writes ``long_run[_quick|
_inprocess].json`` and, for the real run, ``long_run[_quick].png`` (memory over failures).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from typing import Optional

import _common as C
import numpy as np
import soak

WINDOW = 100            # failures in the first and the last memory window
TOLERANCE = 0.10        # the memory bar: last window within 10 % of the first
SERVICE_SPAN = (0.3, 0.6)   # the service kills fall in this share of the failures


# -- pure helpers (tests/unit/test_long_run.py) ---------------------------------------------------
def service_kill_plan(failures: int, syncer: int, controller: int, link: int,
                      span: tuple = SERVICE_SPAN) -> list[tuple[int, str]]:
    """``[(at_failure, kind)]``: the service kills, interleaved and spread evenly over
    ``span`` (shares of ``failures``), so that the first and last memory windows each see one
    process of every actor.

    >>> service_kill_plan(100, 2, 1, 1)
    [(30, 'syncer'), (37, 'controller'), (45, 'link'), (52, 'syncer')]
    """
    kinds = []
    pools = {"syncer": syncer, "controller": controller, "link": link}
    while any(pools.values()):
        for kind in ("syncer", "controller", "link"):
            if pools[kind]:
                kinds.append(kind)
                pools[kind] -= 1
    lo, hi = span[0] * failures, span[1] * failures
    step = (hi - lo) / max(len(kinds), 1)
    return [(int(lo + k * step), kind) for k, kind in enumerate(kinds)]


def window_size(failures: int, window: int = WINDOW) -> int:
    """W: ``window`` failures, or a quarter of a shorter run's (at least 1)."""
    return max(1, min(window, failures // 4))


def memory_windows(samples: list[tuple[int, int]], failures: int, window: int) -> dict:
    """Median RSS (bytes) of ``samples`` ``[(failures_so_far, rss)]`` over the first ``window``
    failures and over the last ``window``; ``ratio`` = last ÷ first, ``within`` = ratio within
    ``TOLERANCE`` of 1 (None where a window has no sample).

    >>> memory_windows([(0, 100), (5, 110), (95, 104), (100, 106)], 100, 10)
    {'first': 105.0, 'last': 105.0, 'ratio': 1.0, 'within': True, 'n_first': 2, 'n_last': 2}
    """
    first = [r for n, r in samples if n < window]
    last = [r for n, r in samples if n >= failures - window]
    out = {"first": float(statistics.median(first)) if first else None,
           "last": float(statistics.median(last)) if last else None}
    ratio = out["last"] / out["first"] if first and last and out["first"] else None
    out.update(ratio=ratio, within=None if ratio is None else abs(ratio - 1.0) <= TOLERANCE,
               n_first=len(first), n_last=len(last))
    return out


def since_restart(samples: list[tuple[int, int, int]], failures: int, window: int) -> dict:
    """``memory_windows`` on the samples ``[(failures_so_far, rss, pid)]`` of the last process
    only (the actor's last incarnation), its first window taken from its own first failure."""
    if not samples:
        return {"first": None, "last": None, "ratio": None, "within": None}
    pid = samples[-1][2]
    mine = [(n, r) for n, r, p in samples if p == pid]
    start = mine[0][0]
    shifted = [(n - start, r) for n, r in mine]
    return {**memory_windows(shifted, failures - start, window), "pid": pid,
            "from_failure": start, "mib_per_100_failures": slope(mine)}


def slope(rows: list[tuple[int, int]]) -> Optional[float]:
    """Least-squares growth of ``[(failures, bytes)]`` in MiB per 100 failures (None: fewer
    than two distinct failure counts). A leak shows as a slope the run's length turns into
    more than the 10 % bar.

    >>> slope([(0, 0), (100, 2 ** 20), (200, 2 ** 21)])
    1.0
    """
    if len({n for n, _ in rows}) < 2:
        return None
    n, r = np.array(rows, dtype=float).T
    return round(float(np.polyfit(n, r, 1)[0]) * 100 / 2 ** 20, 4)


def books_check(summary: dict) -> dict:
    """Term by term, in exact fragment-tokens: processed = applied + dropped + in flight, no
    term negative, dropped = Σ its reasons; with the service's own verdict."""
    ft = summary.get("fragment_tokens") or {}
    by = summary.get("tokens_dropped_by") or {}
    terms = ("processed", "applied", "dropped", "in_flight")
    sums = bool(ft) and all(k in ft for k in terms) and (
        ft["applied"] + ft["dropped"] + ft["in_flight"] == ft["processed"]) and min(
        ft[k] for k in terms) >= 0
    reasons = abs(sum(by.values()) - summary.get("tokens_dropped", 0.0)) < 1e-6 * max(
        1.0, summary.get("tokens_dropped", 0.0))
    return {"terms": sums, "dropped_reasons": reasons,
            "service": bool(summary.get("books_balanced")),
            "balanced": bool(sums and reasons and summary.get("books_balanced"))}


def versions_monotonic(merges) -> tuple[bool, int]:
    """(monotonic, lost) over ``[(fragment, version)]`` in merge order: a fragment's version
    never goes below the highest it had; lost = the most it went below."""
    highest: dict = {}
    lost = 0
    for fragment, version in merges:
        if version < highest.get(fragment, version):
            lost = max(lost, highest[fragment] - version)
        highest[fragment] = max(highest.get(fragment, version), version)
    return lost == 0, lost


def fds_verdict(start: dict, end: dict, learner_window_max: Optional[int],
                learners_training: Optional[int] = None) -> dict:
    """Open fds back where they started, per process role, each count less the process's
    connections to the other live processes listed (``job_fds``).

    The processes that live through the run (the driver, the controller, the syncer, the link
    server; the service kills restart some, and a restarted one is read the same way) must end
    at or below their count at the start. The learners at the end are other processes than at
    the start: each must hold no more fds than the most any learner held at the start or in the
    first window of failures (``learner_window_max``, sampled): a leak grows past that. Where
    ``learners_training`` (the learners training at the start) is given, the start and the end
    must each have read that many learners: a learner not read is not shown to be back, and one
    missed at the start leaves the others' connections to it in their start counts.

    >>> fds_verdict({"driver": 40, "learners": [46, 46]}, {"driver": 40, "learners": [48, 47]}, 48)
    {'driver': True, 'learners': True, 'back': True}
    >>> fds_verdict({"driver": 40, "learners": [46]}, {"driver": 41, "learners": [49]}, 48)
    {'driver': False, 'learners': False, 'back': False}
    >>> fds_verdict({"link": None, "learners": [46]}, {"link": 40, "learners": [46]}, 46)["link"]
    False
    >>> fds_verdict({"learners": [46, 46]}, {"learners": [46]}, 46, learners_training=2)
    {'learners': False, 'back': False}
    >>> fds_verdict({"learners": [46]}, {"learners": [46, 46]}, 46, learners_training=2)
    {'learners': False, 'back': False}
    """
    out = {}
    for role, first in start.items():
        if role == "learners":
            bound = max((first or []) + [learner_window_max or 0])
            out[role] = (bool(first) and bool(end.get(role)) and max(end[role]) <= bound
                         and (learners_training is None
                              or len(first) == len(end[role]) == learners_training))
        else:   # a process not read at the start (or the end) is not shown to be back
            out[role] = first is not None and end.get(role) is not None and end[role] <= first
    out["back"] = bool(out) and all(out.values())
    return out


# -- the real run ---------------------------------------------------------------------------------
def job_config(seed: int, token_file: str) -> dict:
    config = soak.job_config(seed)
    config["name"] = "long-run"
    config["link"] = {"port": 0, "token_file": token_file}
    config["metrics"]["snapshot_every_s"] = 2.0
    config["console"] = {"enabled": False}
    # Every failure here is a kill of ours: a learner starved of CPU beside the restarts is not
    # to be declared hung (the soak's 3 s timeout tests that detection; this run does not).
    config["health"]["timeout_s"] = 30.0
    return config


def actor_pid(handle, timeout_s: float = 10.0) -> Optional[int]:
    """The pid of an actor's process (None while it is down or restarting)."""
    import ray

    try:
        return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout_s)
    except Exception:
        return None


def anon_bytes(pid: Optional[int]) -> Optional[int]:
    """The process's anonymous resident memory (``RssAnon`` in ``/proc/<pid>/status``: its
    heaps, not the shared libraries' pages that RSS also counts); None where it cannot be read.
    """
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def proc_figures(pid: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """(rss bytes, open fds) of a process; (None, None) once it is gone."""
    import psutil   # installed with ray[default]

    if pid is None:
        return None, None
    try:
        p = psutil.Process(pid)
        return p.memory_info().rss, p.num_fds()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None, None


PEER_CONNECTIONS_PER_PAIR = 2   # one each way: each process's Ray client to the other's server


def fds_and_peer_connections(pids: list[int]) -> dict[int, tuple[int, int]]:
    """For each live process of ``pids``: (its open fds, how many of its established TCP
    connections join it to another process of ``pids``), the connections listed before and
    after the count. A connection
    is a peer's only where the other process holds its exact other end (local and remote
    addresses swapped); at most ``PEER_CONNECTIONS_PER_PAIR`` per pair are counted, so sockets
    piling up between two processes still show as theirs. A process that is gone is left out.

    >>> import os
    >>> fds_and_peer_connections([os.getpid()])[os.getpid()][1]
    0
    """
    import collections

    import psutil

    def established(listing) -> set:
        return {(tuple(c.laddr), tuple(c.raddr)) for c in listing(kind="tcp")
                if c.status == psutil.CONN_ESTABLISHED and c.raddr}

    fds: dict[int, int] = {}
    conns: dict[int, set] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            listing = getattr(process, "net_connections", None) or process.connections
            # Listed before and after the fd count; only a connection in both is left out, so
            # one that opened or closed between the reads is not taken off a count without it.
            before = established(listing)
            fds[pid] = process.num_fds()
            conns[pid] = before & established(listing)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            fds.pop(pid, None)
    ends = {(laddr, raddr): pid for pid, listed in conns.items() for laddr, raddr in listed}
    out = {}
    for pid, listed in conns.items():
        per_peer = collections.Counter(
            other for laddr, raddr in listed
            if (other := ends.get((raddr, laddr))) not in (None, pid))
        out[pid] = (fds[pid], sum(min(n, PEER_CONNECTIONS_PER_PAIR) for n in per_peer.values()))
    return out


def net_fds(read: dict, learner_pids: list, service_pids: dict):
    """From ``fds_and_peer_connections``'s read: (each learner's fds less its connections to
    the listed processes, in ``learner_pids``' order; their whole counts; the same two per
    service role). A learner not in the read (gone before it) is left out, so the list comes
    out short (``fds_verdict`` checks its length); a role whose pid is None or not in the read
    is None.

    >>> net_fds({1: (50, 3), 2: (47, 1), 9: (60, 4)}, [1, 2, 3], {"controller": 9, "link": None})
    ([47, 46], [50, 47], {'controller': 56, 'link': None}, {'controller': 60, 'link': None})
    """
    learners, learners_raw = [], []
    for pid in learner_pids:
        if pid in read:
            fds, peers = read[pid]
            learners_raw.append(fds)
            learners.append(fds - peers)
    by_role, by_role_raw = {}, {}
    for role, pid in service_pids.items():
        fds, peers = read.get(pid, (None, 0)) if pid is not None else (None, 0)
        by_role_raw[role] = fds
        by_role[role] = None if fds is None else fds - peers
    return learners, learners_raw, by_role, by_role_raw


def ray_node_pids() -> list[int]:
    """The pids of this node's own Ray processes (the GCS, the raylet, the monitor, the log
    monitor, the dashboard, and the raylet's agents), for a cluster this driver started. Ray
    names them in its node record (a private attribute, checked here: if Ray renames it, the
    run stops with this error rather than count them otherwise)."""
    import psutil
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    if not processes or "raylet" not in processes:
        raise RuntimeError("long_run: this Ray does not name its node processes "
                           "(ray._private.worker._global_node.all_processes)")
    from ray._private.ray_constants import AGENT_PROCESS_LIST

    live = [info.process for infos in processes.values() for info in infos
            if info.process.poll() is None]   # a dead one's pid may be reused
    pids = [process.pid for process in live]
    for raylet in processes["raylet"]:
        try:
            children = psutil.Process(raylet.process.pid).children()
        except psutil.Error:
            continue
        for child in children:   # the workers are the raylet's children too: only its agents
            try:
                title = child.cmdline()
            except psutil.Error:
                continue
            if title and title[0].split()[0] in AGENT_PROCESS_LIST:
                pids.append(child.pid)
    return pids


def job_fds(learner_pids: list, service_pids: dict, node_pids: Optional[list] = None):
    """``net_fds`` of the job's processes read now: the training learners, the service processes
    (``service_pids``: role -> pid or None) and this driver, listed last (its count read after
    the others'; the caller's Ray calls that found their pids connected it to them). A process's
    connections to the others listed (established, at most ``PEER_CONNECTIONS_PER_PAIR`` per
    pair) are left out of its count: Ray keeps one each way between two processes once either
    called the other, so which a process holds follows who is alive and who called whom (a
    restarted learner holds one with the peer it copied from; a restarted controller one with
    the restarted link server, which the first controller never had), not how many failures
    went before. ``node_pids``, the node's own Ray processes (``ray_node_pids``), are listed as
    peers too, not counted themselves: a promoted prestarted learner holds a connection to the
    raylet that a learner launched first does not. Connections to a process not listed (a
    learner or spare still starting) or gone, and those past two per pair, still count, as do
    files, pipes and ``anon_inode``s."""
    services = {**service_pids, "driver": os.getpid()}
    listed = (list(learner_pids) + [pid for pid in (node_pids or []) if pid not in learner_pids]
              + [pid for pid in services.values() if pid is not None])
    return net_fds(fds_and_peer_connections(listed), learner_pids, services)


def complete(counts: dict) -> bool:
    """A read of every role's fds and of every learner training then.

    >>> complete({"fds": {"controller": 42, "learners": [39, 39]}, "learners_training": 2})
    True
    >>> complete({"fds": {"controller": None, "learners": [39, 39]}, "learners_training": 2})
    False
    """
    fds = counts.get("fds") or {}
    return (all(v is not None for k, v in fds.items() if k != "learners")
            and len(fds.get("learners") or []) == counts.get("learners_training"))


def live_actor_count() -> int:
    """Actors Ray holds ALIVE in this cluster (its GCS table)."""
    from ray._private import state

    table = state.actors()
    return sum(1 for a in table.values() if a.get("State") == "ALIVE")


class Chaos:
    """The driver's side of the run: kills, samples, and the counts at start and end."""

    def __init__(self, args, run_dir: str):
        self.args, self.run_dir = args, run_dir
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self.stop, self.done = threading.Event(), threading.Event()
        self.failures = 0
        self.samples: dict[str, list] = {"controller": [], "syncer": []}
        self.anon_samples: dict[str, list] = {"controller": [], "syncer": []}   # RssAnon
        # Open fds over the run (failures so far, fds): a leak grows with failures, a process
        # of another kind (a promoted spare) is an offset.
        self.fd_samples: dict[str, list] = {"driver": [], "controller": [], "syncer": []}
        # (failures so far, each learner's fds), read while every learner trains.
        self.learner_fd_samples: list = []
        # The service processes' pids as last read: the controller's and the syncer's by
        # ``sample`` (every second), the link server's by ``record_link_pid`` (every 10 s and
        # before each service kill); ``sample_learner_fds`` reads them.
        self.current_pids: dict = {"controller": None, "syncer": None, "link": None}
        self.log: list = []
        self.start_counts: dict = {}
        self.end_counts: dict = {}
        self.end_passes = 0   # end reads back in a row (two are needed)
        self.pids_seen: set[tuple] = set()   # (pid, its start time): a pid may be reused
        self.progress: list = []
        self.error: Optional[str] = None
        self._offset = 0
        self.t0 = time.time()

    # -- reading the job -------------------------------------------------------------------------
    def count_failures(self) -> int:
        with open(self.events_path) as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith("\n"):
                    break
                self._offset += len(line.encode())
                if '"learner_failed"' in line and json.loads(line)["event"] == "learner_failed":
                    self.failures += 1
        return self.failures

    def snapshot(self, controller) -> Optional[dict]:
        import ray

        try:
            return ray.get(controller.status_table.remote(), timeout=30)
        except Exception:
            return None

    @staticmethod
    def steady(status: Optional[dict]) -> bool:
        """Every learner training, no spare starting (no process start under way)."""
        return bool(status) and all(x["state"] == "training"
                                    for x in status["learners"].values()) and not any(
            s.get("state") == "starting" for s in (status.get("spares") or {}).values())

    def handles(self):
        import ray

        out = {}
        for role, name in (("syncer", "islands:syncer"), ("link", "islands:link")):
            try:
                out[role] = ray.get_actor(name, namespace="islands")
            except Exception:
                out[role] = None
        return out

    def service_pids(self, controller, timeout_s: float = 10.0) -> dict:
        """The pid of each service process now: the controller, the syncer, the link server
        (None where one is down)."""
        handles = {"controller": controller, **self.handles()}
        return {role: (actor_pid(h, timeout_s) if h is not None else None)
                for role, h in handles.items()}

    def training_learner_pids(self, status: dict) -> list[int]:
        """The pids of the learners training in ``status`` (sorted by learner) that answer."""
        import ray

        pids = []
        for name, x in sorted(status["learners"].items()):
            if x["state"] != "training":
                continue
            try:
                pid = actor_pid(ray.get_actor(x["actor"], namespace="islands"))
            except Exception:
                pid = None
            if pid:
                self.seen(pid)
                pids.append(pid)
        return pids

    def counts(self, controller, status: dict) -> dict:
        """Open fds per process role and live actors, read now (``job_fds``), with the whole
        counts beside (``fds_raw``). The driver's count is read after the Ray calls that find
        the other processes' pids, each of which connects it to that process."""
        import psutil
        import ray

        driver_before_reads = psutil.Process().num_fds()
        pids = self.service_pids(controller)
        for pid in pids.values():
            if pid:
                self.seen(pid)
        learner_pids = self.training_learner_pids(status)
        learners, learners_raw, services, services_raw = job_fds(learner_pids, pids,
                                                                 ray_node_pids())
        fds = {**services, "learners": learners}
        raw = {**services_raw, "learners": learners_raw}
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        total = sum(v or 0 for k, v in raw.items() if k != "learners") + sum(learners_raw)
        return {"fds": fds, "fds_raw": raw, "fds_total_raw": total,
                "learners_training": sum(x["state"] == "training"
                                         for x in status["learners"].values()),
                "driver_fds_before_reads": driver_before_reads,
                "live_actors": live_actor_count(), "named_actors": len(named)}

    def wait_steady(self, controller, timeout_s: float, hold_s: float = 5.0) -> Optional[dict]:
        """The status once the job has been steady for ``hold_s`` (None at the timeout)."""
        deadline, since = time.time() + timeout_s, None
        while time.time() < deadline and not self.stop.is_set():
            status = self.snapshot(controller)
            if self.steady(status):
                since = since or time.time()
                if time.time() - since >= hold_s:
                    return status
            else:
                since = None
            time.sleep(0.5)
        return None

    def record_link_pid(self, handles: dict) -> None:
        """The link server's pid now (kept, as every process of the job seen, for the check
        that nothing is left after the job)."""
        link = handles.get("link")
        self.current_pids["link"] = actor_pid(link, 1.0) if link is not None else None
        if self.current_pids["link"]:
            self.seen(self.current_pids["link"])

    def sample_learner_fds(self, status: dict) -> None:
        """Each training learner's fds now, counted as at the start and the end, kept only when
        read in full: every service process found and still there (a learner's connections to
        one left out would count it high) and every learner read. The pids are the last read
        (``current_pids``); one that is gone since comes out None and the sample is dropped."""
        pids = dict(self.current_pids)
        if any(pid is None for pid in pids.values()):
            return
        learner_pids = self.training_learner_pids(status)
        if len(learner_pids) != len(status["learners"]):
            return
        learners, _, roles, _ = job_fds(learner_pids, pids, ray_node_pids())
        if len(learners) == len(learner_pids) and all(v is not None for v in roles.values()):
            self.learner_fd_samples.append((self.failures, learners))

    def learner_window_max(self) -> Optional[int]:
        """The most fds any learner held in the samples of the first window of failures."""
        window = window_size(max(self.failures, 1))
        rows = [max(fds) for n, fds in self.learner_fd_samples if n < window and fds]
        return max(rows) if rows else None

    def seen(self, pid: int) -> None:
        import psutil

        try:
            self.pids_seen.add((pid, psutil.Process(pid).create_time()))
        except psutil.NoSuchProcess:
            pass

    def sample(self, controller, handles: dict) -> None:
        """RSS of the controller and the syncer now; a syncer handle that no longer answers
        (killed, its successor not named yet) is looked up again."""
        for role in ("controller", "syncer"):
            handle = controller if role == "controller" else handles.get("syncer")
            pid = actor_pid(handle, 5.0) if handle is not None else None
            self.current_pids[role] = pid
            if pid is None and role == "syncer":
                handles.update(self.handles())
                continue
            rss, fds = proc_figures(pid)
            if rss is not None:
                self.samples[role].append((self.failures, rss, pid))
                anon = anon_bytes(pid)
                if anon is not None:
                    self.anon_samples[role].append((self.failures, anon, pid))
                self.fd_samples[role].append((self.failures, fds, pid))
                self.seen(pid)
        import psutil

        self.fd_samples["driver"].append((self.failures, psutil.Process().num_fds(), os.getpid()))

    # -- the chaos thread ------------------------------------------------------------------------
    def run(self, controller) -> None:
        try:
            self._run(controller)
        except Exception as exc:   # reported in the result, never a hang
            self.error = repr(exc)[:500]
        finally:
            self.done.set()

    def _run(self, controller) -> None:
        import ray

        args = self.args
        status = self.wait_steady(controller, 600)
        if status is None:
            raise RuntimeError("the job never trained steadily before the first kill")
        for _ in range(5):   # the start read in full: every learner and service read
            self.start_counts = self.counts(controller, status)
            if complete(self.start_counts):
                break
            status = self.wait_steady(controller, 120) or status
        else:
            raise RuntimeError(f"the start read was not complete: {self.start_counts}")
        print(f"long_run: start {json.dumps(self.start_counts)}", flush=True)
        deadline = self.t0 + args.max_minutes * 60 - args.reserve_s
        gap = args.gap_s if args.gap_s is not None else max(
            0.0, (deadline - time.time()) / args.failures)
        plan = service_kill_plan(args.failures, *args.service_kills)
        trained_since: dict = {}
        handles = self.handles()
        next_kill = next_sample = next_print = next_learner_fds = 0.0
        mode = 0
        while (self.count_failures() < args.failures and time.time() < deadline
               and not self.stop.is_set()):
            now = time.time()
            if now >= next_sample:
                self.sample(controller, handles)
                next_sample = now + 1.0
            while plan and self.failures >= plan[0][0]:
                _, kind = plan.pop(0)
                self.record_link_pid(handles)   # its process, before a kill, for the leak check
                try:
                    if kind == "controller":
                        ray.kill(controller, no_restart=False)
                    elif kind == "syncer":
                        ray.kill(ray.get_actor("islands:syncer", namespace="islands"))
                    else:
                        ray.kill(ray.get_actor("islands:link", namespace="islands"),
                                 no_restart=False)
                    self.log.append((f"{kind}_kill", self.failures))
                    print(f"long_run: {kind} killed at failure {self.failures}", flush=True)
                except Exception as exc:
                    self.log.append(("moot", f"{kind}: {str(exc)[:80]}"))
                handles = self.handles()
            status = self.snapshot(controller)
            if status is None:
                time.sleep(0.5)
                continue
            training = {}
            for name, x in status["learners"].items():
                if x["state"] == "training":
                    key = (name, x["incarnation"])
                    trained_since.setdefault(key, now)
                    training[name] = now - trained_since[key]
            if now >= next_learner_fds:
                # Every 10 s: the link server's and the training learners' processes kept for
                # the check that nothing is left after the job; their fds at a steady moment.
                self.record_link_pid(handles)
                if self.steady(status):
                    try:   # a sample is optional: one that fails is dropped, the run goes on
                        self.sample_learner_fds(status)
                    except Exception as exc:
                        self.log.append(("moot", f"learner fds: {str(exc)[:80]}"))
                else:
                    self.training_learner_pids(status)
                next_learner_fds = now + 10.0
            if training and now >= next_kill:
                victim = max(training, key=training.get)
                how = ("ray_kill", "exit")[mode % 2]
                try:   # the victim's process, kept for the check that nothing is left
                    pid = actor_pid(ray.get_actor(status["learners"][victim]["actor"],
                                                  namespace="islands"), 2.0)
                    if pid:
                        self.seen(pid)
                except Exception:
                    pass
                try:
                    ray.get(controller.chaos_kill.remote(victim, how), timeout=60)
                    mode += 1
                    self.log.append((how, victim))
                except Exception as exc:
                    self.log.append(("moot", f"{victim}: {str(exc)[:80]}"))
                next_kill = time.time() + gap
            if now >= next_print:
                elapsed = now - self.t0
                rss = {r: (s[-1][1] / 2 ** 20 if s else None) for r, s in self.samples.items()}
                line = (f"long_run: {elapsed:7.0f}s  failures {self.failures}/{args.failures}  "
                        f"training {len(training)}/{len(status['learners'])}  rss MiB "
                        f"controller {rss['controller'] or 0:.0f} syncer {rss['syncer'] or 0:.0f}")
                print(line, flush=True)
                self.progress.append((elapsed, self.failures))
                next_print = now + args.progress_s
            time.sleep(0.2)
        # The end: every learner back, nothing starting; then the same counts again.
        self.sample(controller, handles)
        status = self.wait_steady(controller, args.settle_s)
        if status is None:
            self.end_counts = {"error": f"not steady within {args.settle_s:.0f}s"}
        else:
            # A count above the start may be a process, or a connection to one, that is still
            # closing (Ray drops its clients of dead workers lazily): read again, for a minute.
            # Back means back on two reads in a row, not on one lucky low reading; every read
            # is checked, the last one too.
            passed = 0
            for attempt in range(31):
                if self.stop.is_set():
                    self.end_counts = {"error": "the job ended during the end reads"}
                    break
                if attempt:
                    time.sleep(2.0)
                    status = self.wait_steady(controller, 30.0, hold_s=1.0)
                    if status is None:   # read only with every learner training
                        passed = 0
                        continue
                self.end_counts = self.counts(controller, status)
                if (self.end_counts["live_actors"] == self.start_counts["live_actors"]
                        and fds_verdict(self.start_counts["fds"], self.end_counts["fds"],
                                        self.learner_window_max(),
                                        self.start_counts["learners_training"])["back"]):
                    passed += 1
                    if passed == 2:
                        break
                else:
                    passed = 0
            self.end_passes = passed
        print(f"long_run: end {json.dumps(self.end_counts)}", flush=True)


def plot(samples: dict, kills: list, out_dir: str, name: str, window: int, failures: int) -> str:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for role, color in (("controller", "tab:blue"), ("syncer", "tab:orange")):
        rows = samples[role]
        ax.plot([n for n, _, _ in rows], [r / 2 ** 20 for _, r, _ in rows], ".", ms=2,
                color=color, label=f"{role} RSS")
    for kind, at in kills:
        if isinstance(at, int):
            ax.axvline(at, color={"syncer_kill": "k", "controller_kill": "tab:purple"}.get(
                kind, "tab:green"), lw=0.8, ls="--")
    ax.axvspan(0, window, color="0.9"), ax.axvspan(failures - window, failures, color="0.9")
    ax.set_xlabel("learner failures so far"), ax.set_ylabel("resident memory (MiB)")
    ax.set_title("long run: memory over failures (dashed: syncer black, controller purple, "
                 "link green; grey: the windows compared)", fontsize=8)
    ax.legend()
    return C.save_figure(fig, out_dir, name)


def run_real(args) -> dict:
    import ray

    from islands.orchestrator.config import parse
    from islands.orchestrator.job import run_job

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    tmp = tempfile.mkdtemp(prefix="islands-long-run-")
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write("long-run-token\n")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             resources={f"region:{r}": n for r, n in soak.REGIONS.items()},
             _node_ip_address="127.0.0.1", namespace="islands")
    run_dir = os.path.join(tmp, "run")
    os.makedirs(run_dir)
    chaos = Chaos(args, run_dir)

    def on_started(controller):
        chaos.t0 = time.time()
        threading.Thread(target=chaos.run, args=(controller,), daemon=True).start()

    try:
        summary = run_job(parse(job_config(args.seed, token)), duration_s=args.max_minutes * 60,
                          run_dir=run_dir, quiet=True, on_started=on_started,
                          until=lambda snap: chaos.done.is_set())
    finally:
        chaos.stop.set()
        # Its reads end at the stop: judge none it is still making (one read can take minutes
        # while Ray restarts the actors it calls).
        chaos_finished = chaos.done.wait(300)
    alive = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("islands:")]
    # Read while the cluster still runs: ``ray.shutdown`` of a cluster this driver started
    # kills every worker with the raylet, so read after it this would show Ray's teardown.
    left = leaked_pids(chaos.pids_seen, timeout_s=60.0)
    ray.shutdown()
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    monotonic, lost = soak.versions_check(run_dir, events)
    failures = sum(e["event"] == "learner_failed" for e in events)
    window = window_size(failures)
    memory = {role: memory_windows([(n, r) for n, r, _ in s], failures, window)
              for role, s in chaos.samples.items()}
    memory_since = {role: since_restart(s, failures, window)
                    for role, s in chaos.samples.items()}
    # The same windows on anonymous memory alone (reported beside RSS, not in the verdict):
    # what grows with failures shows there undiluted by the libraries' pages.
    anon_since = {role: since_restart(s, failures, window)
                  for role, s in chaos.anon_samples.items()}
    books = books_check(summary)
    start, end = chaos.start_counts, chaos.end_counts
    fds_check = (fds_verdict(start["fds"], end["fds"], chaos.learner_window_max(),
                             start["learners_training"])
                 if start and end.get("fds") else {"back": False})
    # Both back on the last two end reads in a row, not on one, and those reads finished.
    fds_back = fds_check["back"] and chaos.end_passes >= 2 and chaos_finished
    actors_back = bool(start and "live_actors" in end) and (
        end["live_actors"] == start["live_actors"]) and chaos.end_passes >= 2 and chaos_finished
    kinds = [k for k, _ in chaos.log]
    result = {
        "benchmark": "long_run", "driver": "ray", "quick": bool(args.quick), "seed": args.seed,
        "target_failures": args.failures, "max_minutes": args.max_minutes,
        "learner_failures": failures,
        "failure_causes": {c: sum(e["event"] == "learner_failed" and e.get("cause") == c
                                  for e in events) for c in ("crash", "hang", "preemption")},
        "faults_fired": {k: kinds.count(k) for k in sorted(set(kinds))},
        "syncer_kills": summary.get("syncer_restarts", 0),
        "controller_kills": sum(e["event"] == "controller_restarted" for e in events),
        "link_server_kills": sum(e["event"] == "link_server_restarted" for e in events),
        "books_balanced": books["balanced"], "books": books,
        "fragment_tokens": summary.get("fragment_tokens"),
        "tokens_dropped_by": summary.get("tokens_dropped_by"),
        "versions_monotonic": monotonic, "merged_versions_lost": lost,
        "nothing_lost": bool(summary.get("tokens_in_flight") == 0 and lost == 0),
        "memory_window_failures": window,
        "controller_rss_mib_first": _mib(memory["controller"]["first"]),
        "controller_rss_mib_last": _mib(memory["controller"]["last"]),
        "controller_rss_ratio": memory["controller"]["ratio"],
        "syncer_rss_mib_first": _mib(memory["syncer"]["first"]),
        "syncer_rss_mib_last": _mib(memory["syncer"]["last"]),
        "syncer_rss_ratio": memory["syncer"]["ratio"],
        # The bar, per actor: its process of the run's end, over its last W failures against
        # its first W (each service kill restarts one, and a new process starts smaller than
        # the first controller, which built the model: across a restart the role's figures
        # above compare two processes).
        "memory_within_10pct": bool(memory_since["controller"]["within"]
                                    and memory_since["syncer"]["within"]),
        "controller_rss_ratio_since_restart": memory_since["controller"]["ratio"],
        "syncer_rss_ratio_since_restart": memory_since["syncer"]["ratio"],
        "memory": memory, "memory_since_last_restart": memory_since,
        "anon_memory_since_last_restart": anon_since,
        # The verdict's counts: each process's fds less its connections to the job's other
        # live processes (``job_fds``); then the whole counts, and their sum.
        "fds_start": start.get("fds"), "fds_end": end.get("fds"),
        "fds_raw_start": start.get("fds_raw"), "fds_raw_end": end.get("fds_raw"),
        "learners_training_at_end": end.get("learners_training"),
        "driver_fds_before_reads": {"start": start.get("driver_fds_before_reads"),
                                    "end": end.get("driver_fds_before_reads")},
        "fds_total_raw_start": start.get("fds_total_raw"),
        "fds_total_raw_end": end.get("fds_total_raw"),
        "fds_back": fds_back, "fds_check": fds_check,
        "learner_fds_window_max": chaos.learner_window_max(),
        "learner_fd_samples_first_window": sum(n < window for n, _ in chaos.learner_fd_samples),
        "end_reads_back_in_a_row": chaos.end_passes,
        "learner_fds_over_failures": {
            "first": max([max(f) for n, f in chaos.learner_fd_samples if n < window and f],
                         default=None),
            "last": max([max(f) for n, f in chaos.learner_fd_samples
                         if n >= failures - window and f], default=None)},
        # Median open fds (whole counts) over the first and the last W failures, per role.
        "fds_over_failures": {role: {k: v for k, v in memory_windows(
                                         [(n, v) for n, v, _ in rows], failures, window).items()
                                     if k in ("first", "last")}
                              for role, rows in chaos.fd_samples.items()},
        # The same for each role's last process, from its own first failure (reported, not
        # judged: a restarted service starts lower than the first, whose start count the
        # verdict reads).
        "fds_since_last_restart": {role: {k: v for k, v in since_restart(
                                              rows, failures, window).items()
                                          if k in ("first", "last", "pid", "from_failure")}
                                   for role, rows in chaos.fd_samples.items()},
        "live_actors_start": start.get("live_actors"), "live_actors_end": end.get("live_actors"),
        "actors_back": actors_back,
        "leaked_actors": len(alive), "leaked_processes": len(left), "leaked": alive + left,
        "initial_eval_loss": summary.get("initial_eval_loss"),
        "final_eval_loss": summary.get("final_eval_loss"),
        "merges": summary.get("merges"), "goodput": summary.get("goodput"),
        "chaos_error": chaos.error, "chaos_finished": chaos_finished, "run_dir": run_dir,
        # Every sample, for a second look: [failures so far, bytes or fds, pid].
        "samples": {"rss": chaos.samples, "fds": chaos.fd_samples,
                    "learner_fds": chaos.learner_fd_samples},
    }
    result["met"] = bool(failures >= args.failures and books["balanced"] and monotonic
                         and result["nothing_lost"] and result["memory_within_10pct"]
                         and fds_back and actors_back and not alive and not left)
    stem = "long_run_quick" if args.quick else "long_run"
    kills = [(k, at) for k, at in chaos.log if k.endswith("_kill")]
    result["png"] = plot(chaos.samples, kills, args.out, stem + ".png", window, failures)
    return result


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x / 2 ** 20, 2)


def leaked_pids(pids: set, timeout_s: float = 30.0) -> list[str]:
    """The job's processes seen during the run (``(pid, start time)``) still alive after it
    ended; a killed actor's process is given ``timeout_s`` to exit (there is no event to wait
    on)."""
    import psutil

    def alive(pid: int, created: float) -> bool:
        try:
            p = psutil.Process(pid)
            return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + timeout_s
    while True:
        left = sorted(pid for pid, created in pids if alive(pid, created))
        if not left or time.time() > deadline:
            return [f"pid {p}" for p in left]
        time.sleep(0.5)


# -- the in-process driver ------------------------------------------------------------------------
def inprocess_plan(horizon_s: float, seed: int, mtbf_s: float, syncer_kills: int):
    from islands.orchestrator import chaos

    by_region = {r: [f"{r}:{i}" for i in range(n)] for r, n in soak.REGIONS.items()}
    kills = chaos.poisson_plan(by_region, horizon_s, seed=seed, mtbf_s=mtbf_s, repair_s=0.0,
                               region_mtbf_s=8 * mtbf_s)
    exits = chaos.poisson_plan(by_region, horizon_s, seed=seed + 1, mtbf_s=2 * mtbf_s,
                               repair_s=0.0, kill_mode="exit")
    plan = chaos.FaultPlan(list(kills) + list(exits))
    for k in range(syncer_kills):
        plan.kill_syncer(horizon_s * (k + 0.5) / syncer_kills)
    return plan.sorted()


def planned_losses(plan) -> int:
    """Learner losses a plan holds: one per kill or exit, a region's learners per region loss."""
    per = {"kill": 1, "exit": 1, "region_loss": max(soak.REGIONS.values())}
    return max(1, sum(per.get(f.kind.value, 0) for f in plan.faults))


def run_inprocess(args) -> dict:
    from islands.orchestrator import inprocess
    from islands.orchestrator.chaos import RestartCosts

    ids = [f"{r}:{i}" for r, n in soak.REGIONS.items() for i in range(n)]
    step_s, restart_s, mtbf = 1.0, 2.0, args.mtbf or 12.0
    # Kills at mtbf, exits at 2 × mtbf, region losses at 8 × mtbf, each learner down restart_s
    # after each: the rate per learner is about 1 / (mtbf / 1.6 + restart_s).
    rate = len(ids) / (mtbf / (1 + 0.5 + 0.125) + restart_s)
    horizon = args.horizon or float(np.ceil(args.failures / rate))
    plan = inprocess_plan(horizon, args.seed, mtbf, args.syncer_kills_inprocess)
    if not args.horizon:   # scaled to the learner losses the plan holds, with 5 % to spare
        horizon = float(np.ceil(horizon * 1.05 * args.failures / planned_losses(plan)))
        plan = inprocess_plan(horizon, args.seed, mtbf, args.syncer_kills_inprocess)
    print(f"long_run: in-process, {len(ids)} learners, {horizon:.0f} virtual s, "
          f"{len(plan.faults)} faults planned", flush=True)
    setup = C.make_setup(model_kwargs=soak.TINY, num_learners=len(ids), batch_size=4,
                         total_steps=int(horizon / step_s), max_bytes=300_000, seed=args.seed)
    fleet = inprocess.Fleet([1.0] * len(ids), step_time_s=step_s, latency_s=0.001,
                            regions=[i.split(":")[0] for i in ids], seed=args.seed)
    t = time.time()
    cpu = time.process_time()
    record = C.run_ours(setup, learner_ids=ids, fleet=fleet, num_fragments=2,
                        sync_every_steps=4, overlap_steps=1, until_s=horizon, faults=plan,
                        restart=RestartCosts(detect_lost_s=0.0, restart_s=restart_s,
                                             syncer_restart_s=2.0, seed=args.seed))
    wall, cpu = time.time() - t, time.process_time() - cpu
    failed = [tr for _, tr in record.transitions if tr.name == "learner_failed"]
    ledgers = list(record.ledger.values())
    terms = {k: sum(x["fragment_tokens"][k] for x in ledgers)
             for k in ("processed", "applied", "dropped", "in_flight")}
    balanced = all(x["balanced"] for x in ledgers) and (
        terms["applied"] + terms["dropped"] + terms["in_flight"] == terms["processed"]) and min(
        terms.values()) >= 0
    monotonic, lost = versions_monotonic((m.fragment, m.version) for m in record.merges
                                         if not m.refused)
    return {
        "benchmark": "long_run", "driver": "inprocess", "seed": args.seed,
        "target_failures": args.failures, "horizon_virtual_s": horizon,
        "learner_failures": len(failed),
        "faults_fired": len(record.faults_fired), "faults_skipped": len(record.faults_skipped),
        "syncer_kills": sum(f.kind.value == "syncer_kill" for f in record.faults_fired),
        "restarts": len(record.restarts),
        "books_balanced": bool(balanced), "fragment_tokens": terms,
        "versions_monotonic": monotonic, "merged_versions_lost": lost,
        # In flight at the horizon: pushes that exist (the Ray service's stop settles them).
        "nothing_lost": bool(balanced and lost == 0),
        "merges": len(record.merges), "goodput": record.goodput,
        "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
        "failures_per_cpu_s": round(len(failed) / cpu, 2) if cpu > 0 else None,
        "met": bool(len(failed) >= args.failures and balanced and monotonic),
    }


def main(argv=None) -> dict:
    p = C.parser(__doc__)
    p.add_argument("--driver", choices=("ray", "inprocess"), default="ray")
    p.add_argument("--failures", type=int, default=None,
                   help="learner failures to reach (default 2,000; 60 with --quick; 10,000 "
                        "with --driver inprocess)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="the time cap of the real run (default 60; 15 with --quick)")
    p.add_argument("--gap-s", type=float, default=None,
                   help="least seconds between learner kills (default: the failures spread "
                        "over the cap less --reserve-s; 1 with --quick)")
    p.add_argument("--reserve-s", type=float, default=240.0,
                   help="seconds of the cap kept for the start and the settled end")
    p.add_argument("--settle-s", type=float, default=300.0,
                   help="how long the end waits for every learner to train again")
    p.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines")
    p.add_argument("--service-kills", type=int, nargs=3, default=None,
                   metavar=("SYNCER", "CONTROLLER", "LINK"),
                   help="kills of each (default 10 3 3; 2 1 1 with --quick)")
    p.add_argument("--mtbf", type=float, default=None,
                   help="in-process: per-learner MTBF of kills, virtual s (default 12)")
    p.add_argument("--horizon", type=float, default=None,
                   help="in-process: virtual seconds (default: enough for --failures)")
    p.add_argument("--syncer-kills-inprocess", type=int, default=20)
    args = p.parse_args(argv)
    if args.driver == "inprocess":
        args.failures = args.failures or (200 if args.quick else 10_000)
        result = run_inprocess(args)
        name = "long_run_inprocess" + ("_quick" if args.quick else "")
    else:
        args.failures = args.failures or (60 if args.quick else 2000)
        args.max_minutes = args.max_minutes or (15.0 if args.quick else 60.0)
        if args.gap_s is None and args.quick:
            args.gap_s = 1.0
        args.service_kills = args.service_kills or ([2, 1, 1] if args.quick else [10, 3, 3])
        if args.failures < 1:
            raise SystemExit(f"--failures must be >= 1, got {args.failures}")
        watch = C.Stopwatch()
        result = run_real(args)
        result["wall_s"] = watch()
        name = "long_run_quick" if args.quick else "long_run"
    result["machine"] = C.machine()
    flat = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
    print(C.table([flat], list(flat)))
    C.finish(name, result, args.out)
    return result


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
