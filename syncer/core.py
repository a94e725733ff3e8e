"""The syncer's pure core: global fragments, open rounds, merges and the token ledger.

No Ray here: the in-process driver and the Ray actor both wrap one ``SyncerCore``. Time is passed
in as ``now_s``; the caller owns the clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np
import optax

from . import merge as merge_lib
from . import outer as outer_lib
from .fragments import Fragment
from .quorum import Decision, grace_window, merge_decision
from .validate import (Accepted, Push, RejectReason, Rejected, check_drift, check_outlier,
                       drift_norm)


@dataclass(frozen=True)
class SyncerSettings:
    """Everything the core needs to decide; built from JobConfig's ``syncer`` and ``quorum``."""

    min_learners: int = 1
    grace_gamma: float = 0.5
    grace_cap_s: float = 5.0
    overlap_steps: int = 2
    history_versions: int = 8
    max_staleness: Optional[int] = None
    outlier_norm_factor: Optional[float] = 10.0
    staleness_discount: float = 0.0
    merge_rule: merge_lib.MergeRule = merge_lib.MergeRule.RDA
    norm_window: int = 32
    # A merge of n of the M live learners applies n/M of the outer step (see merge()).
    participation_scale: bool = True


@dataclass
class Contribution:
    """An accepted push, reconstructed as the learner's fragment ``θ_m[p] = Θ[p](base) + δ``."""

    push: Push
    theta: Fragment
    staleness: int
    arrived_s: float


@dataclass
class FragmentSlot:
    """Mutable state of one fragment: Θ[p], outer state, version, history and the open round."""

    params: Fragment
    outer_state: Any
    version: int = 0
    history: dict[int, Fragment] = field(default_factory=dict)
    round: dict[str, Contribution] = field(default_factory=dict)
    quorum_reached_at_s: Optional[float] = None
    round_opened_at_s: Optional[float] = None
    recent_norms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=32))


@dataclass
class LedgerEntry:
    """Per learner: what its merged pushes covered (docs/architecture.md#failures-and-reintegration token ledger).

    A step counts as applied once a merge includes a push sent at or after it: that push's drift
    carries the step's update to its fragment.
    """

    incarnation: int = 0
    applied_tokens_done: int = 0     # watermark of the current incarnation
    applied_compute_s: float = 0.0
    applied_step: int = 0            # the learner's data resume point
    applied_tokens_before: int = 0   # applied tokens of finished incarnations
    applied_compute_before_s: float = 0.0

    @property
    def applied_tokens(self) -> int:
        return self.applied_tokens_before + self.applied_tokens_done

    @property
    def applied_compute_total_s(self) -> float:
        return self.applied_compute_before_s + self.applied_compute_s


@dataclass(frozen=True)
class MergeResult:
    fragment: int
    version: int
    params: Fragment
    learners: tuple[str, ...]
    staleness: tuple[int, ...]
    reason: str
    outer_grad_norm: float


class SyncerCore:
    """Owns the global parameters Θ and the outer optimizer state, per fragment."""

    def __init__(self, fragments: list[Fragment], settings: SyncerSettings,
                 outer_optimizer: optax.GradientTransformation,
                 decode: Callable[[Mapping[str, Any]], Fragment],
                 is_embedding: Callable[[str], bool] = lambda path: False,
                 epoch: int = 0):
        self.settings = settings
        self.outer = outer_optimizer
        self.decode = decode
        self.is_embedding = is_embedding
        self.epoch = epoch
        self.slots = []
        for frag in fragments:
            params = {k: np.asarray(v, np.float32) for k, v in frag.items()}
            slot = FragmentSlot(params=params, outer_state=outer_optimizer.init(params))
            slot.recent_norms = collections.deque(maxlen=settings.norm_window)
            slot.history[0] = params
            self.slots.append(slot)
        self.learners: dict[str, int] = {}  # registered learner -> incarnation
        self.ledger: dict[str, LedgerEntry] = {}
        self.rejected: collections.Counter = collections.Counter()

    # -- membership -----------------------------------------------------------------------------
    def register(self, learner: str, incarnation: int) -> tuple[int, list[tuple[Fragment, int]]]:
        """Admits a learner incarnation; returns the epoch and every fragment with its version."""
        previous = self.learners.get(learner)
        if previous is not None and incarnation < previous:
            raise ValueError(f"{learner}: incarnation {incarnation} is older than {previous}")
        self.learners[learner] = incarnation
        entry = self.ledger.setdefault(learner, LedgerEntry(incarnation=incarnation))
        if incarnation != entry.incarnation:
            entry.applied_tokens_before += entry.applied_tokens_done
            entry.applied_compute_before_s += entry.applied_compute_s
            entry.applied_tokens_done, entry.applied_compute_s = 0, 0.0
            entry.incarnation = incarnation
        return self.epoch, [(slot.params, slot.version) for slot in self.slots]

    def forget(self, learner: str) -> list[Push]:
        """A learner left or died: drop its unmerged pushes (their work is lost) and unregister it."""
        dropped = []
        for slot in self.slots:
            contribution = slot.round.pop(learner, None)
            if contribution is not None:
                dropped.append(contribution.push)
                self._recount_quorum(slot)
        self.learners.pop(learner, None)
        return dropped

    # -- the data path --------------------------------------------------------------------------
    def accept_push(self, push: Push, now_s: float) -> Accepted | Rejected:
        """Validates and stores a push in its fragment's open round. A refusal changes nothing."""
        verdict = self._check(push)
        if isinstance(verdict, Rejected):
            self.rejected[verdict.reason] += 1
            return verdict
        slot = self.slots[push.fragment]
        try:
            drift = {k: np.asarray(v) for k, v in self.decode(push.codes).items()}
        except (ValueError, TypeError, KeyError) as exc:  # a malformed code is a bad shape
            self.rejected[RejectReason.BAD_SHAPE] += 1
            return Rejected(RejectReason.BAD_SHAPE, f"cannot decode: {exc}")
        problem = check_drift(drift, slot.params, (), None)  # shapes, dtypes, finite values
        if problem is not None:
            self.rejected[problem.reason] += 1
            return problem
        norm = drift_norm(drift)
        problem = check_outlier(norm, list(slot.recent_norms), self.settings.outlier_norm_factor)
        slot.recent_norms.append(norm)  # well-formed: part of what "normal" is
        if problem is not None:
            self.rejected[problem.reason] += 1
            return problem
        base = slot.history[push.base_version]
        theta = {path: base[path] + np.asarray(drift[path], np.float32) for path in base}
        if not slot.round:
            slot.round_opened_at_s = now_s
        slot.round[push.learner] = Contribution(push, theta, verdict.staleness, now_s)
        if slot.quorum_reached_at_s is None and len(slot.round) >= self.settings.min_learners:
            slot.quorum_reached_at_s = now_s
        return verdict

    def _check(self, push: Push) -> Accepted | Rejected:
        if push.epoch != self.epoch:
            return Rejected(RejectReason.STALE_EPOCH, f"epoch {push.epoch}, current {self.epoch}")
        if self.learners.get(push.learner) != push.incarnation:
            return Rejected(RejectReason.UNKNOWN_LEARNER,
                            f"{push.learner} incarnation {push.incarnation} is not registered")
        if not 0 <= push.fragment < len(self.slots):
            return Rejected(RejectReason.UNKNOWN_FRAGMENT,
                            f"fragment {push.fragment} not in [0, {len(self.slots)})")
        slot = self.slots[push.fragment]
        if push.learner in slot.round:
            return Rejected(RejectReason.DUPLICATE,
                            f"{push.learner} already pushed fragment {push.fragment} this round")
        if push.base_version not in slot.history:
            return Rejected(RejectReason.UNKNOWN_VERSION,
                            f"base version {push.base_version} not in history "
                            f"[{min(slot.history)}, {max(slot.history)}]")
        staleness = slot.version - push.base_version
        limit = self.settings.max_staleness
        if limit is not None and staleness > limit:
            return Rejected(RejectReason.TOO_STALE, f"staleness {staleness} > {limit}")
        return Accepted(staleness)

    def _recount_quorum(self, slot: FragmentSlot) -> None:
        if len(slot.round) < self.settings.min_learners:
            slot.quorum_reached_at_s = None
        if not slot.round:
            slot.round_opened_at_s = None

    # -- deciding and merging -------------------------------------------------------------------
    def grace_s(self, slowest_step_s: float, quorum_s: float, sync_s: float) -> float:
        s = self.settings
        return grace_window(s.overlap_steps, slowest_step_s, quorum_s, sync_s, s.grace_gamma,
                            s.grace_cap_s)

    def decide(self, fragment: int, now_s: float, live: frozenset[str], grace_s: float) -> Decision:
        slot = self.slots[fragment]
        return merge_decision(frozenset(slot.round), live, now_s, slot.quorum_reached_at_s,
                              self.settings.min_learners, grace_s)

    def timed_decision(self, fragment: int, now_s: float, live: frozenset[str],
                       slowest_step_s: float, sync_s: float) -> tuple[Decision, float]:
        """When to merge, in one place for every driver: the grace window of Eq. 3 from the
        slowest learner's step time, how long this round took to reach quorum and the sync time
        ``sync_s`` (the driver's measure of it), then the quorum decision. Returns the decision
        and the grace window it used."""
        slot = self.slots[fragment]
        quorum_s = (slot.quorum_reached_at_s or now_s) - (slot.round_opened_at_s or now_s)
        grace = self.grace_s(slowest_step_s, quorum_s, sync_s)
        return self.decide(fragment, now_s, live, grace), grace

    def merge(self, fragment: int, reason: str = "", live_count: Optional[int] = None) -> MergeResult:
        """Merges the open round of a fragment against the current Θ[p] and steps the outer optimizer.

        Args:
          fragment: p.
          reason: why now (a MergeReason value), for the record.
          live_count: live learners M, for the participation scale (None: no scaling).
        """
        slot = self.slots[fragment]
        if not slot.round:
            raise ValueError(f"fragment {fragment} has no pushes to merge")
        contributions = [slot.round[name] for name in sorted(slot.round)]
        weights = [merge_lib.token_weight(c.push.c_tokens, c.push.c_steps)
                   * merge_lib.staleness_factor(c.staleness, self.settings.staleness_discount)
                   for c in contributions]
        if sum(weights) <= 0:  # every learner pushed with zero steps: nothing to learn from
            weights = [1.0] * len(contributions)
        outer_grads = [{path: slot.params[path] - c.theta[path] for path in slot.params}
                       for c in contributions]
        merged = merge_lib.merge_outer_gradients(outer_grads, weights, self.settings.merge_rule,
                                                 self.is_embedding)
        if self.settings.participation_scale and live_count:
            # With K < M a round of M learners arrives as several merges; each full outer step
            # (Nesterov, lr 0.7) would then count M times per round and its momentum diverges in
            # a mixed fleet (measured: eval loss 3.0 -> 1e5). Scaling by the share n/M keeps one
            # round's total step the size of a synchronous one; with K = M it is exactly 1.
            share = np.float32(min(1.0, len(contributions) / live_count))
            merged = {path: share * g for path, g in merged.items()}
        slot.params, slot.outer_state = outer_lib.outer_step(self.outer, merged, slot.outer_state,
                                                             slot.params)
        slot.version += 1
        slot.history[slot.version] = slot.params
        for old in [v for v in slot.history if v <= slot.version - self.settings.history_versions]:
            del slot.history[old]
        for c in contributions:
            self._credit(c.push)
        slot.round = {}
        slot.quorum_reached_at_s = None
        slot.round_opened_at_s = None
        return MergeResult(
            fragment=fragment, version=slot.version, params=slot.params,
            learners=tuple(c.push.learner for c in contributions),
            staleness=tuple(c.staleness for c in contributions), reason=reason,
            outer_grad_norm=drift_norm(merged))

    def _credit(self, push: Push) -> None:
        entry = self.ledger.setdefault(push.learner, LedgerEntry(incarnation=push.incarnation))
        if push.incarnation != entry.incarnation:
            return  # an older incarnation's push cannot be in a round: forget() removed it
        if push.tokens_done > entry.applied_tokens_done:
            entry.applied_tokens_done = push.tokens_done
            entry.applied_compute_s = push.compute_s
            entry.applied_step = push.step

    # -- views ----------------------------------------------------------------------------------
    def fragment(self, p: int) -> tuple[Fragment, int]:
        return self.slots[p].params, self.slots[p].version

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(slot.version for slot in self.slots)

    def params_flat(self) -> dict[str, np.ndarray]:
        out = {}
        for slot in self.slots:
            out.update(slot.params)
        return out
