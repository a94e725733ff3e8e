"""Chaos: the seeded fault plan (determinism, independence, Poisson rates, builders, replay), the
windows a driver reads it through, and the in-process driver under scripted faults (docs/architecture.md#failures-and-reintegration, §6).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.orchestrator import chaos, inprocess
from islands.orchestrator.chaos import Fault, FaultKind, FaultPlan, Link, RestartCosts
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, merge, outer
from islands.syncer.core import SyncerSettings

REGIONS = {"us-east": ["us-east:0", "us-east:1"], "eu-west": ["eu-west:0", "eu-west:1"]}


def kills_of(plan, target):
    return [f.at_s for f in plan if f.target == target and f.kind == FaultKind.KILL]


# -- the plan -------------------------------------------------------------------------------------

def test_same_seed_same_plan_and_another_seed_another():
    kwargs = dict(horizon_s=5000.0, mtbf_s=300.0, repair_s=20.0, region_mtbf_s=2000.0,
                  slowdown_mtbf_s=800.0, network_mtbf_s=1500.0, syncer_mtbf_s=2500.0)
    a = chaos.poisson_plan(REGIONS, seed=7, **kwargs)
    b = chaos.poisson_plan(REGIONS, seed=7, **kwargs)
    c = chaos.poisson_plan(REGIONS, seed=8, **kwargs)
    assert a.faults == b.faults and len(a) > 20
    assert a.faults != c.faults
    assert {f.kind for f in a} == {FaultKind.KILL, FaultKind.REGION_LOSS, FaultKind.SLOWDOWN,
                                   FaultKind.NETWORK, FaultKind.SYNCER_KILL}
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    assert all(0 <= f.at_s < 5000.0 for f in a)


def test_adding_a_learner_or_region_does_not_reshuffle_the_others():
    kwargs = dict(horizon_s=5000.0, seed=3, mtbf_s=300.0, repair_s=20.0, region_mtbf_s=1000.0)
    small = chaos.poisson_plan(REGIONS, **kwargs)
    bigger = chaos.poisson_plan({"us-east": ["us-east:0", "us-east:1", "us-east:2"],
                                 "eu-west": ["eu-west:0", "eu-west:1"],
                                 "ap-south": ["ap-south:0"]}, **kwargs)
    old = [f for f in bigger if f.target not in ("us-east:2", "ap-south", "ap-south:0")]
    assert old == small.faults
    assert kills_of(bigger, "us-east:2") and kills_of(bigger, "us-east:2") != kills_of(
        bigger, "us-east:1")


def test_kill_rate_without_repair_is_poisson():
    """4 learners, MTBF 10 s, horizon 25 000 s: N ~ Poisson(4·2500 = 10 000), σ = 100.
    |N − 10 000| < 5σ = 500 fails for about one seed in 1.7 million; checked on three seeds."""
    learners = {"r": [f"r:{i}" for i in range(4)]}
    for seed in (0, 1, 2):
        plan = chaos.poisson_plan(learners, 25_000.0, seed=seed, mtbf_s=10.0, repair_s=0.0)
        assert abs(plan.count(FaultKind.KILL) - 10_000) < 500
        gaps = np.diff([0.0] + kills_of(plan, "r:0"))
        # exponential gaps: mean 10, sd 10; the mean of ~2500 gaps has sd 10/√2500 = 0.2
        assert abs(gaps.mean() - 10.0) < 5 * 10.0 / math.sqrt(len(gaps))
        assert abs(gaps.std() - 10.0) < 1.0   # the sd of an exponential equals its mean


def test_a_learner_down_for_repair_cannot_fail_again():
    """Renewal process: cycle = Exp(mtbf) + repair, mean μ = 10 + 10 = 20 s, variance σ² = 100.
    Count over t = 40 000 s: mean t/μ = 2000, variance tσ²/μ³ = 500 per learner; 4 learners:
    mean 8000, σ = √2000 ≈ 45, so 5σ ≈ 224."""
    learners = {"r": [f"r:{i}" for i in range(4)]}
    plan = chaos.poisson_plan(learners, 40_000.0, seed=11, mtbf_s=10.0, repair_s=10.0)
    assert abs(plan.count(FaultKind.KILL) - 8000) < 224
    for name in learners["r"]:
        times = kills_of(plan, name)
        assert min(np.diff(times)) >= 10.0   # never while down
    assert all(f.duration_s == 10.0 for f in plan)


def test_builders_sorted_due_fired_count_and_reset():
    plan = (FaultPlan()
            .crash("us-east:0", at_s=5.0, repair_s=2.0)
            .crash("us-east:1", at_s=1.0, mode="exit")
            .lose_region("eu-west", at_s=3.0, repair_s=4.0)
            .slow("eu-west:0", at_s=2.0, duration_s=3.0, factor=4.0)
            .degrade("us-east", at_s=2.0, duration_s=1.0, extra_latency_ms=50.0, bandwidth_gbps=0.5)
            .partition("eu-west", at_s=6.0, duration_s=2.0)
            .kill_syncer(at_s=7.0))
    assert [(f.at_s, f.kind) for f in plan.sorted()] == [
        (1.0, FaultKind.EXIT), (2.0, FaultKind.SLOWDOWN), (2.0, FaultKind.NETWORK),
        (3.0, FaultKind.REGION_LOSS), (5.0, FaultKind.KILL), (6.0, FaultKind.PARTITION),
        (7.0, FaultKind.SYNCER_KILL)]
    assert plan.sorted().fired == [] and list(plan) == plan.sorted().faults
    assert plan.count() == 7 and plan.count(FaultKind.KILL) == 1 and plan.count("exit") == 1
    assert plan.faults[0] == Fault(5.0, FaultKind.KILL, "us-east:0", duration_s=2.0)
    assert plan.faults[4].bandwidth_gbps == 0.5 and plan.faults[4].end_s == 3.0
    assert plan.due(0.5) == []
    first = plan.due(2.0)
    assert [f.kind for f in first] == [FaultKind.EXIT, FaultKind.SLOWDOWN, FaultKind.NETWORK]
    assert plan.due(2.0) == []                       # each fault is handed out once
    assert [f.kind for f in plan.due(100.0)] == [FaultKind.REGION_LOSS, FaultKind.KILL,
                                                 FaultKind.PARTITION, FaultKind.SYNCER_KILL]
    assert plan.fired == plan.sorted().faults        # every planned fault fired, in time order
    assert plan.reset().fired == [] and len(plan.due(1.0)) == 1
    assert plan.times() == [1.0, 2.0, 3.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("call, message", [
    (lambda: Fault(-1.0, FaultKind.KILL, "a:0"), r"at_s must be >= 0, got -1.0"),
    (lambda: Fault(1.0, "boom", "a:0"), r"kind must be one of kill, exit"),
    (lambda: Fault(1.0, FaultKind.KILL, ""), r"target must be a non-empty string"),
    (lambda: FaultPlan().slow("a:0", 1.0, 2.0, 0.5), r"factor must be a finite number >= 1"),
    (lambda: FaultPlan().slow("a:0", 1.0, 0.0, 2.0), r"duration_s must be > 0 for a slowdown"),
    (lambda: FaultPlan().degrade("a", 1.0, 2.0, bandwidth_gbps=0.0),
     r"bandwidth_gbps must be > 0, got 0.0"),
    (lambda: FaultPlan().crash("a:0", 1.0, mode="nuke"), r"mode must be one of kill, exit"),
    (lambda: Fault(1.0, FaultKind.SYNCER_KILL, "a:0"), r"target of a syncer_kill must be"),
    (lambda: chaos.poisson_plan(REGIONS, 100.0, seed=0, mtbf_s=0.0, repair_s=1.0),
     r"mtbf_s must be > 0, got 0.0"),
    (lambda: chaos.poisson_plan(REGIONS, math.inf, seed=0, mtbf_s=1.0, repair_s=1.0),
     r"horizon_s must be finite"),
    (lambda: chaos.poisson_plan(REGIONS, 100.0, seed=-1, mtbf_s=1.0, repair_s=1.0),
     r"seed must be a non-negative int, got -1"),
    (lambda: chaos.poisson_plan(REGIONS, 100.0, seed=0, mtbf_s=1.0, repair_s=-2.0),
     r"repair_s must be >= 0, got -2.0"),
    (lambda: chaos.poisson_plan({"a": ["x:0"], "b": ["x:0"]}, 100.0, seed=0, mtbf_s=1.0,
                                repair_s=0.0), r"learner 'x:0' is listed twice"),
    (lambda: chaos.poisson_plan({}, 100.0, seed=0, mtbf_s=1.0, repair_s=0.0),
     r"learners_by_region must name at least one region"),
    (lambda: chaos.poisson_plan(REGIONS, 100.0, seed=0, mtbf_s=1.0, repair_s=0.0,
                                region_mtbf_s=-5.0), r"region_mtbf_s must be > 0, got -5.0"),
    (lambda: chaos.poisson_plan(REGIONS, 100.0, seed=0, mtbf_s=1.0, repair_s=0.0,
                                kill_mode="zap"), r"mode must be one of kill, exit"),
])
def test_bad_inputs_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_restart_costs_and_windows():
    costs = RestartCosts(detect_kill_s=0.0, detect_lost_s=10.0, restart_s=3.0)
    assert costs.down_s(Fault(1.0, FaultKind.KILL, "a:0", duration_s=2.0)) == 5.0
    assert costs.down_s(Fault(1.0, FaultKind.REGION_LOSS, "a", duration_s=2.0)) == 15.0
    windows = chaos.FaultWindows()
    for fault in (FaultPlan().slow("a:0", 2.0, 3.0, 4.0).slow("b", 3.0, 1.0, 2.0)
                  .degrade("a", 0.0, 10.0, extra_latency_ms=100.0, bandwidth_gbps=0.008)
                  .partition("b", 5.0, 2.0).partition("b", 6.5, 1.0)):
        windows.add(fault)
    assert windows.slowdown("a:0", "a", 1.9) == 1.0
    assert windows.slowdown("a:0", "a", 2.0) == 4.0 and windows.slowdown("a:0", "a", 5.0) == 1.0
    assert windows.slowdown("b:0", "b", 3.5) == 2.0
    base = Link(latency_s=0.01, bandwidth_bytes_per_s=1e9)
    # 0.008 Gbit/s = 1e6 bytes/s; 1e6 bytes take 1 s, plus 10 ms + 100 ms of latency
    assert windows.arrival_s("a", 1.0, 1e6, base) == pytest.approx(1.0 + 0.11 + 1.0)
    assert windows.arrival_s("a", 10.0, 1e6, base) == pytest.approx(10.0 + 0.01 + 1e-3)
    # chained partitions [5, 7) and [6.5, 7.5): a message at 5.5 leaves at 7.5
    assert windows.departure_s("b", 5.5) == 7.5 and windows.departure_s("b", 4.0) == 4.0


# -- the in-process driver under faults ---------------------------------------------------------

INNER = optax.adam(3e-2)
from tiny_task import TOKENS, batch_for  # noqa: E402  (the shared tiny task)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 2)) * 0.5,
            "bias": jnp.zeros(2), "scale": jnp.ones(8)}


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"]) * params["scale"][None, :]
    return jnp.mean((h @ params["w2"] + params["bias"][None, :] - y) ** 2)


@jax.jit
def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def run(plan, *, M=2, P=1, H=1, tau=0, steps=6, latency_s=0.0, restart_s=1.5, K=1,
        until_s=None, ids=None, spares=0, promote_s=0.3, spare_ready_s=3.0, speeds=None,
        schedule_clock="fleet", **costs):
    params = init_params()
    settings = SyncerSettings(min_learners=K, grace_cap_s=0.0, overlap_steps=tau,
                              merge_rule=merge.MergeRule.MEAN, outlier_norm_factor=None,
                              schedule_clock=merge.ScheduleClock(schedule_clock))
    codec = codec_lib.make_codec("none")
    syncer, learners = inprocess.build_syncer_and_learners(
        params=params, opt_init=INNER.init, plan=fragments.partition(params, P),
        settings=settings, outer_optimizer=outer.build("sgd", lr=1.0, momentum=0.0),
        error_feedback_factory=lambda: codec_lib.error_feedback(codec),
        decode=lambda c: codec_lib.decode_tree(codec, c), wire_bytes=codec_lib.tree_wire_bytes,
        learner_ids=ids or [f"r:{i}" for i in range(M)], merge_alpha=0.0,
        carry_overlap=False)  # worked out by hand with overwrite (the τ steps are dropped)
    calls = []

    def spy(i, k):
        calls.append((i, k))
        return batch_for(i, k)

    record = inprocess.run_inprocess(
        learners=learners, syncer=syncer, train_step=train_step, batch_for=spy,
        tokens_per_batch=TOKENS, fleet=inprocess.Fleet(speeds or [1.0] * len(learners),
                                                       latency_s=latency_s, spares=spares),
        num_fragments=P, sync_every_steps=H, steps=steps, faults=plan,
        restart=RestartCosts(restart_s=restart_s, promote_s=promote_s,
                             spare_ready_s=spare_ready_s, **costs),
        opt_init=INNER.init, until_s=until_s,
        assemble=inprocess.assemble_like(params))
    return record, syncer, calls


def assert_ledger_balances(record, syncer):
    """Each fate is counted where it happens; the terms must account for every fragment-token,
    and the applied ones must be what the syncer counted at its merges (independently), less the
    merges a live learner has not adopted yet (still in flight in its own books)."""
    for i, name in enumerate(record.learner_ids):
        fates = record.ledger[name]
        ft = fates["fragment_tokens"]
        assert ft["applied"] + ft["dropped"] + ft["in_flight"] == ft["processed"], name
        assert sum(fates["dropped_by"].values()) == fates["dropped"], name
        entry = syncer.ledger[name]
        core = record.learners[i]
        unadopted = sum(f.pushed.tokens for p, f in enumerate(core.fates.fragments)
                        if entry.incarnation == core.incarnation and f.pushed_step is not None
                        and entry.merged_steps.get(p) == f.pushed_step)
        assert ft["applied"] + unadopted == entry.merged_tokens_total, name


def test_goodput_of_one_scripted_kill_by_hand():
    """2 learners, 1 s steps, P = H = 1, τ = 0, zero latency: every step is merged when it ends.
    r:1 dies at 2.5 s inside step 3, is back at 4.0 s (restart 1.5 s), resumes at its applied step
    2 and trains steps 3..6 on [4, 8). Useful: r:0 6 s + r:1 (2 + 4) s = 12 s. Allocated: r:0 until
    it finishes at 6 s, r:1 until 8 s: 14 s. Goodput 12/14 = 0.857; the 2 s lost are half a step
    and 1.5 s down."""
    plan = FaultPlan().crash("r:1", at_s=2.5)
    record, syncer, calls = run(plan)
    assert record.goodput == pytest.approx(12 / 14)
    assert record.allocated_s == [6.0, 8.0] and record.useful_s == [6.0, 6.0]
    # its schedule at the fleet's (the fleet clock): r:0 merged step 4 at 4.0 s, r:1 step 2
    assert record.restarts == [{"learner": "r:1", "incarnation": 1, "cause": "kill",
                                "failed_s": 2.5, "back_s": 4.0, "down_s": 1.5,
                                "resume_step": 2, "schedule_step": (4 + 2) // 2, "peer": "r:0"}]
    assert [k for i, k in calls if i == 1] == [0, 1, 2, 2, 3, 4, 5]  # batch 2 is trained again
    fates = record.ledger["r:1"]
    assert {k: fates[k] for k in ("processed", "applied", "dropped", "in_flight", "dropped_by",
                                  "restarts")} == {
        "processed": 7 * TOKENS, "applied": 6 * TOKENS, "dropped": TOKENS, "in_flight": 0,
        "dropped_by": {"kill": TOKENS}, "restarts": 1}
    assert_ledger_balances(record, syncer)
    assert record.down_intervals == [[], [(2.5, 4.0)]]
    assert record.steps == [6, 6] and plan.fired == plan.faults
    _, windowed, cumulative = record.goodput_series(2.0)
    # 2 s bins: [2, 4) has r:0's 2 useful s of 4 allocated (r:1 lost step 3 and was down);
    # [6, 8) has only r:1, which is allocated (r:0 finished at 6 s) and useful
    assert windowed.tolist() == pytest.approx([1.0, 0.5, 1.0, 1.0])
    assert cumulative[-1] == pytest.approx(12 / 14)


def test_a_warm_spare_takes_over_through_the_same_fleet_state_machine_by_hand():
    """The kill above with one warm spare: the fleet launches it once both learners train (t=0),
    it is ready at 1.0 s; r:1 dies at 2.5 s and the spare is r:1 again at 2.5 + 0.25 s (a
    promotion, not the 1.5 s restart), resumes at its applied step 2 and trains steps 3..6 on
    [2.75, 6.75). Useful 6 + 6 = 12 s; allocated 6 + 6.75 = 12.75 s (the spare's own seconds are
    reported apart, not as a learner's): goodput 12/12.75 = 0.941."""
    plan = FaultPlan().crash("r:1", at_s=2.5)
    record, syncer, calls = run(plan, spares=1, promote_s=0.25, spare_ready_s=1.0)
    # its schedule at the fleet's: at 2.75 s r:0 and r:1 both merged step 2
    assert record.restarts == [{"learner": "r:1", "incarnation": 1, "cause": "kill",
                                "failed_s": 2.5, "back_s": 2.75, "down_s": 0.25,
                                "resume_step": 2, "schedule_step": 2, "peer": "r:0"}]
    assert record.goodput == pytest.approx(12 / 12.75)
    assert record.allocated_s == [6.0, 6.75] and record.end_time_s == 6.75
    names = [(t, x.name) for t, x in record.transitions if x.name.startswith("spare_")]
    # the first spare, its promotion, the next spare once r:1 trains again (ready at 3.75),
    # ended with the run
    assert names == [(0.0, "spare_launched"), (1.0, "spare_ready"), (2.5, "spare_promoted"),
                     (2.75, "spare_launched"), (3.75, "spare_ready"), (6.75, "spare_ended")]
    assert [k for i, k in calls if i == 1] == [0, 1, 2, 2, 3, 4, 5]
    assert_ledger_balances(record, syncer)


def test_a_hang_is_found_by_the_timeout_and_a_restart_takes_cpu_from_the_survivors():
    """r:1 wedges at 2.5 s; the health timeout (detect_hang_s = 1) sees it at 3.5 s, and the new
    process (restart 1.5 s) is back at 5.0 s. While that process starts (3.5 – 5.0 s) every
    running learner's step is 1.5× (survivor_slowdown_per_start 0.5 × one start): r:0's step
    that starts at 4.0 s ends at 5.5 s, the others take 1 s."""
    plan = FaultPlan().hang("r:1", at_s=2.5, duration_s=30.0)
    record, syncer, _ = run(plan, steps=8, detect_hang_s=1.0, survivor_slowdown_per_start=0.5)
    assert [(r["cause"], r["failed_s"], r["back_s"]) for r in record.restarts] == [
        ("hang", 2.5, 5.0)]
    r0 = [(s.start_s, s.step_s) for s in record.step_log if s.learner == 0]
    assert r0[:7] == [(0.0, 1.0), (1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (4.0, 1.5), (5.5, 1.0),
                      (6.5, 1.0)]
    assert_ledger_balances(record, syncer)


def test_process_starts_share_the_cores_so_a_burst_makes_each_slower_by_hand():
    """start_cpu_s = 1, start_cores = 1: one restart alone takes 1 s, two at once share the core
    and take 2 s each. r:1 and r:2 die at 2.5 s: both are back at 4.5 s (not 3.5 s). r:0 dies at
    6.5 s alone: back at 7.5 s. A start killed midway stops taking CPU: r:2 dies again at 9.0 s
    (its start alone until 9.5 s: 0.5 s done), r:1 at 9.5 s (two starts at 0.5 CPU/s each), and
    r:2's start is killed at 10.0 s with 0.25 s left: it is dropped and r:2 starts anew (1 s).
    At 10.0 s r:1 has 0.75 s left and r:2 1 s: r:1 is back at 10.0 + 0.75/0.5 = 11.5 s; r:2 then
    has 0.25 s left, alone at 1 CPU/s: back at 11.75 s."""
    plan = (FaultPlan().crash("r:1", at_s=2.5).crash("r:2", at_s=2.5).crash("r:0", at_s=6.5)
            .crash("r:2", at_s=9.0).crash("r:1", at_s=9.5).crash("r:2", at_s=10.0))
    record, syncer, _ = run(plan, M=3, steps=14, start_cpu_s=1.0, start_cores=1.0)
    back = [(r["learner"], r["failed_s"], r["back_s"]) for r in record.restarts]
    assert back == [("r:1", 2.5, 4.5), ("r:2", 2.5, 4.5), ("r:0", 6.5, 7.5),
                    ("r:1", 9.5, 11.5), ("r:2", 9.0, 11.75)]
    assert_ledger_balances(record, syncer)


def test_measured_restart_and_promotion_samples_are_drawn_seeded():
    costs = RestartCosts(restart_s=9.0, promote_s=9.0, restart_samples_s=(1.0, 2.0, 3.0),
                         promote_samples_s=(0.25,), seed=3)
    draw, again = costs.sampler(), costs.sampler()
    restarts = [draw(False) for _ in range(20)]
    assert set(restarts) <= {1.0, 2.0, 3.0} and len(set(restarts)) == 3
    assert restarts == [again(False) for _ in range(20)]      # same seed, same draws
    assert draw(True) == 0.25
    assert RestartCosts(restart_s=2.5).sampler()(False) == 2.5  # no samples: the flat figure


def test_a_kill_drops_unmerged_work_the_victim_resumes_and_the_others_never_wait():
    """3 learners, P = 2, H = 4, τ = 2, 0.3 s latency: pushes are in flight when r:1 dies."""
    kwargs = dict(M=3, P=2, H=4, tau=2, steps=40, latency_s=0.3)
    clean, _, clean_calls = run(None, **kwargs)
    plan = FaultPlan().crash("r:1", at_s=17.5, repair_s=3.0)
    record, syncer, calls = run(plan, **kwargs)
    assert plan.fired == plan.faults
    assert_ledger_balances(record, syncer)
    fates = record.ledger["r:1"]
    assert fates["dropped"] > 0 and fates["restarts"] == 1
    (restart,) = record.restarts
    # the service's rule: its next process is prestarted at the kill and ready after
    # spare_ready_s (3.0), when the repair (3.0) is over too; its promotion takes 0.3 s
    assert restart["back_s"] == pytest.approx(17.5 + 3.0 + 0.3)
    # the victim's first batch after the restart is its applied step at the time it died
    assert restart["resume_step"] == record.watermarks[(1, 0)] < 17
    started_before = sum(s.learner == 1 and s.incarnation == 0 for s in record.step_log)
    assert started_before == 18   # steps 1..18; the 18th was cut short at 17.5 s
    after = [k for i, k in calls if i == 1][started_before:]
    assert after == list(range(restart["resume_step"], 40))
    # the others keep their schedule exactly: same steps at the same times
    for i in (0, 2):
        assert ([(s.step, s.start_s) for s in record.step_log if s.learner == i]
                == [(s.step, s.start_s) for s in clean.step_log if s.learner == i])
        assert [k for j, k in calls if j == i] == [k for j, k in clean_calls if j == i]
    assert record.steps == [40, 40, 40]
    # τ/H = 2/4: the two steps between a fragment's push and its adoption are overwritten, so
    # about half of each fragment's work is applied even without faults (books, not a guess)
    assert clean.goodput > record.goodput > 0.4
    assert clean.ledger["r:0"]["dropped_by"]["overlap"] > 0.4 * clean.ledger["r:0"]["processed"]
    # the honest useful time is below what a watermark (every step before a merged push) credits
    watermark_s = sum(s.step_s for s in record.step_log if record.applied(s))
    assert sum(record.useful_s) < watermark_s


def test_a_restart_in_a_mixed_speed_fleet_takes_the_fleets_schedule_count():
    """The fleet clock (the default): r:1 runs at a quarter of r:0's speed and is killed; its
    restart resumes its data at its own step but its inner schedule at the fleet's count, the
    one the syncer reads its pushes at (r:0's copied inner state takes it too)."""
    record, syncer, _ = run(FaultPlan().crash("r:1", at_s=12.2, repair_s=0.0), M=2, P=1, H=2,
                            steps=40, speeds=[1.0, 0.25])
    (restart,) = record.restarts
    # back at 12.2 + 1.5: r:0 (1 s steps) has pushed and merged every second step up to 12;
    # r:1 (4 s steps) merged its push at step 2 (t = 8) and died in its fourth step. It resumes
    # its data at 2, its schedule at the fleet's (12 + 2) / 2 = 7 (a peer's copied state too)
    assert (restart["back_s"], restart["peer"]) == (pytest.approx(13.7), "r:0")
    assert (restart["resume_step"], restart["schedule_step"]) == (2, 7)
    # the learner clock: its own step, for the peer's copied state too
    record, _, _ = run(FaultPlan().crash("r:1", at_s=12.2, repair_s=0.0), M=2, P=1, H=2,
                       steps=40, speeds=[1.0, 0.25], schedule_clock="learner")
    assert (record.restarts[0]["resume_step"], record.restarts[0]["schedule_step"]) == (2, 2)
    assert_ledger_balances(record, syncer)


def test_region_loss_slowdown_and_horizon():
    ids = ["a:0", "a:1", "b:0"]
    plan = (FaultPlan().lose_region("a", at_s=3.5, repair_s=1.0)
            .slow("b:0", at_s=2.0, duration_s=1.0, factor=3.0))
    record, syncer, _ = run(plan, ids=ids, steps=100, until_s=20.0)
    # detect (lost node: 10 s, at 13.5): each one's next process is prestarted then (the
    # service's rule) and ready 3 s later; due after the 1 s repair (14.5), each restart waits
    # for it (spare_wait_s) and is promoted in 0.3 s: back at 13.5 + 3 + 0.3 = 16.8
    assert [(r["learner"], r["back_s"]) for r in record.restarts] == [("a:0", 16.8),
                                                                     ("a:1", 16.8)]
    # Both are relaunched at once, when no learner of region a trains: the fleet's one peer
    # policy (same region first, else any training learner) gives each of them b:0.
    assert [r["peer"] for r in record.restarts] == ["b:0", "b:0"]
    # b:0's step starting at 2 s takes 3 s: steps end at 1, 2, 5, 6, …, 20 → 2 + 1 + 15 steps
    b_steps = [s for s in record.step_log if s.learner == 2]
    assert [s.step_s for s in b_steps[:4]] == [1.0, 1.0, 3.0, 1.0]
    # a:0 and a:1's last step starts at 16.8 + 3 = 19.8 (before the horizon) and ends at 20.8
    assert record.steps[2] == 18 and record.allocated_s == [20.8, 20.8, 20.0]
    assert_ledger_balances(record, syncer)


def test_syncer_kill_fences_the_old_epoch_and_training_goes_on():
    plan = FaultPlan().kill_syncer(at_s=5.2)
    record, syncer, _ = run(plan, M=3, P=2, H=4, tau=2, steps=20, latency_s=0.3)
    assert syncer.epoch == 1 and plan.fired == plan.faults
    assert record.steps == [20, 20, 20]
    assert sum(record.rejected.values()) > 0   # pushes that met the dead syncer or the old epoch
    assert_ledger_balances(record, syncer)
    assert record.goodput > 0.4   # τ/H = 1/2 of each fragment's steps are overwritten anyway


def test_a_fault_for_an_unknown_target_is_refused():
    with pytest.raises(ValueError, match=r"kill target 'x:9' is not a learner"):
        run(FaultPlan().crash("x:9", at_s=1.0))
