"""Hand-worked values for the syncer's math (docs/architecture.md#the-algorithm): schedule, signs, weights, RDA, grace, outer."""

import math

import numpy as np
import optax
import pytest

from islands.learners.core import blend
from islands.syncer import fragments, merge, outer, quorum
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.quorum import MergeReason
from islands.syncer.validate import Push


def identity_decode(codes):
    return {k: np.asarray(v, np.float32) for k, v in codes.items()}


def one_fragment_syncer(theta, outer_optimizer, **settings):
    core = SyncerCore([{"w": np.asarray(theta, np.float32)}],
                      SyncerSettings(outlier_norm_factor=None, **settings), outer_optimizer,
                      identity_decode)
    for name in ("a", "b", "c"):
        core.register(name, 0)
    return core


def push_theta(core, learner, theta, tokens=100, steps=1, now_s=0.0):
    """Pushes the drift that brings the learner from the current global fragment to ``theta``."""
    current, version = core.fragment(0)
    drift = {"w": np.asarray(theta, np.float32) - current["w"]}
    verdict = core.accept_push(Push(learner, 0, drift, version, core.epoch, tokens, steps,
                                    step=steps, tokens_done=tokens), now_s)
    assert verdict.ok, verdict


# -- schedule -------------------------------------------------------------------------------------
def test_two_fragment_schedule_over_three_rounds():
    # P = 2, H = 4: offsets (0·4)//2 = 0 and (1·4)//2 = 2.
    assert fragments.fragment_offsets(2, 4) == (0, 2)
    due = {t: fragments.due_fragments(t, 2, 4) for t in range(0, 13)}
    assert due[0] == ()          # before the first step nothing is due
    assert due[1] == ()          # first step
    assert [t for t, ps in due.items() if 1 in ps] == [2, 6, 10]
    assert [t for t, ps in due.items() if 0 in ps] == [4, 8, 12]
    assert due[12] == (0,)       # last step of round 3
    # P = H: exactly one fragment, t mod P, at every step.
    assert [fragments.due_fragments(t, 3, 3) for t in range(1, 7)] == [(1,), (2,), (0,)] * 2


def test_partition_is_balanced_and_deterministic():
    params = {"a": np.zeros((10, 10)), "b": np.zeros(60), "c": np.zeros(50), "d": np.zeros(5)}
    plan = fragments.partition(params, 2)
    # Largest first: a(100) -> f0, b(60) -> f1, c(50) -> f1 (60 < 100), d(5) -> f0 (100 < 110).
    assert plan.fragments == (("a", "d"), ("b", "c"))
    assert plan.sizes == (105, 110)
    assert fragments.partition(params, 2) == plan
    with pytest.raises(ValueError, match=r"fragments \(5\) exceeds parameter tensors \(4\)"):
        fragments.partition(params, 5)


def test_extract_insert_round_trip():
    params = {"x": {"a": np.ones(3), "b": np.zeros(2)}, "y": np.full(4, 2.0)}
    plan = fragments.partition(params, 2)
    p = plan.fragment_of("x/b")
    frag = fragments.extract(params, plan, p)
    new = fragments.insert(params, plan, p, {k: v + 1 for k, v in frag.items()})
    np.testing.assert_array_equal(new["x"]["b"], np.ones(2))
    np.testing.assert_array_equal(new["y"], params["y"])


# -- signs and weights ----------------------------------------------------------------------------
def test_pseudo_gradient_sign():
    # Θ = [1, 2]; the learner trains to θ = [0.5, 2.5]: drift δ = [-0.5, 0.5], outer gradient
    # g = Θ − θ = [0.5, -0.5] (gradient sign), and sgd(1.0) steps Θ − g = θ.
    core = one_fragment_syncer([1.0, 2.0], outer.build("sgd", lr=1.0, momentum=0.0))
    push_theta(core, "a", [0.5, 2.5])
    result = core.merge(0)
    np.testing.assert_allclose(result.params["w"], [0.5, 2.5])
    assert result.version == 1
    assert result.outer_grad_norm == pytest.approx(math.sqrt(0.5))


def test_token_weights_hand_worked():
    # tokens 100/300 and steps 1/3 give weights 10⁴ and 3·10⁴: mean = 0.25·g₁ + 0.75·g₂.
    assert merge.token_weight(100, 1) == 1e4
    assert merge.token_weight(300, 3) == 3e4
    assert merge.token_weight(500, 0) == 0.0
    g1, g2 = np.array([4.0, 0.0]), np.array([0.0, 8.0])
    np.testing.assert_allclose(merge.weighted_mean([g1, g2], [1e4, 3e4]), [1.0, 6.0])
    # Through the syncer: learners at θ₁ = Θ − g₁, θ₂ = Θ − g₂ with those counters, sgd(1).
    core = one_fragment_syncer([0.0, 0.0], outer.build("sgd", lr=1.0, momentum=0.0),
                               merge_rule=merge.MergeRule.MEAN)
    push_theta(core, "a", -g1, tokens=100, steps=1)
    push_theta(core, "b", -g2, tokens=300, steps=3)
    np.testing.assert_allclose(core.merge(0).params["w"], [-1.0, -6.0])


def test_rda_two_vectors_and_fallback():
    # g₁ = [3, 0], g₂ = [0, 4], equal weights: mean length 3.5, mean direction [½, ½] → φ = [1,1]/√2.
    rda = merge.radial_directional_average([np.array([3.0, 0.0]), np.array([0.0, 4.0])], [1, 1])
    np.testing.assert_allclose(rda, [3.5 / math.sqrt(2)] * 2, rtol=1e-6)
    # Weights 3:1 → length (3·3 + 4)/4 = 3.25, direction ∝ [0.75, 0.25].
    rda = merge.radial_directional_average([np.array([3.0, 0.0]), np.array([0.0, 4.0])], [3, 1])
    np.testing.assert_allclose(rda, 3.25 * np.array([0.75, 0.25]) / math.hypot(0.75, 0.25),
                               rtol=1e-6)
    # Opposite directions cancel: fall back to the weighted mean [(1 − 2)/2, 0].
    fallback = merge.radial_directional_average([np.array([1.0, 0.0]), np.array([-1.0, 0.0])],
                                                [1, 1])
    np.testing.assert_allclose(fallback, [0.0, 0.0])
    fallback = merge.radial_directional_average([np.array([2.0, 0.0]), np.array([-2.0, 0.0]),
                                                 np.array([0.0, 0.0])], [1, 1, 2])
    np.testing.assert_allclose(fallback, [0.0, 0.0])
    assert np.all(np.isfinite(merge.radial_directional_average([np.zeros(3)], [1])))


def test_embedding_tensors_use_the_mean_under_rda():
    grads = [{"embed/tokens": np.array([3.0, 0.0]), "w": np.array([3.0, 0.0])},
             {"embed/tokens": np.array([0.0, 4.0]), "w": np.array([0.0, 4.0])}]
    out = merge.merge_outer_gradients(grads, [1, 1], merge.MergeRule.RDA,
                                      lambda path: path.startswith("embed/"))
    np.testing.assert_allclose(out["embed/tokens"], [1.5, 2.0])
    np.testing.assert_allclose(out["w"], [3.5 / math.sqrt(2)] * 2, rtol=1e-6)


def test_staleness_discount():
    assert merge.staleness_factor(3, 0.0) == 1.0
    assert merge.staleness_factor(3, 1.0) == 0.25
    assert merge.staleness_factor(0, 2.0) == 1.0


# -- grace and quorum -----------------------------------------------------------------------------
def test_grace_clamp_both_ends():
    # slack = τ·ξ_step − (ξ_quorum + ξ_sync)
    assert quorum.grace_window(2, 1.0, 0.2, 0.3, 0.5, 5.0) == pytest.approx(0.75)
    assert quorum.grace_window(2, 1.0, 1.5, 1.0, 0.5, 5.0) == 0.0    # slack −0.5 → 0
    assert quorum.grace_window(2, 100.0, 0.0, 0.0, 0.5, 5.0) == 5.0  # 100 → cap 5
    assert quorum.grace_window(2, 1.0, 2.0, 0.0, 0.5, 5.0) == 0.0    # slack exactly 0


def test_merge_decision_k_of_m():
    live = frozenset({"a", "b", "c"})
    d = quorum.merge_decision(frozenset({"a"}), live, 10.0, None, 2, 1.0)
    assert (d.merge, d.reason) == (False, MergeReason.BELOW_QUORUM)
    d = quorum.merge_decision(frozenset({"a", "b"}), live, 10.0, 10.0, 2, 1.0)
    assert (d.merge, d.reason, d.wait_until_s) == (False, MergeReason.IN_GRACE, 11.0)
    d = quorum.merge_decision(frozenset({"a", "b"}), live, 11.0, 10.0, 2, 1.0)
    assert (d.merge, d.reason) == (True, MergeReason.GRACE_EXPIRED)
    d = quorum.merge_decision(frozenset({"a", "b", "c"}), live, 10.0, 10.0, 2, 1.0)
    assert (d.merge, d.reason) == (True, MergeReason.ALL_LIVE_IN)
    # K = 3 with only two learners alive: the floor holds, never merge below quorum.
    d = quorum.merge_decision(frozenset({"a", "b"}), frozenset({"a", "b"}), 99.0, 10.0, 3, 0.0)
    assert (d.merge, d.reason) == (False, MergeReason.BELOW_QUORUM)


# -- outer optimizer ------------------------------------------------------------------------------
def test_nesterov_outer_three_rounds():
    # optax sgd(0.7, momentum 0.9, nesterov): t_k = g + 0.9·t_{k−1}; Θ −= 0.7·(g + 0.9·t_k).
    # Θ₀ = 1, the learner always lands 1 below the current Θ, so g = 1 every round:
    #   round 1: t = 1,    step 0.7·(1 + 0.9)      = 1.33    → Θ = −0.33
    #   round 2: t = 1.9,  step 0.7·(1 + 1.71)     = 1.897   → Θ = −2.227
    #   round 3: t = 2.71, step 0.7·(1 + 2.439)    = 2.4073  → Θ = −4.6343
    core = one_fragment_syncer([1.0], outer.build("nesterov", lr=0.7, momentum=0.9))
    expected = [-0.33, -2.227, -4.6343]
    for round_index, want in enumerate(expected, start=1):
        current, _ = core.fragment(0)
        push_theta(core, "a", current["w"] - 1.0)
        result = core.merge(0)
        assert result.version == round_index
        np.testing.assert_allclose(result.params["w"], [want], rtol=1e-5)


def test_outer_sgd_one_is_the_weighted_mean_of_learners():
    core = one_fragment_syncer([0.0, 0.0], outer.build("sgd", lr=1.0, momentum=0.0),
                               merge_rule=merge.MergeRule.MEAN)
    push_theta(core, "a", [1.0, 2.0])
    push_theta(core, "b", [3.0, -2.0])
    np.testing.assert_allclose(core.merge(0).params["w"], [2.0, 0.0])


def test_unknown_outer_optimizer():
    with pytest.raises(ValueError, match="unknown outer optimizer 'lion'"):
        outer.build("lion")


def test_alpha_blend():
    local, merged = {"w": np.array([2.0, -1.0])}, {"w": np.array([4.0, 1.0])}
    np.testing.assert_allclose(blend(local, merged, 0.0)["w"], [4.0, 1.0])
    np.testing.assert_allclose(blend(local, merged, 0.5)["w"], [3.0, 0.0])
    np.testing.assert_allclose(blend(local, merged, 1.0)["w"], [2.0, -1.0])


def test_merge_against_current_not_base():
    # Learner b pushed against version 0 after a merged to version 1; its outer gradient is taken
    # against the *current* Θ (the paper's anchor): θ_b = Θ(0) + δ, g_b = Θ(1) − θ_b. The
    # paper's rules, named (the service's defaults re-base the push and join a's round).
    core = one_fragment_syncer([0.0], optax.sgd(1.0), outer_gradient=merge.OuterGradientRule.PULL,
                               round_step=merge.RoundStep.PER_MERGE)
    push_theta(core, "a", [2.0])
    core.merge(0)                                   # Θ(1) = 2
    drift = {"w": np.array([5.0], np.float32)}      # b trained from Θ(0) = 0 to 5
    assert core.accept_push(Push("b", 0, drift, 0, 0, 10, 1), 0.0).staleness == 1
    np.testing.assert_allclose(core.merge(0).params["w"], [5.0])


def test_participation_scale():
    # 1 of 4 live learners merges alone with g = Θ − θ = 4: it applies a quarter of the step,
    # Θ = 0 − 1.0·(¼·4) = −1; with all 4 in (K = M) the share is 1 and nothing changes.
    core = one_fragment_syncer([0.0], optax.sgd(1.0))
    push_theta(core, "a", [-4.0])
    np.testing.assert_allclose(core.merge(0, live_count=4).params["w"], [-1.0])
    for name in ("a", "b", "c"):
        push_theta(core, name, [-3.0])
    np.testing.assert_allclose(core.merge(0, live_count=3).params["w"], [-3.0])


@pytest.mark.parametrize("rule", [merge.MergeRule.RDA, merge.MergeRule.MEAN])
def test_a_forgotten_push_leaves_the_round_sum_decoding_only_itself(rule):
    """Θ = 0, outer sgd(1.0) (Θ' = −G), equal token weights, under the pull rule and one step
    per merge (g = Θ − θ_m = −θ_m): a pushes θ = (2, 0), b (7, 7), c (0, 4). b is forgotten: its
    push alone is decoded again and taken out of the sum, and the merge is a's and c's, Θ' = −G:
    mean G = −(1, 2); RDA G = (mean norm 3)·φ((−1, 0) + (0, −1)) = −3·(1, 1)/√2."""
    decoded = []

    def decode(codes):
        decoded.append(1)
        return identity_decode(codes)

    core = SyncerCore([{"w": np.zeros(2, np.float32)}],
                      SyncerSettings(outlier_norm_factor=None, merge_rule=rule,
                                     outer_gradient=merge.OuterGradientRule.PULL,
                                     round_step=merge.RoundStep.PER_MERGE),
                      outer.build("sgd", lr=1.0, momentum=0.0), decode)
    for name in ("a", "b", "c"):
        core.register(name, 0)
    for name, theta in (("a", [2.0, 0.0]), ("b", [7.0, 7.0]), ("c", [0.0, 4.0])):
        push_theta(core, name, theta)
    assert len(decoded) == 3            # each push decoded once, as it was accepted
    assert [p.learner for p in core.forget("b")] == ["b"]
    assert len(decoded) == 4, "forget decoded more than the push that left"
    result = core.merge(0, live_count=None)
    assert result.learners == ("a", "c")
    want = ([1.0, 2.0] if rule == merge.MergeRule.MEAN
            else 3.0 * np.array([1.0, 1.0]) / math.sqrt(2.0))
    np.testing.assert_allclose(core.fragment(0)[0]["w"], want, rtol=1e-6, atol=1e-7)


def test_forgetting_every_push_empties_the_round_sum():
    core = one_fragment_syncer([0.0], outer.build("sgd", lr=1.0, momentum=0.0))
    push_theta(core, "a", [1.0])
    push_theta(core, "b", [3.0])
    core.forget("a")
    core.forget("b")
    assert core.slots[0].round == {} and core.slots[0].open_sum is None
