"""Codecs: derived error bounds, exact wire bytes, hand-worked quantization, error feedback."""

import ml_dtypes
import numpy as np
import pytest

from islands.syncer import codec as codec_lib


@pytest.fixture
def gaussian():
    return np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)


def rel_err(c, x):
    return codec_lib.relative_error(x, c.encode(x), c)


def test_none_is_exact(gaussian):
    c = codec_lib.make_codec("none")
    assert rel_err(c, gaussian) == 0.0
    assert c.encode(gaussian).wire_bytes == gaussian.size * 4


def test_bf16_bound(gaussian):
    # bf16 keeps 8 significant bits; round-to-nearest errs by at most half an ulp, i.e. 2⁻⁸ of
    # each element's magnitude, so the relative error of the whole tensor is at most 2⁻⁸.
    c = codec_lib.make_codec("bf16")
    err = rel_err(c, gaussian)
    assert 0 < err <= 2 ** -8
    assert c.encode(gaussian).payload.dtype == ml_dtypes.bfloat16
    assert c.encode(gaussian).wire_bytes == gaussian.size * 2


@pytest.mark.parametrize("kind,levels,typical", [("int8", 127, 0.008), ("int4", 7, 0.12)])
def test_int_bounds(gaussian, kind, levels, typical):
    # Absmax scale s = max|x_block| / L; rounding errs by ≤ s/2 per element, so
    # ‖err‖ ≤ √N · max|x| / (2L) and rel ≤ max|x| / (2L · rms(x)) — a guaranteed bound.
    # For Gaussian blocks of 64 the error is ~uniform: rms err ≈ s/√12 with E[max|x|] ≈ 2.5σ,
    # so the typical value is ≈ 2.5 / (L·√12): 0.0057 for int8 and 0.103 for int4.
    c = codec_lib.make_codec(kind, block_size=64)
    err = rel_err(c, gaussian)
    guaranteed = np.max(np.abs(gaussian)) / (2 * levels * np.sqrt(np.mean(gaussian ** 2)))
    assert err <= guaranteed
    assert err < typical
    decoded = c.decode(c.encode(gaussian))
    assert decoded.shape == gaussian.shape and decoded.dtype == np.float32


def test_wire_bytes_exact():
    x = np.ones(1000, np.float32)
    # 1000 elements in blocks of 64 → 16 blocks (1024 slots); int4 packs 2 per byte.
    assert codec_lib.make_codec("int4").encode(x).wire_bytes == 512 + 16 * 4
    assert codec_lib.make_codec("int8").encode(x).wire_bytes == 1024 + 16 * 4
    assert codec_lib.tree_wire_bytes({"a": codec_lib.make_codec("bf16").encode(x)}) == 2000


def test_hand_worked_int4_and_int8():
    # int4, one block of 4: absmax 1.75 → s = 1.75/7 = 0.25; x/s = [3, −7, 0.5, 0];
    # 0.5 rounds half to even → 0. Decoded: [0.75, −1.75, 0, 0].
    c4 = codec_lib.make_codec("int4", block_size=4)
    code = c4.encode(np.array([0.75, -1.75, 0.125, 0.0], np.float32))
    np.testing.assert_array_equal(code.scales, [0.25])
    # nibbles q+8 = [11, 1, 8, 8] packed low-first: [11 | 1<<4, 8 | 8<<4] = [27, 136]
    np.testing.assert_array_equal(code.payload, np.array([27, 136], np.uint8))
    np.testing.assert_array_equal(c4.decode(code), [0.75, -1.75, 0.0, 0.0])
    # int8: absmax 127 → s = 1; −63.5 → −64 (half to even), 0.5 → 0.
    c8 = codec_lib.make_codec("int8", block_size=4)
    code = c8.encode(np.array([127.0, -63.5, 0.5, 0.0], np.float32))
    np.testing.assert_array_equal(code.payload, np.array([127, -64, 0, 0], np.int8))
    np.testing.assert_array_equal(c8.decode(code), [127.0, -64.0, 0.0, 0.0])


@pytest.mark.parametrize("kind", codec_lib.KINDS)
def test_zero_constant_and_odd_shapes(kind):
    c = codec_lib.make_codec(kind, block_size=8)
    for x in (np.zeros((3, 5), np.float32), np.full((7,), -2.5, np.float32),
              np.array(3.0, np.float32)):
        out = c.decode(c.encode(x))
        assert out.shape == x.shape and np.all(np.isfinite(out))
        np.testing.assert_allclose(out, x, rtol=0.01)  # constants are exact up to bf16 rounding
    assert codec_lib.relative_error(np.zeros(4), c.encode(np.zeros(4)), c) == 0.0


def test_unknown_codec_and_bad_block():
    with pytest.raises(ValueError, match="unknown codec 'int3'; choose one of none, bf16, int8, int4"):
        codec_lib.make_codec("int3")
    with pytest.raises(ValueError, match="block_size must be > 0"):
        codec_lib.make_codec("int4", block_size=0)


def test_error_feedback_keeps_the_sum_of_pushes():
    # Σ decoded = Σ true − final residual exactly (the residual starts at 0), so with error
    # feedback the gap never exceeds one step's quantization error; without it, errors add up (~√n).
    rng = np.random.default_rng(1)
    c = codec_lib.make_codec("int4", block_size=64)
    drifts = [{"w": rng.standard_normal(512).astype(np.float32) * 0.01} for _ in range(100)]
    true_sum = np.sum([d["w"] for d in drifts], axis=0)
    gaps = {}
    for name, ef in (("ef", codec_lib.error_feedback(c)), ("plain", codec_lib.no_error_feedback(c))):
        state = ef.init(drifts[0])
        decoded_sum = np.zeros(512, np.float32)
        for d in drifts:
            codes, state = ef.update(d, state)
            decoded_sum += codec_lib.decode_tree(c, codes)["w"]
        gaps[name] = float(np.linalg.norm(decoded_sum - true_sum))
        if name == "ef":
            np.testing.assert_allclose(decoded_sum, true_sum - state.residual["w"], atol=1e-5)
    # One int4 step errs by ≤ max|x|/(2·7·rms x) of the tensor: ≈ 3.5σ/14σ = 0.25 for 512 normals.
    one_step = float(np.linalg.norm(drifts[0]["w"])) * 0.25
    assert gaps["ef"] <= one_step
    assert gaps["plain"] > 4 * gaps["ef"]
