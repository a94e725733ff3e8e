"""What an operator command may end (orchestrator/safety.py), decided before it ends anything:
a region command ends only a gone join's leftovers; drain-node refuses the head node and a
region's last node without --force; a failing draining-node query is counted and logged once."""

import doctest
import logging
import threading

import pytest

from islands.orchestrator import cli, metrics, safety
from islands.orchestrator.console import ActionError, plan_action
from islands.orchestrator.groups import DrainQuery, draining_nodes
from islands.orchestrator.accelerators import learner_devices
from islands.orchestrator.safety import (HEAD_MARKER, DrainGuard, DrainRefused, NodeView, Plan,
                                         Seen, drain_refusal, plan_leftovers)

JOIN = {"region": "far", "job": "demo", "home": "h:7000", "pid": 4242, "host": "region-a",
        "ray_job_id": "02000000"}


def test_docstring_examples():
    result = doctest.testmod(safety, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- region leave / join --address ----------------------------------------------------------------
def test_a_home_job_is_refused_by_name_whatever_else_is_there():
    names = ("islands:controller", "islands:syncer", "islands:us-east:0", "islands:eu-west:1")
    for join in (None, JOIN):   # even a stale record of a join does not make them a region's
        plan = plan_leftovers(Seen(names, controller={"kind": "home", "job": "demo"},
                                   link={"kind": "unknown", "error": "no identity"}, join=join))
        assert plan.end == () and "the home job 'demo'" in plan.refusal


def test_a_live_join_is_refused_naming_its_region_job_and_process():
    names = ("islands:controller", "islands:syncer", "islands:far:0")
    agent = {"kind": "region", "job": "demo", "region": "far"}
    plan = plan_leftovers(Seen(names, controller=agent, link={"kind": "link", "region": "far"},
                               join=JOIN))
    assert plan.end == ()
    assert plan.refusal.startswith("the join of region 'far' into job 'demo' (pid 4242 on "
                                   "region-a) is still running"), plan.refusal
    # Before its agent exists (the link only, during its hello): alive all the same.
    plan = plan_leftovers(Seen(("islands:syncer",), link={"kind": "link", "region": "far"}))
    assert plan.end == () and "the join of region 'far' is still running" in plan.refusal


@pytest.mark.parametrize("seen, words", [
    (Seen(("islands:controller",), controller={"kind": "unknown", "error": "GetTimeoutError"}),
     "islands:controller is here but does not say whose it is (GetTimeoutError)"),
    (Seen(("islands:syncer", "islands:a:0"), link={"kind": "unknown", "error": "no identity"},
          join=JOIN), "islands:syncer is here and is not a region's link"),
    (Seen(("islands:a:0", "islands:syncer-1")),
     "no region join is recorded in this cluster, so its islands actors (islands:a:0, "
     "islands:syncer-1) are not known"),
])
def test_what_does_not_say_whose_it_is_is_refused(seen, words):
    plan = plan_leftovers(seen)
    assert plan.end == () and words in plan.refusal, plan.refusal


def test_a_gone_joins_learners_and_spares_end_and_nothing_else():
    names = ("islands:far:0", "islands:far:12", "islands:spare:far:3", "islands:faraway:0",
             "islands:spare:near:0", "islands:something")
    plan = plan_leftovers(Seen(names, join=JOIN))
    assert plan.refusal is None and plan.join == JOIN
    assert plan.end == ("islands:far:0", "islands:far:12", "islands:spare:far:3")
    assert plan.others == ("islands:faraway:0", "islands:something", "islands:spare:near:0")
    assert plan_leftovers(Seen((), join=JOIN)) == Plan(join=JOIN)
    assert plan_leftovers(Seen()) == Plan()


def test_region_leave_needs_an_address_and_never_guesses_one(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["region", "leave"]) == 2
    err = capsys.readouterr().err
    assert "--address" in err and "never guesses" in err


@pytest.mark.parametrize("broken", ["raises", "renamed"])
def test_a_failing_join_record_call_is_one_line_naming_it(monkeypatch, broken):
    """region leave/join reach the join record through Ray's private key-value calls; if a Ray
    upgrade changes them, the command must say so in one line, not die with a traceback."""
    from ray.experimental import internal_kv

    from islands.orchestrator import region_agent

    if broken == "raises":
        def boom(*args, **kwargs):
            raise TypeError("_internal_kv_get() got an unexpected keyword argument\n'namespace'")

        monkeypatch.setattr(internal_kv, "_internal_kv_get", boom)
        why = ("TypeError: _internal_kv_get() got an unexpected keyword argument 'namespace'")
    else:
        monkeypatch.delattr(internal_kv, "_internal_kv_get")
        why = "AttributeError: "
    with pytest.raises(region_agent.JoinRecordError) as caught:
        region_agent.read_join_record()
    message = str(caught.value)
    assert message.startswith("cannot reach the region join record in Ray's key-value store "
                              f"(ray.experimental.internal_kv._internal_kv_get: {why}"), message
    assert "\n" not in message
    assert isinstance(caught.value, RuntimeError)   # region leave's one-line refusal (exit 1)


# -- drain-node -------------------------------------------------------------------------------------
HEAD = NodeView("head", True, {HEAD_MARKER: 1.0, "CPU": 4, "region:a": 2})
B1, B2 = NodeView("b1", True, {"region:b": 1}), NodeView("b2", True, {"region:b": 1})
NODES = [HEAD, B1, B2]


def test_the_head_node_is_refused():
    assert "node head is the head node" in drain_refusal("head", NODES, ["a", "b"])


def test_the_last_node_a_region_can_run_on_is_refused():
    assert drain_refusal("b1", NODES, ["a", "b"]) is None   # b2 is left for region b
    for gone in (["b2"], []):   # b2 draining, or dead
        nodes = [HEAD, B1] + ([B2] if gone else [NodeView("b2", False, {"region:b": 1})])
        refusal = drain_refusal("b1", nodes, ["a", "b"], draining=gone)
        assert refusal == ("node b1 is the last node where region 'b''s learners can run "
                           "(region:b; the others are draining or gone)")


def test_a_node_of_no_region_of_the_job_or_unknown_is_not_refused():
    other = NodeView("c", True, {"region:c": 1})
    assert drain_refusal("c", NODES + [other], ["a", "b"]) is None   # c is no region of the job
    assert drain_refusal("nope", NODES, ["a", "b"]) is None   # Ray refuses it (no live node)


def test_a_node_of_a_region_is_refused_while_ray_cannot_say_which_nodes_are_draining():
    # Before: a failed query read as "nothing is draining", so b1 passed though b2 may be.
    refusal = drain_refusal("b1", NODES, ["a", "b"], draining=None,
                            unknown="AttributeError: no get_draining_nodes")
    assert refusal == ("Ray cannot say which nodes are draining (AttributeError: no "
                       "get_draining_nodes), so whether region 'b''s learners could run elsewhere "
                       "after node b1 is unknown")
    assert "head node" in drain_refusal("head", NODES, ["a", "b"], draining=None)
    other = NodeView("c", True, {"region:c": 1})   # no region of the job: nothing to judge
    assert drain_refusal("c", NODES + [other], ["a", "b"], draining=None) is None


def test_the_real_failing_query_refuses_through_the_guard_naming_why():
    query, asked = DrainQuery(), []

    def look():   # Ray is not started in this process: the private call fails
        return NODES, draining_nodes(query), query.last_error

    with pytest.raises(DrainRefused, match=r"^Ray cannot say which nodes are draining "
                       r"\(RaySystemError: .*\), so whether region 'b''s learners could run "
                       r"elsewhere after node b1 is unknown: not drained \(Ray cannot undo a "
                       r"drain\); force it with --force"):
        DrainGuard().drain("b1", look, ["a", "b"], lambda: asked.append("b1"))
    assert asked == []
    DrainGuard().drain("b1", look, ["a", "b"], lambda: asked.append("b1"), force=True)
    assert asked == ["b1"]


def _pairs(n, units=1):
    return [NodeView(f"p{i}", True, {"region:p": units}) for i in range(1, n + 1)]


def test_a_region_of_multi_host_learners_keeps_nodes_for_one_whole_learner():
    pairs = {"p": learner_devices("cpu", 1, 2)}   # hosts_per_learner: 2, one host per node
    nodes = [HEAD] + _pairs(3)
    assert drain_refusal("p1", nodes, ["a", "p"], units=pairs) is None   # p2, p3 left
    refusal = drain_refusal("p2", nodes, ["a", "p"], draining=["p1"], units=pairs)
    # Before: one node (p3) was left, so it passed, and no learner of 2 hosts could be placed.
    assert refusal == ("node p2 is one of the last nodes where a whole learner of region 'p' "
                       "can run: a learner spans 2 hosts (hosts_per_learner), and only 1 "
                       "node(s) not draining would be left")
    assert drain_refusal("p2", nodes, ["a", "p"], draining=["p1"]) is None   # one host: fine
    # Fewer nodes than hosts: Ray packs a unit's hosts (runtime.reserve_unit), so the units of
    # the region left decide.
    three = {"p": learner_devices("cpu", 1, 3)}
    assert "only 2 unit(s) of region:p" in drain_refusal("p1", _pairs(2, 2), ["p"], units=three)
    assert drain_refusal("p1", _pairs(2, 4), ["p"], units=three) is None
    # A TPU slice's hosts are always separate nodes.
    tpu = {"p": learner_devices("tpu", tpu_type="v5p", topology="2x2x2")}   # 2 hosts
    assert "only 1 node(s)" in drain_refusal("p1", _pairs(2, 4), ["p"], units=tpu)


def test_two_concurrent_drains_of_a_regions_last_two_nodes_leave_one():
    """The console and the CLI at once: before, both checks passed (neither node was draining
    yet) and both were drained."""
    guard, entered, release, drained = DrainGuard(), threading.Event(), threading.Event(), []
    looked = []

    def look():   # Ray's draining table has not caught up with either drain
        looked.append(threading.current_thread().name)
        return NODES, {}, None

    def slow_drain():   # the first drain is in Ray's hands
        entered.set()
        assert release.wait(10)
        drained.append("b1")

    first = threading.Thread(target=guard.drain, name="first",
                             args=("b1", look, ["a", "b"], slow_drain))
    first.start()
    assert entered.wait(10)
    outcome = {}

    def second_drain():
        try:
            guard.drain("b2", look, ["a", "b"], lambda: drained.append("b2"))
            outcome["second"] = "drained"
        except DrainRefused as exc:
            outcome["second"] = str(exc)

    second = threading.Thread(target=second_drain, name="second")
    second.start()
    second.join(0.5)   # it waits on the guard: it must not check while the first drains
    assert second.is_alive() and looked == ["first"]
    release.set()
    first.join(10)
    second.join(10)
    assert drained == ["b1"]
    assert outcome["second"].startswith("node b2 is the last node where region 'b''s learners "
                                        "can run"), outcome
    assert guard.requested == {"b1"}


def test_the_guard_counts_its_own_drains_before_ray_reports_them():
    guard, drained = DrainGuard(), []
    look = lambda: (NODES, {}, None)   # noqa: E731 - Ray's table lags behind
    guard.drain("b1", look, ["a", "b"], lambda: drained.append("b1"))
    with pytest.raises(DrainRefused, match="node b2 is the last node where region 'b'"):
        guard.drain("b2", look, ["a", "b"], lambda: drained.append("b2"))

    def refused_by_ray():
        raise ValueError("Ray refused to drain node b2")

    # A drain Ray refused is not counted as draining.
    other = DrainGuard()
    with pytest.raises(ValueError, match="Ray refused"):
        other.drain("b2", look, ["a", "b"], refused_by_ray)
    assert other.requested == set()
    other.drain("b1", look, ["a", "b"], lambda: drained.append("b1 again"))
    assert drained == ["b1", "b1 again"]


def test_drain_node_takes_force_from_the_cli_and_the_console():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args)) or "ok"

    plan_action({"action": "drain_node", "node_id": "n", "force": True}, False, "c")[1](Recorder())
    plan_action({"action": "drain_node", "node_id": "n"}, False, "c")[1](Recorder())
    assert calls == [("drain_node", ("n", None, "c", True)), ("drain_node", ("n", None, "c", False))]
    with pytest.raises(ActionError, match="'force' must be true or false, got 'yes'"):
        plan_action({"action": "drain_node", "node_id": "n", "force": "yes"}, False, "c")
    with pytest.raises(SystemExit):   # --force is a flag: it takes no value
        cli.main(["drain-node", "abc", "--force=yes"])


# -- the draining-node query ------------------------------------------------------------------------
def test_a_failing_drain_query_is_counted_logged_once_and_exported(caplog):
    query = DrainQuery()
    with caplog.at_level(logging.WARNING, logger="islands.controller"):
        # Ray is not started in this process: the private call fails, as a renamed one would.
        assert [draining_nodes(query) for _ in range(3)] == [None, None, None]
    assert query.failures == 3
    logged = [r for r in caplog.records if "draining-node query failed" in r.getMessage()]
    assert len(logged) == 1 and "RaySystemError" in logged[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="islands.controller"):
        query.answered()   # it answered in between: a new failure is logged again
        assert draining_nodes(query) is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "Ray's draining-node query answers again after 3 failed polls",
        "Ray's draining-node query failed"]
    assert query.failures == 4
    families = {f.name: f for f in metrics.families(_snapshot(query.failures))}
    (sample,) = families["islands_drain_query_failures"].samples
    assert sample.name == "islands_drain_query_failures_total" and sample.value == 4.0


def _snapshot(failures):
    from test_metrics import snapshot

    return snapshot(drain_query_failures=failures)
