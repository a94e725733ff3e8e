"""Refusals that lose nothing, and garbage that stays out of Θ (the pure syncer and learner cores).

Each test reproduces a defect of the service as it was: a refused ``unknown_version`` push threw
its drift away; the first pushes of a job were never checked for outliers; refused outliers wore
the median window down; merge weights came from unchecked counters; one learner could push as
another; a non-finite merge could replace Θ.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.learners.core import LearnerCore
from islands.syncer import codec as codec_lib
from islands.syncer import fragments, outer
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.merge import MergeRule, RoundStep
from islands.syncer.validate import Push, RejectReason

CODEC = codec_lib.make_codec("none")
DECODE = lambda codes: codec_lib.decode_tree(CODEC, codes)  # noqa: E731


def syncer(outer_lr=1.0, **settings):
    base = dict(min_learners=1, grace_cap_s=0.0, overlap_steps=0, merge_rule=MergeRule.MEAN)
    base.update(settings)
    return SyncerCore([{"w": np.zeros(4, np.float32)}], SyncerSettings(**base),
                      outer.build("sgd", lr=outer_lr, momentum=0.0), DECODE)


def push(learner, drift, base_version=0, c_tokens=8, c_steps=1, session=""):
    codes = codec_lib.encode_tree(CODEC, {"w": np.asarray(drift, np.float32)})
    return Push(learner, 0, codes, base_version, 0, c_tokens, c_steps, session=session)


def merge_round(core, learner, drift, base_version):
    assert core.accept_push(push(learner, drift, base_version), 0.0).ok
    return core.merge(0, "test")


def test_unknown_version_rebases_the_drift_on_the_carried_fragment_and_pushes_again():
    # per_merge: the second push is merged alone (per_round would take it into fast's round)
    core = syncer(history_versions=1, round_step=RoundStep.PER_MERGE)
    params = {"w": jnp.zeros(4)}
    plan = fragments.partition(params, 1)
    _, frags = core.register("slow", 0)
    core.register("fast", 0)
    learner = LearnerCore("slow", params, optax.sgd(1.0).init(params), plan, [v for _, v in frags],
                          codec_lib.no_error_feedback(CODEC), codec_lib.tree_wire_bytes, DECODE,
                          overlap_steps=0)
    learner.params = {"w": jnp.array([1.0, 2.0, 3.0, 4.0])}   # three steps of local work
    for _ in range(3):
        learner.record_step(8, 0.1)
    # Meanwhile the others moved Θ twice: version 0 left the (one-version) history.
    merge_round(core, "fast", [0.5] * 4, 0)
    merge_round(core, "fast", [0.5] * 4, 1)
    stale = learner.make_push(0, core.epoch).push
    verdict = core.accept_push(stale, 0.0)
    assert verdict.reason == RejectReason.UNKNOWN_VERSION
    current, version = core.fragment(0)
    learner.refused(0, verdict.reason.value, current, version)
    # Nothing lost: local = Θ(2) + the old drift, counters still carry the three steps, due now.
    np.testing.assert_allclose(np.asarray(learner.params["w"]), current["w"] + [1.0, 2.0, 3.0, 4.0])
    assert learner.tracks[0].c_steps == 3 and learner.tracks[0].c_tokens == 24
    assert learner.due(1, 100) == [0]
    again = learner.make_push(0, core.epoch).push
    assert again.base_version == 2 and core.accept_push(again, 0.0).ok
    result = core.merge(0, "test")
    np.testing.assert_allclose(result.params["w"], current["w"] + [1.0, 2.0, 3.0, 4.0])


def test_the_first_push_of_a_job_is_checked_against_what_the_inner_loop_can_move():
    # lr 1e-2 (no warm-up), one step, 4 values: the bound is 10 · 0.01 · 1 · √4 = 0.2
    core = syncer(inner_schedule=(1e-2, 1, 100, 1.0), outlier_norm_factor=10.0)
    core.register("a", 0)
    verdict = core.accept_push(push("a", [0.1, 0.1, 0.1, 0.15]), 0.0)   # norm 0.2291
    assert verdict.reason == RejectReason.OUTLIER_NORM
    assert "drift norm 11.46 > 10" in verdict.detail   # 0.2291 / (0.01 · √4)
    assert core.accept_push(push("a", [0.09, 0.09, 0.09, 0.09]), 0.0).ok   # norm 0.18


def test_refused_outliers_do_not_wear_the_window_down():
    core = syncer(outlier_norm_factor=2.0)
    for name in "abc":
        core.register(name, 0)
        assert core.accept_push(push(name, [0.5, 0.5, 0.5, 0.5]), 0.0).ok  # norm 1
        core.merge(0, "t")
    # per-step norms over √4: accepted [0.5, 0.5, 0.5], limit = 0.5 + 2 · max(0, 0.25) = 1
    for _ in range(10):
        assert core.accept_push(push("a", [1.5] * 4, core.versions[0]), 0.0).reason == \
            RejectReason.OUTLIER_NORM  # 3 / 2 = 1.5, refused every time: the window held
    assert list(core.slots[0].recent_norms) == [0.5, 0.5, 0.5]


def test_when_every_learner_looks_like_an_outlier_the_window_starts_over():
    core = syncer(outlier_norm_factor=2.0)
    for name in "abc":
        core.register(name, 0)
        assert core.accept_push(push(name, [0.5] * 4), 0.0).ok
        core.merge(0, "t")
    assert not core.accept_push(push("a", [1.5] * 4, core.versions[0]), 0.0).ok
    # b too: the norms moved for everyone, so the window restarts from the first-push bound
    # (2 per step) and b's 1.5 is inside it.
    assert core.accept_push(push("b", [1.5] * 4, core.versions[0]), 0.0).ok
    assert list(core.slots[0].recent_norms) == [1.5]


def test_counters_are_checked_against_the_jobs_batch():
    core = syncer(tokens_per_step=8)
    core.register("a", 0)
    assert core.accept_push(push("a", [0.1] * 4, c_tokens=17, c_steps=2), 0.0).reason == \
        RejectReason.BAD_COUNTERS
    assert core.accept_push(push("a", [0.1] * 4, c_tokens=-1, c_steps=2), 0.0).reason == \
        RejectReason.BAD_COUNTERS
    assert core.accept_push(push("a", [0.1] * 4, c_tokens=16, c_steps=2), 0.0).ok


def test_a_learner_cannot_push_as_another():
    core = syncer()
    core.register("victim", 0, session="s3cret")
    core.register("mallory", 0, session="other")
    verdict = core.accept_push(push("victim", [0.1] * 4, session="other"), 0.0)
    assert verdict.reason == RejectReason.BAD_SESSION
    assert core.accept_push(push("victim", [0.1] * 4, session="s3cret"), 0.0).ok


def test_a_non_finite_merge_never_replaces_theta():
    core = syncer(outer_lr=4.0, outlier_norm_factor=None)   # Θ ← Θ − 4·(Θ − θ̄) = 4·θ̄
    for name in "ab":
        core.register(name, 0)
        assert core.accept_push(push(name, [-3e38] * 4), 0.0).ok  # finite; 4 × it is not
    before = core.fragment(0)[0]["w"].copy()
    result = core.merge(0, "t")
    assert result.refused and result.version == 0 and core.versions == (0,)
    np.testing.assert_array_equal(core.fragment(0)[0]["w"], before)
    assert core.rejected[RejectReason.BAD_MERGE] == 2


def test_every_refusal_is_recorded_and_garbage_in_a_row_quarantines():
    core = syncer(quarantine_after=3)
    core.register("a", 2)
    for _ in range(3):
        verdict = core.accept_push(Push("a", 0, codec_lib.encode_tree(
            CODEC, {"w": np.full(4, np.nan, np.float32)}), 0, 0, 8, 1, incarnation=2), 0.0)
        assert verdict.reason == RejectReason.NON_FINITE
    assert core.refusals_total == 3
    assert core.refusals[-1] == {"learner": "a", "incarnation": 2, "fragment": 0,
                                 "reason": "non_finite", "detail": "w: NaN or inf"}
    assert core.quarantined == {"a": 2}
    core.register("a", 3)  # its restart starts with a clean slate
    assert core.quarantined == {}


def test_the_syncers_schedule_is_the_learners_schedule():
    from islands.learners.inner import END_LR_FRACTION, inner_schedule
    from islands.syncer.validate import warmup_cosine

    counts = np.arange(0, 400)
    expected = np.asarray(jax.vmap(inner_schedule(3e-3, 20, 300))(jnp.asarray(counts)))
    np.testing.assert_allclose(warmup_cosine(counts.astype(np.float64), 3e-3, 20, 300,
                                             END_LR_FRACTION), expected, rtol=1e-5, atol=1e-9)


def test_a_first_push_with_impossible_cumulative_counters_is_refused_and_moves_nothing():
    """Issue 21: a first push claiming step 10^12 and 10^15 tokens was accepted, moving the
    learner's resume step and the books. It is garbage now (bad_counters), like other garbage."""
    import dataclasses

    core = syncer(tokens_per_step=8)
    core.register("a:0", 0)
    bogus = dataclasses.replace(push("a:0", [0.1] * 4), step=10**12, tokens_done=10**15)
    verdict = core.accept_push(bogus, 0.0)
    assert verdict.reason == RejectReason.BAD_COUNTERS and "10000000000" in verdict.detail
    assert core.ledger["a:0"].applied_step == 0 and core.ledger["a:0"].applied_tokens_done == 0
    # Tokens beyond what its steps can hold, at a plausible step: refused too.
    greedy = dataclasses.replace(push("a:0", [0.1] * 4), step=1, tokens_done=9)
    assert core.accept_push(greedy, 0.0).reason == RejectReason.BAD_COUNTERS
    # The same push with honest counters (one step of 8 tokens) is taken and merged.
    honest = dataclasses.replace(push("a:0", [0.1] * 4), step=1, tokens_done=8)
    assert core.accept_push(honest, 0.0).ok
    core.merge(0, "test")
    assert core.ledger["a:0"].applied_step == 1


def test_an_outlier_refusal_starts_over_without_the_error_feedback_residual():
    """A push that spanned many steps (held back by a partition) merges, and its rounding error
    stays behind as the error-feedback residual, large against a few steps' drift: the next
    push carries it and is refused as an outlier. Starting over from the carried fragment drops
    that residual too, so the push after is judged on its own drift and merges (before, the
    residual rode along in every push: three refusals in a row quarantined the learner)."""
    nf2 = codec_lib.make_codec("nf2", block_size=64)
    decode = lambda codes: codec_lib.decode_tree(nf2, codes)  # noqa: E731
    n = 64
    core = SyncerCore([{"w": np.zeros(n, np.float32)}],
                      SyncerSettings(min_learners=1, grace_cap_s=0.0, overlap_steps=0,
                                     merge_rule=MergeRule.MEAN, outlier_norm_factor=10.0,
                                     inner_schedule=(1e-2, 1, 10_000, 1.0)),
                      outer.build("sgd", lr=1.0, momentum=0.0), decode)
    params = {"w": jnp.zeros(n)}
    _, frags = core.register("far:0", 0)
    learner = LearnerCore("far:0", params, optax.sgd(1.0).init(params),
                          fragments.partition(params, 1), [v for _, v in frags],
                          codec_lib.error_feedback(nf2), codec_lib.tree_wire_bytes, decode,
                          overlap_steps=0)
    rng = np.random.default_rng(0)

    def train(steps, scale):   # ``steps`` inner steps that moved each value by about ``scale``
        learner.params = {"w": learner.params["w"] + jnp.asarray(
            rng.normal(0.0, scale, n), jnp.float32)}
        for _ in range(steps):
            learner.record_step(8, 0.1)

    def push_and_judge():
        plan = learner.make_push(0, core.epoch)
        verdict = core.accept_push(plan.push, 0.0)
        if verdict.ok:
            result = core.merge(0, "test")
            learner.offer_reply(0, result.params, result.version)
            assert learner.adopt_ready() == [0]
        else:
            current, version = core.fragment(0)
            learner.refused(0, verdict.reason.value, current, version)
        return verdict

    train(100, 0.5)   # the long push: 100 steps, scaled norm ≈ 0.5 / 0.01 / 100 = 0.5
    assert push_and_judge().ok
    residual = np.linalg.norm(np.asarray(learner.tracks[0].ef_state.residual["w"]))
    assert residual > 0.5   # nf2 leaves about a quarter of a norm-4 drift behind
    train(1, 0.005)   # one step: its own scaled norm ≈ 0.5, with the residual ≈ 12
    refused = push_and_judge()
    assert refused.reason == RejectReason.OUTLIER_NORM
    assert not np.any(np.asarray(learner.tracks[0].ef_state.residual["w"]))
    train(1, 0.005)
    assert push_and_judge().ok


# -- issue 36: a restart without a peer, and the garbage probes ------------------------------------
def test_a_fresh_inner_state_resumes_at_the_schedule_of_its_resume_step():
    """A restart with no live peer starts a fresh AdamW state. Its schedule count used to be 0:
    it warmed up to the peak rate, 10× the end of a finished cosine that the syncer expected
    at the resume step, and every push was refused as an outlier. At the resume step its first
    update is Adam's first (bias-corrected: sign(g)) times the schedule's rate there."""
    from islands.learners.inner import at_schedule_step, inner_optimizer

    opt = inner_optimizer(lr=1e-2, warmup_steps=2, total_steps=10, clip_norm=10.0)
    params = {"b": jnp.zeros(3)}            # rank 1: no weight decay
    grads = {"b": jnp.array([0.5, -2.0, 1.0])}
    fresh = opt.init(params)
    updates, _ = opt.update(grads, fresh, params)
    np.testing.assert_allclose(np.asarray(updates["b"]), 0.0)       # count 0: rate 0 (warm-up)
    updates, state = opt.update(grads, at_schedule_step(fresh, 4744), params)
    # Past total_steps the rate is lr/10 = 1e-3; Adam's first step is -sign(g).
    np.testing.assert_allclose(np.asarray(updates["b"]), [-1e-3, 1e-3, -1e-3], rtol=1e-5)
    assert int(state[1][2].count) == 4745 and int(state[1][0].count) == 1


def settled(norm=0.5, learners="abc", **settings):
    """Three learners whose pushes (per-step norm ``norm`` over √4) made the outlier window."""
    core = syncer(outlier_norm_factor=10.0, tokens_per_step=8, quarantine_after=3, **settings)
    for name in learners:
        core.register(name, 0)
    for _ in range(2):
        for name in learners:
            assert core.accept_push(push(name, [norm] * 4, core.versions[0]), 0.0).ok
            core.merge(0, "t")
    return core


def test_probe_a_5000x_push_retried_20_times_stays_refused_and_quarantines():
    core = settled()
    window = list(core.slots[0].recent_norms)   # per-step norms 0.5: limit 0.5 + 10 · 0.25 = 3
    core.register("d", 1)                        # a restarted learner, its first pushes
    for attempt in range(20):
        verdict = core.accept_push(dataclasses.replace(
            push("d", [2500.0] * 4, core.versions[0]), incarnation=1), 0.0)
        assert verdict.reason == RejectReason.OUTLIER_NORM, attempt
    assert list(core.slots[0].recent_norms) == window and core.versions == (6,)
    assert core.quarantined == {"d": 1}
    # An honest first push of a fresh state (here 3× the settled drift) is taken.
    core.register("e", 1)
    assert core.accept_push(dataclasses.replace(push("e", [1.5] * 4, core.versions[0]),
                                                incarnation=1), 0.0).ok


def test_probe_a_first_push_bomb_is_refused_at_the_start_of_a_job_and_of_an_incarnation():
    # The job's first push: the first-push bound (factor 10 per step, √4 values).
    core = syncer(outlier_norm_factor=10.0)
    core.register("a", 0)
    assert core.accept_push(push("a", [1e6] * 4), 0.0).reason == RejectReason.OUTLIER_NORM
    assert core.versions == (0,) and list(core.slots[0].recent_norms) == []
    # A new incarnation's first push in a settled job: the fleet's limit.
    core = settled()
    core.register("a", 1)
    bomb = dataclasses.replace(push("a", [1e6] * 4, core.versions[0]), incarnation=1)
    assert core.accept_push(bomb, 0.0).reason == RejectReason.OUTLIER_NORM


def test_probe_forged_counters_of_a_new_incarnation_are_refused():
    core = settled()
    core.register("a", 1)
    forged = [dict(c_tokens=10**9, c_steps=1), dict(c_tokens=-5, c_steps=1),
              dict(step=10**12), dict(step=3, tokens_done=10**15)]
    for fields in forged:
        bad = dataclasses.replace(push("a", [0.5] * 4, core.versions[0]), incarnation=1,
                                  **fields)
        assert core.accept_push(bad, 0.0).reason == RejectReason.BAD_COUNTERS, fields
    assert core.ledger["a"].applied_step == 0 and core.quarantined == {"a": 1}
