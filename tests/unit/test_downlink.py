"""The encoded downlink: the int2 codec's bound, every codec's stated bound, and exact agreement
between the learner's copy and the syncer's shadow over many rounds with error feedback on both
sides; a rejoin, a lost update and a learner too far behind get the full fragment."""

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from islands.learners.core import LearnerCore
from islands.syncer import codec as codec_lib
from islands.syncer import downlink, fragments, merge, outer
from islands.syncer.core import SyncerCore, SyncerSettings
from islands.syncer.validate import RejectReason


def test_module_doctest():
    assert doctest.testmod(downlink).failed == 0


# -- codecs ------------------------------------------------------------------------------------
def test_int2_hand_worked_code():
    # A = 0.75: levels (2k − 3)·0.25 = −0.75, −0.25, 0.25, 0.75; 1.5·x/A + 1.5 gives
    # 0.75 → 3, −0.25 → 1, 0.2 → 1.9 → 2, 0 → 1.5 → 2 (half to even), −0.75 → 0.
    x = np.array([0.75, -0.25, 0.2, 0.0, -0.75], np.float32)
    code, _ = codec_lib.make_codec("int2", block_size=4).encode(x)
    code = codec_lib.to_numpy(code)
    # k = [3, 1, 2, 2 | 0]: first byte 3 | 1<<2 | 2<<4 | 2<<6 = 0b10_10_01_11 = 167; the second
    # holds one value (k = 0) and zero padding.
    assert code.payload.tolist() == [167, 0]
    np.testing.assert_array_equal(code.scales, np.array([0.75, 0.75], np.float32))
    assert codec_lib.wire_bytes(code) == 2 + 2 * 4
    want = np.array([0.75, -0.25, 0.25, 0.25, -0.75], np.float32)
    np.testing.assert_array_equal(codec_lib.decode_host(code), want)
    np.testing.assert_array_equal(np.asarray(codec_lib.decode(code)), want)


@pytest.mark.parametrize("kind", codec_lib.KINDS)
def test_every_codec_keeps_its_stated_bound(kind):
    """|decode − x| ≤ max_abs_error per element, on 64×1000 normals with a 10³ spread of scales
    and a constant block; the host decoder gives the device decoder's values (for nf2, whose
    decode is one float32 multiply, the very same bits)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 1000)) * np.exp(rng.uniform(-3.5, 3.5, (64, 1)))).astype(
        np.float32)
    x[0, :64] = 0.37   # a constant block decodes exactly (its absmax is the value)
    block = 64
    code = codec_lib.to_numpy(codec_lib.make_codec(kind, block_size=block).encode(x)[0])
    flat = x.reshape(-1)
    if kind in codec_lib.BLOCK_KINDS:   # int kinds store the absmax, nf2 its fitted outer level
        assert np.array_equal(code.scales.astype(np.float32),
                              np.abs(flat).reshape(-1, block).max(axis=1)) == (kind != "nf2")
    decoded = codec_lib.decode_host(code)
    error = np.abs(decoded.astype(np.float64) - x)
    bound = codec_lib.max_abs_error(kind, x, block_scale(code, x.shape))
    assert np.all(error <= bound * (1 + 1e-6) + 1e-30)
    if kind != "none":   # and the bound is nearly reached somewhere: it is the right one
        assert np.max(error / np.maximum(bound, 1e-30)) > 0.5
    if kind == "nf2":    # a constant block decodes to its value rounded to bfloat16
        np.testing.assert_array_equal(decoded[0, :64], np.float32(ml_dtypes.bfloat16(0.37)))
        np.testing.assert_array_equal(decoded, np.asarray(codec_lib.decode(code)))
    elif kind in codec_lib.BLOCK_KINDS:
        np.testing.assert_array_equal(decoded[0, :64], np.float32(0.37))
    np.testing.assert_allclose(decoded, np.asarray(codec_lib.decode(code)), rtol=1e-6, atol=0)


def block_scale(code, shape):
    """Each element's block scale as the code stores it (what max_abs_error takes); zeros for
    the kinds without scales."""
    size = int(np.prod(shape))
    if code.scales.size == 0:
        return np.zeros(shape)
    return np.repeat(code.scales.astype(np.float64), code.block_size)[:size].reshape(shape)


def test_int2_bytes_and_zero_blocks():
    x = np.zeros(1000, np.float32)
    x[500:] = np.linspace(-1, 1, 500, dtype=np.float32)
    code = codec_lib.to_numpy(codec_lib.make_codec("int2", block_size=128).encode(x)[0])
    # 1000 values at 4 per byte = 250 bytes; ceil(1000/128) = 8 float32 scales = 32 bytes.
    assert codec_lib.wire_bytes(code) == 250 + 32
    np.testing.assert_array_equal(codec_lib.decode_host(code)[:384], 0.0)  # 3 zero blocks


def test_host_decode_refuses_a_code_that_does_not_fit():
    code = codec_lib.to_numpy(codec_lib.make_codec("int2").encode(np.ones(10, np.float32))[0])
    bad = codec_lib.Code("int2", code.payload[:2], code.scales, code.shape, code.dtype,
                         code.block_size)
    with pytest.raises(ValueError, match=r"int2 payload is uint8\[2\], shape \[10\] needs "
                                         r"uint8\[3\]"):
        codec_lib.decode_host(bad)


# -- the downlink protocol ------------------------------------------------------------------------
SHAPES = {"a": (40, 33), "b": (17,), "c": (64, 8)}


def make_system(*, up="int2", down="int2", learners=("x:0", "x:1"), full_after=8,
                error_feedback=True, block=32):
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    plan = fragments.partition(params, 2)
    up_codec = codec_lib.make_codec(up, block_size=block)
    settings = downlink.DownlinkSettings(
        None if down == "none" else codec_lib.make_codec(down, block_size=block),
        error_feedback, full_after)
    syncer = SyncerCore([fragments.extract(params, plan, p) for p in range(2)],
                        # pull, per merge: g = Θ − (S + δ), the formula the tests check
                        SyncerSettings(min_learners=1, overlap_steps=0, outlier_norm_factor=None,
                                       outer_gradient=merge.OuterGradientRule.PULL,
                                       round_step=merge.RoundStep.PER_MERGE),
                        outer.build("sgd", lr=1.0, momentum=0.0),
                        lambda codes: codec_lib.decode_tree(up_codec, codes), downlink=settings)
    cores = {}
    for name in learners:
        _, frags = syncer.register(name, 0)
        cores[name] = LearnerCore(name, jax.tree_util.tree_map(jnp.asarray, params), None, plan,
                                  [v for _, v in frags], codec_lib.error_feedback(up_codec),
                                  codec_lib.tree_wire_bytes,
                                  lambda codes: codec_lib.decode_tree(up_codec, codes),
                                  overlap_steps=0)
    return syncer, cores, rng


def train(core, rng, scale=0.01):
    """A stand-in for inner steps: every parameter moves by noise (the drift to push)."""
    core.params = jax.tree_util.tree_map(
        lambda v: v + jnp.asarray(rng.standard_normal(v.shape).astype(np.float32) * scale),
        core.params)
    core.record_step(tokens=8, step_s=0.01)


def push_and_merge(syncer, core, p, now):
    plan = core.make_push(p, syncer.epoch)
    verdict = syncer.accept_push(plan.push, now)
    return plan, verdict


def host(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


@pytest.mark.parametrize("down, up", [("int2", "int2"), ("int4", "int4"), ("bf16", "int2"),
                                      ("nf2", "nf2")])
def test_learner_and_shadow_agree_bit_for_bit_over_many_rounds(down, up):
    """60 rounds, two learners taking turns on two fragments, error feedback both ways: after
    every adoption the learner's base is exactly the syncer's shadow, the syncer's reconstruction
    of the next push is exactly the learner's base plus the decoded drift, and the base stays
    within one code's bound of Θ (the feedback does not let errors pile up)."""
    syncer, cores, rng = make_system(up=up, down=down)
    down_codec = syncer.downlink.codec
    diffs = 0
    for r in range(60):
        name = ("x:0", "x:1")[r % 2]
        core, p = cores[name], (r // 2) % 2
        train(core, rng)
        plan, verdict = push_and_merge(syncer, core, p, float(r))
        assert verdict.ok, verdict
        outer_grad, _ = syncer.outer_gradient_of(p, name)   # as the round folded it
        base = host(core.tracks[p].base)
        decoded = {k: np.asarray(v) for k, v in codec_lib.decode_tree(None, plan.push.codes).items()}
        theta_now = syncer.slots[p].params
        for k in base:  # g = Θ − (S + δ) on the syncer is Θ − (the learner's base + δ), exactly
            np.testing.assert_array_equal(outer_grad[k],
                                          (theta_now[k] - base[k]) - decoded[k])
        result = syncer.merge(p, "test", live_count=2)
        update = syncer.updates(result)[name]
        diffs += isinstance(update, downlink.DiffUpdate)
        core.offer_reply(p, update, result.version)
        assert core.adopt_ready() == [p]
        shadow = syncer.shadows[(name, p)]
        assert core.tracks[p].base_id == shadow.shadow_id and core.versions[p] == shadow.version
        for k, value in core.tracks[p].base.items():
            np.testing.assert_array_equal(np.asarray(value), shadow.params[k])
            # Error feedback: Θ − S' is one code's error of the difference Θ − S it encoded
            # (which carried the previous error along), never a sum of them.
            theta = result.params[k].astype(np.float64)
            # (nf2 clips: a value beyond its block's ±c errs by exactly |x| − c, carried onwards)
            diff = (result.params[k] - base[k]).reshape(-1)
            scale = block_scale(update.codes[k], theta.shape).reshape(-1)
            if down != "nf2":   # the int kinds' scale is the difference's block absmax
                np.testing.assert_array_equal(scale, block_absmax(diff, 32) * (down != "bf16"))
            bound = codec_lib.max_abs_error(down, diff, scale).reshape(theta.shape)
            left = np.abs(theta - shadow.params[k])
            assert np.all(left <= bound * (1 + 1e-5) + 1e-6 * np.abs(theta))
        assert update_is_small(update, result.params, down_codec)
    assert diffs == 60


def block_absmax(flat, block):
    padded = np.zeros(-(-flat.size // block) * block, np.float64)
    padded[:flat.size] = np.abs(flat)
    return np.repeat(padded.reshape(-1, block).max(axis=1), block)[:flat.size]


def update_is_small(update, params, codec):
    fp32 = sum(v.nbytes for v in params.values())
    return downlink.update_bytes(update) < fp32 * (0.55 if codec.kind != "bf16" else 0.51)


def test_without_a_downlink_codec_the_reply_is_the_fragment():
    syncer, cores, rng = make_system(down="none")
    core = cores["x:0"]
    train(core, rng)
    push_and_merge(syncer, core, 0, 0.0)
    result = syncer.merge(0, "test", live_count=2)
    update = syncer.updates(result)["x:0"]
    assert isinstance(update, downlink.FullUpdate) and update.params is result.params
    assert downlink.update_bytes(update) == sum(v.nbytes for v in result.params.values())
    assert syncer.shadows == {}
    core.offer_reply(0, update, result.version)
    core.adopt_ready()
    assert core.tracks[0].base_id == downlink.EXACT
    for k, v in core.tracks[0].base.items():
        np.testing.assert_array_equal(np.asarray(v), result.params[k])


def test_a_learner_too_far_behind_gets_the_full_fragment():
    """full_after_versions = 2: x:1 pushes from version 0 while x:0 merged 3 times."""
    syncer, cores, rng = make_system(full_after=2)
    for r in range(3):
        train(cores["x:0"], rng)
        push_and_merge(syncer, cores["x:0"], 0, float(r))
        result = syncer.merge(0, "test", live_count=2)
        cores["x:0"].offer_reply(0, syncer.updates(result)["x:0"], result.version)
        cores["x:0"].adopt_ready()
    train(cores["x:1"], rng)
    push_and_merge(syncer, cores["x:1"], 0, 3.0)
    result = syncer.merge(0, "test", live_count=2)
    assert result.version == 4
    update = syncer.updates(result)["x:1"]
    assert isinstance(update, downlink.FullUpdate)   # 4 − 0 > 2
    assert ("x:1", 0) not in syncer.shadows and ("x:0", 0) in syncer.shadows


def test_a_lost_update_is_healed_by_a_refusal_with_the_full_fragment():
    """The update never reaches the learner: its next push names the old base, which the
    syncer no longer records; the refusal carries the fragment, the learner re-bases (keeping
    its drift), and the push after that is accepted from the exact fragment."""
    syncer, cores, rng = make_system()
    core = cores["x:0"]
    train(core, rng)
    push_and_merge(syncer, core, 0, 0.0)
    syncer.updates(syncer.merge(0, "test", live_count=2))   # sent, lost on the way
    train(core, rng)
    plan, verdict = push_and_merge(syncer, core, 0, 1.0)
    assert plan.push.base_shadow == downlink.EXACT   # still on its first (exact) base ...
    assert verdict.ok   # ... which is in the history: accepted, reconstructs exactly
    result = syncer.merge(0, "test", live_count=2)
    core.offer_reply(0, syncer.updates(result)["x:0"], result.version)
    core.adopt_ready()
    assert core.tracks[0].base_id != downlink.EXACT
    # Now lose the next update: the learner keeps shadow n, the syncer records n + 1.
    train(core, rng)
    push_and_merge(syncer, core, 0, 2.0)
    syncer.updates(syncer.merge(0, "test", live_count=2))
    core.push_refused(0)   # its push is void for the learner (say, the reply went missing)
    local_before = host(fragments.extract(core.params, core.plan, 0))
    train(core, rng)
    plan, verdict = push_and_merge(syncer, core, 0, 3.0)
    assert not verdict.ok and verdict.reason is RejectReason.UNKNOWN_VERSION
    assert "base shadow" in verdict.detail
    current, version = syncer.fragment(0)
    core.refused(0, verdict.reason.value, current, version)   # re-base on the exact fragment
    assert core.tracks[0].base_id == downlink.EXACT and core.tracks[0].resend
    for k, v in core.tracks[0].base.items():
        np.testing.assert_array_equal(np.asarray(v), current[k])
    assert not np.array_equal(host(fragments.extract(core.params, core.plan, 0))["a"],
                              local_before["a"])   # the drift was kept (moved, not reset)
    plan, verdict = push_and_merge(syncer, core, 0, 4.0)
    assert verdict.ok


def test_an_update_for_another_base_is_not_applied():
    syncer, cores, rng = make_system()
    core = cores["x:0"]
    train(core, rng)
    push_and_merge(syncer, core, 0, 0.0)
    update = syncer.updates(syncer.merge(0, "test", live_count=2))["x:0"]
    stale = downlink.DiffUpdate(update.codes, update.from_id + 99, update.to_id, update.version)
    before = host(core.tracks[0].base)
    core.offer_reply(0, stale, update.version)
    assert core.adopt_ready() == [0]
    assert core.tracks[0].base_id == downlink.EXACT and core.tracks[0].in_flight_since_step is None
    for k, v in core.tracks[0].base.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])


def test_a_rejoining_learner_starts_from_the_full_fragment():
    syncer, cores, rng = make_system()
    core = cores["x:0"]
    train(core, rng)
    push_and_merge(syncer, core, 1, 0.0)
    syncer.updates(syncer.merge(1, "test", live_count=2))
    assert ("x:0", 1) in syncer.shadows
    syncer.forget("x:0")
    assert not any(name == "x:0" for name, _ in syncer.shadows)
    _, frags = syncer.register("x:0", 1)   # a new incarnation: full fragments, exact bases
    assert [v for _, v in frags] == [0, 1]
    syncer.register("x:1", 0)   # the same incarnation again keeps its records
    train(cores["x:1"], rng)
    push_and_merge(syncer, cores["x:1"], 1, 1.0)
    syncer.updates(syncer.merge(1, "test", live_count=2))
    syncer.register("x:1", 0)
    assert ("x:1", 1) in syncer.shadows


def test_without_error_feedback_the_update_is_the_merges_since_the_base():
    syncer, cores, rng = make_system(error_feedback=False, down="int8")
    core = cores["x:0"]
    train(core, rng)
    push_and_merge(syncer, core, 0, 0.0)
    result = syncer.merge(0, "test", live_count=2)
    update = syncer.updates(result)["x:0"]
    history0 = syncer.slots[0].history[0]
    want = codec_lib.to_numpy(codec_lib.encode_tree(
        codec_lib.make_codec("int8", block_size=32),
        {k: result.params[k] - history0[k] for k in history0}))
    for k in want:
        np.testing.assert_array_equal(update.codes[k].payload, want[k].payload)


@pytest.mark.parametrize("cap", [None, 2])
def test_diverged_learners_keep_encoded_replies_unless_a_shadow_cap_is_set(cap):
    """Five learners merge one at a time (a fleet out of phase): each holds its own copy. With
    no bound (the default) every reply stays encoded, one shadow each; with ``max_shadows`` the
    fragment keeps at most that many, and the learners past it get the full fragment."""
    names = tuple(f"x:{i}" for i in range(5))
    syncer, cores, rng = make_system(learners=names)
    syncer.downlink = dataclasses.replace(syncer.downlink, max_shadows=cap)
    kinds = []
    for r in range(3):
        for i, name in enumerate(names):
            train(cores[name], rng)
            push_and_merge(syncer, cores[name], 0, float(r * 10 + i))
            result = syncer.merge(0, "test", live_count=len(names))
            update = syncer.updates(result)[name]
            kinds.append(type(update).__name__)
            cores[name].offer_reply(0, update, result.version)
            cores[name].adopt_ready()
            held = [k for k in syncer.shadows if k[1] == 0]
            assert cap is None or len(held) <= cap, held
    if cap is None:
        assert "FullUpdate" not in kinds
        assert len([k for k in syncer.shadows if k[1] == 0]) == len(names)
    else:
        assert kinds.count("FullUpdate") >= len(names)   # past the cap, round after round
