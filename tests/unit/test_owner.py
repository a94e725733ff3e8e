"""The fleet's one owner (orchestrator/owner.py), without Ray and without a controller: its
handlers carried out on the in-process driver's real groups, its books settled once, its saved
state read back; the region agent's forwarded methods are the controller's; and no module reads
another class's private fields."""

import ast
import dataclasses
import json
import pathlib

import pytest

from islands.orchestrator import fleet as F
from islands.orchestrator import groups_api as api
from islands.orchestrator.books import Books
from islands.orchestrator.chaos import FaultPlan
from islands.orchestrator.controller import Controller
from islands.orchestrator.groups_api import Incarnation, SyncerStatus
from islands.orchestrator.health import Cause, RestartPolicy
from islands.orchestrator.logs import RECOVERIES_KEPT
from islands.orchestrator.owner import Owner
from islands.orchestrator.region_agent import FORWARDED, RegionController

from test_seam import driver   # a virtual fleet of three learners on a tiny model


# -- the handlers on the in-process driver's groups ------------------------------------------------
def started(**kwargs):
    d = driver(**kwargs)
    d.begin()
    d.advance(2.5)
    return d


def test_the_driver_holds_an_owner_on_its_groups_and_the_owner_knows_every_incarnation():
    d = started()
    assert d.owner.learners is d.groups and d.owner.syncers is d.shards
    assert isinstance(d.groups, api.LearnerGroup) and isinstance(d.shards, api.SyncerGroup)
    assert {name: inc.number for name, inc in d.owner.running.items()} == {
        "r:0": 0, "r:1": 0, "r:2": 0}


def test_drain_pause_and_hang_are_named_operations_on_the_virtual_learners():
    d = started()
    d.owner.do_drainlearner(F.DrainLearner("r:1"))
    assert 1 in d.machine.draining
    d.owner.do_pauselearner(F.PauseLearner("r:2", True))
    assert d.paused[2]
    d.owner.do_pauselearner(F.PauseLearner("r:2", False))
    assert not d.paused[2]
    d.owner.do_hang(F.Hang("r:0", 30.0))
    assert not d.up[0] and d.machine.cause_of[0] == "hang"
    # a hang ends the incarnation now: its books are settled at once
    assert d.owner.closed["r:0"]["settled"] == 0


def test_faults_are_windows_in_process_and_a_kill_takes_its_fault_from_the_action():
    d = started()
    slow = FaultPlan().slow("r:1", at_s=2.5, duration_s=2.0, factor=3.0).faults[0]
    d.owner.do_slowdown(F.Slowdown(("r:1",), slow))
    assert d.windows.slowdown("r:1", "r", 3.0) == 3.0
    kill = FaultPlan().crash("r:2", at_s=2.5, mode="exit").faults[0]
    d.owner.do_kill(F.Kill("r:2", 0, "exit", fault=kill))
    assert not d.up[2] and d.machine.cause_of[2] == "exit"
    assert "r:2" in d.owner.running   # not buried: its end is seen after detection
    d.owner.do_kill(F.Kill("r:1", 0, "bury", reason="quarantine"))
    assert not d.up[1] and "r:1" not in d.owner.running   # buried: closed at once
    assert d.owner.closed["r:1"]["settled"] == 0


def test_a_restart_remote_is_refused_for_a_region_that_is_not_remote():
    d = started()
    with pytest.raises(RuntimeError, match=r"RestartRemote\(r:0, incarnation 1\)"):
        d.owner.do_restartremote(F.RestartRemote("r:0", "r", 1, "hang"))


def test_a_syncer_kill_and_restart_go_through_the_owner_and_count_once():
    d = started()
    fault = FaultPlan().kill_syncer(at_s=2.5).faults[0]
    d.owner.do_killsyncer(F.KillSyncer(0, fault))
    assert d.machine.killed()
    d.owner.do_killsyncer(F.KillSyncer(0, fault))       # down already: skipped, with its fault
    assert d.record.faults_skipped == [(fault, "syncer is already down")]
    d.owner.do_startsyncer(F.StartSyncer(0, 1))
    assert d.owner.syncer_restarts == 1 and d.syncer.epoch == 1
    assert d.owner.shard_status[0].epoch == 1


# -- the books: settled once, from the newest copy ----------------------------------------------
class Syncers:
    """One syncer shard whose ledger says what a test puts there (statuses as a shard's)."""

    count = 1

    def __init__(self):
        self.ledger, self.forgotten = {}, []

    def forget(self, learner, incarnation, reason, timeout_s=10):
        self.forgotten.append((learner, incarnation, reason))

    def statuses(self, slowest_step_s, paused, timeout_s=10):
        return {0: SyncerStatus(ledger=dict(self.ledger))}


def owner_with(syncers) -> Owner:
    settings = F.FleetSettings({"a": F.RegionPlan(1, 1)}, 1, RestartPolicy())
    return Owner(settings, 1, None, syncers, None, clock=lambda: 0.0)


def test_a_killed_incarnations_books_are_closed_at_once_for_its_fault():
    """The virtual learner's last stats are its final beat; the owner settles from them and the
    syncer's ledger: what it held unmerged is dropped for the fault's kind, nothing in flight."""
    d = started()
    fault = FaultPlan().crash("r:2", at_s=2.5).faults[0]
    d.owner.do_kill(F.Kill("r:2", 0, "ray_kill", fault=fault))
    books = d.owner.books.learner_tokens("r:2", None).as_dict(2)
    assert books["processed"] > 0 and books["in_flight"] == 0
    assert books["applied"] + books["dropped"] == books["processed"]
    assert set(books["dropped_by"]) <= {"kill", "overlap"} and books["dropped_by"].get("kill")
    assert d.owner.closed["r:2"]["settled"] == 0
    d.owner.settle("r:2", 0, "crash")                     # once: a second reason changes nothing
    assert d.owner.books.learner_tokens("r:2", None).as_dict(2) == books


def test_settle_reads_the_incarnations_books_once_and_forget_unregisters_first():
    syncers = Syncers()
    owner = owner_with(syncers)
    owner.running["a:0"] = Incarnation(2, start_step=5)
    # no beat and no ledger entry: nothing to settle, but it is settled (once) all the same
    owner.do_forget(F.Forget("a:0", 2, "crash"))
    assert syncers.forgotten == [("a:0", 2, "crash")]
    assert owner.closed["a:0"]["settled"] == 2
    before = owner.books.to_json()
    owner.do_forget(F.Forget("a:0", 2, "crash"))        # again: the books do not move
    assert owner.books.to_json() == before


def test_a_remote_incarnation_is_closed_at_its_forget_and_a_local_one_at_its_runs_end():
    syncers = Syncers()
    owner = owner_with(syncers)
    owner.running["a:0"] = Incarnation(1, remote=True)
    owner.do_forget(F.Forget("a:0", 1, "hang"))
    assert "a:0" not in owner.running and owner.closed["a:0"]["beat"] == {"step": 0}


def test_a_remote_launch_takes_its_early_beat_and_drops_older_incarnations_waiting_beats():
    """A region's report can bring an incarnation's beat before the home records its launch:
    the beat waits, the launch takes it, and beats of older incarnations that never launched
    here are dropped with it (they waited for good)."""
    owner = owner_with(Syncers())
    early, stale = {"step": 7}, {"step": 3}
    owner.remote_beats.update({("a:0", 2): early, ("a:0", 1): stale, ("b:0", 1): stale})
    owner.record(F.Transition("learner_restarted", "a:0", {"remote": True, "incarnation": 2}),
                 0.0)
    assert owner.running["a:0"].number == 2 and owner.running["a:0"].beat is early
    assert owner.remote_beats == {("b:0", 1): stale}


# -- saved state ---------------------------------------------------------------------------------
def test_the_saved_state_reads_back_keeping_a_running_learner_and_relaunching_a_gone_one():
    d = started(M=3)
    for i in range(RECOVERIES_KEPT + 5):
        d.owner.recoveries.append({"total_s": float(i)})
    d.owner.shard_refusals_seen = [5]   # refusals already emitted as events
    backoff = F.SpareBackoff(failed=2, not_before_s=40.0, node="n1", on_node=2)
    d.owner.fleet = dataclasses.replace(d.owner.fleet, spare_backoff={"r": backoff})
    restart = {"learner": "far:0", "incarnation": 3, "cause": "hang"}
    d.owner.remote_restarts = {"far": [restart]}   # decided, not yet taken by the agent
    saved = json.loads(json.dumps(d.owner.save(2.5)))
    assert len(saved["recoveries"]["rows"]) == RECOVERIES_KEPT
    fresh = driver(M=3).owner
    fresh.refresh_syncer_status()
    observed = {"r:0": {"state": "training", "incarnation": 0, "start_step": 0},
                "r:1": {"state": "paused", "incarnation": 0, "start_step": 0},
                "r:2": None}
    paused = fresh.restore(saved, observed, 10.0, syncer_restarts_missed=2)
    assert paused == ["r:1"]
    states = {n: (x.state, x.incarnation) for n, x in fresh.fleet.slots.items()}
    assert states["r:0"] == (F.SlotState.TRAINING, 0)
    assert states["r:1"] == (F.SlotState.TRAINING, 0)   # the floor decides again
    assert states["r:2"][0] == F.SlotState.RESTARTING   # gone: relaunched
    assert sorted(fresh.running) == ["r:0", "r:1"]
    assert fresh.syncer_restarts == 2 and fresh.books.to_json() == d.owner.books.to_json()
    assert fresh.recoveries.newest(1) == [{"total_s": float(RECOVERIES_KEPT + 4)}]
    assert fresh.recoveries.total == RECOVERIES_KEPT + 5
    # The same shard (same epoch): its 5 refusals are not emitted again; a shard restarted
    # meanwhile counts its own from 0.
    assert (fresh.shard_refusals_seen, fresh.refusals_seen) == ([5], 5)
    assert fresh.fleet.spare_backoff == {"r": backoff}
    assert fresh.remote_restarts == {"far": [restart]}
    other = driver(M=3).owner
    other.refresh_syncer_status()
    other.restore(dict(saved, syncer_epochs=[1]), observed, 10.0)
    assert (other.shard_refusals_seen, other.refusals_seen) == ([0], 0)


def test_a_saved_remote_learner_stays_mirrored():
    settings = F.FleetSettings({"far": F.RegionPlan(1, 1, remote=True)}, 1, RestartPolicy())
    owner = Owner(settings, 1, None, Syncers(), None, clock=lambda: 0.0)
    row = {"learner": "far:0", "region": "far", "index": 0, "shard": 0, "speed_factor": 1.0,
           "state": "training", "incarnation": 3, "start_step": 9, "restarts": {"hang": 1}}
    saved = {"books": Books(1).to_json(), "closed": {}, "recoveries": [], "syncer_restarts": 0,
             "syncer_closed": {}, "slots": [row], "targets": {"far": 1},
             "next_index": {"far": 1}, "next_shard": 1}
    assert owner.restore(saved, {}, 5.0) == []
    slot = owner.fleet.slots["far:0"]
    assert (slot.remote, slot.state, slot.last_beat_s) == (True, F.SlotState.TRAINING, 5.0)
    assert owner.running["far:0"].remote and slot.restart_counts == {Cause.HANG: 1}


# -- the region agent answers as the controller does ------------------------------------------
def test_every_forwarded_name_is_a_public_method_of_the_controller():
    for name in FORWARDED:
        assert not name.startswith("_"), name
        assert callable(getattr(Controller, name, None)), f"Controller has no {name}"
        assert getattr(RegionController, name).__doc__ == getattr(Controller, name).__doc__
    assert len(set(FORWARDED)) == len(FORWARDED)


def test_the_controllers_operator_and_learner_facing_methods_are_forwarded():
    """A new public read or command on the controller must be forwarded too, or named here as
    the home's own (a remote region's report, serving what only the home serves)."""
    home_only = {"link_report", "build_task", "init_shards", "start_threads", "step"}
    public = {name for name, value in vars(Controller).items()
              if callable(value) and not name.startswith("_")}
    assert public - set(FORWARDED) - home_only == set()


# -- no module reads another class's private fields ------------------------------------------
PACKAGE = pathlib.Path(__file__).resolve().parents[2]
DIRS = ("islands_pkg", "orchestrator", "learners", "syncer", "link", "tasks")
# Private by their owner's convention only: namedtuple's and os's public API.
PUBLIC_UNDERSCORE = {"_replace", "_exit", "_asdict", "_fields", "_make"}
ALLOWED = {   # (file, expression): why it is allowed
    ("orchestrator/job.py", "actor._actor_id"): "Ray has no public actor-id accessor",
}


def outside_modules(tree: ast.Module) -> set:
    """Names a file binds to modules that are not this package's (ray, ssl, os ...): their
    internals are their own business, not one of our classes' fields."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.asname or a.name).split(".")[0] for a in node.names
                       if not a.name.startswith("islands"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (
                node.module or "").startswith("islands"):
            out.update(a.asname or a.name for a in node.names)
    return out


def root_name(node: ast.AST):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_private_reads(root: pathlib.Path = PACKAGE, dirs=DIRS) -> list:
    """``file:line: expression`` for every read or write of another object's private field
    (``x._name``, ``x`` not ``self``/``cls`` nor a module from outside this package) and every
    import of another module's private name (``from .m import _name``)."""
    out = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            if path.name.endswith("_pb2.py"):   # generated by protoc
                continue
            rel = str(path.relative_to(root))
            tree = ast.parse(path.read_text())
            outside = outside_modules(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.level > 0 or (
                        node.module or "").startswith("islands")):
                    out += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
                    continue
                if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                        and not node.attr.startswith("__")
                        and node.attr not in PUBLIC_UNDERSCORE):
                    continue
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if root_name(node) in outside:
                    continue
                if (rel, ast.unparse(node)) not in ALLOWED:
                    out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_reads_or_writes_another_objects_private_fields():
    assert foreign_private_reads() == []
    assert len(ALLOWED) <= 2   # the allow-list stays short


def test_the_private_field_walk_finds_one(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import os\nfrom .other import _helper, public\nfrom islands.x import _y\n"
        "x = controller._fleet\nself._ok = 1\nt = p._replace(a=1)\nos._exit\n"
        "actor._actor_id\n")
    found = foreign_private_reads(tmp_path, ("pkg",))
    assert found == ["pkg/m.py:2: import _helper", "pkg/m.py:3: import _y",
                     "pkg/m.py:4: controller._fleet", "pkg/m.py:8: actor._actor_id"]
