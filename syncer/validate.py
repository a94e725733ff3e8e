"""Push validation: a push is Accepted or Rejected(reason); a refusal never changes global state."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np


# The answer to a push that reached no syncer (a dead one, or the link to it down): no verdict
# on the drift, which its learner keeps and pushes again (learners/core.py RESEND_REASONS).
SYNCER_DOWN = "syncer_down"


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
    OUTLIER_NORM = "outlier_norm"          # drift norm far above what an inner loop can move
    BAD_COUNTERS = "bad_counters"          # token/step counters impossible for the job's batch
    BAD_SESSION = "bad_session"            # the incarnation's session token does not match
    BAD_MERGE = "bad_merge"                # the round's merged fragment was not finite
    UNADOPTED = "unadopted"                # (a whole merge) no contributor had adopted Θ[p] yet
    NOT_DURABLE = "not_durable"            # (a whole merge) its journal entry was not written


# Refusals that say the drift itself is garbage: counted towards quarantine.
GARBAGE_REASONS = frozenset({RejectReason.BAD_SHAPE, RejectReason.BAD_DTYPE,
                             RejectReason.NON_FINITE, RejectReason.OUTLIER_NORM,
                             RejectReason.BAD_COUNTERS})


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
      session: the token the syncer gave this incarnation at registration ("" where the driver
        registers without one: the in-process drivers, which are trusted code).
      fates: the learner's token books (``IncarnationFates.to_json()``) as of this push, so the
        books of an incarnation that dies know what its newest push carried.
      base_shadow: the id of the learner's base (``syncer/downlink.py``): 0, the exact global
        fragment of ``base_version``; otherwise the shadow the syncer recorded when it sent the
        encoded update the learner adopted.
      members: a region's pre-merged push (``link/premerge.py``): one Push per learner it
        carries, each with its own counters, identity and books and no codes; ``codes`` are
        then the token-weighted mean of their drifts. Empty: an ordinary push.
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
    session: str = ""
    fates: Optional[Mapping[str, Any]] = None
    base_shadow: int = 0
    members: tuple = ()


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


def outlier_limit(accepted_norms: Sequence[float], first_bound: Optional[float],
                  factor: Optional[float], min_history: int = 3) -> Optional[float]:
    """The largest (scaled, see ``scaled_norm``) drift norm a push may have; None: no limit.

    Until ``min_history`` pushes were accepted: ``first_bound`` (the factor itself on scaled
    norms: a drift at most factor × what the inner optimizer can move), so the first pushes of a
    job or of a restarted syncer are checked too. After: median + factor · spread of the
    *accepted* norms, spread = max(1.4826 · MAD, median / 2): robust to a few outliers, and
    refused pushes never enter the window.

    >>> outlier_limit([], 12.0, 10.0), outlier_limit([1.0, 1.0, 4.0], 12.0, 10.0)
    (12.0, 6.0)
    >>> outlier_limit([1.0, 2.0, 3.0, 4.0, 50.0], None, 2.0)   # median 3, MAD 1 -> spread 1.5
    6.0
    """
    if factor is None:
        return None
    if len(accepted_norms) < min_history:
        return first_bound
    norms = np.asarray(accepted_norms, np.float64)
    median = float(np.median(norms))
    mad = float(np.median(np.abs(norms - median)))
    return median + factor * max(1.4826 * mad, median / 2)


def lr_sum(schedule: Optional[tuple], step: int, c_steps: int) -> float:
    """Σ of the inner learning rate over the ``c_steps`` updates that end at ``step``:
    ``schedule`` = (peak lr, warmup steps, total steps, end fraction) of the learners' warmup +
    cosine schedule (update k uses the rate at count k). None: c_steps (a unit rate), so norms
    are compared per step. Never below one warmup increment (the first update's rate is 0).

    >>> lr_sum((1.0, 4, 100, 0.1), step=2, c_steps=2)   # counts 0 and 1: 0 + 0.25
    0.25
    >>> lr_sum(None, 7, 3)
    3.0
    """
    if schedule is None:
        return float(max(c_steps, 1))
    peak, warmup, total, end_fraction = schedule
    warmup = max(int(warmup), 1)
    counts = np.arange(max(step - c_steps, 0), max(step, 1), dtype=np.float64)
    return max(float(np.sum(warmup_cosine(counts, peak, warmup, total, end_fraction))),
               peak / warmup)


def warmup_cosine(counts: np.ndarray, peak: float, warmup: int, total: int,
                  end_fraction: float) -> np.ndarray:
    """optax.warmup_cosine_decay_schedule(0, peak, warmup, total, peak · end_fraction) in numpy
    (the syncer evaluates it for every push: no device dispatch on that path)."""
    decay = max(total - warmup, 1)
    phase = np.minimum(np.maximum(counts - warmup, 0.0), decay) / decay
    cosine = peak * ((1 - end_fraction) * 0.5 * (1 + np.cos(np.pi * phase)) + end_fraction)
    return np.where(counts < warmup, peak * counts / warmup, cosine)


def scaled_norm(norm: float, schedule: Optional[tuple], step: int, c_steps: int,
                size: int) -> float:
    """‖δ‖ ÷ (Σ lr · √n): the drift in units of what AdamW can move a fragment of n values
    (about lr per value and step: clipped, bias-corrected moments). Comparable across warm-up
    and decay, across H, and between fragments of different sizes.

    >>> scaled_norm(0.8, None, 8, 8, 100)
    0.01
    """
    return float(norm / (lr_sum(schedule, step, c_steps) * np.sqrt(max(size, 1))))


def check_counters(c_tokens: int, c_steps: int, tokens_per_step: Optional[int]) -> Optional[Rejected]:
    """The merge weight comes from these counters: refuse impossible ones (negative, or more
    tokens than ``c_steps`` full batches hold).

    >>> check_counters(64, 2, 32) is None, check_counters(65, 2, 32).reason.value
    (True, 'bad_counters')
    """
    if c_tokens < 0 or c_steps < 0:
        return Rejected(RejectReason.BAD_COUNTERS, f"negative counters ({c_tokens}, {c_steps})")
    if tokens_per_step is not None and c_tokens > c_steps * tokens_per_step:
        return Rejected(RejectReason.BAD_COUNTERS,
                        f"{c_tokens} tokens in {c_steps} steps of at most {tokens_per_step}")
    return None


# No inner step of any model runs faster than this (a JAX dispatch alone takes longer): the
# bound on how many steps a learner can have taken since it registered.
MIN_STEP_S = 1e-5


def check_progress(step: int, tokens_done: int, registered_step: Optional[int], elapsed_s: float,
                   tokens_per_step: Optional[int], min_step_s: float = MIN_STEP_S
                   ) -> Optional[Rejected]:
    """A push's cumulative counters move the learner's resume step and the books: refuse what
    the incarnation cannot have trained since it registered. At most ``elapsed_s / min_step_s``
    (+1) steps past ``registered_step`` (the syncer's resume step for it when it registered, at
    or above where it started; None: no anchor, after a restore), and at most ``step`` full
    batches of tokens in all.

    >>> check_progress(110, 40, 100, 1.0, 4) is None
    True
    >>> check_progress(10**12, 0, 0, 60.0, 4).detail
    'step 1000000000000 is 1000000000000 steps past the resume step 0 after 60s (at most 6000001)'
    >>> check_progress(110, 10**15, 100, 1.0, 4).reason.value
    'bad_counters'
    """
    most_steps = int(max(elapsed_s, 0.0) / min_step_s) + 1
    if registered_step is not None and step - registered_step > most_steps:
        return Rejected(RejectReason.BAD_COUNTERS,
                        f"step {step} is {step - registered_step} steps past the resume step "
                        f"{registered_step} after {elapsed_s:.0f}s (at most {most_steps})")
    if tokens_done < 0 or (tokens_per_step is not None
                           and tokens_done > max(step, 0) * tokens_per_step):
        return Rejected(RejectReason.BAD_COUNTERS,
                        f"{tokens_done} tokens done by step {step} of at most {tokens_per_step}")
    return None


def drift_norm(drift: Mapping[str, np.ndarray]) -> float:
    """Global L2 norm over every tensor of a fragment (float32 dot products, float64 sum)."""
    total = 0.0
    for v in drift.values():
        flat = np.asarray(v, np.float32).reshape(-1)
        total += float(np.dot(flat, flat))
    return float(np.sqrt(total))
