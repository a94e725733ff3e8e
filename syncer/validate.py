"""Push validation: a push is Accepted or Rejected(reason); a refusal never changes global state."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np


class RejectReason(str, enum.Enum):
    """Why a push was refused; the values are the ``reason`` label of islands_rejected_pushes_total."""

    STALE_EPOCH = "stale_epoch"            # sent to an earlier (or later) syncer incarnation
    UNKNOWN_LEARNER = "unknown_learner"    # not registered, retired, or an older incarnation
    UNKNOWN_FRAGMENT = "unknown_fragment"  # fragment index out of range
    DUPLICATE = "duplicate"                # second push by the same learner in one round
    UNKNOWN_VERSION = "unknown_version"    # base version not in the history (too old or ahead)
    TOO_STALE = "too_stale"                # staleness above max_staleness
    BAD_SHAPE = "bad_shape"                # tensor set or shapes differ from the fragment's
    BAD_DTYPE = "bad_dtype"                # not float32 after decoding
    NON_FINITE = "non_finite"              # NaN or inf in the drift
    OUTLIER_NORM = "outlier_norm"          # drift norm far above recent accepted ones


REJECT_REASONS: tuple[str, ...] = tuple(reason.value for reason in RejectReason)


@dataclass(frozen=True)
class Push:
    """One learner's compressed drift for one fragment (docs/architecture.md#the-algorithm, learner step 2).

    Attributes:
      learner: learner id, "us-east:0".
      fragment: fragment index p.
      codes: ``{path: code}`` of the drift δ = θ_m[p] − Θ[p](base_version), as the codec encoded it.
      base_version: version of the global fragment the learner last adopted.
      epoch: the syncer epoch the learner registered with (fencing).
      c_tokens: tokens processed since the learner last received fragment p.
      c_steps: inner steps since the learner last received fragment p.
      incarnation: the learner's restart count; pushes of an older incarnation are refused.
      step: the learner's inner step when it pushed (ledger watermark and data resume point).
      tokens_done: tokens processed by this incarnation up to ``step``.
      compute_s: inner-step seconds spent by this incarnation up to ``step``.
      wire_bytes: encoded payload size (for the byte counters).
    """

    learner: str
    fragment: int
    codes: Mapping[str, Any]
    base_version: int
    epoch: int
    c_tokens: int
    c_steps: int
    incarnation: int = 0
    step: int = 0
    tokens_done: int = 0
    compute_s: float = 0.0
    wire_bytes: int = 0


@dataclass(frozen=True)
class Accepted:
    staleness: int

    @property
    def ok(self) -> bool:
        return True


@dataclass(frozen=True)
class Rejected:
    reason: RejectReason
    detail: str = ""

    @property
    def ok(self) -> bool:
        return False


def check_drift(drift: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                recent_norms: Sequence[float], outlier_norm_factor: Optional[float],
                min_history: int = 3) -> Optional[Rejected]:
    """Checks a decoded drift against the fragment it belongs to; None when it is fine.

    The outlier test compares with the median of the recent pushes' norms (``min_history`` of them
    at least). The caller records every well-formed push's norm there, refused or not, so the
    median follows a legitimate rise (warmup, a growing learning rate) instead of locking out
    everyone whose drift outgrew the first few pushes.
    """
    if set(drift) != set(reference):
        missing = sorted(set(reference) - set(drift))
        extra = sorted(set(drift) - set(reference))
        return Rejected(RejectReason.BAD_SHAPE, f"tensors missing {missing}, unexpected {extra}")
    for path, value in drift.items():
        value = np.asarray(value)
        if value.shape != np.shape(reference[path]):
            return Rejected(RejectReason.BAD_SHAPE,
                            f"{path}: shape {value.shape}, expected {np.shape(reference[path])}")
        if value.dtype != np.float32:
            return Rejected(RejectReason.BAD_DTYPE, f"{path}: dtype {value.dtype}, expected float32")
        if not np.all(np.isfinite(value)):
            return Rejected(RejectReason.NON_FINITE, f"{path}: NaN or inf")
    if outlier_norm_factor is not None and len(recent_norms) >= min_history:
        return check_outlier(drift_norm(drift), recent_norms, outlier_norm_factor, min_history)
    return None


def check_outlier(norm: float, recent_norms: Sequence[float],
                  outlier_norm_factor: Optional[float], min_history: int = 3) -> Optional[Rejected]:
    """OUTLIER_NORM when ``norm`` exceeds ``factor`` × the median of the recent norms (needs
    ``min_history`` of them); None otherwise or when the test is off (factor None)."""
    if outlier_norm_factor is None or len(recent_norms) < min_history:
        return None
    limit = outlier_norm_factor * float(np.median(recent_norms))
    if limit > 0 and norm > limit:
        return Rejected(RejectReason.OUTLIER_NORM, f"drift norm {norm:.4g} > {limit:.4g}")
    return None


def drift_norm(drift: Mapping[str, np.ndarray]) -> float:
    """Global L2 norm over every tensor of a fragment (float32 dot products, float64 sum)."""
    total = 0.0
    for v in drift.values():
        flat = np.asarray(v, np.float32).reshape(-1)
        total += float(np.dot(flat, flat))
    return float(np.sqrt(total))
