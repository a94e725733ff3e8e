"""Hand-worked values for the asynchrony rules (issue 34; docs/architecture.md#asynchrony-stale-and-partial-merges):
the re-based outer gradient, one outer step per round, the staleness share and the fleet clock.

Every syncer here holds one fragment ``w`` with M = 2 or 3 registered learners, fp32 drifts, the
weighted mean and outer sgd(1.0) (plain averaging: Θ ← Θ − share · Δ̄), so each value is a sum
one can do by hand."""

import time

import numpy as np
import pytest

from islands.learners import inner
from islands.learners.core import LearnerCore
from islands.syncer import downlink, fragments, merge, outer, state
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.validate import Push

SGD1 = outer.build("sgd", lr=1.0, momentum=0.0)


def decode(codes):
    return {k: np.asarray(v, np.float32) for k, v in codes.items()}


def syncer(names=("a", "b"), theta=0.0, **settings):
    core = SyncerCore([{"w": np.array([theta], np.float32)}],
                      SyncerSettings(outlier_norm_factor=None, merge_rule=merge.MergeRule.MEAN,
                                     **settings), SGD1, decode)
    for name in names:
        core.register(name, 0)
    return core


def push(core, learner, drift, base_version, tokens=100, steps=1, step=None):
    verdict = core.accept_push(Push(learner, 0, {"w": np.array([drift], np.float32)},
                                    base_version, core.epoch, tokens, steps,
                                    step=steps if step is None else step, tokens_done=tokens),
                               0.0)
    assert verdict.ok, verdict
    return verdict


def theta(core):
    return float(core.fragment(0)[0]["w"][0])


# -- the pure functions ---------------------------------------------------------------------------
def test_gradient_anchor_signs():
    now, then, held = {"w": np.array([5.0])}, {"w": np.array([2.0])}, {"w": np.array([2.5])}
    # pull: g = Θ − (base + δ) with δ = 1: 5 − 3.5 = +1.5 (Θ is pulled down, towards 3.5)
    g_pull = merge.gradient_anchor(merge.OuterGradientRule.PULL, now, then, held)["w"] - 3.5
    # rebased: g = Θ(v_base) − (base + δ) = 2 − 3.5 = −1.5: Θ moves up by the drift (and the
    # base's rounding, 0.5): 5 + 1.5 = 6.5
    g_rebased = merge.gradient_anchor(merge.OuterGradientRule.REBASED, now, then, held)["w"] - 3.5
    assert g_pull.tolist() == [1.5] and g_rebased.tolist() == [-1.5]
    # the version is gone from the history: g = base − (base + δ) = −δ
    assert merge.gradient_anchor(merge.OuterGradientRule.REBASED, now, None, held)["w"] is held["w"]


def test_participation_share_exact_values():
    assert merge.participation_share([0], 2) == 0.5            # n/M
    assert merge.participation_share([0, 0, 0], 2) == 1.0      # capped
    assert merge.participation_share([1], 2, 1.0) == 0.25      # a lone stale push: ½ · ½
    assert merge.participation_share([0, 1, 3], 4, 1.0) == pytest.approx((1 + 0.5 + 0.25) / 4)
    assert merge.participation_share([5], 0) == 1.0            # no live count: no scaling
    assert merge.participation_share([7, 7], 2) == 1.0         # d = 0: staleness changes nothing


def test_fleet_step_and_schedule_position():
    assert merge.fleet_step([10, 20, 30, 40]) == 25.0
    assert merge.fleet_step([]) == 0.0
    # first merge of a run: the fleet at 24, the learner pushed at 24 and adopts at 26
    assert merge.schedule_position(24.0, 24, 26) == 26
    # a slow learner (its own step 12) takes the fleet's 24 + its 2 steps since the push
    assert merge.schedule_position(24.0, 10, 12) == 26
    # a fast learner (step 50) is held back to the fleet's
    assert merge.schedule_position(24.4, 48, 50) == 26
    assert merge.schedule_position(3.0, None, 9) == 3   # no open push (a refusal's restart)


# -- the re-based gradient ----------------------------------------------------------------------
@pytest.mark.parametrize("rule, expected", [("pull", 1.25), ("rebased", 1.5)])
def test_a_stale_push(rule, expected):
    # M = 2, Θ0 = 0. a pushes δ = 1 from v0, merged alone: g = 0 − 1 = −1, share ½: Θ1 = 0.5.
    # Each partial merge its own step (per_merge; per_round's join is tested below).
    core = syncer(outer_gradient=merge.OuterGradientRule(rule),
                  round_step=merge.RoundStep.PER_MERGE)
    push(core, "a", 1.0, 0)
    assert core.merge(0, live_count=2).version == 1 and theta(core) == 0.5
    # b pushes δ = 2 from v0 (staleness 1). pull: g = Θ1 − (0 + 2) = −1.5, Θ2 = 0.5 + 0.75;
    # rebased: g = Θ0 − (0 + 2) = −2, Θ2 = 0.5 + 1 (b's own drift, at its share).
    assert push(core, "b", 2.0, 0).staleness == 1
    result = core.merge(0, live_count=2)
    assert result.staleness == (1,)
    assert theta(core) == expected


def test_rebased_equals_pull_at_staleness_zero():
    results = []
    for rule in ("pull", "rebased"):
        core = syncer(outer_gradient=merge.OuterGradientRule(rule), theta=3.0)
        push(core, "a", 1.0, 0)
        push(core, "b", -0.5, 0)
        core.merge(0, live_count=2)
        results.append(theta(core))
    assert results == [3.25, 3.25]   # 3 + mean(1, −0.5)


# -- one outer step per round -------------------------------------------------------------------
@pytest.mark.parametrize("rule, last_theta", [("pull", 10 / 3), ("rebased", 3.0)])
def test_round_of_three_in_three_merges(rule, last_theta):
    core = syncer(("a", "b", "c"), round_step=merge.RoundStep.PER_ROUND,
                  outer_gradient=merge.OuterGradientRule(rule))
    # first merge of the round: a alone, share 1/3 of g = −3: Θ1 = 1
    push(core, "a", 3.0, 0)
    first = core.merge(0, live_count=3)
    assert (first.joined, theta(core)) == (0, 1.0)
    # b (δ = 6 from v0) joins: the step is taken again from Θ0 with a and b: mean(−3, −6) =
    # −4.5 at share 2/3: Θ2 = 3 (not 1 + ⅓·(...)): under pull, b's g = Θ1 − 6 = −5 is moved
    # to the round's start: −5 + (0 − 1) = −6.
    push(core, "b", 6.0, 0)
    second = core.merge(0, live_count=3)
    assert (second.joined, second.learners, theta(core)) == (1, ("b",), 3.0)
    # last merge of the round: c (δ = 0 from v1, θ_c = Θ1 = 1) joins at share 1. rebased:
    # g_c = Θ1 − 1 = 0, mean(−3, −6, 0) = −3: Θ3 = 3. pull: g_c = Θ_start − 1 = −1 (c moved
    # Θ_start by +1 as far as the pull can tell), mean(−3, −6, −1) = −10/3: Θ3 = 10/3.
    push(core, "c", 0.0, 1)
    last = core.merge(0, live_count=3)
    assert last.joined == 2 and theta(core) == pytest.approx(last_theta, abs=1e-6)
    # the round held every live learner: a's next push opens a new one from Θ3 (+⅓·3)
    push(core, "a", 3.0, 3)
    new = core.merge(0, live_count=3)
    assert new.joined == 0 and theta(core) == pytest.approx(last_theta + 1.0, abs=1e-6)


def test_a_learner_already_in_the_round_opens_the_next():
    core = syncer(("a", "b", "c"), round_step=merge.RoundStep.PER_ROUND)
    push(core, "a", 3.0, 0)
    core.merge(0, live_count=3)             # Θ1 = 1 (a alone, share 1/3)
    push(core, "a", 3.0, 1)                 # a again, before b and c: a new round from Θ1
    result = core.merge(0, live_count=3)
    assert (result.joined, theta(core)) == (0, 2.0)
    assert set(core.slots[0].stepped) == {"a"}


def test_per_round_token_weights_and_books_unchanged():
    core = syncer(round_step=merge.RoundStep.PER_ROUND)
    # weights c_tokens²/c_steps: 100²/1 = 10⁴ and 300²/3 = 3·10⁴: ¼ and ¾
    push(core, "a", 4.0, 0, tokens=100, steps=1)
    core.merge(0, live_count=2)                        # Θ1 = 0 + ½·4 = 2
    push(core, "b", 8.0, 0, tokens=300, steps=3)       # joins: ¼·4 + ¾·8 = 7 at share 1
    core.merge(0, live_count=2)
    assert theta(core) == 7.0
    # the books count each push once, in the merge that included it
    assert core.ledger["a"].merged_tokens_total == 100
    assert core.ledger["b"].merged_tokens_total == 300


def test_per_merge_is_todays_rule():
    # pull and per_merge, named (the core's defaults before they became the service's)
    core = syncer(outer_gradient=merge.OuterGradientRule.PULL,
                  round_step=merge.RoundStep.PER_MERGE)
    push(core, "a", 4.0, 0)
    core.merge(0, live_count=2)                        # Θ1 = 2
    push(core, "b", 8.0, 0)                            # pull, stale: g = 2 − 8 = −6, share ½
    core.merge(0, live_count=2)
    assert theta(core) == 5.0


def test_a_lone_stale_push_is_discounted_by_the_share():
    core = syncer(outer_gradient=merge.OuterGradientRule.REBASED, staleness_share=1.0)
    push(core, "a", 4.0, 0)
    core.merge(0, live_count=2)                        # staleness 0: share ½, Θ1 = 2
    push(core, "b", 4.0, 0)                            # staleness 1: share ½ · ½ = ¼
    core.merge(0, live_count=2)
    assert theta(core) == 3.0
    # a staleness *discount* of the weights does nothing to a lone push
    core = syncer(outer_gradient=merge.OuterGradientRule.REBASED, staleness_discount=1.0)
    push(core, "a", 4.0, 0)
    core.merge(0, live_count=2)
    push(core, "b", 4.0, 0)
    core.merge(0, live_count=2)
    assert theta(core) == 4.0


def test_a_push_across_a_syncer_restart_opens_a_new_round():
    core = syncer(round_step=merge.RoundStep.PER_ROUND,
                  outer_gradient=merge.OuterGradientRule.REBASED)
    push(core, "a", 4.0, 0)
    core.merge(0, live_count=2)                        # Θ1 = 2, a stepped in the open round
    arrays, meta = state.snapshot_tree(core)
    restarted = syncer((), round_step=merge.RoundStep.PER_ROUND,
                       outer_gradient=merge.OuterGradientRule.REBASED)
    state.restore_into(restarted, arrays, meta)
    restarted.register("b", 0)
    # b re-registered and pushes from the restored v1: a new round (the restarted syncer does
    # not know a's part), share ½ of g = Θ1 − (2 + 2) = −2: Θ2 = 3
    push(restarted, "b", 2.0, 1)
    result = restarted.merge(0, live_count=2)
    assert (result.joined, result.staleness, theta(restarted)) == (0, (0,), 3.0)


# -- the fleet clock ----------------------------------------------------------------------------
def test_merges_carry_the_fleet_step_to_the_learners():
    core = syncer(schedule_clock=merge.ScheduleClock.FLEET)
    for name in ("a", "b"):   # registered long enough ago to have taken 30 steps
        core.registered_at[name] = (0, time.monotonic() - 60.0)
    push(core, "a", 1.0, 0, step=30)
    push(core, "b", 1.0, 0, step=10)
    result = core.merge(0, live_count=2)
    assert result.fleet_step == 20.0 == core.fleet_step()
    updates = core.updates(result)
    assert {u.fleet_step for u in updates.values()} == {20.0}
    assert isinstance(updates["a"], downlink.FullUpdate)
    # without the fleet clock, nothing rides along
    plain = syncer(schedule_clock=merge.ScheduleClock.LEARNER)
    plain.registered_at["a"] = (0, time.monotonic() - 60.0)
    push(plain, "a", 1.0, 0, step=30)
    assert plain.updates(plain.merge(0, live_count=2))["a"].fleet_step is None


def schedule_count(opt_state):
    return int(opt_state[1][2].count)


def test_a_learner_adopts_the_fleets_schedule_position():
    params = {"w": np.zeros((2, 2), np.float32)}
    plan = fragments.partition(params, 1)
    opt = inner.inner_optimizer()
    core = LearnerCore("a", params, opt.init(params), plan, [0],
                       error_feedback=_NoEF(), wire_bytes=lambda codes: 0, decode=decode,
                       overlap_steps=2, carry_overlap=False)
    core.step = 40                      # it pushed at its step 40 ...
    core.tracks[0].in_flight_since_step = 40
    core.step = 43                      # ... and adopts 3 steps later
    core.offer_reply(0, downlink.FullUpdate(params, 1, fleet_step=100.0), 1)
    assert core.adopt_ready() == [0]
    assert schedule_count(core.opt_state) == 103
    assert int(core.opt_state[1][0].count) == 0         # Adam's own count is not touched
    # an update without the fleet's step leaves the count alone
    core.tracks[0].in_flight_since_step = 43
    core.step = 45
    core.offer_reply(0, downlink.FullUpdate(params, 2), 2)
    core.adopt_ready()
    assert schedule_count(core.opt_state) == 103


def test_a_restart_of_a_mixed_speed_fleet_runs_its_first_push_at_the_rates_the_syncer_reads():
    """Fleet clock, warm-up over 100 counts (rate = count/100 there). The fast learner f merged
    its push at step 100, the slow s at step 20: the fleet stands at 60. s restarts at its own
    step 20; the syncer tells it 60 at registration, for a fresh inner state and for f's copied
    one (count 110) alike. s takes 4 steps (counts 60..63) while f merges a push at step 108:
    the fleet is at (108 + 20)/2 = 64 when s's push is read, over counts 60..63, exactly the
    rates s ran. (At its own step, s would have run 20..23: 0.86 against the 2.46 read.)"""
    from islands.learners.factories import place_learner_state
    from islands.syncer.validate import lr_sum, warmup_cosine

    schedule = (1.0, 100, 1000, 0.1)
    core = syncer(("f", "s"), schedule_clock=merge.ScheduleClock.FLEET, inner_schedule=schedule,
                  round_step=merge.RoundStep.PER_MERGE)
    for name in ("f", "s"):
        core.registered_at[name] = (0, time.monotonic() - 60.0)
    push(core, "f", 1.0, 0, step=100)
    push(core, "s", 1.0, 0, step=20)
    core.merge(0, live_count=2)
    core.forget("s")
    core.register("s", 1)                               # the restart, resuming at step 20
    core.registered_at["s"] = (20, time.monotonic() - 60.0)
    assert core.ledger["s"].applied_step == 20 and core.schedule_start() == 60
    params = {"w": np.zeros((2, 2), np.float32)}
    opt = inner.inner_optimizer(lr=1.0, warmup_steps=100, total_steps=1000)
    donor = inner.at_schedule_step(opt.init(params), 110)    # f's own count
    for peer_state in (None, donor):
        _, state = place_learner_state(None, opt, params, peer_state, core.schedule_start())
        counts = []
        for _ in range(4):                                   # its first push's inner steps
            counts.append(schedule_count(state))
            _, state = opt.update({"w": np.ones((2, 2), np.float32)}, state, params)
        assert counts == [60, 61, 62, 63]
    push(core, "f", 1.0, 1, tokens=200, step=108)
    core.merge(0, live_count=2)                              # the fleet moves on meanwhile
    first = Push("s", 0, {"w": np.array([1.0], np.float32)}, 2, core.epoch, 400, 4, step=24,
                 tokens_done=400, incarnation=1)
    at = core.schedule_read_at(first)
    assert at == 64
    ran = float(np.sum(warmup_cosine(np.array(counts, np.float64), *schedule)))
    assert lr_sum(schedule, at, 4) == pytest.approx(ran) == pytest.approx(2.46)
    assert core.accept_push(first, 0.0).ok
    # a fleet with nothing merged yet starts at 0; the learner clock tells nothing (the
    # restart's schedule runs on its own steps)
    assert syncer(("a",)).schedule_start() == 0
    assert syncer(("a",), schedule_clock=merge.ScheduleClock.LEARNER).schedule_start() is None


class _NoEF:
    def init(self, tree):
        return None

    def update(self, drift, state):
        return drift, state


# -- the round-completion wait (syncer.round_wait) ----------------------------------------------
def push_at(core, learner, drift, base_version, now_s):
    verdict = core.accept_push(Push(learner, 0, {"w": np.array([drift], np.float32)},
                                    base_version, core.epoch, 100, 1, step=1, tokens_done=100),
                               now_s)
    assert verdict.ok, verdict
    return verdict


def two_rounds(round_wait, b_phase=1.0):
    """a and b push every 24 s (a at 0, 24; b at ``b_phase``, 24 + ``b_phase``), each round
    merged whole: Θ0 = 0 → Θ1 = 3 (drifts 2, 4) → Θ2 = 5 (drifts 1, 3)."""
    core = syncer(round_step=merge.RoundStep.PER_ROUND,
                  outer_gradient=merge.OuterGradientRule.REBASED, round_wait=round_wait)
    for t0, (da, db) in ((0.0, (2.0, 4.0)), (24.0, (1.0, 3.0))):
        push_at(core, "a", da, core.slots[0].version, t0)
        push_at(core, "b", db, core.slots[0].version, t0 + b_phase)
        assert core.decide(0, t0 + b_phase, frozenset("ab"), 1.0).merge
        core.merge(0, live_count=2)
    assert theta(core) == 5.0 and core.push_times[("b", 0)] == 24.0 + b_phase
    assert core.push_periods == {"a": 24.0, "b": 24.0}
    return core


def test_round_hold_predictions():
    from islands.syncer.quorum import round_hold
    # b last pushed at 25 with a 24 s period: due at 49, within 48 + 12: held until 49 + 1
    assert round_hold({"b": (24.0, 25.0)}, 48.0, 48.0, 12.0, 1.0) == 50.0
    # due at 49 but the bound ends at 48 + 0.5: not waited for
    assert round_hold({"b": (24.0, 25.0)}, 48.0, 48.0, 0.5, 1.0) is None
    # overdue by more than the margin (a push it skipped, or a learner that is gone): its next
    # one is a period later (73), beyond the bound: not waited for
    assert round_hold({"b": (24.0, 25.0)}, 50.5, 48.0, 12.0, 1.0) is None
    # a skipped push: the next after it (25 + 2·12 = 49) is waited for
    assert round_hold({"b": (12.0, 25.0)}, 48.0, 48.0, 12.0, 1.0) == 50.0
    # no period or no push of the fragment yet: not predicted; the latest due learner sets it
    assert round_hold({"b": (None, 25.0), "e": (24.0, None), "c": (20.0, 30.0),
                       "d": (24.0, 27.0)}, 48.0, 48.0, 12.0, 1.0) == 52.0


def test_round_wait_first_push_waits_for_a_due_learner():
    core = two_rounds(0.5)
    push_at(core, "a", 2.0, 2, 48.0)
    # b is due at 25 + 24 = 49: held past the grace window (48 + 1) until 49 + 1
    decision = core.decide(0, 48.0, frozenset("ab"), 1.0)
    assert (decision.merge, decision.wait_until_s) == (False, 50.0)
    assert not core.decide(0, 49.5, frozenset("ab"), 1.0).merge
    push_at(core, "b", 4.0, 2, 49.6)
    decision = core.decide(0, 49.6, frozenset("ab"), 1.0)
    assert (decision.merge, decision.reason.value) == (True, "all_live_in")
    # the round merges whole: Θ3 = 5 − mean(5 − 7, 5 − 9) = 8, one version, no join
    result = core.merge(0, live_count=2)
    assert (theta(core), result.version, result.joined, result.staleness) == (8.0, 3, 0, (0, 0))


def test_round_wait_off_merges_at_the_grace_window():
    core = two_rounds(0.0)
    push_at(core, "a", 2.0, 2, 48.0)
    assert core.decide(0, 48.0, frozenset("ab"), 1.0).wait_until_s == 49.0
    decision = core.decide(0, 49.0, frozenset("ab"), 1.0)
    assert (decision.merge, decision.reason.value) == (True, "grace_expired")
    core.merge(0, live_count=2)                   # a alone: Θ3 = 5 + ½·2 = 6, replied to a
    assert theta(core) == 6.0
    push_at(core, "b", 4.0, 2, 49.6)              # stale by 1, joins the round: Θ4 = 8
    result = core.merge(0, live_count=2)
    assert (theta(core), result.joined, result.staleness) == (8.0, 1, (1,))


def test_round_wait_not_beyond_its_bound_nor_for_an_overdue_learner():
    core = two_rounds(0.1, b_phase=5.0)           # b due at 29 + 24 = 53 > 48 + 0.1·24
    push_at(core, "a", 2.0, 2, 48.0)
    assert core.decide(0, 48.0, frozenset("ab"), 1.0).wait_until_s == 49.0
    core = two_rounds(0.5)
    push_at(core, "a", 2.0, 2, 48.0)
    assert core.decide(0, 50.0, frozenset("ab"), 1.0).merge   # b due at 49, not in by 50


def test_round_wait_last_push_of_a_round_merges_at_once():
    core = two_rounds(0.5)
    push_at(core, "a", 2.0, 2, 48.0)
    core.merge(0, live_count=2)                   # a alone (say the hold expired): Θ3 = 6
    push_at(core, "b", 4.0, 2, 52.0)              # the round's last learner: nothing to wait for
    decision = core.decide(0, 52.0, frozenset("ab"), 1.0)
    assert (decision.merge, decision.reason.value) == (True, "all_live_in")
    result = core.merge(0, live_count=2)
    assert (theta(core), result.joined, result.staleness) == (8.0, 1, (1,))
    # without the wait the same push waits out the grace window for nobody
    core = two_rounds(0.0)
    push_at(core, "a", 2.0, 2, 48.0)
    core.merge(0, live_count=2)
    push_at(core, "b", 4.0, 2, 52.0)
    assert core.decide(0, 52.0, frozenset("ab"), 1.0).wait_until_s == 53.0


def test_round_wait_a_stale_push_is_merged_as_without_the_wait():
    # b's push is based on v1 (it had not adopted v2): staleness 1 with or without the hold,
    # re-based g_b = Θ(v1) − (3 + 4) = −4, g_a = 5 − 7 = −2: Θ3 = 5 + 3 = 8 both ways
    for wait in (0.5, 0.0):
        core = two_rounds(wait)
        push_at(core, "a", 2.0, 2, 48.0)
        push_at(core, "b", 4.0, 1, 48.5)
        result = core.merge(0, live_count=2)
        assert (theta(core), result.staleness) == (8.0, (0, 1))


def test_round_wait_forgets_its_timings_across_a_restart_and_a_new_incarnation():
    core = two_rounds(0.5)
    core.register("b", 1)                         # a new incarnation: measured afresh
    assert ("b", 0) not in core.push_times and ("a", 0) in core.push_times
    assert "b" not in core.push_periods and core.push_periods["a"] == 24.0
    core = two_rounds(0.5)
    arrays, meta = state.snapshot_tree(core)
    restarted = syncer((), round_step=merge.RoundStep.PER_ROUND,
                       outer_gradient=merge.OuterGradientRule.REBASED, round_wait=0.5)
    state.restore_into(restarted, arrays, meta)
    for name in "ab":
        restarted.register(name, 0)
    assert restarted.push_times == {} and restarted.push_periods == {}
    # a push across the restart: nobody's period is known, so the grace window alone decides
    push_at(restarted, "a", 2.0, 2, 48.0)
    assert restarted.decide(0, 48.0, frozenset("ab"), 1.0).wait_until_s == 49.0
    core.restart(core.epoch + 1)
    assert core.push_times == {} and core.push_periods == {}


def test_round_wait_leaves_a_pause_out_of_the_periods_and_starts_over_on_resume():
    core = two_rounds(0.5)                        # periods 24, 24; a last at 24, b at 25
    core.pause_periods(True)                      # the fleet pauses at 30 ...
    push_at(core, "a", 1.0, 2, 35.0)              # ... pushes sent before arrive at 35, 40:
    push_at(core, "b", 1.0, 2, 40.0)
    assert core.push_periods == {"a": 24.0, "b": 24.0}   # no sample (15 would make b's 19.5)
    core.pause_periods(True)                      # (told again each tick: nothing changes)
    assert core.push_times[("b", 0)] == 40.0
    core.pause_periods(False)                     # resumed at 600: everything measured afresh
    assert core.push_times == {} and core.push_periods == {}
    core.merge(0, live_count=2)                   # the round the pause held, whole
    # a's first push after the resume: nobody's period is known, the grace window alone
    # decides (601 + 1). With the pause in it, a's period would be ½·24 + ½·566 = 295 and b
    # (last at 40, period 24) due at 40 + 24·24 = 616 ≤ 601 + ½·295: held until 617.
    push_at(core, "a", 2.0, 3, 601.0)
    assert core.decide(0, 601.0, frozenset("ab"), 1.0).wait_until_s == 602.0
    core.merge(0, live_count=2)                   # a alone
    push_at(core, "b", 2.0, 3, 605.0)             # joins a's round
    core.merge(0, live_count=2)
    # The periods start over: one gap each after the resume, 24 s, taken as they are
    for a_s, b_s in ((625.0, 629.0),):
        push_at(core, "a", 1.0, core.slots[0].version, a_s)
        push_at(core, "b", 1.0, core.slots[0].version, b_s)
        core.merge(0, live_count=2)
    assert core.push_periods == {"a": 24.0, "b": 24.0}
    # and predict again: a at 649, b due at 629 + 24 = 653 ≤ 649 + 12: held until 654
    push_at(core, "a", 1.0, core.slots[0].version, 649.0)
    assert core.decide(0, 649.0, frozenset("ab"), 1.0).wait_until_s == 654.0


def test_round_wait_reads_a_learners_period_off_any_fragment():
    # Two fragments: a learner's period, measured on fragment 1, predicts its second push of
    # fragment 0 (the round a fragment's own two pushes could not predict yet)
    core = SyncerCore([{"w": np.zeros(1, np.float32)}, {"v": np.zeros(1, np.float32)}],
                      SyncerSettings(outlier_norm_factor=None, merge_rule=merge.MergeRule.MEAN,
                                     round_step=merge.RoundStep.PER_ROUND,
                                     outer_gradient=merge.OuterGradientRule.REBASED,
                                     round_wait=0.5), SGD1, decode)
    for name in "ab":
        core.register(name, 0)

    def send(learner, p, now_s):
        key = "w" if p == 0 else "v"
        assert core.accept_push(Push(learner, p, {key: np.array([1.0], np.float32)},
                                     core.slots[p].version, core.epoch, 100, 1, step=1,
                                     tokens_done=100), now_s).ok

    for p, t in ((1, 2.0), (0, 10.0), (1, 26.0)):
        send("a", p, t)
        send("b", p, t + 1.0)
        core.merge(p, live_count=2)
    assert core.push_periods == {"a": 24.0, "b": 24.0}
    send("a", 0, 34.0)                            # b's next push of fragment 0: 11 + 24 = 35
    assert core.decide(0, 34.0, frozenset("ab"), 1.0).wait_until_s == 36.0
