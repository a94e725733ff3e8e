"""Drift codecs (none/fp32, bf16, int8/int4/int2 blockwise absmax, nf2 blockwise fitted 2-bit) and
error feedback, optax-shaped.

The math is jax.numpy, so ``Codec.encode``/``decode``, ``encode_tree``/``decode_tree`` and the
error-feedback ``init``/``update`` can run inside a jitted train step on the accelerator
(docs/architecture.md#learners-on-accelerators); ``to_numpy`` brings the codes to the host for sending, and decoding accepts numpy
codes as well.

Wire bytes are honest (``wire_bytes``): int4 packs two values per byte, int2 and nf2 four, and
every block's scale is counted (float32, 4 bytes; nf2's bfloat16, 2 bytes); Python and pickling
overhead is not.

Quantization (int8: L = 127, int4: L = 7), per block b of ``block_size`` consecutive elements of the
flattened tensor (the tail block padded with zeros):
``A_b = max|x_b|``, ``q = round_half_even(x / A_b · L) ∈ [−L, L]``, ``decode = q · A_b / L``.
``scales`` stores ``A_b`` itself (the step is ``A_b / L``), so the largest element of every block,
and hence a constant tensor, decodes exactly; a block of zeros has ``A_b = 0`` and decodes to zeros.

int2 (four values per byte) has no zero level: the four levels ``(2k − 3)·A_b/3``, k ∈ {0, 1, 2, 3},
i.e. ``{−A, −A/3, A/3, A}``, split ``[−A, A]`` evenly (step ``2A/3``), ``k = round_half_even(1.5·x/A
+ 1.5)``. Error bounds per element (what ``max_abs_error`` states and tests/unit/test_codec.py
checks): none 0; bf16 ≤ 2⁻⁸·|x|; intN ≤ half a step, ``A_b/(2L)`` (int8 A/254, int4 A/14) and
int2 ``A_b/3``.

nf2 (four values per byte, one **bfloat16** scale per block) is a clipping 2-bit code with the
Lloyd-Max levels of a normal distribution, ``±0.4528σ`` and ``±1.5104σ``: per block the levels are
``{−c, −R·c, R·c, c}`` with ``R = 0.4528/1.5104`` (``NF2_RATIO``, float32) and the stored scale
``c_b`` is the outer level. Encoding: ``c₀ = 1.5104 · rms(x_b)`` (over the block's real elements),
then one least-squares refit of c to the levels that c₀ assigns, ``c₁ = Σ|x|·l / Σ l²`` (l = 1
or R), then ``c_b = bfloat16(c₁)`` and every value goes to its nearest level for that ``c_b``:
k = 3 or 2 for x ≥ 0 (0 or 1 below), the outer one where ``|x| ≥ T·c_b``, ``T = (1 + R)/2``.
Values beyond ``±c_b`` are clipped to it. Bound per element: ``(1 − R)/2 · c_b ≈ 0.350·c_b``
(≈ 0.53·rms) for ``|x| ≤ c_b``, and exactly ``|x| − c_b`` for a clipped value, which error
feedback carries into the next encoding (so the receiver's running sum stays within one
encoding's error of the sender's). Decoding is one float32 multiply ``level_k · c_b``,
bit-identical in numpy and XLA. On normals its relative error is 0.34 (int2, absmax with
128-value blocks: 0.55); a constant block is exact only where its value is a bfloat16 number.

>>> code, rel = make_codec("int4", block_size=4).encode(np.array([0.7, -1.4, 0.1, 0.0], np.float32))
>>> to_numpy(code).payload, wire_bytes(code), round(float(rel), 3)
(array([ 28, 136], dtype=uint8), 6, 0.09)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .codec_kinds import DEFAULT_BLOCK_SIZE, KINDS  # noqa: E402,F401

LEVELS: dict[str, int] = {"int8": 127, "int4": 7}  # symmetric: q ∈ [−L, L]
_INT4_ZERO = 8  # int4 nibbles are offset binary: q + 8 ∈ [1, 15], 8 means 0
BLOCK_KINDS = ("int8", "int4", "int2", "nf2")  # the kinds with a scale per block (nf2: bfloat16)
# nf2: the 2-bit Lloyd-Max quantizer of N(0, 1) has levels ±0.4528, ±1.5104 (thresholds 0, ±0.9816).
NF2_OUTER = 1.5104   # c₀ = NF2_OUTER · rms: the first guess of the outer level
NF2_RATIO = np.float32(0.4528 / 1.5104)   # R: inner level / outer level
NF2_THRESHOLD = np.float32((1.0 + 0.4528 / 1.5104) / 2)   # T: |x| ≥ T·c goes to the outer level
NF2_IN_RANGE_BOUND = (1.0 - float(NF2_RATIO)) / 2   # max error for |x| ≤ c, in units of c


def max_abs_error(kind: str, x: Any, scale: Any) -> np.ndarray:
    """The largest ``|decode(encode(x)) − x|`` a codec allows per element (its stated bound).

    Args:
      kind: one of ``KINDS``.
      x: the encoded values (float32 array).
      scale: each element's block scale as the code stores it, broadcast to x's shape (ignored by
        none/bf16): the block absmax ``A_b`` for int8/int4/int2, the outer level ``c_b`` for nf2.

    nf2 clips: ``(1 − R)/2 · c_b`` holds for ``|x| ≤ c_b``; a clipped value (``|x| > c_b``) errs
    by exactly ``|x| − c_b``, which error feedback carries to the next encoding.

    >>> float(max_abs_error("int2", np.float32(0.5), np.float32(0.75)))
    0.25
    >>> [round(float(e), 4) for e in max_abs_error("nf2", np.float32([0.5, -3.0]), np.float32(2.0))]
    [0.7002, 1.0]
    """
    x, scale = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    if kind == "none":
        return np.zeros_like(x)
    if kind == "bf16":
        return np.abs(x) * 2.0 ** -8
    if kind == "int2":
        return scale / 3.0
    if kind == "nf2":
        return np.where(np.abs(x) <= scale, NF2_IN_RANGE_BOUND * scale, np.abs(x) - scale)
    if kind in LEVELS:
        return scale / (2 * LEVELS[kind])
    raise _unknown_kind(kind)


def _unknown_kind(kind: Any) -> ValueError:
    return ValueError(f"unknown codec {kind!r}; choose one of {', '.join(KINDS)}")


@dataclasses.dataclass(frozen=True)
class Code:
    """One encoded tensor: the arrays that cross the wire plus what decoding needs.

    A pytree: ``payload`` and ``scales`` are its leaves (jax arrays when encoded, numpy after
    ``to_numpy``), the rest is static, so a jitted function can return codes.

    Attributes:
      kind: one of ``KINDS``.
      payload: float32 (none), bfloat16 (bf16), int8 (int8, one per element) or uint8 (int4, two per
        byte, the first element in the low nibble; int2 and nf2, four per byte, the first in the
        lowest two bits); exactly the tensor's elements, no padding.
      scales: float32 absmax of each block for int8/int4/int2; bfloat16 outer level of each block
        for nf2; empty for none and bf16.
      shape: the original tensor's shape.
      dtype: the original tensor's dtype name; decoding gives it back.
      block_size: elements per block (int kinds).
    """

    kind: str
    payload: Any
    scales: Any
    shape: tuple[int, ...]
    dtype: str
    block_size: int


jax.tree_util.register_dataclass(Code, data_fields=["payload", "scales"],
                                 meta_fields=["kind", "shape", "dtype", "block_size"])


def _is_code(node: Any) -> bool:
    return isinstance(node, Code)


def wire_bytes(code: Code) -> int:
    """Bytes that cross the wire for one tensor: payload bytes + scale bytes."""
    return int(code.payload.nbytes) + int(code.scales.nbytes)


def tree_wire_bytes(codes: Any) -> int:
    """``wire_bytes`` summed over a tree of codes (a fragment)."""
    return sum(wire_bytes(code) for code in jax.tree_util.tree_leaves(codes, is_leaf=_is_code))


def to_numpy(tree: Any) -> Any:
    """Copies a tree of codes (or arrays) to the host as numpy arrays, ready to send."""
    return jax.device_get(tree)


# -- the pure core (jax.numpy; jittable) -----------------------------------------------------------
def _blocks(flat: jax.Array, block_size: int) -> jax.Array:
    """``flat`` zero-padded to whole blocks, shape (n_blocks, block_size)."""
    n_blocks = -(-flat.size // block_size)
    return jnp.pad(flat, (0, n_blocks * block_size - flat.size)).reshape(n_blocks, block_size)


def _dequantize(q: jax.Array, absmax: jax.Array, levels: int) -> jax.Array:
    """Blocks of codes q (n_blocks, block_size) back to values; encode and decode share it."""
    absmax = absmax.astype(jnp.float32)[:, None]
    # ±L gives back A itself, exactly: a constant block decodes to its constant (q·(A/L) may not).
    return jnp.where(jnp.abs(q) == levels, jnp.sign(q) * absmax, q * (absmax / levels))


def _dequantize2(k: jax.Array, absmax: jax.Array) -> jax.Array:
    """int2 levels k ∈ {0..3} (n_blocks, block_size) back to ``(2k − 3)·A/3``; ±A exactly."""
    absmax = absmax.astype(jnp.float32)[:, None]
    inner = (2.0 * k - 3.0) * (absmax / 3.0)
    return jnp.where(k == 0, -absmax, jnp.where(k == 3, absmax, inner))


def _dequantize_nf2(k: jax.Array, scale: jax.Array) -> jax.Array:
    """nf2 levels k ∈ {0..3} (n_blocks, block_size) back to ``{−c, −R·c, R·c, c}``; one float32
    multiply per value, as ``decode_host`` does it (the same bits)."""
    c = scale.astype(jnp.float32)[:, None]
    inner = NF2_RATIO * c
    return jnp.where(k == 3, c, jnp.where(k == 2, inner, jnp.where(k == 1, -inner, -c)))


def _pack2(k_flat: jax.Array) -> jax.Array:
    """2-bit codes (uint8 ∈ {0..3}), four per byte, the first in the lowest two bits."""
    k = jnp.pad(k_flat.astype(jnp.uint8), (0, (-k_flat.size) % 4)).reshape(-1, 4)
    return k[:, 0] | (k[:, 1] << 2) | (k[:, 2] << 4) | (k[:, 3] << 6)


def _nf2_codes(flat: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """``(k_blocks, scale)``: nf2's level per element (float32 0..3, padded blocks) and its
    bfloat16 outer level per block (see the module docstring)."""
    blocks = _blocks(flat, block_size)
    valid = _blocks(jnp.ones_like(flat), block_size)   # padding takes no part in the fit
    count = jnp.maximum(jnp.sum(valid, axis=1), 1.0)
    a = jnp.abs(blocks)
    c0 = NF2_OUTER * jnp.sqrt(jnp.sum(blocks * blocks, axis=1) / count)
    outer = a >= NF2_THRESHOLD * c0[:, None]
    r = NF2_RATIO
    num = jnp.sum(jnp.where(outer, a, r * a), axis=1)
    den = jnp.sum(jnp.where(outer, valid, (r * r) * valid), axis=1)
    scale = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0).astype(jnp.bfloat16)
    c = scale.astype(jnp.float32)[:, None]
    outer = a >= NF2_THRESHOLD * c
    k_blocks = jnp.where(blocks >= 0, jnp.where(outer, 3.0, 2.0), jnp.where(outer, 0.0, 1.0))
    return k_blocks, scale


def _quantize(x: jax.Array, kind: str, block_size: int) -> tuple[Code, jax.Array]:
    """``(code, decoded)``: decoded (float32, x's shape) is ``decode(code)`` before the cast to x's
    dtype, computed from the codes before packing."""
    shape, dtype = tuple(x.shape), jnp.dtype(x.dtype).name
    flat = x.astype(jnp.float32).reshape(-1)
    no_scales = jnp.zeros((0,), jnp.float32)
    if kind == "none":
        same = flat.reshape(shape)
        return Code(kind, same, no_scales, shape, dtype, block_size), same
    if kind == "bf16":  # round to nearest even
        payload = flat.astype(jnp.bfloat16).reshape(shape)
        return Code(kind, payload, no_scales, shape, dtype, block_size), payload.astype(jnp.float32)
    if kind == "nf2":
        k_blocks, scale = _nf2_codes(flat, block_size)
        decoded = _dequantize_nf2(k_blocks, scale).reshape(-1)[:flat.size].reshape(shape)
        packed = _pack2(k_blocks.reshape(-1)[:flat.size])
        return Code(kind, packed, scale, shape, dtype, block_size), decoded
    blocks = _blocks(flat, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    safe = jnp.where(absmax > 0, absmax, 1.0)[:, None]  # an all-zero block: 0/1 → q = 0
    if kind == "int2":
        k_blocks = jnp.clip(jnp.round(blocks / safe * 1.5 + 1.5), 0, 3)
        decoded = _dequantize2(k_blocks, absmax).reshape(-1)[:flat.size].reshape(shape)
        packed = _pack2(k_blocks.reshape(-1)[:flat.size])
        return Code(kind, packed, absmax, shape, dtype, block_size), decoded
    levels = LEVELS[kind]
    # x/A is exactly ±1 at the absmax, so |q| ≤ L; the clip only tames non-finite input (whose
    # non-finite scale still makes the decoded drift non-finite, for the syncer to refuse).
    q_blocks = jnp.clip(jnp.round(blocks / safe * levels), -levels, levels)  # round half to even
    decoded = _dequantize(q_blocks, absmax, levels).reshape(-1)[:flat.size].reshape(shape)
    q = q_blocks.reshape(-1)[:flat.size]
    if kind == "int8":
        return Code(kind, q.astype(jnp.int8), absmax, shape, dtype, block_size), decoded
    nibbles = (q + _INT4_ZERO).astype(jnp.uint8)
    nibbles = jnp.pad(nibbles, (0, flat.size % 2), constant_values=_INT4_ZERO)
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return Code(kind, packed, absmax, shape, dtype, block_size), decoded


def _expected_payload(code: Code) -> tuple[tuple[int, ...], str]:
    size = math.prod(code.shape)
    if code.kind == "none":
        return code.shape, "float32"
    if code.kind == "bf16":
        return code.shape, "bfloat16"
    if code.kind == "int8":
        return (size,), "int8"
    if code.kind == "int4":
        return ((size + 1) // 2,), "uint8"
    if code.kind in ("int2", "nf2"):
        return ((size + 3) // 4,), "uint8"
    raise _unknown_kind(code.kind)


def _check_scales(code: Code, scales: Any) -> None:
    """The scales fit the shape and block size (and are bfloat16 for nf2: 2 wire bytes each)."""
    size = math.prod(code.shape)
    n_blocks = -(-size // code.block_size)
    if tuple(scales.shape) != (n_blocks,):
        raise ValueError(f"{code.kind} has {scales.size} scales, shape {list(code.shape)} with "
                         f"block_size {code.block_size} needs {n_blocks}")
    if code.kind == "nf2" and np.dtype(scales.dtype).name != "bfloat16":
        raise ValueError(f"nf2 scales are bfloat16, got {np.dtype(scales.dtype).name}")


def _decode(code: Code) -> jax.Array:
    want_shape, want_dtype = _expected_payload(code)
    payload, scales = jnp.asarray(code.payload), jnp.asarray(code.scales)
    if tuple(payload.shape) != want_shape or jnp.dtype(payload.dtype).name != want_dtype:
        got = f"{jnp.dtype(payload.dtype).name}{list(payload.shape)}"
        raise ValueError(f"{code.kind} payload is {got}, shape {list(code.shape)} needs "
                         f"{want_dtype}{list(want_shape)}")
    if code.kind in ("none", "bf16"):
        return payload.astype(code.dtype)
    size = math.prod(code.shape)
    _check_scales(code, scales)
    if code.kind in ("int2", "nf2"):
        k = jnp.stack([(payload >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1).reshape(-1)[:size]
        k_blocks = _blocks(k.astype(jnp.float32), code.block_size)
        values = (_dequantize2(k_blocks, scales) if code.kind == "int2"
                  else _dequantize_nf2(k_blocks, scales))
        return values.reshape(-1)[:size].reshape(code.shape).astype(code.dtype)
    levels = LEVELS[code.kind]
    if code.kind == "int8":
        q = payload.astype(jnp.float32)
    else:
        nibbles = jnp.stack([payload & 0x0F, payload >> 4], axis=-1).reshape(-1)[:size]
        q = nibbles.astype(jnp.float32) - _INT4_ZERO
    values = _dequantize(_blocks(q, code.block_size), scales, levels)
    return values.reshape(-1)[:size].reshape(code.shape).astype(code.dtype)


@jax.jit
def decode(code: Code) -> jax.Array:
    """Decodes one code (numpy or jax arrays) by its own kind and block size.

    Returns:
      the tensor, with the code's shape and dtype (a jax array).

    Raises:
      ValueError: unknown kind, or payload/scales that do not fit the shape and block size.
    """
    return _decode(code)


def decode_host(code: Code) -> np.ndarray:
    """Decodes one code in numpy, on the host, float32 (the downlink's decoder).

    Both ends of the downlink apply an update with this one function, so the learner's copy and
    the syncer's record of it agree bit for bit whatever device the learner trains on (a jitted
    decode may fuse ``base + q·step`` into a fused multiply-add on one side and not the other).
    The same validation as ``decode``; the values are those of ``decode`` up to float rounding.

    >>> x = np.array([0.75, -0.25, 0.2, 0.0], np.float32)  # A = 0.75: levels ±0.75, ±0.25
    >>> decode_host(to_numpy(make_codec("int2", block_size=4).encode(x)[0]))
    array([ 0.75, -0.25,  0.25,  0.25], dtype=float32)
    """
    want_shape, want_dtype = _expected_payload(code)
    payload, scales = np.asarray(code.payload), np.asarray(code.scales)
    if tuple(payload.shape) != want_shape or np.dtype(payload.dtype).name != want_dtype:
        got = f"{np.dtype(payload.dtype).name}{list(payload.shape)}"
        raise ValueError(f"{code.kind} payload is {got}, shape {list(code.shape)} needs "
                         f"{want_dtype}{list(want_shape)}")
    if code.kind in ("none", "bf16"):
        return payload.astype(np.float32)
    size = math.prod(code.shape)
    n_blocks = -(-size // code.block_size)
    _check_scales(code, scales)
    absmax = scales.astype(np.float32)
    if code.kind == "nf2":
        k = np.stack([(payload >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1).reshape(-1)[:size]
        values = np.zeros(n_blocks * code.block_size, np.uint8)
        values[:size] = k
        k_blocks = values.reshape(n_blocks, code.block_size)
        c = absmax[:, None]
        inner = NF2_RATIO * c
        out = np.where(k_blocks == 3, c, np.where(k_blocks == 2, inner,
                                                  np.where(k_blocks == 1, -inner, -c)))
    elif code.kind == "int2":
        k = np.stack([(payload >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1).reshape(-1)[:size]
        values = np.zeros(n_blocks * code.block_size, np.float32)
        values[:size] = k
        k_blocks = values.reshape(n_blocks, code.block_size)
        step = (absmax / np.float32(3.0))[:, None]
        out = (np.float32(2.0) * k_blocks - np.float32(3.0)) * step
        out = np.where(k_blocks == 0, -absmax[:, None], np.where(k_blocks == 3, absmax[:, None], out))
    else:
        levels = LEVELS[code.kind]
        if code.kind == "int8":
            q = payload.astype(np.float32)
        else:
            nibbles = np.stack([payload & 0x0F, payload >> 4], axis=-1).reshape(-1)[:size]
            q = nibbles.astype(np.float32) - np.float32(_INT4_ZERO)
        values = np.zeros(n_blocks * code.block_size, np.float32)
        values[:size] = q
        q_blocks = values.reshape(n_blocks, code.block_size)
        step = (absmax / np.float32(levels))[:, None]
        out = np.where(np.abs(q_blocks) == levels, np.sign(q_blocks) * absmax[:, None],
                       q_blocks * step)
    return out.reshape(-1)[:size].reshape(code.shape).astype(np.float32)


def _relative_error(x: jax.Array, decoded: jax.Array) -> jax.Array:
    """``‖decoded − x‖ / ‖x‖`` as a float32 scalar, 0 when ‖x‖ = 0."""
    x = x.astype(jnp.float32)
    err_sq = jnp.sum(jnp.square(decoded.astype(jnp.float32) - x))
    norm_sq = jnp.sum(jnp.square(x))
    return jnp.where(norm_sq > 0, jnp.sqrt(err_sq / jnp.where(norm_sq > 0, norm_sq, 1.0)), 0.0)


# Jitted per (shape, dtype, kind, block size): one compile, then one fused call per tensor; inside
# a caller's jit (the train step) they simply inline.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _encode(x: jax.Array, kind: str, block_size: int) -> tuple[Code, jax.Array]:
    code, decoded = _quantize(x, kind, block_size)
    return code, _relative_error(x, decoded.astype(x.dtype))  # as decode() gives it back


@functools.partial(jax.jit, static_argnums=(2, 3))
def _encode_with_feedback(delta: jax.Array, residual: jax.Array, kind: str,
                          block_size: int) -> tuple[Code, jax.Array]:
    target = delta.astype(jnp.float32) + residual
    code, decoded = _quantize(target, kind, block_size)
    return code, target - decoded


@dataclasses.dataclass(frozen=True)
class Codec:
    """One compression setting; hashable, so it can be a static argument of a jitted function.

    Attributes:
      kind: one of ``KINDS``: ``none`` (fp32), ``bf16``, ``int8``, ``int4``, ``int2``, ``nf2``.
      block_size: elements per scale for int8/int4/int2 (float32) and nf2 (bfloat16); ignored by
        none and bf16.
    """

    kind: str = "int4"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if self.kind not in KINDS:
            raise _unknown_kind(self.kind)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size!r}")

    def encode(self, x: Any) -> tuple[Code, jax.Array]:
        """Encodes one tensor (numpy or jax).

        Returns:
          ``(code, rel_error)``: rel_error = ‖decode(code) − x‖ / ‖x‖, a float32 scalar (0 when
          x = 0), which the learner exports as islands_compression_relative_error.
        """
        return _encode(jnp.asarray(x), self.kind, self.block_size)

    def decode(self, code: Code) -> jax.Array:
        """Decodes one code; it names its own kind and block size, which win over this codec's."""
        return decode(code)


def make_codec(kind: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """Builds a codec.

    Raises:
      ValueError: an unknown kind (naming the allowed ones) or a block size that is not positive.
    """
    return Codec(kind, block_size)


def encode_tree(codec: Codec, tree: Any) -> Any:
    """Encodes every tensor of a pytree (a fragment: ``{path: array}``); the same tree of codes."""
    return jax.tree_util.tree_map(lambda x: codec.encode(x)[0], tree)


def decode_tree(codec: Optional[Codec], codes: Any) -> Any:
    """Decodes a tree of codes; jax arrays.

    With a ``codec`` (the job's), every code must be of its kind (and block size for int kinds):
    the codec is the job's, not the pusher's, so a code of another kind is refused with a
    ValueError naming both. ``None`` decodes each code by its own kind.
    """
    if codec is not None:
        for code in jax.tree_util.tree_leaves(codes, is_leaf=_is_code):
            if not _is_code(code):
                raise ValueError(f"not a code: {type(code).__name__}")
            if code.kind != codec.kind or (code.kind in BLOCK_KINDS
                                           and code.block_size != codec.block_size):
                raise ValueError(f"a {code.kind} code (block {code.block_size}) where the job's "
                                 f"codec is {codec.kind} (block {codec.block_size})")
    return jax.tree_util.tree_map(decode, codes, is_leaf=_is_code)


def relative_error(x: Any, code: Code) -> float:
    """``‖decode(code) − x‖ / ‖x‖`` on the host (float64), 0 when ‖x‖ = 0."""
    return tree_relative_error({"x": x}, {"x": code})


def tree_relative_error(tree: Any, codes: Any) -> float:
    """``‖decode(codes) − tree‖ / ‖tree‖`` over a whole fragment (float64), 0 when it is 0."""
    exact = jax.tree_util.tree_leaves(tree)
    decoded = jax.tree_util.tree_leaves(decode_tree(None, codes))
    err_sq = sum(float(np.sum(np.square(np.asarray(d, np.float64) - np.asarray(x, np.float64))))
                 for x, d in zip(exact, decoded, strict=True))
    norm_sq = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in exact)
    return 0.0 if norm_sq == 0.0 else math.sqrt(err_sq / norm_sq)


# -- error feedback ------------------------------------------------------------------------------
class ErrorFeedback(NamedTuple):
    """Optax-shaped: ``init(fragment) -> state``, ``update(drift, state) -> (codes, state)``."""

    init: Callable[[Any], "ErrorFeedbackState"]
    update: Callable[[Any, "ErrorFeedbackState"], tuple[Any, "ErrorFeedbackState"]]


class ErrorFeedbackState(NamedTuple):
    residual: Any  # tree like the fragment, float32: what earlier encodings left out


def error_feedback(codec: Codec) -> ErrorFeedback:
    """Error feedback: encode ``t = δ + r``, keep ``r' = t − decode(code)``.

    Telescoping over n pushes from r₀ = 0: ``Σ decode = Σ δ − r_n``, so the receiver's sum of
    decoded drifts is off by one step's quantization error, however many pushes there were.
    """

    def init(fragment: Any) -> ErrorFeedbackState:
        return ErrorFeedbackState(jax.tree_util.tree_map(
            lambda x: jnp.zeros(jnp.shape(x), jnp.float32), fragment))

    def update(drift: Any, state: ErrorFeedbackState) -> tuple[Any, ErrorFeedbackState]:
        leaves, treedef = jax.tree_util.tree_flatten(drift)
        residuals = treedef.flatten_up_to(state.residual)
        codes, new_residuals = [], []
        for delta, residual in zip(leaves, residuals, strict=True):
            code, new_residual = _encode_with_feedback(jnp.asarray(delta), residual, codec.kind,
                                                       codec.block_size)
            codes.append(code)
            new_residuals.append(new_residual)
        return treedef.unflatten(codes), ErrorFeedbackState(treedef.unflatten(new_residuals))

    return ErrorFeedback(init, update)


def no_error_feedback(codec: Codec) -> ErrorFeedback:
    """The same interface without feedback: encodes ``δ`` alone and the residual stays zero."""
    with_feedback = error_feedback(codec)

    def update(drift: Any, state: ErrorFeedbackState) -> tuple[Any, ErrorFeedbackState]:
        return encode_tree(codec, drift), state

    return ErrorFeedback(with_feedback.init, update)
