"""The syncer's in-place hot path (pushes folded into running sums, then one step from them)
gives the reference math (merge.py + optax) for every outer optimizer and merge rule, leaves Θ
and the old state alone, and reuses its buffers."""

import numpy as np
import pytest

from islands.syncer import fused, merge, outer


def grads_and_norms(rng, m, pool=None):
    params = {"w": rng.standard_normal((33, 7)).astype(np.float32),
              "embed/tokens": rng.standard_normal(50).astype(np.float32)}
    out = []
    for _ in range(m):
        base = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
                for k, v in params.items()}
        drift = {k: 0.05 * rng.standard_normal(v.shape).astype(np.float32)
                 for k, v in params.items()}
        g, n = fused.outer_gradient(params, base, drift, pool)
        for k in params:
            np.testing.assert_allclose(g[k], params[k] - (base[k] + drift[k]), atol=1e-6)
            assert n[k] == pytest.approx(float(np.linalg.norm(g[k])), rel=1e-5)
        out.append((g, n))
    return params, out


def merge_and_step(optimizer, rda, grads, norms, weights, share, params, state, pool=None):
    """The syncer's merge of a round: each push folded into the round's sum as it is
    accepted, then one step from the sum."""
    sums = fused.GradSum(rda)
    for g, n, w in zip(grads, norms, weights):
        sums.fold(g, n, w, 1.0, pool)
    return fused.step_sums(optimizer, [sums], share, params, state, pool)


@pytest.mark.parametrize("kind, kwargs", [("nesterov", {}), ("sgd", {"lr": 1.0, "momentum": 0.0}),
                                          ("sgd", {"lr": 0.5, "momentum": 0.8}),
                                          ("adam", {"lr": 1e-2})])
@pytest.mark.parametrize("rule", [merge.MergeRule.RDA, merge.MergeRule.MEAN])
@pytest.mark.parametrize("block", [fused.BLOCK, 16])   # 16: every tensor spans several blocks
def test_the_merge_from_running_sums_matches_the_reference(kind, kwargs, rule, block, monkeypatch):
    monkeypatch.setattr(fused, "BLOCK", block)
    rng = np.random.default_rng(0)
    pool = fused.BufferPool()
    params, gn = grads_and_norms(rng, 3, pool)
    weights, share = [1e4, 3e4, 2e4], 0.75
    optimizer = outer.build(kind, **kwargs)
    state = optimizer.init(params)
    rda = frozenset({"w"} if rule == merge.MergeRule.RDA else ())
    before = {k: v.copy() for k, v in params.items()}
    for _ in range(2):   # twice: the second step reads the first one's momentum
        reference = merge.merge_outer_gradients([g for g, _ in gn], weights, rule,
                                                lambda p: p.startswith("embed/"))
        reference = {k: np.float32(share) * v for k, v in reference.items()}
        want, want_state = outer.outer_step(optimizer, reference, state, params)
        got, got_state, finite, norm = merge_and_step(
            optimizer, rda, [g for g, _ in gn], [n for _, n in gn], weights, share, params,
            state, pool)
        assert finite
        assert norm == pytest.approx(float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2)
                                                        for v in reference.values()))), rel=1e-5)
        for k in params:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(params[k], before[k])   # Θ itself is never written
        params, state, before = got, got_state, {k: v.copy() for k, v in got.items()}
        _, gn = grads_and_norms(rng, 3, pool)


def test_rda_falls_back_to_the_mean_when_directions_cancel():
    """g and −g: the directions cancel, so the weighted mean (0) is the merge and Θ stays;
    hand-worked RDA: unit directions (1, 0) and (0, 1), norms 2 and 4, weights 1 and 3: mean
    norm (2 + 12)/4 = 3.5, direction (1, 3)/4 → φ = (1, 3)/√10, so G = 3.5·(1, 3)/√10."""
    sgd = outer.build("sgd", lr=1.0, momentum=0.0)
    params = {"w": np.zeros(2, np.float32)}
    g = np.array([1.0, -2.0], np.float32)
    new, _, finite, norm = merge_and_step(sgd, frozenset({"w"}), [{"w": g}, {"w": -g}],
                                          [{"w": float(np.linalg.norm(g))}] * 2, [1.0, 1.0],
                                          1.0, params, sgd.init(params))
    assert finite and norm == 0.0
    np.testing.assert_array_equal(new["w"], [0.0, 0.0])
    new, _, _, norm = merge_and_step(sgd, frozenset({"w"}),
                                     [{"w": np.array([2.0, 0.0], np.float32)},
                                      {"w": np.array([0.0, 4.0], np.float32)}],
                                     [{"w": 2.0}, {"w": 4.0}], [1.0, 3.0], 1.0, params,
                                     sgd.init(params))
    np.testing.assert_allclose(new["w"], -3.5 * np.array([1.0, 3.0]) / np.sqrt(10), rtol=1e-6)
    assert norm == pytest.approx(3.5)


def test_a_non_finite_step_is_reported_and_the_state_kept():
    optimizer = outer.build("nesterov")
    params = {"w": np.array([3e38, 1.0], np.float32)}
    state = optimizer.init(params)
    g = {"w": np.array([-3e38, 0.0], np.float32)}
    _, new_state, finite, _ = merge_and_step(optimizer, frozenset(), [g], [{"w": 3e38}], [1.0],
                                             1.0, params, state)
    assert not finite
    np.testing.assert_array_equal(np.asarray(state[0].trace["w"]), [0.0, 0.0])


def test_buffers_come_back_to_the_pool():
    pool = fused.BufferPool()
    a = pool.take((4, 3))
    pool.give(a)
    assert pool.take((4, 3)) is a and pool.take((4, 3)) is not a



@pytest.mark.parametrize("block", [fused.BLOCK, 1])
def test_nesterov_merge_by_hand(block, monkeypatch):
    """Hand-worked, exact in float32: lr 0.5, μ 0.5, Θ = 0, m = 0.
    Mean of g₁ = (1, 2, 0, 4) and g₂ = (3, 2, 4, 0), weights 1 and 3: G = (2.5, 2, 3, 1).
    Step 1: m' = G; Θ' = −0.5·(G + 0.5·G) = −0.75·G = (−1.875, −1.5, −2.25, −0.75).
    Step 2 (same G): m'' = G + 0.5·G = 1.5·G; Θ'' = Θ' − 0.5·(G + 0.75·G) = −1.625·G
    = (−4.0625, −3.25, −4.875, −1.625). ‖G‖ = √(6.25 + 4 + 9 + 1) = 4.5."""
    monkeypatch.setattr(fused, "BLOCK", block)
    pool = fused.BufferPool()
    optimizer = outer.build("nesterov", lr=0.5, momentum=0.5)
    params = {"w": np.zeros(4, np.float32)}
    state = optimizer.init(params)
    grads = [{"w": np.array([1, 2, 0, 4], np.float32)}, {"w": np.array([3, 2, 4, 0], np.float32)}]
    norms = [{"w": float(np.linalg.norm(g["w"]))} for g in grads]
    G = np.array([2.5, 2, 3, 1], np.float32)
    for want_theta, want_m in [(-0.75 * G, G), (-1.625 * G, 1.5 * G)]:
        params, state, finite, norm = merge_and_step(
            optimizer, frozenset(), grads, norms, [1.0, 3.0], 1.0, params, state, pool)
        assert finite and norm == 4.5
        np.testing.assert_array_equal(params["w"], want_theta)
        np.testing.assert_array_equal(state[0].trace["w"], want_m)


@pytest.mark.parametrize("block", [fused.BLOCK, 1])
def test_rda_merge_by_hand(block, monkeypatch):
    """RDA of (2, 0) and (0, 4), weights 1 and 3 (test above): 3.5·(1, 3)/√10, times the
    participation share 0.5, stepped by plain SGD lr 1 from Θ = (1, 1)."""
    monkeypatch.setattr(fused, "BLOCK", block)
    optimizer = outer.build("sgd", lr=1.0, momentum=0.0)
    params = {"w": np.ones(2, np.float32)}
    grads = [{"w": np.array([2.0, 0.0], np.float32)}, {"w": np.array([0.0, 4.0], np.float32)}]
    new, _, finite, norm = merge_and_step(optimizer, frozenset({"w"}), grads,
                                          [{"w": 2.0}, {"w": 4.0}], [1.0, 3.0], 0.5,
                                          params, optimizer.init(params))
    assert finite and norm == pytest.approx(1.75)
    np.testing.assert_allclose(new["w"], 1 - 1.75 * np.array([1.0, 3.0]) / np.sqrt(10), rtol=1e-6)


@pytest.mark.parametrize("kind, kwargs", [("nesterov", {"lr": 1.0, "momentum": 0.0}),
                                          ("sgd", {"lr": 0.5, "momentum": 0.8}),
                                          ("adam", {"lr": 1e-2})])
@pytest.mark.parametrize("rule", [merge.MergeRule.RDA, merge.MergeRule.MEAN])
@pytest.mark.parametrize("block", [fused.BLOCK, 16])
def test_running_sums_step_as_the_gradients_do(kind, kwargs, rule, block, monkeypatch):
    """A round folded push by push into a GradSum (split in two sums, as a joining partial
    merge) steps to what merge.py and optax make of the gradients themselves, to float32
    rounding; zero weights count as 1 each only when every weight is 0."""
    monkeypatch.setattr(fused, "BLOCK", block)
    rng = np.random.default_rng(3)
    pool = fused.BufferPool()
    params, gn = grads_and_norms(rng, 4, pool)
    rda = frozenset({"w"} if rule == merge.MergeRule.RDA else ())
    optimizer = outer.build(kind, **kwargs)
    state = optimizer.init(params)
    for weights in ([1e4, 0.0, 3e4, 2e4], [0.0, 0.0, 0.0, 0.0]):
        first, second = fused.GradSum(rda), fused.GradSum(rda)
        for i, ((g, n), w) in enumerate(zip(gn, weights)):
            (first if i < 2 else second).fold(g, n, w, 1.0, pool)
        effective = weights if sum(weights) > 0 else [1.0] * 4
        reference = merge.merge_outer_gradients([g for g, _ in gn], effective, rule,
                                                lambda p: p.startswith("embed/"))
        reference = {k: np.float32(0.75) * v for k, v in reference.items()}
        want, _ = outer.outer_step(optimizer, reference, state, params)
        want_norm = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2)
                                      for v in reference.values())))
        got, _, finite, norm = fused.step_sums(optimizer, [first, second], 0.75, params, state,
                                               pool)
        assert finite and norm == pytest.approx(want_norm, rel=1e-5)
        for k in params:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        first.absorb(second, pool)
        assert second.count == 0 and first.count == 4
        again, _, _, _ = fused.step_sums(optimizer, [first], 0.75, params, state, pool)
        for k in params:
            np.testing.assert_allclose(again[k], want[k], rtol=1e-5, atol=1e-6)


def test_zero_momentum_keeps_no_trace():
    """Nesterov with momentum 0 (the rule's at H ≤ 128) stores no momentum array."""
    params = {"w": np.ones(8, np.float32)}
    assert fused._trace(outer.build("nesterov", lr=1.0, momentum=0.0).init(params)) is None
    assert fused._trace(outer.build("nesterov", lr=0.7, momentum=0.9).init(params)) is not None


def test_unfold_takes_a_push_out_of_the_sums_by_hand():
    """RDA of (2, 0) and (0, 4) with weights 1 and 3 (3.5·(1, 3)/√10, test above) after a third
    push (1, 1), weight 2, was folded in and taken out again; its direction too: a tensor none
    of whose remaining pushes points anywhere keeps no residue."""
    optimizer = outer.build("sgd", lr=1.0, momentum=0.0)
    params = {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}
    sums = fused.GradSum(frozenset({"w", "b"}))
    pushes = [({"w": np.array([2.0, 0.0], np.float32), "b": np.zeros(1, np.float32)}, 1.0),
              ({"w": np.array([1.0, 1.0], np.float32), "b": np.ones(1, np.float32)}, 2.0),
              ({"w": np.array([0.0, 4.0], np.float32), "b": np.zeros(1, np.float32)}, 3.0)]
    norms = [{k: fused.tensor_norm(v) for k, v in g.items()} for g, _ in pushes]
    for (g, w), n in zip(pushes, norms):
        sums.fold(g, n, w)
    assert sums.unfold(pushes[1][0], norms[1], 2.0)
    assert (sums.count, sums.weight, "b" in sums.direction) == (2, 4.0, False)
    new, _, finite, norm = fused.step_sums(optimizer, [sums], 1.0, params,
                                           optimizer.init(params))
    assert finite and norm == pytest.approx(3.5)
    np.testing.assert_allclose(new["w"], -3.5 * np.array([1.0, 3.0]) / np.sqrt(10), rtol=1e-6)
    np.testing.assert_array_equal(new["b"], [0.0])
    assert sums.unfold(pushes[0][0], norms[0], 1.0) and sums.unfold(pushes[2][0], norms[2], 3.0)
    assert (sums.count, sums.mean, sums.direction) == (0, {}, {})


def test_unfold_leaves_no_length_where_no_direction_is_left():
    """Three pushes pointing somewhere and one of norm 0 on an RDA tensor: once the three are
    taken out, the tensor's length is exactly 0 (not the float residue of adding and
    subtracting their w·‖g‖, 0.1 + 0.1 + 0.1 − 0.1 − 0.1 − 0.1 = 3e-17), as its direction is
    gone."""
    sums = fused.GradSum(frozenset({"w"}))
    pushes = [(np.array([1.0, 0.0], np.float32), 0.1), (np.array([0.0, 1.0], np.float32), 0.1),
              (np.array([-1.0, 0.0], np.float32), 0.1), (np.zeros(2, np.float32), 1.3)]
    for g, w in pushes:
        sums.fold({"w": g}, {"w": fused.tensor_norm(g)}, w)
    for g, w in pushes[:3]:
        assert sums.unfold({"w": g}, {"w": fused.tensor_norm(g)}, w)
    assert "w" not in sums.direction and "w" not in sums.directed
    assert sums.length["w"] == 0.0 and sums.count == 1


def test_unfold_of_a_push_outweighing_the_rest_asks_for_a_refold():
    """A push of weight 10¹⁰ (gradient ~10³) and one of weight 1: subtracting the big one from
    the float32 sum would leave its rounding (~10⁶) in place of the small one's (4); unfold
    empties the sums and asks for a refold instead. Equal weights still subtract."""
    big, small = np.array([1e3, 1e3], np.float32), np.array([0.0, 4.0], np.float32)
    sums = fused.GradSum(frozenset())
    sums.fold({"w": big}, {"w": fused.tensor_norm(big)}, 1e10)
    sums.fold({"w": small}, {"w": fused.tensor_norm(small)}, 1.0)
    assert sums.unfold({"w": big}, {"w": fused.tensor_norm(big)}, 1e10) is False
    assert (sums.count, sums.mean, sums.weight) == (1, {}, 0.0)
    even = fused.GradSum(frozenset())
    even.fold({"w": big}, {"w": fused.tensor_norm(big)}, 1.0)
    even.fold({"w": small}, {"w": fused.tensor_norm(small)}, 1.0)
    assert even.unfold({"w": big}, {"w": fused.tensor_norm(big)}, 1.0)
    np.testing.assert_array_equal(even.mean["w"], small)


def test_unfold_of_the_only_positive_weight_asks_for_a_refold():
    """A push of weight 0 folded before a positive one is left out of the sums (it weighs
    nothing next to it); taking the positive one out cannot give the zero-weight push's sum."""
    g = {"w": np.array([1.0], np.float32)}
    n = {"w": 1.0}
    sums = fused.GradSum(frozenset())
    sums.fold(g, n, 0.0)
    sums.fold(g, n, 5.0)
    assert sums.unfold(g, n, 5.0) is False and sums.count == 1 and sums.mean == {}
    zero = fused.GradSum(frozenset())
    zero.fold(g, n, 0.0)
    zero.fold({"w": np.array([3.0], np.float32)}, n, 0.0)
    assert zero.unfold(g, n, 0.0) and zero.weight == 1.0
    np.testing.assert_array_equal(zero.mean["w"], [3.0])
