"""The typed seam between an owner and its learners and syncers (orchestrator/groups_api.py): the
Ray bodies and the in-process driver's virtual ones (orchestrator/virtual_groups.py) implement the
interfaces, every member an owner or a body uses of a group is in them, and what they report is
the fleet's own observations."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from islands.learners.messages import Heartbeat
from islands.orchestrator import fleet as F
from islands.orchestrator import groups_api as api
from islands.orchestrator import inprocess
from islands.orchestrator.chaos import FaultPlan, RestartCosts
from islands.orchestrator.groups_api import Incarnation
from islands.orchestrator.groups import LearnerGroups, SyncerShards
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer
from islands.syncer.core import SyncerSettings


def test_the_ray_bodies_implement_the_interfaces():
    assert isinstance(LearnerGroups(), api.LearnerGroup)
    assert isinstance(SyncerShards(2), api.SyncerGroup)


def test_the_out_messages_are_frozen_dataclasses_and_no_fleet_type_is_repacked():
    for message in (api.ShardEnded, api.SyncerStatus):
        assert dataclasses.is_dataclass(message)
        assert message.__dataclass_params__.frozen
    # The groups report the fleet's own types: none of the same name lives here.
    assert not {"RunEnded", "SpareReady", "SpareFailed", "How"} & set(vars(api))


def test_a_returned_runs_final_stats_ride_along_but_are_not_part_of_its_identity():
    ended = F.RunEnded("a:0", 1, final={"step": 3})
    assert ended == F.RunEnded("a:0", 1) and ended.final == {"step": 3}
    assert not ended.crashed and ended.error is None


def test_a_syncer_status_reads_the_actors_answer_and_combines():
    one = api.SyncerStatus.from_dict({"epoch": 2, "versions": [3, 4], "merges": 7,
                                      "ledger": {"a:0": {"incarnation": 1}}, "new_key": 1})
    assert (one.epoch, list(one.versions), one.ledger["a:0"]["incarnation"]) == (2, [3, 4], 1)
    assert api.SyncerStatus.from_dict(None) == api.SyncerStatus()
    both = api.combined([one, None])
    assert (both.epoch, both.merges, [row["epoch"] for row in both.shards]) == (2, 7, [2])


def test_an_incarnation_keeps_its_heartbeat_typed_and_its_final_stats():
    inc = Incarnation(3, start_step=10)
    assert inc.counters() == {"step": 10}
    inc.beat = Heartbeat("a:0", 3, 1.0, "training", step=12, fates={"events": 1})
    inc.ended_with({"learner": "a:0", "incarnation": 3, "state": "stopped", "step": 15,
                    "not_a_beat_field": 1})
    assert (inc.beat.step, inc.beat.fates, inc.beat.state.value) == (15, {"events": 1}, "stopped")
    fresh = Incarnation(0, start_step=4)
    fresh.ended_with({"learner": "b:0", "incarnation": 0, "state": "stopped", "pushes": 2})
    assert (fresh.beat.learner, fresh.beat.step, fresh.beat.pushes) == ("b:0", 4, 2)


# -- the in-process body: the same interfaces on the virtual clock (virtual_groups.py) ------------
INNER = optax.sgd(0.1)
COSTS = RestartCosts(detect_kill_s=1.0, restart_s=3.0, syncer_restart_s=1.0)


def _train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((p["w"] - batch) ** 2))(params)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def virtual_driver():
    """Two learners (1 s steps, one fragment pushed every step, 0.3 s each way), not yet run."""
    params = {"w": jnp.ones((3, 2))}
    codec = codec_lib.make_codec("none")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=fragments.partition(params, 1),
        settings=SyncerSettings(min_learners=1, grace_cap_s=0.0, overlap_steps=1,
                                merge_rule=merge.MergeRule.MEAN, outlier_norm_factor=None),
        outer_optimizer=outer.build("sgd", lr=1.0, momentum=0.0),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=["r:0", "r:1"], merge_alpha=0.0)
    return inprocess._Driver(
        learners=learners, syncer=syncer, train_step=jax.jit(_train_step),
        batch_for=lambda i, k: jnp.full((3, 2), float(i + k % 3)), tokens_per_batch=4,
        fleet=inprocess.Fleet([1.0, 1.0], latency_s=0.3), num_fragments=1, sync_every_steps=1,
        steps=20, evaluate=None, eval_every_steps=0, assemble=inprocess.assemble_like(params),
        faults=None, restart=COSTS, opt_init=INNER.init, until_s=None)


def polled(driver) -> list:
    """(time, message) of every ended run the driver polls from its learner group."""
    seen, ended = [], driver.groups.ended

    def poll():
        out = ended()
        seen.extend((driver.now, e) for e in out)
        return out
    driver.groups.ended = poll
    return seen


def test_the_virtual_bodies_implement_the_interfaces():
    d = virtual_driver()
    assert isinstance(d.groups, api.LearnerGroup) and isinstance(d.shards, api.SyncerGroup)
    assert d.shards.count == 1
    # The machine they run on (process starts, drains, what is not polled yet) is one object,
    # the driver's, held by both groups: the driver never reaches it through a group.
    assert d.groups.m is d.machine and d.shards.m is d.machine


def test_a_virtual_learner_told_to_drain_leaves_once_its_last_push_is_answered():
    d = virtual_driver()
    seen = polled(d)
    d.begin()
    d.advance(4.5)                                  # r:1 is in its step of 4..5 s
    assert d.groups.drain("r:1") is True
    d.advance(5.5)                                  # that step ended; its push is in flight
    assert d.up[1] and seen == []
    d.advance(7.0)
    (t, ended), = [(t, e) for t, e in seen if e.learner == "r:1"]
    assert t == pytest.approx(5.0 + 0.3 + 0.3)     # the reply to its push of step 5
    assert (ended.incarnation, ended.error, ended.final["step"]) == (0, None, 5)
    assert ended.final["fates"] == d.cores[1].fates.to_json()   # its books, as a Ray run's
    assert [s.start_s for s in d.record.step_log if s.learner == 1][-1] == 4.0
    assert not d.up[1] and 1 not in d.machine.draining


def test_a_killed_virtual_learner_takes_no_call_and_its_end_is_seen_after_detection():
    d = virtual_driver()
    seen = polled(d)
    d.begin()
    d.advance(2.5)
    fault = FaultPlan().crash("r:0", at_s=2.5).faults[0]
    with pytest.raises(ValueError, match="without its fault"):
        d.groups.kill("r:0", 0, "ray_kill")
    assert d.groups.kill("r:0", 0, "ray_kill", fault) is False   # its end is reported, not now
    assert not d.up[0] and d.machine.cause_of[0] == "kill"
    assert d.groups.drain("r:0") is False         # down: nothing running takes it
    d.advance(3.4)
    assert seen == []
    d.advance(3.5)                                  # detect_kill_s later
    assert [(t, e.learner, e.error, e.crashed) for t, e in seen] == [(3.5, "r:0", "kill", False)]
    assert d.groups.kill("r:1", 7, "bury") is False       # not its incarnation: left alone
    assert d.up[1]


def test_the_virtual_syncer_restarts_through_its_core_at_a_new_epoch():
    d = virtual_driver()
    d.begin()
    d.advance(2.5)
    versions = list(d.syncer.versions)
    d.shards.kill(0)
    assert d.shards.ended() == [api.ShardEnded(0)] and d.shards.ended() == []
    with pytest.raises(RuntimeError, match="down"):
        d.shards.attach(0, "islands:syncer", 1.0)
    ready = d.shards.start(0, None, 1, True, {}, 1.0)
    assert (ready["epoch"], ready["versions"], ready["back_at_s"]) == (1, versions, 3.5)
    with pytest.raises(ValueError, match="one syncer"):
        d.shards.start(1, None, 2, True, {}, 1.0)
    d.advance(4.0)
    status = d.shards.statuses(1.0, False)[0]
    assert status.epoch == 1 and set(status.registered) == {"r:0", "r:1"}
    assert d.shards.attach(0, "islands:syncer", 1.0)["epoch"] == 1
    assert set(d.shards.global_params()) == set(d.syncer.params_flat())


def protocol_members(protocol) -> set:
    return {name for name in vars(protocol) if not name.startswith("_")}


@pytest.mark.parametrize("group, protocol", [
    (LearnerGroups, api.LearnerGroup), (SyncerShards, api.SyncerGroup),
    (inprocess.VirtualLearnerGroup, api.LearnerGroup),
    (inprocess.VirtualSyncerGroup, api.SyncerGroup)], ids=lambda x: x.__name__)
def test_every_member_of_the_interface_has_the_same_signature_in_each_body(group, protocol):
    import inspect

    for name in protocol_members(protocol):
        want, got = getattr(protocol, name), getattr(group, name)
        if isinstance(want, property):
            assert isinstance(got, property), name
            continue
        assert list(inspect.signature(got).parameters) == list(
            inspect.signature(want).parameters), f"{group.__name__}.{name}"


# The expressions that hold a group: ``self`` in the classes that hold one, and the names the
# other modules give such a holder (recovery's ``c``, the region role's ``self.controller`` ...).
HOLDER_CLASSES = {"Owner", "Controller", "_Driver"}
HOLDER_NAMES = {"c", "controller", "self.c", "self.controller", "d", "driver", "self.d",
                "owner", "self.owner", "c.owner", "controller.owner"}
GROUP_KINDS = {"learners": "learners", "groups": "learners",   # Owner.learners, bodies' .groups
               "syncers": "syncers", "shards": "syncers"}      # Owner.syncers, bodies' .shards


def group_member_uses(path, rel: str) -> set:
    """``(file, "learners" | "syncers", member)`` for every member used of a group."""
    import ast

    uses = set()

    def visit(node, holders):
        if isinstance(node, ast.ClassDef):
            holders = HOLDER_NAMES | ({"self"} if node.name in HOLDER_CLASSES else set())
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr in GROUP_KINDS
                and ast.unparse(node.value.value) in holders):
            uses.add((rel, GROUP_KINDS[node.value.attr], node.attr))
        for child in ast.iter_child_nodes(node):
            visit(child, holders)

    visit(ast.parse(path.read_text()), HOLDER_NAMES)
    return uses


def test_every_module_uses_only_members_of_the_interfaces():
    """Every member of a group that the owner, the bodies holding it (the controller, its
    recovery, the region role, the driver) or anything else in the package uses is in the
    Protocol, so a body's group can be swapped for another's."""
    import pathlib

    root = pathlib.Path(api.__file__).resolve().parents[1]
    uses = set()
    for path in sorted((root / "orchestrator").rglob("*.py")):
        uses |= group_member_uses(path, str(path.relative_to(root)))
    users = {rel for rel, _, _ in uses}
    assert {"orchestrator/owner.py", "orchestrator/controller.py", "orchestrator/recovery.py",
            "orchestrator/region_agent.py", "orchestrator/inprocess.py"} <= users, users
    members = {"learners": protocol_members(api.LearnerGroup),
               "syncers": protocol_members(api.SyncerGroup)}
    assert {u for u in uses if u[2] not in members[u[1]]} == set()


def test_the_member_walk_finds_a_use_outside_the_interface(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("class Controller:\n    def f(self):\n        self.groups.secret()\n"
                    "        self.shards.count\n\nclass Other:\n    def g(self, c):\n"
                    "        self.groups.mine()\n        c.shards.handles\n")
    assert group_member_uses(path, "m.py") == {
        ("m.py", "learners", "secret"), ("m.py", "syncers", "count"),
        ("m.py", "syncers", "handles")}
