"""One model of time and pause (syncer/timing.py): ξ_step, ξ_sync, the live set and the pause rule,
worked by hand, and both bodies (the Ray controller, syncer and learner; the in-process driver)
computing them through it."""

import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.learners.loop import LearnerLoop
from islands.orchestrator import build, inprocess
from islands.orchestrator import fleet as F
from islands.orchestrator.chaos import RestartCosts
from islands.orchestrator.fleet import SlotState
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer, timing
from islands.syncer.core import SyncerSettings


# -- the definitions, by hand ---------------------------------------------------------------------
def test_the_running_average_weighs_the_newest_sample_a_fifth():
    assert timing.ema(None, 3.0) == 3.0
    assert timing.ema(2.0, 1.0) == pytest.approx(0.8 * 2.0 + 0.2 * 1.0)   # 1.8
    assert timing.ema(0.0, 0.5) == pytest.approx(0.1)


def test_a_pace_leaves_the_first_step_out_then_averages():
    # 30 s (the first step: it compiles), then 1, 2, 1 s: 1.0, 0.8 + 0.4 = 1.2, 0.96 + 0.2 = 1.16
    pace = timing.StepPace()
    got = [pace.observe(s) for s in (30.0, 1.0, 2.0, 1.0)]
    assert got[0] is None
    assert got[1:] == pytest.approx([1.0, 1.2, 1.16])


def test_the_learner_loop_keeps_the_pace_both_bodies_read():
    loop = LearnerLoop(None, None, None, tokens_per_batch=1, num_fragments=1, sync_every_steps=1)
    assert loop.step_time_s is None
    loop.paced(12.0)
    assert loop.step_time_s is None          # the first step is not a pace
    loop.paced(0.5)
    loop.paced(1.5)
    assert loop.step_time_s == pytest.approx(0.8 * 0.5 + 0.2 * 1.5)   # 0.7


def test_the_slowest_step_is_the_largest_known_pace_or_one_second():
    assert timing.slowest_step_s([0.25, None, 0.75]) == 0.75
    assert timing.slowest_step_s([None, None]) == timing.DEFAULT_STEP_S == 1.0
    assert timing.slowest_step_s([]) == 1.0
    assert timing.slowest_step_s([0.0]) == 1.0                 # 0: not known (as a heartbeat's)
    assert timing.slowest_step_s([1e-5]) == timing.MIN_STEP_S


def test_sync_time_is_the_round_trip_plus_the_merges_running_average():
    assert timing.round_trip_s([0.05, 0.12, 0.0]) == pytest.approx(0.24)
    assert timing.round_trip_s([]) == 0.0
    t = timing.SyncTime(round_trip_s=0.2)
    assert t.sync_s == pytest.approx(0.2)        # no merge measured: only the transfer
    t.observe_merge(1.0)                         # 0.8·0 + 0.2·1 = 0.2
    assert (t.merge_s, t.sync_s) == pytest.approx((0.2, 0.4))
    t.observe_merge(1.0)                         # 0.8·0.2 + 0.2·1 = 0.36
    assert (t.merge_s, t.sync_s) == pytest.approx((0.36, 0.56))
    zero = timing.SyncTime(round_trip_s=0.6)     # the virtual clock: merges take no time
    for _ in range(5):
        zero.observe_merge(0.0)
    assert zero.sync_s == pytest.approx(0.6)


def test_the_live_set_is_the_registered_learners_and_a_pause_holds_merges():
    assert timing.live_set({"a:0": 3, "b:1": 0}) == frozenset({"a:0", "b:1"})
    assert timing.live_set({}) == frozenset()
    assert not timing.merges_held(None)
    assert timing.merges_held("1 live learner(s) below quorum 2: training paused")


# -- the Ray body ---------------------------------------------------------------------------------
def test_the_ray_syncer_takes_its_round_trip_from_the_largest_region_latency():
    from islands.orchestrator.config import parse
    from tests.conftest import TINY_JOB

    job = parse({**TINY_JOB, "name": "timing",
                 "regions": {"a": {"learners": 1, "latency_ms": 50.0},
                             "b": {"learners": 1, "latency_ms": 120.0}}})
    assert build.syncer_options(job, "/tmp/unused")["round_trip_s"] == pytest.approx(0.24)
    one = parse({**TINY_JOB, "name": "timing"})    # no latency configured: merges only
    assert build.syncer_options(one, "/tmp/unused")["round_trip_s"] == 0.0


def test_the_ray_syncer_starts_from_its_round_trip_and_the_default_pace():
    import asyncio

    from islands.syncer.actor import Syncer, SyncerSpec

    spec = SyncerSpec(fragments=[{"w": np.zeros(4, np.float32)}], settings=SyncerSettings(),
                      outer_kind="nesterov", outer_kwargs={}, codec_kind="none",
                      codec_block_size=64, round_trip_s=0.4)
    syncer = Syncer(spec)
    assert syncer.sync_time.sync_s == pytest.approx(0.4)
    assert syncer.slowest_step_s == timing.DEFAULT_STEP_S
    asyncio.run(syncer.set_fleet(1e-6, paused=True))
    assert (syncer.slowest_step_s, syncer.paused) == (timing.MIN_STEP_S, True)


def test_the_owner_gives_the_syncer_the_slowest_training_pace_and_the_pause():
    from islands.orchestrator.owner import Owner

    told = []
    slots = {"a:0": SimpleNamespace(state=SlotState.TRAINING, step_time_s=0.5),
             "a:1": SimpleNamespace(state=SlotState.TRAINING, step_time_s=None),
             "a:2": SimpleNamespace(state=SlotState.PAUSED, step_time_s=9.0),
             "a:3": SimpleNamespace(state=SlotState.STARTING, step_time_s=None)}
    fake = SimpleNamespace(
        fleet=SimpleNamespace(slots=slots, paused_reason=None), lock=threading.Lock(),
        syncers=SimpleNamespace(statuses=lambda slowest, paused: told.append((slowest, paused))
                                or {}))
    Owner.refresh_syncer_status(fake)
    fake.fleet.paused_reason = "paused by an operator"
    slots["a:0"] = SimpleNamespace(state=SlotState.PAUSED, step_time_s=0.5)
    Owner.refresh_syncer_status(fake)
    assert told == [(0.5, False), (1.0, True)]   # a:2 is paused: not counted; none known: 1 s


# -- the in-process body --------------------------------------------------------------------------
INNER = optax.sgd(1e-2)
TOKENS = 8


def _train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(params)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _batch_for(learner, index):
    return np.random.default_rng(100 * learner + index).normal(size=(TOKENS, 3)).astype(np.float32)


def driver(*, speeds, latency_s, steps, commands=()):
    """K = 1, one fragment pushed every step, τ = 1; learner i steps 1 / speeds[i] seconds."""
    params = {"w": jnp.ones((3, 2))}
    codec = codec_lib.make_codec("none")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=fragments.partition(params, 1),
        settings=SyncerSettings(min_learners=1, overlap_steps=1, merge_rule=merge.MergeRule.MEAN,
                                outlier_norm_factor=None),
        outer_optimizer=outer.build("sgd", lr=1.0, momentum=0.0),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=[f"r:{i}" for i in range(len(speeds))], merge_alpha=0.0)
    d = inprocess._Driver(
        learners=learners, syncer=syncer, train_step=jax.jit(_train_step), batch_for=_batch_for,
        tokens_per_batch=TOKENS, fleet=inprocess.Fleet(list(speeds), latency_s=latency_s),
        num_fragments=1, sync_every_steps=1, steps=steps, evaluate=None, eval_every_steps=0,
        assemble=inprocess.assemble_like(params), faults=None, restart=RestartCosts(),
        opt_init=INNER.init, until_s=None, commands=commands)
    decisions, merged = [], []
    timed = syncer.timed_decision
    merge_now = syncer.merge

    def record_decision(p, now, live, slowest, sync_s):
        decisions.append((now, live, slowest, sync_s))
        return timed(p, now, live, slowest, sync_s)

    def record_merge(*args, **kwargs):
        merged.append(decisions[-1][0])
        return merge_now(*args, **kwargs)

    syncer.timed_decision, syncer.merge = record_decision, record_merge
    return d, decisions, merged


def test_the_driver_reads_the_paces_the_round_trip_and_the_registered_learners():
    # r:0 steps 1 s, r:1 steps 2 s. A pace is known once a learner's second step ends: r:0's at
    # t = 2 (1.0 s), r:1's at t = 4 (2.0 s). Until t = 2 ξ_step is the 1 s default, as on the
    # service before any heartbeat carried a pace; ξ_sync is 2 × 0.1 s and merges cost nothing.
    d, decisions, merged = driver(speeds=[1.0, 0.5], latency_s=0.1, steps=6)
    d.run()
    assert decisions and merged
    for now, live, slowest, sync_s in decisions:
        assert live == frozenset({"r:0", "r:1"})
        assert sync_s == pytest.approx(0.2)
        assert slowest == pytest.approx(2.0 if now >= 4.0 else 1.0), now
    assert any(now < 4.0 for now, *_ in decisions) and any(now >= 4.0 for now, *_ in decisions)


def test_the_driver_merges_nothing_while_the_fleet_is_paused():
    # The operator pauses the job at 2.05 s and resumes it at 5 s: the pushes of the steps that
    # ended at t = 3 (both learners were in a step when the pause came) arrive at 3.3 s and are
    # held; the round merges at the resume, with both learners in.
    d, decisions, merged = driver(speeds=[1.0, 1.0], latency_s=0.3, steps=6,
                                  commands=[(2.05, F.PauseJob(True)), (5.0, F.PauseJob(False))])
    record = d.run()
    assert not record.commands_refused
    assert not [t for t in merged if 2.05 < t < 5.0]
    assert 5.0 in merged
    assert not [now for now, *_ in decisions if 2.05 < now < 5.0]   # not even decided
