"""Codecs: derived error bounds, exact wire bytes, hand-worked codes, purity, error feedback."""

import doctest
import math
import pickle

import jax
import ml_dtypes
import numpy as np
import pytest

from islands.syncer import codec as codec_lib

L = codec_lib.LEVELS  # int8: 127, int4: 7


@pytest.fixture(autouse=True)
def strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(scope="module")
def gaussian():
    return np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)


def encode_np(codec, x):
    code, rel = codec.encode(x)
    return codec_lib.to_numpy(code), float(rel)


def test_module_doctest():
    assert doctest.testmod(codec_lib).failed == 0


# -- error bounds on 64×1000 standard normals (1000 blocks of 64) ----------------------------------
def test_none_is_exact_fp32(gaussian):
    code, rel = encode_np(codec_lib.make_codec("none"), gaussian)
    assert rel == 0.0 and code.payload.dtype == np.float32
    np.testing.assert_array_equal(codec_lib.decode(code), gaussian)
    assert codec_lib.wire_bytes(code) == 64_000 * 4
    assert codec_lib.wire_bytes(encode_np(codec_lib.make_codec("bf16"), gaussian)[0]) == 64_000 * 2


def test_bf16_bound(gaussian):
    # bf16 has an 8-bit significand (7 stored + the implicit 1). Round to nearest (even) errs by at
    # most half an ulp: for 2^e ≤ |x| < 2^(e+1), ulp = 2^(e−7), so |err| ≤ 2^(e−8) ≤ 2^−8·|x| and
    # the tensor's relative error is ≤ 2^−8 = 0.0039 (guaranteed). (2^−9 would need a 9-bit
    # significand.) Expected: the error is ~uniform on ±ulp/2, E[err²] = ulp(x)²/12, which the
    # sample itself turns into a prediction; over any binade it lies in [2^−8/√12, 2^−7/√12] =
    # [0.00113, 0.00226]. Measured 0.00166 (predicted 0.00166).
    code, rel = encode_np(codec_lib.make_codec("bf16"), gaussian)
    assert code.payload.dtype == ml_dtypes.bfloat16 and code.scales.size == 0
    ulp = 2.0 ** (np.floor(np.log2(np.abs(gaussian.astype(np.float64)))) - 7)
    predicted = math.sqrt(np.sum(ulp ** 2 / 12) / np.sum(np.square(gaussian.astype(np.float64))))
    assert 2 ** -8 / math.sqrt(12) < rel <= 2 ** -8
    assert rel == pytest.approx(predicted, rel=0.05)
    np.testing.assert_array_equal(codec_lib.decode(code), gaussian.astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))


def expected_max_sq(n):
    """E[A²] for A = max of n |N(0, 1)|: ∫ 2a·(1 − erf(a/√2)^n) da (A's tail integral)."""
    a = np.linspace(0.0, 12.0, 24_001)
    cdf = np.array([math.erf(v / math.sqrt(2)) for v in a]) ** n
    return float(np.trapezoid(2 * a * (1 - cdf), a))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int_bounds(gaussian, kind):
    # Block b has absmax A_b and step A_b/L. Round to nearest errs by ≤ A_b/(2L) per element and
    # the absmax element is exact, so (guaranteed) ‖err‖² ≤ Σ_b (n_b − 1)·(A_b/(2L))².
    # Expected (RMS): the error is ~uniform on ±step/2, E[err²] = A_b²/(12L²) for 63 of 64
    # elements; for standard normals E[A²] = 6.914 (max of 64 |N|), so
    # rel ≈ √(63/64 · 6.914/12) / L = 0.753/L: 0.00593 for int8, 0.1076 for int4.
    # Measured 0.00595 and 0.1083; 5 % slack for the sample (1000 blocks) and the uniform model.
    c = codec_lib.make_codec(kind, block_size=64)
    code, rel = encode_np(c, gaussian)
    levels = L[kind]
    guaranteed = math.sqrt(63 * np.sum((code.scales.astype(np.float64) / (2 * levels)) ** 2)
                           / np.sum(np.square(gaussian.astype(np.float64))))
    expected = math.sqrt(63 / 64 * expected_max_sq(64) / 12) / levels
    assert rel <= guaranteed
    assert rel == pytest.approx(expected, rel=0.05)
    assert rel < 1.05 * expected
    np.testing.assert_allclose(code.scales, np.abs(gaussian).reshape(1000, 64).max(axis=1))
    decoded = codec_lib.decode(code)
    assert decoded.shape == gaussian.shape and decoded.dtype == np.float32
    # every element within half a step of its block
    step = np.repeat(code.scales / levels, 64).reshape(gaussian.shape)
    assert np.all(np.abs(np.asarray(decoded) - gaussian) <= step / 2 * (1 + 1e-6))


def test_reported_rel_error_matches_host_helpers(gaussian):
    c = codec_lib.make_codec("int4")
    code, rel = c.encode(gaussian)
    assert float(rel) == pytest.approx(codec_lib.relative_error(gaussian, code), rel=1e-5)
    small = np.linspace(-1, 1, 1000, dtype=np.float32)
    small_rel = float(c.encode(small)[1])
    codes = codec_lib.encode_tree(c, {"a": gaussian, "b": small})
    # over a fragment, errors and norms add in quadrature: rel² = Σ rel_i²‖x_i‖² / Σ ‖x_i‖²
    norms_sq = [np.sum(np.square(v.astype(np.float64))) for v in (gaussian, small)]
    expected = math.sqrt((float(rel) ** 2 * norms_sq[0] + small_rel ** 2 * norms_sq[1])
                         / sum(norms_sq))
    assert codec_lib.tree_relative_error({"a": gaussian, "b": small}, codes) == pytest.approx(
        expected, rel=1e-5)


# -- wire bytes, shapes, dtypes --------------------------------------------------------------------
def test_wire_bytes_exact():
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    # 1000 elements in blocks of 64 → 16 blocks (the tail padded for the scale only); the payload
    # holds the 1000 elements: int4 2 per byte → 500, int8 → 1000; 16 float32 scales → 64.
    # (none: 4 bytes and bf16: 2 bytes per element are checked on the 64×1000 tensor above)
    nbytes = {kind: codec_lib.wire_bytes(encode_np(codec_lib.make_codec(kind), x)[0])
              for kind in ("int8", "int4")}
    assert nbytes == {"int8": 1000 + 64, "int4": 500 + 64}
    code = encode_np(codec_lib.make_codec("int4"), x[:999])[0]  # odd: 500 bytes, last nibble pad
    assert (code.payload.shape, code.scales.shape) == ((500,), (16,))
    codes = codec_lib.encode_tree(codec_lib.make_codec("int4"), {"w": x, "b": x[:999]})
    assert codec_lib.tree_wire_bytes(codes) == 2 * (500 + 64)
    # jax arrays count the same as their numpy copies
    assert codec_lib.tree_wire_bytes(codec_lib.to_numpy(codes)) == 1128


@pytest.mark.parametrize("kind", codec_lib.KINDS)
def test_round_trip_shapes_and_dtypes(kind):
    c = codec_lib.make_codec(kind, block_size=8)
    rng = np.random.default_rng(2)
    # (3, 7) with block 8 is 2 full blocks and a padded tail of 5, as in the next test; a scalar
    # and an empty tensor matter for the blocked kinds only
    tensors = [rng.standard_normal((3, 7)).astype(np.float32),
               rng.standard_normal((3, 7)).astype(ml_dtypes.bfloat16)]
    if kind in L or kind == "nf2":
        tensors += [np.float32(3.0), np.zeros((0, 4), np.float32)]
    for x in tensors:
        code = codec_lib.to_numpy(c.encode(x)[0])
        code = pickle.loads(pickle.dumps(code))  # what crosses the wire
        assert isinstance(code.payload, np.ndarray) and isinstance(code.scales, np.ndarray)
        out = np.asarray(c.decode(code))
        assert out.shape == np.shape(x) and out.dtype == np.asarray(x).dtype


@pytest.mark.parametrize("kind", codec_lib.KINDS)
def test_zero_and_constant_tensors_exact(kind):
    # A zero block has scale 0 and decodes to 0 (no 0/0). A constant block is its own absmax and
    # q = ±L decodes to the stored absmax itself, so it is exact, including 1.9, where a stored
    # step would not be: float32 (1.9/7)·7 ≠ 1.9. bf16 is exact for bf16 numbers (−2.5, 0), and so
    # is nf2, whose bfloat16 scale of a constant block is the constant rounded to bfloat16 (every
    # value is beyond T·c₀ = 0.98·|v|, so all go to the outer level and the refit gives c = |v|).
    c = codec_lib.make_codec(kind, block_size=8)
    bf16_scaled = kind in ("bf16", "nf2")
    constants = [0.0, -2.5] + ([] if bf16_scaled else [1.9])
    for value in constants:
        x = np.full((3, 7), value, np.float32)
        code, rel = encode_np(c, x)
        out = np.asarray(codec_lib.decode(code))
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(code.scales))
        np.testing.assert_array_equal(out, x)
        assert rel == 0.0
    # a zero block next to constant ones
    x = np.concatenate([np.zeros(8, np.float32), np.full(13, 1.9, np.float32)]).reshape(3, 7)
    code, _ = encode_np(c, x)
    np.testing.assert_array_equal(codec_lib.decode(code),
                                  x if not bf16_scaled else x.astype(ml_dtypes.bfloat16))
    assert codec_lib.relative_error(np.zeros((3, 7)), encode_np(c, np.zeros((3, 7)))[0]) == 0.0


def test_non_finite_input_stays_non_finite():
    # so the syncer's NON_FINITE check still refuses the push after int quantization
    x = np.array([1.0, np.nan, 2.0, np.inf], np.float32)
    for kind in ("int8", "int4", "int2", "nf2"):  # (none and bf16 carry NaN and inf as they are)
        out = np.asarray(codec_lib.decode(encode_np(codec_lib.make_codec(kind, 4), x)[0]))
        assert not np.all(np.isfinite(out)), kind


# -- hand-worked examples --------------------------------------------------------------------------
def test_hand_worked_int4():
    # x = [0.7, −1.4, 0.1, 0], one block of 4: A = 1.4, L = 7, step 0.2.
    # x/A·L = [3.5, −7, 0.5, 0], and both halves are exact in float32 (0.7f is exactly 1.4f/2;
    # 0.1f/1.4f·7 rounds to exactly 0.5). Rule: round half to even, so 3.5 → 4 and 0.5 → 0
    # (half away from zero would give [4, −7, 1, 0]). q = [4, −7, 0, 0].
    # Nibbles q + 8 = [12, 1, 8, 8], first element low: bytes [12 + 1·16, 8 + 8·16] = [28, 136].
    # Decoded [0.8, −1.4, 0, 0]; error [0.1, 0, −0.1, 0], rel = √0.02/√2.46 = 0.0902.
    # Wire: 2 payload bytes + 1 scale × 4 = 6.
    x = np.array([0.7, -1.4, 0.1, 0.0], np.float32)
    code, rel = encode_np(codec_lib.make_codec("int4", block_size=4), x)
    np.testing.assert_array_equal(code.payload, np.array([28, 136], np.uint8))
    np.testing.assert_array_equal(code.scales, np.array([1.4], np.float32))
    decoded = np.asarray(codec_lib.decode(code))
    np.testing.assert_allclose(decoded, [0.8, -1.4, 0.0, 0.0], rtol=1e-6)
    assert decoded[1] == np.float32(-1.4)  # the absmax is exact
    assert rel == pytest.approx(math.sqrt(0.02 / 2.46), rel=1e-5)
    assert codec_lib.wire_bytes(code) == 6
    # odd count: [1, −1, 0.5] → A = 1, x·7 = [7, −7, 3.5] → q = [7, −7, 4] (half to even);
    # nibbles [15, 1, 12] + pad 8 → bytes [15 + 1·16, 12 + 8·16] = [31, 140]; decoded 4/7 for 0.5.
    code, _ = encode_np(codec_lib.make_codec("int4", block_size=4),
                        np.array([1, -1, 0.5], np.float32))
    np.testing.assert_array_equal(code.payload, np.array([31, 140], np.uint8))
    np.testing.assert_allclose(codec_lib.decode(code), [1, -1, 4 / 7], rtol=1e-6)


def test_hand_worked_int8():
    # Same x, L = 127: x/A·L = [63.5, −127, 9.07, 0] → q = [64 (half to even), −127, 9, 0];
    # decoded [64·1.4/127, −1.4, 9·1.4/127, 0] = [0.70551, −1.4, 0.099213, 0]; wire 4 + 4 = 8.
    x = np.array([0.7, -1.4, 0.1, 0.0], np.float32)
    code, _ = encode_np(codec_lib.make_codec("int8", block_size=4), x)
    np.testing.assert_array_equal(code.payload, np.array([64, -127, 9, 0], np.int8))
    np.testing.assert_allclose(codec_lib.decode(code), [0.705512, -1.4, 0.0992126, 0.0], rtol=1e-5)
    assert codec_lib.wire_bytes(code) == 8


def test_hand_worked_nf2():
    # x = [3, −1.5, 0.5, −0.5 | 0, 0, 0], blocks of 4 (the second: 3 values, padding not counted).
    # Block 1: rms = √(11.75/4) = 1.71391, c₀ = 1.5104·rms = 2.58870, T = (1 + R)/2 = 0.649894
    # with R = 0.4528/1.5104 = 0.299788, T·c₀ = 1.68238: only 3 goes to the outer level.
    # Refit: c₁ = (3 + R·(1.5 + 0.5 + 0.5)) / (1 + 3R²) = 3.749470/1.269619 = 2.953225;
    # bfloat16 (7 stored bits; step 2⁻⁶ = 0.015625 on [2, 4)): 2.953225/2⁻⁶ = 189.006 → 189,
    # c = 2.953125. Final levels for that c: ±2.953125 and ±R·c = ±0.885312; T·c = 1.91921.
    # k (0: −c, 1: −Rc, 2: +Rc, 3: +c) = [3 (3 is clipped to c), 1, 2, 1].
    # Errors: 3 − c = 0.046875 (clipped: |x| − c); −1.5 → −0.885: 0.615, 0.5 → 0.885: 0.385,
    # all within (1 − R)/2·c = 1.0339 for the values inside ±c.
    # Block 2: zeros → rms 0, c = 0, every 0 ≥ T·0 goes to k = 3 (x ≥ 0), decoding +0·… = 0.
    # Bytes: [3 | 1<<2 | 2<<4 | 1<<6, 3 | 3<<2 | 3<<4 | 0 (padding)] = [103, 63]; wire 2 + 2·2 = 6.
    x = np.array([3.0, -1.5, 0.5, -0.5, 0.0, 0.0, 0.0], np.float32)
    code, rel = encode_np(codec_lib.make_codec("nf2", block_size=4), x)
    assert code.payload.tolist() == [103, 63]
    assert code.scales.dtype == ml_dtypes.bfloat16 and code.scales.tolist() == [2.953125, 0.0]
    assert codec_lib.wire_bytes(code) == 6
    inner = float(np.float32(codec_lib.NF2_RATIO) * np.float32(2.953125))
    assert inner == pytest.approx(0.885312, abs=1e-6)
    want = np.array([2.953125, -inner, inner, -inner, 0, 0, 0], np.float32)
    np.testing.assert_array_equal(codec_lib.decode_host(code), want)
    np.testing.assert_array_equal(np.asarray(codec_lib.decode(code)), want)
    err = np.abs(want.astype(np.float64) - x)
    np.testing.assert_allclose(err[:4], [0.046875, 1.5 - inner, inner - 0.5, inner - 0.5],
                               rtol=1e-6)
    bound = codec_lib.max_abs_error("nf2", x, np.array([2.953125] * 4 + [0.0] * 3))
    np.testing.assert_allclose(bound[:4], [0.046875] + [(1 - codec_lib.NF2_RATIO) / 2 * 2.953125]
                               * 3, rtol=1e-6)
    assert np.all(err <= bound * (1 + 1e-7))
    assert rel == pytest.approx(math.sqrt(np.sum(err ** 2) / np.sum(x.astype(np.float64) ** 2)),
                                rel=1e-5)


def test_nf2_on_normals(gaussian):
    # The 2-bit Lloyd-Max quantizer of N(0, 1) has MSE 0.1175σ², rel error √0.1175 = 0.343; the
    # per-block refit of the scale does a little better (measured 0.337 with blocks of 64, 0.340
    # with 128). int2 (absmax) on the same values: 0.48 (64), 0.55 (128). The outer level sits at
    # ≈ 1.51σ (the refit moves it little on normals). Wire: 0.25 + 2/B bytes per value.
    for block, want in ((64, 0.337), (128, 0.340)):
        code, rel = encode_np(codec_lib.make_codec("nf2", block_size=block), gaussian)
        assert rel == pytest.approx(want, abs=0.005)
        int2_rel = encode_np(codec_lib.make_codec("int2", block_size=block), gaussian)[1]
        assert rel < 0.75 * int2_rel
        assert np.mean(code.scales.astype(np.float64)) == pytest.approx(1.51, abs=0.03)
        assert codec_lib.wire_bytes(code) == 64_000 // 4 + 2 * 64_000 // block
        scale = np.repeat(code.scales.astype(np.float64), block).reshape(gaussian.shape)
        err = np.abs(codec_lib.decode_host(code).astype(np.float64) - gaussian)
        inside = np.abs(gaussian) <= scale
        # inside ±c: (1 − R)/2·c, reached (x halfway between R·c and c); outside: exactly |x| − c
        assert np.all(err[inside] <= codec_lib.NF2_IN_RANGE_BOUND * scale[inside] * (1 + 1e-6))
        assert np.max(err[inside] / scale[inside]) > 0.99 * codec_lib.NF2_IN_RANGE_BOUND
        np.testing.assert_allclose(err[~inside], np.abs(gaussian[~inside]) - scale[~inside],
                                   rtol=1e-5)
        assert 0.05 < np.mean(~inside) < 0.2   # P(|x| > 1.51σ) = 0.13 for a normal


def test_nf2_error_feedback_keeps_the_sum_over_many_rounds():
    # nf2 clips, so one encoding's error is not bounded by the scale alone; error feedback still
    # telescopes: Σ decode = Σ δ − r_n exactly (to float rounding), and r_n is the last encoding's
    # error, within max_abs_error("nf2", t_n, c_n) of its target t_n = δ_n + r_{n−1} (what was
    # clipped is carried, not lost). The residual does not grow: ‖r‖/‖δ‖ averages ≈ 0.6 over the
    # first 100 rounds and ≈ 0.5–0.6 over the last 100 (measured; at most 1.47 in any round).
    rng = np.random.default_rng(5)
    c = codec_lib.make_codec("nf2", block_size=64)
    ef = codec_lib.error_feedback(c)
    shapes = {"w": (8, 64), "b": (100,)}
    state = ef.init({p: np.zeros(s, np.float32) for p, s in shapes.items()})
    true_sum = {p: np.zeros(s) for p, s in shapes.items()}
    decoded_sum = {p: np.zeros(s) for p, s in shapes.items()}
    ratios = []
    for n in range(300):
        # heavy-tailed drifts (Student t, 3 degrees of freedom) so that clipping happens a lot
        d = {p: (0.01 * rng.standard_t(3, s)).astype(np.float32) for p, s in shapes.items()}
        codes, state = ef.update(d, state)
        codes = codec_lib.to_numpy(codes)
        for p in shapes:
            decoded = codec_lib.decode_host(codes[p]).astype(np.float64)
            decoded_sum[p] += decoded
            true_sum[p] += d[p]
            r = np.asarray(state.residual[p], np.float64)
            np.testing.assert_allclose(decoded_sum[p] + r, true_sum[p], rtol=0, atol=1e-5)
            scale = np.repeat(codes[p].scales.astype(np.float64), 64)[:r.size].reshape(r.shape)
            bound = codec_lib.max_abs_error("nf2", decoded + r, scale)
            assert np.all(np.abs(r) <= bound * (1 + 1e-5) + 1e-8)
            ratios.append(np.linalg.norm(r) / np.linalg.norm(d[p].astype(np.float64)))
    ratios = np.array(ratios).reshape(300, 2)
    assert np.max(ratios) < 2.0
    assert np.mean(ratios[-100:]) < 0.8 and np.mean(ratios[-100:]) < 1.2 * np.mean(ratios[:100])


# -- config and malformed codes --------------------------------------------------------------------
def test_unknown_codec_and_bad_block():
    allowed = "unknown codec 'int3'; choose one of none, bf16, int8, int4"
    with pytest.raises(ValueError, match=allowed):
        codec_lib.make_codec("int3")
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        codec_lib.make_codec("int4", block_size=0)


def test_malformed_code_is_a_value_error():
    code = codec_lib.Code("int4", np.zeros(3, np.uint8), np.ones(1, np.float32), (4,), "float32", 4)
    with pytest.raises(ValueError,
                       match=r"int4 payload is uint8\[3\], shape \[4\] needs uint8\[2\]"):
        codec_lib.decode(code)
    code = codec_lib.Code("int8", np.zeros(9, np.int8), np.ones(1, np.float32), (9,), "float32", 4)
    with pytest.raises(ValueError,
                       match=r"int8 has 1 scales, shape \[9\] with block_size 4 needs 3"):
        codec_lib.decode(code)
    # nf2 scales are bfloat16 (2 wire bytes each): float32 ones are refused on both decoders
    code = codec_lib.Code("nf2", np.zeros(1, np.uint8), np.ones(1, np.float32), (4,), "float32", 4)
    for decoder in (codec_lib.decode, codec_lib.decode_host):
        with pytest.raises(ValueError, match="nf2 scales are bfloat16, got float32"):
            decoder(code)


# -- purity: the same results under jit ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["int4", "nf2"])
def test_encode_and_error_feedback_jit(kind):
    # one jitted "train-step tail": encode a tensor, run error feedback on the fragment, decode
    rng = np.random.default_rng(3)
    fragment = {"w": rng.standard_normal((8, 64)).astype(np.float32),
                "b": rng.standard_normal(100).astype(np.float32)}
    c = codec_lib.make_codec(kind, block_size=64)
    ef = codec_lib.error_feedback(c)

    def step(fragment, state):
        code, rel = c.encode(fragment["w"])
        codes, new_state = ef.update(fragment, state)
        return code, rel, codes, new_state, codec_lib.decode_tree(c, codes)

    state = ef.init(fragment)
    code, rel, codes, new_state, decoded = step(fragment, state)
    j_code, j_rel, j_codes, j_state, j_decoded = jax.jit(step)(fragment, state)
    np.testing.assert_array_equal(j_code.payload, code.payload)
    np.testing.assert_array_equal(j_code.scales, code.scales)
    assert float(j_rel) == pytest.approx(float(rel), rel=1e-6)
    for path in fragment:
        np.testing.assert_array_equal(j_codes[path].payload, codes[path].payload)
        np.testing.assert_allclose(j_state.residual[path], new_state.residual[path], atol=1e-7)
        np.testing.assert_allclose(j_decoded[path], decoded[path], atol=1e-7)
        # the residual is what the receiver will not see
        np.testing.assert_allclose(np.asarray(decoded[path]) + new_state.residual[path],
                                   fragment[path], atol=1e-6)


# -- error feedback --------------------------------------------------------------------------------
def test_error_feedback_keeps_the_sum_of_pushes():
    # With EF, r₀ = 0 and r_k = t_k − dec_k, t_k = δ_k + r_{k−1}, so Σ dec = Σ δ − r_n: the gap is
    # exactly the last step's quantization error, bounded by √(Σ_b (n_b − 1)(A_b/2L)²) of that
    # step, at every n. Without EF the per-push errors e_k are independent, so ‖Σ e_k‖ ≈ √n·rms.
    rng = np.random.default_rng(1)
    c = codec_lib.make_codec("int4", block_size=64)
    n = 100
    drifts = [{"w": 0.01 * rng.standard_normal((8, 64)).astype(np.float32),
               "b": 0.01 * rng.standard_normal(100).astype(np.float32)} for _ in range(n)]
    true_sum = {p: np.sum([d[p].astype(np.float64) for d in drifts], axis=0) for p in drifts[0]}

    def gap(a, b):
        return math.sqrt(sum(np.sum(np.square(a[p] - b[p])) for p in a))

    ef = codec_lib.error_feedback(c)
    state = ef.init(drifts[0])
    running_true = {p: np.zeros(np.shape(v)) for p, v in drifts[0].items()}
    decoded_sum = {p: np.zeros(np.shape(v)) for p, v in drifts[0].items()}
    for d in drifts:
        codes, state = ef.update(d, state)
        codes = codec_lib.to_numpy(codes)
        for p, v in codec_lib.decode_tree(c, codes).items():
            decoded_sum[p] += np.asarray(v, np.float64)
            running_true[p] += d[p]
        residual = {p: np.asarray(r, np.float64) for p, r in state.residual.items()}
        one_step_bound = math.sqrt(sum(
            (64 - 1) * np.sum((code.scales.astype(np.float64) / (2 * L["int4"])) ** 2)
            for code in codes.values()))
        assert gap(decoded_sum, running_true) == pytest.approx(
            math.sqrt(sum(np.sum(r ** 2) for r in residual.values())), rel=1e-4)
        assert gap(decoded_sum, running_true) <= one_step_bound
    gap_ef = gap(decoded_sum, true_sum)

    plain = codec_lib.no_error_feedback(c)
    state = plain.init(drifts[0])
    decoded_sum = {p: np.zeros(np.shape(v)) for p, v in drifts[0].items()}
    step_err_sq = []
    for d in drifts:
        codes, state = plain.update(d, state)
        decoded = codec_lib.decode_tree(c, codes)
        for p, v in decoded.items():
            decoded_sum[p] += np.asarray(v, np.float64)
        step_err_sq.append(gap({p: np.asarray(v, np.float64) for p, v in decoded.items()}, d) ** 2)
    assert all(not np.any(np.asarray(r)) for r in state.residual.values())  # stays zero
    gap_plain = gap(decoded_sum, true_sum)
    rms_step = math.sqrt(np.mean(step_err_sq))
    assert 0.7 * math.sqrt(n) * rms_step < gap_plain < 1.3 * math.sqrt(n) * rms_step
    assert gap_plain > 5 * gap_ef


def test_error_feedback_with_lossless_codec_has_zero_residual():
    ef = codec_lib.error_feedback(codec_lib.make_codec("none"))
    x = {"w": np.random.default_rng(4).standard_normal(100).astype(np.float32)}
    codes, state = ef.update(x, ef.init(x))
    np.testing.assert_array_equal(codec_lib.decode_tree(None, codes)["w"], x["w"])
    assert not np.any(np.asarray(state.residual["w"]))
