"""One seam, one owner, three bodies: every action the fleet can return (``fleet.ACTIONS``) has
one handler, the owner's (orchestrator/owner.py), which the Ray controller, the region agent (with
its role's three) and the in-process driver all hold, found when each is made; and the in-process
body carries out a drain and a syncer restart as the Ray body does (orchestrator/seam.py).
"""

import ast
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.orchestrator.region_agent import RegionController, RegionRole
from islands.orchestrator import fleet as F
from islands.orchestrator import inprocess, seam
from islands.orchestrator.chaos import FaultPlan, RestartCosts
from islands.orchestrator.controller import Controller
from islands.orchestrator.owner import Owner
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer
from islands.syncer.core import SyncerSettings
from islands.syncer.validate import RejectReason

BODIES = [(Owner, "do_")]   # the one handler table: every body holds an Owner
NOT_ACTIONS = {"Transition", "Step"}   # dataclasses of the actions section that are its output


# -- the registry and the tables ------------------------------------------------------------------
def test_the_registry_holds_every_dataclass_of_the_actions_section():
    """A new action class in fleet.py that is not in ``ACTIONS`` fails here (and then every
    body must handle it: the next test)."""
    source = inspect.getsource(F)
    lines = source.splitlines()
    start = next(n for n, line in enumerate(lines, 1)
                 if line.startswith("# -- actions: what a body must do"))
    end = next(n for n, line in enumerate(lines, 1) if n > start and line.startswith("# -- "))
    defined = [node.name for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef) and start < node.lineno < end
               and any("dataclass" in ast.unparse(d) for d in node.decorator_list)]
    actions = [name for name in defined if name not in NOT_ACTIONS]
    assert len(actions) >= 14
    assert [t.__name__ for t in F.ACTIONS] == actions   # in the order they are defined
    assert all(dataclasses.is_dataclass(t) for t in F.ACTIONS)
    assert set(F.Action.__args__) == set(F.ACTIONS)


@pytest.mark.parametrize("body, prefix", BODIES, ids=lambda x: getattr(x, "__name__", x))
def test_every_action_has_a_handler_in_every_body(body, prefix):
    assert seam.missing_handlers(body, prefix) == []
    table = seam.handler_table(body, prefix)
    assert set(table) == set(F.ACTIONS)
    for action_type, handler in table.items():
        assert handler.__name__ == prefix + action_type.__name__.lower()


def test_the_region_agent_is_a_controller_with_the_regions_role_not_a_subclass():
    """Composition: the agent holds a ``Controller`` built with a ``RegionRole``, whose handlers
    replace the owner's for the three actions a region carries out its own way."""
    assert not issubclass(RegionController, Controller)
    role = RegionRole("a", 0, 1)
    table = {**seam.handler_table(Owner, "do_"), **role.handlers()}
    assert set(table) == set(F.ACTIONS)
    assert {t for t, handler in table.items() if getattr(handler, "__self__", None) is role} == {
        F.LinkFault, F.PartitionHome, F.RestartRemote}
    assert not (role.owns_syncers or role.evaluates)


def test_no_body_has_handlers_of_its_own():
    """The controller and the driver hold an Owner; neither writes a handler again."""
    for body in (Controller, inprocess._Driver):
        assert not [name for name in dir(body) if name.startswith(("do_", "_do_"))], body


def test_a_body_missing_handlers_is_refused_at_its_start_naming_them():
    class Partial(Owner):
        do_drainlearner = None
        do_startsyncer = None

    assert seam.missing_handlers(Partial, "do_") == [F.DrainLearner, F.StartSyncer]
    with pytest.raises(seam.MissingHandlers, match=r"Partial has no handler for DrainLearner "
                                                   r"\(do_drainlearner\), StartSyncer"):
        seam.handler_table(Partial, "do_")
    with pytest.raises(TypeError, match="not a fleet action"):
        seam.dispatch(seam.handler_table(Owner, "do_"), F.Drain("a:0"))


def test_an_owner_that_contains_errors_reports_a_failed_action_and_goes_on_with_the_next():
    """The Ray controller's owner: a fleet of two learners whose launches fail (no Ray, no
    controller: the owner with groups that raise)."""
    events, launched = [], []

    class Learners:
        def launch(self, learner, *args, **kwargs):
            launched.append(learner)
            raise RuntimeError(f"no room for {learner}")

    class Specs:
        def learner(self, a):
            return None, None, None

    owner = Owner(F.FleetSettings(regions={"a": F.RegionPlan(2, 2)}), 1, Learners(), None,
                  Specs(), clock=lambda: 0.0, contain_errors=True,
                  emit=lambda kind, **fields: events.append((kind, fields)))
    owner.step([])
    assert launched == ["a:0", "a:1"]
    failed = [fields for kind, fields in events if kind == "action_failed"]
    assert [(e["action"], e["error"]) for e in failed] == [
        ("Launch", "RuntimeError('no room for a:0')"), ("Launch", "RuntimeError('no room for a:1')")]
    assert owner.running == {}   # nothing launched is counted running
    with pytest.raises(RuntimeError, match="no room"):   # the driver's owner: errors propagate
        Owner(F.FleetSettings(regions={"a": F.RegionPlan(1, 1)}), 1, Learners(), None, Specs(),
              clock=lambda: 0.0).step([])


def test_the_region_agent_and_the_driver_refuse_remote_only_actions_clearly():
    fault = FaultPlan().partition("a", at_s=1.0, duration_s=2.0).faults[0]
    agent = RegionRole("a", 0, 1)
    with pytest.raises(RuntimeError, match="home partition"):
        agent._do_partitionhome(F.PartitionHome(fault))
    owner = driver().owner
    with pytest.raises(RuntimeError, match=r"RestartRemote\(b:0, incarnation 2\)"):
        owner.do_restartremote(F.RestartRemote("b:0", "b", 2, "hang"))


# -- the in-process body: a drain and a syncer restart --------------------------------------------
INNER = optax.adam(3e-2)
TOKENS = 16


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 2)) * 0.5,
            "bias": jnp.zeros(2), "scale": jnp.ones(8)}


@jax.jit
def train_step(params, opt_state, batch):
    def loss_fn(p):
        x, y = batch
        h = jnp.tanh(x @ p["w1"]) * p["scale"][None, :]
        return jnp.mean((h @ p["w2"] + p["bias"][None, :] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch_for(learner, index):
    rng = np.random.default_rng(1000 * learner + index)
    x = rng.normal(size=(TOKENS, 4)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype(np.float32)
    return x, y


def driver(*, faults=None, commands=(), M=3, P=2, H=2, tau=1, steps=16, latency_s=0.3,
           **fleet):
    """A virtual fleet of M learners on a tiny model (1 s steps), not yet run."""
    params = init_params()
    codec = codec_lib.make_codec("none")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=fragments.partition(params, P),
        settings=SyncerSettings(min_learners=1, grace_cap_s=0.0, overlap_steps=tau,
                                merge_rule=merge.MergeRule.MEAN, outlier_norm_factor=None),
        outer_optimizer=outer.build("sgd", lr=1.0, momentum=0.0),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=[f"r:{i}" for i in range(M)], merge_alpha=0.0)
    return inprocess._Driver(
        learners=learners, syncer=syncer, train_step=train_step, batch_for=batch_for,
        tokens_per_batch=TOKENS, fleet=inprocess.Fleet([1.0] * M, latency_s=latency_s, **fleet),
        num_fragments=P, sync_every_steps=H, steps=steps, evaluate=None, eval_every_steps=0,
        assemble=inprocess.assemble_like(params), faults=faults,
        restart=RestartCosts(syncer_restart_s=1.0), opt_init=INNER.init, until_s=None,
        commands=commands)


def assert_books_balance(record, syncer, left=()):
    """Every fragment-token has one fate; the applied ones are what the syncer merged (less, for
    a learner still running, the merges it has not adopted yet); a learner that ``left`` holds
    nothing in flight any more."""
    for i, name in enumerate(record.learner_ids):
        fates = record.ledger[name]
        ft = fates["fragment_tokens"]
        assert ft["applied"] + ft["dropped"] + ft["in_flight"] == ft["processed"], name
        assert sum(fates["dropped_by"].values()) == fates["dropped"], name
        entry = syncer.ledger[name]
        if name in left:
            assert ft["in_flight"] == 0 and ft["applied"] == entry.merged_tokens_total, name
            continue
        core = record.learners[i]
        unadopted = sum(f.pushed.tokens for p, f in enumerate(core.fates.fragments)
                        if f.pushed_step is not None and entry.merged_steps.get(p) == f.pushed_step)
        assert ft["applied"] + unadopted == entry.merged_tokens_total, name


def transitions(record, learner=None):
    return [(t.name, dict(t.fields)) for _, t in record.transitions
            if learner is None or t.learner == learner]


def test_a_drained_learner_finishes_its_in_flight_pushes_then_leaves_and_its_books_settle():
    d = driver(commands=[(4.5, F.Drain("r:1"))])
    record = d.run()
    (drained_at, retired), = [(t, x) for t, x in record.transitions
                              if x.name == "learner_retired" and x.learner == "r:1"]
    assert retired.fields["reason"] == "drained"
    names = [name for name, _ in transitions(record, "r:1")]
    assert names[-2:] == ["learner_draining", "learner_retired"]
    # It finished the step it was in (4..5 s) and took no other; its pushes of step 5 were in
    # flight (0.3 s each way), so it left when the last of them was answered, not at once.
    r1 = [s for s in record.step_log if s.learner == 1]
    assert r1[-1].start_s == 4.0 and r1[-1].step == 5
    assert drained_at == pytest.approx(5.0 + 0.3 + 0.3)   # the reply to its push of step 5
    core, entry = record.learners[1], d.syncer.ledger["r:1"]
    pushed = {p: f.pushed_step for p, f in enumerate(core.fates.fragments)
              if f.pushed_step is not None}
    assert 5 in pushed.values()
    assert {p: entry.merged_steps.get(p) for p in pushed} == pushed   # every one was merged
    assert "r:1" not in d.syncer.learners   # forgotten
    # The books: its merged pushes are applied, the rest it held is dropped as "drained".
    assert_books_balance(record, d.syncer, left=("r:1",))
    ledger = record.ledger["r:1"]
    assert set(ledger["dropped_by"]) <= {"drained", "overlap"}
    assert record.allocated_s[1] == pytest.approx(drained_at)
    assert d.owner.fleet.slots["r:1"].state == F.SlotState.RETIRED
    # The others train on to the end; nothing else was in the way.
    assert record.steps[0] == record.steps[2] == 16 and record.steps[1] == 5
    assert record.restarts == [] and record.commands_refused == []


def test_a_drain_command_the_fleet_refuses_is_recorded():
    record = driver(commands=[(2.0, F.Drain("r:9"))], steps=4).run()
    (t, command, why), = record.commands_refused
    assert (t, command) == (2.0, F.Drain("r:9")) and "r:9" in why


def test_a_scale_up_in_process_is_refused_naming_the_region_and_the_job_goes_on():
    """The in-process driver runs the learners it was given: a new slot (the fleet names it
    after the region's next index) would be no learner of its own (it raised a KeyError)."""
    record = driver(commands=[(1.0, F.Scale("r", 2)), (2.0, F.Scale("r", 3))], steps=6).run()
    (t, command, why), = record.commands_refused
    assert (t, command) == (2.0, F.Scale("r", 3)) and "r scales down only" in why
    assert record.steps[0] == record.steps[1] == 6


def test_a_syncer_restart_keeps_versions_monotonic_and_fences_the_old_epoch():
    d = driver(faults=FaultPlan().kill_syncer(at_s=5.2))
    record = d.run()
    # The fleet saw it end and restarted it (the Ray controller's SyncerEnded -> StartSyncer).
    syncer_events = [(name, f) for name, f in transitions(record) if name in (
        "chaos", "syncer_failed")]
    assert syncer_events == [("chaos", {"action": "kill", "target": "syncer", "mode": "ray_kill"}),
                             ("syncer_failed", {"epoch": 0})]
    shard = d.owner.fleet.syncer_shards[0]
    assert (shard.state, shard.epoch, shard.restarts) == (F.ShardState.UP, 1, 1)
    assert d.syncer.epoch == 1
    # Versions go on from where they were, one merge at a time, across the restart.
    for p in range(2):
        versions = [m.version for m in record.merges if m.fragment == p]
        assert versions == list(range(1, len(versions) + 1)) and len(versions) > 4
        assert d.syncer.slots[p].version == versions[-1]
    # Pushes met the dead syncer (or its old epoch), and training went on.
    assert record.rejected.get(inprocess.SYNCER_DOWN, 0) + record.rejected.get(
        RejectReason.STALE_EPOCH, 0) > 0
    assert record.steps == [16, 16, 16] and record.restarts == []
    assert_books_balance(record, d.syncer)
    # A push to the old epoch is refused by the restarted syncer.
    core = record.learners[0]
    old = core.make_push(0, epoch=0).push
    verdict = d.syncer.accept_push(old, record.end_time_s)
    assert not verdict.ok and verdict.reason == RejectReason.STALE_EPOCH


def test_a_drain_while_the_syncer_is_down_ends_when_the_restarted_syncer_voids_its_push():
    """Both at once: r:2 is told to drain while the syncer is down. Its last push (step 6, to
    the dead syncer's epoch) is void once it registers with the restarted syncer, which answers
    it, so it leaves then; what that push held is dropped as drained."""
    d = driver(faults=FaultPlan().kill_syncer(at_s=5.2), commands=[(5.5, F.Drain("r:2"))])
    record = d.run()
    (drained_at,) = [t for t, x in record.transitions
                     if x.name == "learner_retired" and x.learner == "r:2"]
    assert drained_at == pytest.approx(5.2 + 1.0)   # the syncer is back (syncer_restart_s)
    assert d.syncer.epoch == 1 and d.owner.fleet.syncer_shards[0].state == F.ShardState.UP
    assert_books_balance(record, d.syncer, left=("r:2",))
    assert record.ledger["r:2"]["dropped_by"].get("drained", 0) > 0
    assert record.steps[:2] == [16, 16] and record.steps[2] == 6


def test_syncer_restart_drops_the_open_rounds_and_forgets_registrations():
    d = driver()
    syncer, loop = d.syncer, d.loops[0]
    loop.train(loop.batch())
    loop.record(1.0)
    assert syncer.accept_push(d.cores[0].make_push(0, syncer.epoch).push, 1.0).ok
    versions = syncer.versions
    dropped = syncer.restart(epoch=3)
    assert [(x.learner, x.fragment) for x in dropped] == [("r:0", 0)]
    assert syncer.epoch == 3 and syncer.versions == versions and syncer.learners == {}
    assert all(not slot.round for slot in syncer.slots)
    assert syncer.restart(epoch=0) == [] and syncer.epoch == 4   # always a new epoch


@pytest.mark.parametrize("health", [{}, {"health": {"timeout_s": 7.0}}])
def test_the_in_process_body_bounds_a_drain_as_the_ray_body_does(health):
    """One job's drain bound is the same in both bodies: the Ray controller's fleet
    (``build.fleet_settings``) and the in-process driver's (``virtual_fleet.Fleet.settings``),
    given the job's ``health.timeout_s`` or left at its default."""
    from islands.orchestrator import build
    from islands.orchestrator.config import JobConfig

    config = JobConfig.model_validate({"name": "j", "regions": {"r": {"learners": 3}}, **health})
    ray_body = build.fleet_settings(config).drain_timeout_s
    in_process = driver(**({"health_timeout_s": config.health.timeout_s} if health else {}))
    assert in_process.owner.fleet.settings.drain_timeout_s == ray_body
    assert ray_body == 2 * config.health.timeout_s


def test_a_drain_past_the_fleets_deadline_ends_in_process_too_with_its_own_reason():
    """The in-process body has the fleet's drain bound: r:2, told to drain while the syncer is
    down, waits on a push nobody answers; past ``drain_timeout_s`` the fleet ends it and what
    it held is dropped as ``drain_timeout`` (its own reason, not "drained")."""
    d = driver(faults=FaultPlan().kill_syncer(at_s=5.2), commands=[(5.5, F.Drain("r:2"))])
    d.owner.fleet = dataclasses.replace(d.owner.fleet, settings=dataclasses.replace(
        d.owner.fleet.settings, drain_timeout_s=0.5))
    record = d.run()
    (ended_at, ended), = [(t, x) for t, x in record.transitions
                          if x.name == "learner_drain_timeout"]
    assert ended.learner == "r:2" and 5.5 + 0.5 <= ended_at < 5.2 + 1.0   # before the syncer
    (retired,) = [x for _, x in record.transitions
                  if x.name == "learner_retired" and x.learner == "r:2"]
    assert retired.fields["reason"].startswith("drain_timeout")
    assert_books_balance(record, d.syncer, left=("r:2",))
    dropped = record.ledger["r:2"]["dropped_by"]
    assert dropped.get("drain_timeout", 0) > 0 and "drained" not in dropped
    assert record.steps[:2] == [16, 16] and record.steps[2] == 6
