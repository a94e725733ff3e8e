"""Codecs for the drift a learner sends: none (fp32), bf16, int8 and int4 (blockwise absmax),
with optional error feedback as an optax-shaped ``init`` / ``update`` pair.

Wire bytes are honest: int4 packs two values per byte, and every block's float32 scale is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import ml_dtypes
import numpy as np

KINDS = ("none", "bf16", "int8", "int4")
_LEVELS = {"int8": 127, "int4": 7}  # symmetric: q ∈ [−L, L]


@dataclass(frozen=True)
class Code:
    """One encoded tensor: ``payload`` (and ``scales`` for int kinds) plus what decoding needs."""

    kind: str
    payload: np.ndarray
    scales: np.ndarray
    shape: tuple[int, ...]

    @property
    def wire_bytes(self) -> int:
        return int(self.payload.nbytes + self.scales.nbytes)


_NO_SCALES = np.zeros(0, np.float32)


@dataclass(frozen=True)
class Codec:
    """``encode(x) -> Code`` and ``decode(code) -> float32 array`` for one kind."""

    kind: str = "int4"
    block_size: int = 64

    def encode(self, x: Any) -> Code:
        x = np.asarray(x, dtype=np.float32)
        if self.kind == "none":
            return Code("none", x.copy(), _NO_SCALES, x.shape)
        if self.kind == "bf16":
            return Code("bf16", x.astype(ml_dtypes.bfloat16), _NO_SCALES, x.shape)
        levels = _LEVELS[self.kind]
        flat = x.reshape(-1)
        n_blocks = max(1, -(-flat.size // self.block_size))
        padded = np.zeros(n_blocks * self.block_size, np.float32)
        padded[:flat.size] = flat
        blocks = padded.reshape(n_blocks, self.block_size)
        scales = (np.max(np.abs(blocks), axis=1) / levels).astype(np.float32)
        safe = np.where(scales > 0, scales, 1.0)[:, None]
        # Round half to even (numpy's rule); |q| ≤ L because |x| ≤ absmax = L·scale.
        q = np.clip(np.round(blocks / safe), -levels, levels).astype(np.int8)
        if self.kind == "int8":
            return Code("int8", q.reshape(-1), scales, x.shape)
        nibbles = (q.reshape(-1) + 8).astype(np.uint8)  # [−7, 7] → [1, 15]
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        packed = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
        return Code("int4", packed, scales, x.shape)

    def decode(self, code: Code) -> np.ndarray:
        size = int(np.prod(code.shape)) if code.shape else 1
        if code.kind == "none":
            return np.asarray(code.payload, np.float32).reshape(code.shape)
        if code.kind == "bf16":
            return np.asarray(code.payload).astype(np.float32).reshape(code.shape)
        if code.kind == "int8":
            q = np.asarray(code.payload, np.int8).astype(np.float32)
        elif code.kind == "int4":
            packed = np.asarray(code.payload, np.uint8)
            q = np.empty(packed.size * 2, np.float32)
            q[0::2] = (packed & 0x0F).astype(np.float32) - 8
            q[1::2] = (packed >> 4).astype(np.float32) - 8
        else:
            raise ValueError(f"unknown codec {code.kind!r}; choose one of {', '.join(KINDS)}")
        n_blocks = code.scales.size
        block = q[:n_blocks * self.block_size].reshape(n_blocks, self.block_size)
        values = (block * code.scales[:, None]).reshape(-1)[:size]
        return values.astype(np.float32).reshape(code.shape)


def make_codec(kind: str, block_size: int = 64) -> Codec:
    """Raises ValueError naming the allowed kinds, or a non-positive block size."""
    if kind not in KINDS:
        raise ValueError(f"unknown codec {kind!r}; choose one of {', '.join(KINDS)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return Codec(kind, block_size)


def relative_error(x: Any, code: Code, codec: Codec) -> float:
    """``‖decode(encode(x)) − x‖ / ‖x‖`` (0 when ‖x‖ = 0)."""
    x = np.asarray(x, np.float64)
    norm = float(np.linalg.norm(x))
    if norm == 0.0:
        return 0.0
    return float(np.linalg.norm(codec.decode(code).astype(np.float64) - x) / norm)


def encode_tree(codec: Codec, tree: Mapping[str, Any]) -> dict[str, Code]:
    return {path: codec.encode(value) for path, value in tree.items()}


def decode_tree(codec: Codec, codes: Mapping[str, Code]) -> dict[str, np.ndarray]:
    """Decodes every tensor; a code of another kind than ``codec`` decodes by its own kind."""
    return {path: codec.decode(code) if isinstance(code, Code) else np.asarray(code)
            for path, code in codes.items()}


def tree_wire_bytes(codes: Mapping[str, Code]) -> int:
    return sum(code.wire_bytes for code in codes.values())


class ErrorFeedbackState(NamedTuple):
    residual: dict  # path -> float32 array: what earlier encodings left out


class _ErrorFeedback:
    def __init__(self, codec: Codec, enabled: bool):
        self.codec = codec
        self.enabled = enabled

    def init(self, fragment: Mapping[str, Any]) -> ErrorFeedbackState:
        return ErrorFeedbackState({path: np.zeros(np.shape(v), np.float32)
                                   for path, v in fragment.items()})

    def update(self, drift: Mapping[str, Any],
               state: ErrorFeedbackState) -> tuple[dict[str, Code], ErrorFeedbackState]:
        """Encodes ``drift + residual`` and keeps ``residual' = (drift + residual) − decode(code)``."""
        codes, residual = {}, {}
        for path, value in drift.items():
            target = np.asarray(value, np.float32)
            if self.enabled:
                target = target + state.residual[path]
            code = self.codec.encode(target)
            codes[path] = code
            residual[path] = ((target - self.codec.decode(code)) if self.enabled
                              else state.residual[path])
        return codes, ErrorFeedbackState(residual)


def error_feedback(codec: Codec) -> _ErrorFeedback:
    """Error feedback: the sum of decoded pushes tracks the sum of true drifts within one residual."""
    return _ErrorFeedback(codec, enabled=True)


def no_error_feedback(codec: Codec) -> _ErrorFeedback:
    """Same interface, residual stays zero, so callers never branch."""
    return _ErrorFeedback(codec, enabled=False)
