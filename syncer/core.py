"""The syncer's pure core: global fragments, open rounds, merges and the token ledger.

No Ray here: the in-process driver and the Ray actor both wrap one ``SyncerCore``. Time is passed
in as ``now_s``; the caller owns the clock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import optax

from islands import defaults

from . import downlink as downlink_lib
from . import fused
from . import merge as merge_lib
from .fragments import Fragment
from .timing import ema as timing_ema
from .quorum import Decision, grace_window, merge_decision, round_hold
from .validate import (GARBAGE_REASONS, Accepted, Push, RejectReason, Rejected, check_counters,
                       check_progress,
                       check_drift, drift_norm, outlier_limit, scaled_norm)

log = logging.getLogger("islands.syncer")

# Refusals that say the pusher is not who it claims (or not of this syncer): its books are not kept.
IDENTITY_REASONS = frozenset({RejectReason.STALE_EPOCH, RejectReason.UNKNOWN_LEARNER,
                              RejectReason.BAD_SESSION})


@dataclass(frozen=True)
class SyncerSettings:
    """Everything the core needs to decide; built from JobConfig's ``syncer`` and ``quorum``."""

    min_learners: int = defaults.MIN_LEARNERS
    grace_gamma: float = defaults.GRACE_GAMMA
    grace_cap_s: float = defaults.GRACE_CAP_S
    overlap_steps: int = defaults.OVERLAP_STEPS
    history_versions: int = defaults.HISTORY_VERSIONS
    max_staleness: Optional[int] = defaults.MAX_STALENESS
    outlier_norm_factor: Optional[float] = defaults.OUTLIER_NORM_FACTOR
    staleness_discount: float = defaults.STALENESS_DISCOUNT
    merge_rule: merge_lib.MergeRule = merge_lib.MergeRule(defaults.MERGE_RULE)
    norm_window: int = 32
    # A merge of n of the M live learners applies n/M of the outer step (see merge()).
    participation_scale: bool = defaults.PARTICIPATION_SCALE
    # What the syncer can check a push against: the learners' inner learning-rate schedule (drift
    # norms are compared in units of what it can move) and the tokens one inner step processes.
    inner_schedule: Optional[tuple] = None   # (peak lr, warmup, total steps, end fraction)
    tokens_per_step: Optional[int] = None
    # A learner whose drifts are refused as garbage this many times in a row is quarantined.
    quarantine_after: int = 3
    # Asynchrony (docs/architecture.md#asynchrony-stale-and-partial-merges): where a push's
    # outer gradient is taken from, how many outer steps a round split into partial merges
    # takes, the staleness exponent of a merge's share of a step, and what the learners' inner
    # schedule runs on. The defaults are the job config's (islands.defaults): a core built by
    # hand runs the service's rules.
    outer_gradient: merge_lib.OuterGradientRule = merge_lib.OuterGradientRule(
        defaults.OUTER_GRADIENT)
    round_step: merge_lib.RoundStep = merge_lib.RoundStep(defaults.ROUND_STEP)
    staleness_share: float = defaults.STALENESS_SHARE
    schedule_clock: merge_lib.ScheduleClock = merge_lib.ScheduleClock(defaults.SCHEDULE_CLOCK)
    # The round-completion wait: hold a partial merge past the grace window for the round's
    # missing live learners predicted to push within this share of the waiting pushers' sync
    # period (``quorum.round_hold``: each one's last push of the fragment plus whole periods of
    # its own); 0: the grace window only.
    round_wait: float = defaults.ROUND_WAIT

    def rules(self) -> dict:
        """The merge rules by their config names, for a benchmark's or a study's output.

        >>> SyncerSettings().rules()["round_step"]
        'per_round'
        """
        return {"merge_rule": self.merge_rule.value, "outer_gradient": self.outer_gradient.value,
                "round_step": self.round_step.value, "staleness_share": self.staleness_share,
                "schedule_clock": self.schedule_clock.value, "round_wait": self.round_wait,
                "history_versions": self.history_versions}


@dataclass
class Contribution:
    """An accepted push, kept as its outer gradient ``g_m = Θ[p] − θ_m[p]`` where
    ``θ_m[p] = base + δ`` is the learner's fragment (Θ[p] does not change while the round is open:
    only this fragment's merge, which closes the round, replaces it, or a catch-up after a
    restore, which folds the round's sum again against the new Θ[p])."""

    push: Push
    outer_grad: Optional[Fragment]   # None: folded into the round's running sum at once
    staleness: int
    arrived_s: float
    base: Optional[Fragment] = None   # exactly what the learner held (the downlink diffs from it)
    grad_norms: Optional[dict] = None  # ‖g_m‖ per tensor
    # A member of a region's pre-merged push: the push's name. Its members share one outer
    # gradient (the group's mean) and are merged, forgotten and answered together.
    group: Optional[str] = None
    # What its outer gradient is decoded from again, and its merge weight: the round keeps
    # running sums, not the gradients (fused.GradSum). The codes are the push's own (the same
    # object as ``push.codes``; a pre-merged push's, which its members share), held until the
    # round merges because they are read again when the push leaves the round unmerged (its
    # learner forgotten: ``_take_out`` decodes this push alone and subtracts it) and, under
    # ``outer_gradient: pull``, when a partial merge joins its round (each gradient moves to
    # the round's start, and RDA needs each one's new norm). They are the smallest record of
    # the gradient there is (nf2: 0.07 of its float32 bytes), and dropping them here would free
    # nothing before the push is answered: the syncer's ``push`` call holds its argument until
    # then.
    codes: Any = None
    weight: float = 0.0


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
    outlier_learners: set = field(default_factory=set)   # refused as outliers since an accept
    # round_step per_round: the learners already stepped in the open round (name -> staleness)
    # with the running sum of their pushes, and the Θ and outer state the round started from
    # (its later pushes step again from there, with them).
    stepped: dict = field(default_factory=dict)
    round_start: Optional[tuple] = None
    stepped_sum: Optional[fused.GradSum] = None
    # The open round's pushes, folded as they are accepted (one or two fragment-sized arrays
    # whatever the number of learners: docs/operations.md#syncer-memory).
    open_sum: Optional[fused.GradSum] = None


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
    # The current incarnation, per fragment: the learner step of its last merged push (the books
    # settle a dead learner's open push with it) and the fragment-tokens merges applied (counted
    # here, independently of the learner's own books).
    merged_steps: dict = field(default_factory=dict)
    merged_tokens: dict = field(default_factory=dict)
    fates: Optional[dict] = None     # the newest books a push of this incarnation carried
    merged_tokens_total: int = 0     # fragment-tokens merged, every incarnation
    # The current incarnation, per fragment: the version of Θ[p] its registration handed it. A
    # push based on an older version comes from weights it had before it adopted that fragment
    # (SyncerCore.adopted).
    born: dict = field(default_factory=dict)

    def __post_init__(self):  # JSON round trips (snapshots) turn the fragment keys into strings
        self.merged_steps = {int(p): int(v) for p, v in self.merged_steps.items()}
        self.merged_tokens = {int(p): int(v) for p, v in self.merged_tokens.items()}
        self.born = {int(p): int(v) for p, v in self.born.items()}

    @property
    def applied_tokens(self) -> int:
        return self.applied_tokens_before + self.applied_tokens_done

    @property
    def applied_compute_total_s(self) -> float:
        return self.applied_compute_before_s + self.applied_compute_s


@dataclass(frozen=True)
class _Judged:
    """A push that passed every check (internal to accept_push)."""

    staleness: int
    drift: dict
    norm: float
    ok: bool = True


@dataclass(frozen=True)
class Credit:
    """What one merged push added to its learner's ledger entry, with what the entry held before,
    so that a merge that could not be made durable takes it back (``SyncerCore.revoke``)."""

    push: Push
    step_before: Optional[int]        # merged_steps[p] before the credit (None: none)
    tokens_before: Optional[int]      # merged_tokens[p] before
    mark_before: Optional[tuple]      # SyncerCore.merge_marks[(learner, p)] before


@dataclass(frozen=True)
class MergeResult:
    """The record of one merge: what it made and who took part.

    Participation is part of the record: ``learners`` (the participants, one per contribution),
    ``live`` (the live learners M the merge was decided against; None when the caller did not
    say) and ``staleness`` (per participant, aligned with ``learners``: the fragment's version
    at the merge minus the version its push was based on)."""

    fragment: int
    version: int
    params: Fragment
    learners: tuple[str, ...]
    staleness: tuple[int, ...]
    reason: str
    outer_grad_norm: float
    refused: bool = False    # Θ and the version unchanged: not finite, or no contributor adopted
    # Per learner (aligned with ``learners``): (base id, base version, base) it pushed from.
    bases: tuple = ()
    # Per learner: the pre-merged push it came in (None: its own push). A group's members share
    # one base, so they are sent one update and keep one shadow (they pre-merge again next round).
    groups: tuple = ()
    fleet_step: Optional[float] = None   # the fleet's progress after the merge (fleet clock)
    joined: int = 0                      # per_round: pushes of the round stepped before this merge
    live: Optional[int] = None           # live learners M when the merge was decided
    detail: str = ""                     # a refused merge: why, in words
    # What the merge credited to the ledger, per push (``SyncerCore.revoke`` takes it back).
    credits: tuple = field(default=(), repr=False, compare=False)

    @property
    def participants(self) -> int:
        """Learners whose pushes this merge took (n of the ``live`` M)."""
        return len(self.learners)

    @property
    def participation(self) -> Optional[float]:
        """n / M, the share of the live learners that took part (None: M unknown).

        >>> MergeResult(0, 1, {}, ("a", "b"), (0, 1), "quorum", 0.0, live=4).participation
        0.5
        """
        return self.participants / self.live if self.live else None

    def record(self) -> dict:
        """The participation record (JSON): who took part out of how many, how stale each push was.

        >>> MergeResult(2, 7, {}, ("a", "b"), (0, 3), "grace", 0.0, live=3).record()
        {'fragment': 2, 'version': 7, 'participants': 2, 'live': 3, 'staleness': {'a': 0, 'b': 3}, 'reason': 'grace', 'refused': False}
        """
        return {"fragment": self.fragment, "version": self.version,
                "participants": self.participants, "live": self.live,
                "staleness": dict(zip(self.learners, self.staleness)), "reason": self.reason,
                "refused": self.refused}


def participation_key(participants: int, live: Optional[int]) -> str:
    """The key of ``SyncerCore.participation_counts``: ``"n/M"`` (``"n/?"``: M unknown).

    >>> participation_key(16, 30), participation_key(1, None)
    ('16/30', '1/?')
    """
    return f"{participants}/{live if live else '?'}"


def parse_participation_key(key: str) -> tuple[int, Optional[int]]:
    """``"16/30"`` -> (16, 30); ``"1/?"`` -> (1, None).

    >>> parse_participation_key("16/30"), parse_participation_key("1/?")
    ((16, 30), (1, None))
    """
    n, _, m = str(key).partition("/")
    return int(n), (int(m) if m.isdigit() else None)


def regions_to_rejoin(learners: Sequence[str], bases: Sequence[tuple],
                      groups: Sequence[Optional[str]]) -> frozenset:
    """Regions whose learners of one merge must all get the full fragment: a region with a
    pre-merged push in the merge and learners there from more than one base (a round that left
    as several pushes). Each part would otherwise get its own encoded update and keep its own
    shadow, and the region's pushes would never share a base, nor pre-merge, again; the full
    fragment gives them one (exact) base. Names are ``region:index``, a group's
    ``region:premerge``.

    >>> regions_to_rejoin(["r:0", "r:1", "r:2", "s:0"],
    ...                   [(7, 3, None), (7, 3, None), (9, 3, None), (5, 2, None)],
    ...                   ["r:premerge", "r:premerge", None, None])
    frozenset({'r'})
    >>> regions_to_rejoin(["r:0", "r:1"], [(7, 3, None), (7, 3, None)],
    ...                   ["r:premerge", "r:premerge"])
    frozenset()
    """
    grouped = {g.rsplit(":", 1)[0] for g in groups if g is not None}
    bases_of: dict[str, set] = {}
    for name, (base_id, base_version, _), group in zip(learners, bases, groups, strict=True):
        region = name.rsplit(":", 1)[0]
        if region in grouped:
            bases_of.setdefault(region, set()).add((base_id, base_version))
    return frozenset(r for r, seen in bases_of.items() if len(seen) > 1)


class SyncerCore:
    """Owns the global parameters Θ and the outer optimizer state, per fragment."""

    def __init__(self, fragments: list[Fragment], settings: SyncerSettings,
                 outer_optimizer: optax.GradientTransformation,
                 decode: Callable[[Mapping[str, Any]], Fragment],
                 is_embedding: Callable[[str], bool] = lambda path: False,
                 epoch: int = 0, downlink: Optional[downlink_lib.DownlinkSettings] = None):
        self.settings = settings
        self.downlink = downlink or downlink_lib.DownlinkSettings()
        # (learner, fragment) -> the Shadow of what it holds after its last encoded update.
        self.shadows: dict[tuple[str, int], downlink_lib.Shadow] = {}
        self._shadow_ids = itertools.count((epoch << 32) + 1)  # never 0, unique per epoch
        self.pool = fused.BufferPool()   # outer-gradient buffers, reused round after round
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
        self.sessions: dict[str, str] = {}  # learner -> its incarnation's session token
        self.ledger: dict[str, LedgerEntry] = {}
        self.rejected: collections.Counter = collections.Counter()
        self.refusals: collections.deque = collections.deque(maxlen=10_000)  # newest refusals
        self.refusals_total = 0
        self.garbage_streak: collections.Counter = collections.Counter()
        # Fragments restored from a snapshot that may be older than what learners adopted since:
        # until the fragment's first merge, a re-registering learner's newer copy is taken.
        self.catching_up: set[int] = set()
        self.quarantined: dict[str, int] = {}  # learner -> incarnation, until it re-registers
        self.registered_at: dict[str, tuple[int, float]] = {}  # learner -> (resume step, when)
        # Participation books (docs/metrics.md): merges that replaced Θ by "n/M" (participants of
        # the live learners), merged pushes by staleness, and the newest merge records (refused
        # ones included).
        self.participation_counts: collections.Counter = collections.Counter()
        self.staleness_counts: collections.Counter = collections.Counter()
        self.merge_records: collections.deque = collections.deque(maxlen=1_000)
        self.last_live: dict[int, int] = {}   # fragment -> live learners at its last merge
        # syncer.round_wait predicts a learner's next push of a fragment from these, on the
        # now_s clock: (learner, fragment) -> when its last accepted push of it arrived, and
        # learner -> its sync period (the EMA of the time between two pushes of one fragment).
        # They live in this process only: a restarted syncer, or a new incarnation, measures
        # them afresh.
        self.push_times: dict[tuple[str, int], float] = {}
        self.push_periods: dict[str, float] = {}
        # The fleet is paused (the pause rule): a gap that holds a pause is no period; the
        # measure starts over on resume (``pause_periods``).
        self.periods_paused = False
        # (learner, fragment) -> (incarnation, tokens_done, compute_s, step) of its newest push
        # merged in this process (a revoked merge's mark goes back to the one before it), and
        # learner -> (incarnation, (tokens_done, compute_s, step)): the applied watermark its
        # incarnation held before its first merge in this process (restored, or a new
        # incarnation's start: nothing a revoke can take back). A revoke rebuilds the watermark
        # from these alone (``revoke``).
        self.merge_marks: dict[tuple[str, int], tuple] = {}
        self.watermark_bases: dict[str, tuple] = {}

    # -- membership -----------------------------------------------------------------------------
    def register(self, learner: str, incarnation: int, session: Optional[str] = None
                 ) -> tuple[int, list[tuple[Fragment, int]]]:
        """Admits a learner incarnation; returns the epoch and every fragment with its version.

        ``session``: a token every push of this incarnation must carry (the Ray syncer hands a
        fresh random one to each registration, so one learner cannot push as another); None: not
        checked (a trusted in-process driver)."""
        previous = self.learners.get(learner)
        if previous is not None and incarnation < previous:
            raise ValueError(f"{learner}: incarnation {incarnation} is older than {previous}")
        if previous != incarnation:
            self._drop_shadows(learner)  # a new incarnation starts from the full fragments
            self._drop_push_times(learner)
        self.learners[learner] = incarnation
        # A new incarnation's progress is bounded from here (wall clock on purpose, also under a
        # virtual one: it bounds what a process can train). One the ledger knows already (a
        # syncer restart, a re-registration) keeps its earlier anchor, or none after a restore.
        known = self.ledger.get(learner)
        if known is None or known.incarnation != incarnation:
            resume = known.applied_step if known is not None else 0
            self.registered_at[learner] = (resume, time.monotonic())
        if session is None:
            self.sessions.pop(learner, None)
        else:
            self.sessions[learner] = session
        self.garbage_streak.pop(learner, None)
        self.quarantined.pop(learner, None)
        entry = self.ledger.get(learner)
        if entry is None:
            entry = self.ledger[learner] = LedgerEntry(incarnation=incarnation,
                                                       born=dict(enumerate(self.versions)))
        if incarnation != entry.incarnation:
            entry.applied_tokens_before += entry.applied_tokens_done
            entry.applied_compute_before_s += entry.applied_compute_s
            entry.applied_tokens_done, entry.applied_compute_s = 0, 0.0
            entry.merged_steps, entry.merged_tokens, entry.fates = {}, {}, None
            entry.born = dict(enumerate(self.versions))
            entry.incarnation = incarnation
        return self.epoch, [(slot.params, slot.version) for slot in self.slots]

    def forget(self, learner: str) -> list[Push]:
        """A learner left or died: drop its unmerged pushes (their work is lost) and unregister it."""
        dropped = []
        for slot in self.slots:
            contribution = slot.round.pop(learner, None)
            if contribution is not None:
                left = [contribution]
                if contribution.group is not None:
                    # Its drift is inside the group's mean: the group goes with it (its other
                    # members are answered "dropped" and push their drift again).
                    left += [slot.round.pop(mate) for mate in
                             [n for n, c in slot.round.items() if c.group == contribution.group]]
                dropped.extend(c.push for c in left)
                self._take_out(slot, left)   # the sum without it (none left: no sum)
                self._recount_quorum(slot)
        self.learners.pop(learner, None)
        self.sessions.pop(learner, None)
        self._drop_shadows(learner)
        self._drop_push_times(learner)
        return dropped

    def restart(self, epoch: int) -> list[Push]:
        """This syncer restarts in place at ``epoch`` (at least the current epoch + 1: fencing,
        every push to an earlier epoch is refused), as a new process finds it after restoring its
        newest snapshot and merge journal (``state.restore_into`` and ``FragmentJournal.replay``:
        each fragment as of its last merge). Θ, versions, outer state and ledger stay; what lived
        only in the dead process is gone: the open rounds (their pushes are returned, dropped),
        the older versions, the shadows of the learners' copies, the drift-norm windows, the
        registrations (each learner registers again) and progress anchors. The refusal counts go
        on (the Ray controller keeps a dead syncer's counts too). Returns the dropped pushes."""
        dropped = []
        for slot in self.slots:
            dropped.extend(c.push for c in slot.round.values())
            slot.round = {}
            self._release_open(slot)
            self._release_round(slot)
            slot.quorum_reached_at_s = slot.round_opened_at_s = None
            slot.history = {slot.version: slot.params}
            slot.recent_norms.clear()
            slot.outlier_learners = set()
        self.epoch = max(int(epoch), self.epoch + 1)
        self.shadows.clear()
        self.push_times, self.push_periods = {}, {}
        self._shadow_ids = itertools.count((self.epoch << 32) + 1)
        self.learners, self.sessions, self.registered_at = {}, {}, {}
        self.garbage_streak.clear()
        self.quarantined = {}
        self.ledger_durable()
        return dropped

    def ledger_durable(self) -> None:
        """The ledger as it stands is durable (restored from a snapshot and the merge journal,
        or restarted as of them): no merge credited so far can be revoked, so the marks a revoke
        rebuilds the watermark from start over (``revoke``)."""
        self.merge_marks, self.watermark_bases = {}, {}

    def _drop_shadows(self, learner: str) -> None:
        for key in [key for key in self.shadows if key[0] == learner]:
            del self.shadows[key]

    def _drop_push_times(self, learner: str) -> None:
        for key in [key for key in self.push_times if key[0] == learner]:
            del self.push_times[key]
        self.push_periods.pop(learner, None)

    def pause_periods(self, paused: bool) -> None:
        """The fleet paused (True) or resumed (False; ``timing.merges_held``). A pause is no
        part of a sync period: while it lasts no period is sampled (a push still arriving then
        only notes its time), and on resume every learner's period and last push times are
        forgotten, so ``round_wait`` waits on nobody until each one is measured again (two
        pushes of a fragment after the resume)."""
        if self.periods_paused and not paused:
            self.push_times, self.push_periods = {}, {}
        self.periods_paused = paused

    def _note_push_time(self, learner: str, fragment: int, now_s: float) -> None:
        """An accepted push of ``fragment`` arrived at ``now_s``: the time since its last push of
        the fragment is a sample of the learner's period (EMA weight ½); none while paused."""
        last = self.push_times.get((learner, fragment))
        if last is not None and now_s > last and not self.periods_paused:
            self.push_periods[learner] = timing_ema(self.push_periods.get(learner),
                                                    now_s - last, 0.5)
        self.push_times[(learner, fragment)] = now_s

    def catch_up(self, learner: str, incarnation: int,
                 adopted: Sequence[tuple[int, Fragment]]) -> list[int]:
        """After a restore from a snapshot: takes a learner's adopted fragments that are newer
        than the snapshot, so no merged version is lost. Only before the fragment's first merge
        since the restore, only from an incarnation the restored ledger knows, only finite and
        of the fragment's shapes. Returns the fragments taken."""
        entry = self.ledger.get(learner)
        if entry is None or entry.incarnation != incarnation:
            return []
        taken = []
        for p, (version, fragment) in enumerate(adopted):
            if p >= len(self.slots) or p not in self.catching_up:
                continue
            slot = self.slots[p]
            if version <= slot.version or set(fragment) != set(slot.params):
                continue
            values = {k: np.asarray(v, np.float32) for k, v in fragment.items()}
            if any(v.shape != slot.params[k].shape or not np.all(np.isfinite(v))
                   for k, v in values.items()):
                continue
            log.info("fragment %d: version %d from %s's adopted copy (restored: %d)", p,
                     version, learner, slot.version)
            slot.params, slot.version = values, int(version)
            slot.history = {slot.version: values}
            if slot.round:
                # The open pushes' anchor (``_anchor``: Θ[p], or a version of the history) is
                # another now: their sum is folded again against it, so that a push leaving the
                # round (``_take_out`` decodes it against the current anchor and subtracts it)
                # takes out what it put in, and the merge reads the pushes as the rule says.
                self._refold(slot)
            taken.append(p)
        return taken

    # -- the data path --------------------------------------------------------------------------
    def accept_push(self, push: Push, now_s: float) -> Accepted | Rejected:
        """Validates and stores a push in its fragment's open round. A refusal changes nothing
        but the refusal books (counts, the event, a learner's garbage streak)."""
        if push.members:
            return self._accept_group(push, now_s)
        verdict = self._judge(push)
        if verdict.ok or verdict.reason not in IDENTITY_REASONS:
            self._note_fates(push)
        if not verdict.ok:
            self._refused(push, verdict)
            return verdict
        slot = self.slots[push.fragment]
        drift, norm = verdict.drift, verdict.norm
        slot.recent_norms.append(norm)  # accepted: part of what "normal" is
        self.garbage_streak.pop(push.learner, None)
        base = self._base_of(push)
        weight = self._weight(push, verdict.staleness)
        self._fold(slot, push, base, drift, weight, 1.0)
        if not slot.round:
            slot.round_opened_at_s = now_s
        slot.round[push.learner] = Contribution(push, None, verdict.staleness, now_s, base,
                                                codes=push.codes, weight=weight)
        self._note_push_time(push.learner, push.fragment, now_s)
        if slot.quorum_reached_at_s is None and len(slot.round) >= self.settings.min_learners:
            slot.quorum_reached_at_s = now_s
        return Accepted(verdict.staleness)

    def _accept_group(self, push: Push, now_s: float) -> Accepted | Rejected:
        """A region's pre-merged push (``link/premerge.py``): every member is checked as its own
        push would be (identity, session, round, base, counters), the mean drift once (shapes,
        finite, outlier norm). All or nothing: one refused member refuses the whole push (the
        region then sends its members one by one, each judged alone). Accepted, each member
        enters the round as itself (quorum, live set and ledger count learners) with the
        group's one outer gradient and its own token weight: for the weighted mean that is
        exactly the merge of the members' own gradients."""
        refusal = self._group_refusal(push)
        if refusal is None:
            first = max(push.members, key=lambda m: m.c_steps)   # the norm's lr units
            refusal = self._judge(dataclasses.replace(first, codes=push.codes))
            if refusal.ok:
                judged, refusal = refusal, None
        if refusal is not None:
            # A group of one is its learner's own push: booked as that learner's refusal.
            self._refused(push.members[0] if len(push.members) == 1 else push, refusal)
            return refusal
        for member in push.members:
            self._note_fates(member)
        slot = self.slots[push.fragment]
        slot.recent_norms.append(judged.norm)
        base = self._base_of(push.members[0])
        weights = [self._weight(m, judged.staleness) for m in push.members]
        # One gradient for the group, with the sum of its members' weights: Σ w_i ḡ = (Σ w_i) ḡ.
        self._fold(slot, push.members[0], base, judged.drift, sum(weights),
                   float(len(push.members)))
        if not slot.round:
            slot.round_opened_at_s = now_s
        for member, weight in zip(push.members, weights):
            self.garbage_streak.pop(member.learner, None)
            slot.round[member.learner] = Contribution(member, None, judged.staleness, now_s,
                                                      base, group=push.learner,
                                                      codes=push.codes, weight=weight)
            self._note_push_time(member.learner, push.fragment, now_s)
        if slot.quorum_reached_at_s is None and len(slot.round) >= self.settings.min_learners:
            slot.quorum_reached_at_s = now_s
        return Accepted(judged.staleness)

    def _group_refusal(self, push: Push) -> Optional[Rejected]:
        """Why a pre-merged push cannot enter the round as it is (None: it can, but for its
        drift): a member of another fragment, epoch or base, a member refused by its own checks
        (the reason is that member's), or a merge rule the mean does not reproduce."""
        if self.settings.merge_rule != merge_lib.MergeRule.MEAN:
            return Rejected(RejectReason.BAD_SHAPE, "a pre-merged push needs merge_rule mean "
                            "(link.premerge): RDA of a mean is not the RDA of its parts")
        for member in push.members:
            if (member.fragment, member.epoch, member.base_version, member.base_shadow) != (
                    push.fragment, push.epoch, push.base_version, push.base_shadow):
                return Rejected(RejectReason.BAD_SHAPE, f"member {member.learner}: another "
                                "fragment, epoch or base than its pre-merged push")
            verdict = self._check(member)
            if not verdict.ok:
                return Rejected(verdict.reason, f"member {member.learner}: {verdict.detail}")
            step, since_s = self.registered_at.get(member.learner, (None, 0.0))
            problem = (check_counters(member.c_tokens, member.c_steps,
                                      self.settings.tokens_per_step)
                       or check_progress(member.step, member.tokens_done, step,
                                         time.monotonic() - since_s,
                                         self.settings.tokens_per_step))
            if problem is not None:
                return Rejected(problem.reason, f"member {member.learner}: {problem.detail}")
        return None

    def _judge(self, push: Push):
        verdict = self._check(push)
        if isinstance(verdict, Rejected):
            return verdict
        problem = check_counters(push.c_tokens, push.c_steps, self.settings.tokens_per_step)
        if problem is None:
            step, since_s = self.registered_at.get(push.learner, (None, 0.0))
            problem = check_progress(push.step, push.tokens_done, step,
                                     time.monotonic() - since_s, self.settings.tokens_per_step)
        if problem is not None:
            return problem
        slot = self.slots[push.fragment]
        try:
            drift = {k: np.asarray(v) for k, v in self.decode(push.codes).items()}
        except (ValueError, TypeError, KeyError) as exc:  # a malformed code is a bad shape
            return Rejected(RejectReason.BAD_SHAPE, f"cannot decode: {exc}")
        problem = check_drift(drift, slot.params, (), None)  # shapes, dtypes, finite values
        if problem is not None:
            return problem
        size = sum(int(np.size(v)) for v in slot.params.values())
        at = self.schedule_read_at(push)
        norm = scaled_norm(drift_norm(drift), self.settings.inner_schedule, at, push.c_steps,
                           size)
        factor = self.settings.outlier_norm_factor
        limit = outlier_limit(list(slot.recent_norms), factor, factor)
        if limit is not None and limit > 0 and norm > limit:
            slot.outlier_learners.add(push.learner)
            if len(slot.outlier_learners) >= 2:
                # Several learners in a row look like outliers: the reference is what is off
                # (the loss landscape moved). Start again from the first-push bound.
                log.warning("fragment %d: outlier window reset after refusals from %s",
                            push.fragment, sorted(slot.outlier_learners))
                slot.recent_norms.clear()
                slot.outlier_learners = set()
                if norm <= factor:
                    return _Judged(verdict.staleness, drift, norm)
            return Rejected(RejectReason.OUTLIER_NORM,
                            f"drift norm {norm:.4g} > {limit:.4g} (in units of the inner step; "
                            f"{push.c_steps} steps to step {push.step})")
        slot.outlier_learners = set()
        return _Judged(verdict.staleness, drift, norm)

    def _note_fates(self, push: Push) -> None:
        """Keeps the newest books of a registered incarnation's pushes."""
        entry = self.ledger.get(push.learner)
        if push.fates and entry is not None and entry.incarnation == push.incarnation and (
                entry.fates is None or push.fates["events"] > entry.fates["events"]):
            entry.fates = dict(push.fates)

    def _refused(self, push: Push, verdict: Rejected) -> None:
        self.rejected[verdict.reason] += 1
        self.refusals_total += 1
        self.refusals.append({"learner": push.learner, "incarnation": push.incarnation,
                              "fragment": push.fragment, "reason": verdict.reason.value,
                              "detail": verdict.detail[:300]})
        log.warning("refused %s fragment %s: %s (%s)", push.learner, push.fragment,
                    verdict.reason.value, verdict.detail)
        if verdict.reason in GARBAGE_REASONS and self.learners.get(push.learner) == \
                push.incarnation:
            self.garbage_streak[push.learner] += 1
            if self.garbage_streak[push.learner] >= self.settings.quarantine_after:
                self.quarantined[push.learner] = push.incarnation

    def _check(self, push: Push) -> Accepted | Rejected:
        if push.epoch != self.epoch:
            return Rejected(RejectReason.STALE_EPOCH, f"epoch {push.epoch}, current {self.epoch}")
        if self.learners.get(push.learner) != push.incarnation:
            return Rejected(RejectReason.UNKNOWN_LEARNER,
                            f"{push.learner} incarnation {push.incarnation} is not registered")
        session = self.sessions.get(push.learner)
        if session is not None and push.session != session:
            return Rejected(RejectReason.BAD_SESSION,
                            f"{push.learner}: the push does not carry its incarnation's session")
        if not 0 <= push.fragment < len(self.slots):
            return Rejected(RejectReason.UNKNOWN_FRAGMENT,
                            f"fragment {push.fragment} not in [0, {len(self.slots)})")
        slot = self.slots[push.fragment]
        if push.learner in slot.round:
            return Rejected(RejectReason.DUPLICATE,
                            f"{push.learner} already pushed fragment {push.fragment} this round")
        if push.base_shadow != downlink_lib.EXACT:
            shadow = self.shadows.get((push.learner, push.fragment))
            if shadow is None or (shadow.shadow_id, shadow.version) != (push.base_shadow,
                                                                         push.base_version):
                held = "none" if shadow is None else f"{shadow.shadow_id} (v{shadow.version})"
                return Rejected(RejectReason.UNKNOWN_VERSION,
                                f"base shadow {push.base_shadow} (v{push.base_version}) is not "
                                f"the one recorded for {push.learner}: {held}")
        elif push.base_version not in slot.history:
            return Rejected(RejectReason.UNKNOWN_VERSION,
                            f"base version {push.base_version} not in history "
                            f"[{min(slot.history)}, {max(slot.history)}]")
        staleness = slot.version - push.base_version
        limit = self.settings.max_staleness
        if limit is not None and staleness > limit:
            return Rejected(RejectReason.TOO_STALE, f"staleness {staleness} > {limit}")
        return Accepted(staleness)

    def _weight(self, push: Push, staleness: int) -> float:
        """A push's merge weight: its token weight times its staleness factor."""
        return (merge_lib.token_weight(push.c_tokens, push.c_steps)
                * merge_lib.staleness_factor(staleness, self.settings.staleness_discount))

    def _rda_paths(self, slot: FragmentSlot) -> frozenset:
        return frozenset(path for path in slot.params
                         if self.settings.merge_rule == merge_lib.MergeRule.RDA
                         and not self.is_embedding(path))

    def _fold(self, slot: FragmentSlot, push: Push, base: Fragment, drift: Mapping,
              weight: float, unit_weight: float, shift: Optional[tuple] = None) -> None:
        """Adds a push's outer gradient to the open round's running sum (its buffers go back
        to the pool at once). ``shift``: (Θ_start, Θ): the gradient moves to the round's start,
        ``g + (Θ_start − Θ)`` (a pull-rule join)."""
        if slot.open_sum is None:
            slot.open_sum = fused.GradSum(self._rda_paths(slot))
        grads, norms = fused.outer_gradient(self._anchor(slot, push, base), base, drift,
                                            self.pool)
        if shift is not None:
            for path, g in grads.items():
                g += shift[0][path] - shift[1][path]
                norms[path] = fused.tensor_norm(g)
        slot.open_sum.fold(grads, norms, weight, unit_weight, self.pool)
        for g in grads.values():
            self.pool.give(g)

    def _take_out(self, slot: FragmentSlot, left: Sequence[Contribution]) -> None:
        """The open round's sum without the pushes ``left`` (one push, or the members of one
        pre-merged push, which share one outer gradient): their gradient is decoded again from
        their codes, as ``_fold`` made it (the same anchor, base and drift: the same values),
        and subtracted (``GradSum.unfold``); the pushes that stay are not decoded. Only where
        subtracting cannot give their sum (the pushes that left held its only positive weights)
        or not precisely (they weighed more than all that stay: float32 cancellation) is it
        folded again from theirs."""
        if not slot.round or slot.open_sum is None:
            self._release_open(slot)
            return
        c = left[0]
        drift = {k: np.asarray(v) for k, v in self.decode(c.codes).items()}
        grads, norms = fused.outer_gradient(self._anchor(slot, c.push, c.base), c.base, drift,
                                            self.pool)
        whole = slot.open_sum.unfold(grads, norms, sum(m.weight for m in left),
                                     float(len(left)), self.pool)
        for g in grads.values():
            self.pool.give(g)
        if not whole:
            self._refold(slot)

    def _refold(self, slot: FragmentSlot, shift: Optional[tuple] = None) -> None:
        """Rebuilds the open round's sum from its pushes' codes, in the order they came (the
        same numbers as folding them as they came): after a push left the round, or moved to
        its round's start (``shift``, see ``_fold``)."""
        self._release_open(slot)
        done = set()
        for c in list(slot.round.values()):
            key = c.group if c.group is not None else ("", c.push.learner)
            if key in done:
                continue
            done.add(key)
            mates = ([m for m in slot.round.values() if m.group == c.group]
                     if c.group is not None else [c])
            drift = {k: np.asarray(v) for k, v in self.decode(c.codes).items()}
            self._fold(slot, c.push, c.base, drift, sum(m.weight for m in mates),
                       float(len(mates)), shift)

    def _release_open(self, slot: FragmentSlot) -> None:
        if slot.open_sum is not None:
            slot.open_sum.release(self.pool)
            slot.open_sum = None

    def outer_gradient_of(self, fragment: int, learner: str) -> tuple[dict, dict]:
        """The outer gradient (and its norms) of a learner's open push of a fragment, decoded
        again from its codes as the round folded it (for tests and tools; the round keeps only
        its running sum)."""
        slot = self.slots[fragment]
        c = slot.round[learner]
        drift = {k: np.asarray(v) for k, v in self.decode(c.codes).items()}
        return fused.outer_gradient(self._anchor(slot, c.push, c.base), c.base, drift)

    def _anchor(self, slot: FragmentSlot, push: Push, base: Fragment) -> Fragment:
        """The Θ the push's outer gradient is taken from (``merge.gradient_anchor``)."""
        return merge_lib.gradient_anchor(self.settings.outer_gradient, slot.params,
                                         slot.history.get(push.base_version), base)

    def schedule_read_at(self, push: Push) -> int:
        """Where the syncer takes the pusher's inner schedule to stand when the push left (its
        drift is read at the rates of the ``c_steps`` counts before it): its own step, or under
        the fleet clock the fleet's."""
        if self.settings.schedule_clock == merge_lib.ScheduleClock.FLEET:
            return max(int(round(self.fleet_step())), push.c_steps)
        return push.step

    def schedule_start(self) -> Optional[int]:
        """Under the fleet clock, the schedule count a learner (re)starting now takes: the
        fleet's position, as a merge it adopts would set it (``merge.schedule_position`` with no
        open push), whatever its own resume step or a peer's copied count; None under the
        learner clock (its schedule runs on its own steps)."""
        if self.settings.schedule_clock == merge_lib.ScheduleClock.FLEET:
            return merge_lib.schedule_position(self.fleet_step(), None, 0)
        return None

    def fleet_step(self) -> float:
        """The fleet's progress in inner steps (``merge.fleet_step``): the mean, over the
        registered learners, of the step of each one's newest merged push (the ledger's data
        resume point, kept in snapshots, so it survives a syncer restart)."""
        return merge_lib.fleet_step([self.ledger[name].applied_step for name in self.learners
                                     if name in self.ledger])

    def _base_of(self, push: Push) -> Fragment:
        """What the pushing learner holds of the fragment (``_check`` made sure it is known)."""
        if push.base_shadow != downlink_lib.EXACT:
            return self.shadows[(push.learner, push.fragment)].params
        return self.slots[push.fragment].history[push.base_version]

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
        arrived, hold = frozenset(slot.round), None
        if self.settings.round_wait > 0 and slot.quorum_reached_at_s is not None:
            arrived = self.round_members(fragment, live)
            hold = self._round_hold(fragment, arrived, live, now_s, grace_s)
        return merge_decision(arrived, live, now_s, slot.quorum_reached_at_s,
                              self.settings.min_learners, grace_s, hold)

    def round_members(self, fragment: int, live: frozenset[str]) -> frozenset[str]:
        """The learners of the round the open pushes of a fragment belong to: theirs, and under
        ``round_step: per_round`` those already stepped in the round they would join
        (``_join_round``'s rule)."""
        slot = self.slots[fragment]
        names = frozenset(slot.round)
        if (self.settings.round_step == merge_lib.RoundStep.PER_ROUND and slot.stepped
                and slot.round_start is not None and not names & set(slot.stepped)
                and len(slot.stepped) < len(live)):
            return names | frozenset(slot.stepped)
        return names

    def _round_hold(self, fragment: int, members: frozenset[str], live: frozenset[str],
                    now_s: float, grace_s: float) -> Optional[float]:
        """``syncer.round_wait``: until when the round's missing live learners that are due to
        push soon are waited for (``quorum.round_hold``), bounded by ``round_wait`` times the
        shortest known period of the learners whose pushes are open; None: the grace window."""
        slot = self.slots[fragment]
        periods = [self.push_periods[name] for name in slot.round if name in self.push_periods]
        if not periods:
            return None
        missing = {name: (self.push_periods.get(name), self.push_times.get((name, fragment)))
                   for name in live - members}
        return round_hold(missing, now_s, slot.quorum_reached_at_s,
                          self.settings.round_wait * min(periods), grace_s)

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

    def adopted(self, push: Push) -> bool:
        """Whether a push comes from weights that adopted the global fragment
        (docs/architecture.md#merges-only-from-adopted-learners): its base is an encoded update
        the syncer sent this incarnation, or a version of Θ[p] no older than the one its
        registration handed it (then every later base, a merged reply or the fragment a refusal
        carries, is newer still). A base older than that is what a worker holds that started
        from its own weights (a fresh initialisation, an old checkpoint) instead of the global
        ones; under the pull rule its merge alone would make those weights Θ[p].

        >>> import optax
        >>> core = SyncerCore([{"w": np.zeros(1)}], SyncerSettings(), optax.sgd(1.0), dict)
        >>> core.slots[0].version = core.slots[0].history[3] = 3   # (three merges since)
        >>> _ = core.register("a", 0)
        >>> push = lambda v: Push("a", 0, {}, v, 0, 1, 1)
        >>> core.adopted(push(3)), core.adopted(push(0))
        (True, False)
        """
        entry = self.ledger.get(push.learner)
        if entry is None or entry.incarnation != push.incarnation:
            return False
        return (push.base_shadow != downlink_lib.EXACT
                or push.base_version >= entry.born.get(push.fragment, 0))

    def merge(self, fragment: int, reason: str = "", live_count: Optional[int] = None) -> MergeResult:
        """Merges the open round of a fragment against the current Θ[p] and steps the outer optimizer.

        Every merge is recorded with its participation: the participants, the live learners M
        (``live_count``) and each push's staleness (``MergeResult.record``, kept in
        ``merge_records``, ``participation_counts`` and ``staleness_counts``).

        A merge none of whose contributions comes from adopted weights (``adopted``: each push
        is based on a version older than the one its incarnation was handed when it registered)
        is **refused**, not held: Θ[p], its version and the outer state stay as they are, and
        every push of the merge is refused with reason ``unadopted`` and the current Θ[p], which
        its learner starts over from (``LearnerCore.refused``). Its next push is based on that
        fragment, so it counts. A fresh worker alone in a quorum thus never makes its own weights
        the cluster state, and nothing waits on a learner that may never come (a hold would stall
        a fleet whose adopted learners all died). One adopted contribution is enough.

        Args:
          fragment: p.
          reason: why now (a MergeReason value), for the record.
          live_count: live learners M, for the participation scale (None: no scaling) and the
            record.
        """
        slot = self.slots[fragment]
        if not slot.round:
            raise ValueError(f"fragment {fragment} has no pushes to merge")
        contributions = [slot.round[name] for name in sorted(slot.round)]
        if not any(self.adopted(c.push) for c in contributions):
            return self._refuse_unadopted(slot, fragment, contributions, live_count)
        # round_step per_round: the pushes of this merge join the open round's step when none of
        # their learners is in it yet and it does not hold every live learner already; the step
        # is then taken again from the round's start with every push of the round so far.
        per_round = self.settings.round_step == merge_lib.RoundStep.PER_ROUND
        joined = self._join_round(slot, contributions, live_count)
        start_params, start_state = (slot.round_start if joined else
                                     (slot.params, slot.outer_state))
        share = 1.0
        if self.settings.participation_scale and live_count:
            # With K < M a round of M learners arrives as several merges; each full outer step
            # (Nesterov, lr 0.7) would then count M times per round and its momentum diverges in
            # a mixed fleet (measured: eval loss 3.0 -> 1e5). Scaling by the share n/M keeps one
            # round's total step the size of a synchronous one; with K = M it is exactly 1.
            # With syncer.staleness_share d > 0 each push counts (1 + staleness)^-d of a learner.
            share = merge_lib.participation_share(
                [slot.stepped[name] for name in joined] + [c.staleness for c in contributions],
                live_count, self.settings.staleness_share)
        # The round's running sums (fused.GradSum): the merge reads each once, whatever the
        # number of learners in it. per_round keeps its round's start state (not recycled).
        sums = [slot.stepped_sum, slot.open_sum] if joined else [slot.open_sum]
        new_params, new_outer, finite, grad_norm = fused.step_sums(
            self.outer, sums, share, start_params, start_state, self.pool,
            recycle_state=not per_round)
        if not finite:
            # Θ is never replaced by garbage: the round is refused whole and Θ stays as it was.
            return self._refuse_round(slot, fragment, contributions, live_count,
                                      RejectReason.BAD_MERGE,
                                      "the merged fragment was not finite")
        slot.params, slot.outer_state = new_params, new_outer
        if per_round:
            if joined:
                slot.stepped_sum.absorb(slot.open_sum, self.pool)
                slot.open_sum = None
            else:
                slot.stepped_sum, slot.open_sum = slot.open_sum, None
            slot.stepped.update({c.push.learner: c.staleness for c in contributions})
        else:
            self._release_open(slot)
        slot.version += 1
        self.catching_up.discard(fragment)
        slot.history[slot.version] = slot.params
        for old in [v for v in slot.history if v <= slot.version - self.settings.history_versions]:
            del slot.history[old]
        credits = tuple(credit for credit in map(self._credit, (c.push for c in contributions))
                        if credit is not None)
        slot.round = {}
        slot.quorum_reached_at_s = None
        slot.round_opened_at_s = None
        return self._recorded(MergeResult(
            fragment=fragment, version=slot.version, params=slot.params,
            learners=tuple(c.push.learner for c in contributions),
            staleness=tuple(c.staleness for c in contributions), reason=reason,
            outer_grad_norm=grad_norm,
            bases=tuple((c.push.base_shadow, c.push.base_version, c.base)
                        for c in contributions),
            groups=tuple(c.group for c in contributions),
            fleet_step=(self.fleet_step() if self.settings.schedule_clock
                        == merge_lib.ScheduleClock.FLEET else None),
            joined=len(joined), live=live_count, credits=credits))

    def _refuse_unadopted(self, slot: FragmentSlot, fragment: int,
                          contributions: Sequence[Contribution],
                          live_count: Optional[int]) -> MergeResult:
        """The merge of only unadopted contributions (``merge``): refused whole, Θ[p] kept; each
        learner is handed the current Θ[p] to start over from."""
        detail = (f"no contribution is based on the global fragment {fragment} its learner was "
                  f"handed at registration: Θ[{fragment}] (v{slot.version}) is kept and handed "
                  f"to each")
        return self._refuse_round(slot, fragment, contributions, live_count,
                                  RejectReason.UNADOPTED, detail)

    def _refuse_round(self, slot: FragmentSlot, fragment: int,
                      contributions: Sequence[Contribution], live_count: Optional[int],
                      reason: RejectReason, detail: str) -> MergeResult:
        """Refuses a round whole (Θ[p], its version and outer state kept): each push is refused
        with ``reason`` and the round closes; the record hands every learner the current Θ[p]."""
        for c in contributions:
            self._refused(c.push, Rejected(reason, detail))
        self._release_open(slot)   # closed unmerged: its buffers serve the next pushes
        slot.round = {}
        slot.quorum_reached_at_s = None
        slot.round_opened_at_s = None
        return self._recorded(MergeResult(
            fragment=fragment, version=slot.version, params=slot.params,
            learners=tuple(c.push.learner for c in contributions),
            staleness=tuple(c.staleness for c in contributions),
            reason=reason.value, outer_grad_norm=float("nan"), refused=True,
            live=live_count, detail=detail))

    def _recorded(self, result: MergeResult) -> MergeResult:
        """Keeps a merge's participation in the books: every record in ``merge_records``; a
        merge that replaced Θ also in ``participation_counts`` ("n/M") and, per push, in
        ``staleness_counts`` (what islands_merge_participants and islands_staleness export)."""
        self.merge_records.append(result.record())
        if not result.refused:
            self.participation_counts[participation_key(result.participants, result.live)] += 1
            self.staleness_counts.update(result.staleness)
            if result.live:
                self.last_live[result.fragment] = result.live
        return result

    def _join_round(self, slot: FragmentSlot, contributions: Sequence[Contribution],
                    live_count: Optional[int]) -> list[str]:
        """round_step per_round: the learners of the open round already stepped, when this
        merge's join it (none of its learners is in the round, and the round does not hold
        every live learner yet); else [] and a new round starts at the current Θ and outer
        state. With the pull rule the joining gradients, taken against the current Θ, are moved
        to the round's start: ``g + (Θ_start − Θ)`` (the open sum is folded again from the
        pushes' codes)."""
        if self.settings.round_step != merge_lib.RoundStep.PER_ROUND:
            return []
        names = {c.push.learner for c in contributions}
        if (slot.stepped and slot.round_start is not None and slot.stepped_sum is not None
                and not names & set(slot.stepped)
                and (not live_count or len(slot.stepped) < live_count)):
            if self.settings.outer_gradient == merge_lib.OuterGradientRule.PULL:
                self._refold(slot, shift=(slot.round_start[0], slot.params))
            return sorted(slot.stepped)
        self._release_round(slot)
        slot.round_start = (slot.params, slot.outer_state)
        return []

    def _release_round(self, slot: FragmentSlot) -> None:
        """Closes the stepped round of a fragment: its sum's buffers go back to the pool."""
        if slot.stepped_sum is not None:
            slot.stepped_sum.release(self.pool)
        slot.stepped, slot.stepped_sum = {}, None
        slot.round_start = None

    def updates(self, result: MergeResult) -> dict[str, Any]:
        """What each learner of a merge is sent back (``downlink.FullUpdate`` or ``DiffUpdate``);
        records the shadow each encoded update leaves. Call once per merge, right after it.

        Learners of the merge at one base (its id and version: the same content, bit for bit)
        get the same update and share one shadow (one id): the update is a function of the base
        and Θ[p] alone. The members of a pre-merged push always do, so the region fans one reply
        out and their next pushes share a base and pre-merge again. At most
        ``downlink.max_shadows`` shadows of a fragment are kept: the bases of the merge that
        would make more (its least shared ones first) get the full fragment and hold the exact
        Θ[p] (docs/operations.md#syncer-memory)."""
        out = {}
        history = self.slots[result.fragment].history
        groups = result.groups or (None,) * len(result.learners)
        rejoin = regions_to_rejoin(result.learners, result.bases, groups)
        full = self._bases_sent_full(result, rejoin)
        made: dict[tuple, tuple] = {}   # (base id, base version) -> (update, shadow)
        for name, (base_id, base_version, base) in zip(result.learners, result.bases,
                                                      strict=True):
            key = (name, result.fragment)
            shared = (base_id, base_version)
            if name.rsplit(":", 1)[0] in rejoin or shared in full:
                update, shadow = downlink_lib.FullUpdate(result.params, result.version,
                                                         result.fleet_step), None
            elif shared in made:
                update, shadow = made[shared]
            else:
                update, shadow = downlink_lib.make_update(
                    self.downlink, base, base_id, base_version, result.params, result.version,
                    next(self._shadow_ids), history.get(base_version))
                if result.fleet_step is not None:
                    update = dataclasses.replace(update, fleet_step=result.fleet_step)
                made[shared] = (update, shadow)
            if shadow is None:
                self.shadows.pop(key, None)
            else:
                self.shadows[key] = shadow
            out[name] = update
        return out

    def _bases_sent_full(self, result: MergeResult, rejoin: frozenset) -> set:
        """The bases (id, version) of a merge whose learners get the full fragment so that the
        fragment keeps at most ``downlink.max_shadows`` shadows: the shadows held by learners
        outside the merge stay, and the merge's bases make one new shadow each, the most shared
        first (ties: the lower id)."""
        cap = self.downlink.max_shadows
        if cap is None or self.downlink.codec is None:
            return set()
        inside = set(result.learners)
        kept = {shadow.shadow_id for (name, p), shadow in self.shadows.items()
                if p == result.fragment and name not in inside}
        sharing = collections.Counter(
            (base_id, version) for name, (base_id, version, _) in zip(result.learners,
                                                                       result.bases)
            if name.rsplit(":", 1)[0] not in rejoin)
        ranked = sorted(sharing, key=lambda k: (-sharing[k], k))
        return set(ranked[max(cap - len(kept), 0):])

    def _credit(self, push: Push) -> Optional[Credit]:
        entry = self.ledger.setdefault(push.learner, LedgerEntry(incarnation=push.incarnation))
        if push.incarnation != entry.incarnation:
            return None  # an older incarnation's push cannot be in a round: forget() removed it
        p, key = push.fragment, (push.learner, push.fragment)
        base = self.watermark_bases.get(push.learner)
        if base is None or base[0] != push.incarnation:   # its first merge in this process
            self.watermark_bases[push.learner] = (push.incarnation, (
                entry.applied_tokens_done, entry.applied_compute_s, entry.applied_step))
        credit = Credit(push, entry.merged_steps.get(p), entry.merged_tokens.get(p),
                        self.merge_marks.get(key))
        entry.merged_steps[p] = push.step
        entry.merged_tokens[p] = entry.merged_tokens.get(p, 0) + push.c_tokens
        entry.merged_tokens_total += push.c_tokens
        self.merge_marks[key] = (push.incarnation, push.tokens_done, push.compute_s, push.step)
        if push.tokens_done > entry.applied_tokens_done:
            entry.applied_tokens_done = push.tokens_done
            entry.applied_compute_s = push.compute_s
            entry.applied_step = push.step
        return credit

    def revoke(self, result: MergeResult, detail: str) -> None:
        """A merge that could not be made durable (its journal entry was not written): its
        pushes are refused ``not_durable`` (their learners drop their tokens with that reason
        and start over from the current Θ[p]), so the ledger takes back what the merge credited
        them: the fragment-tokens merged, the fragment's last merged step and the applied
        watermark, rebuilt from what still stands: the incarnation's watermark before its first
        merge in this process (``watermark_bases``) and the newest merge of each fragment not
        revoked (``merge_marks``). Not from what the entry held when this merge credited it:
        that may hold another fragment's merge that is itself revoked later (a full disk fails
        every pending journal write), which would come back with it. Every token then has one
        fate on both sides. Θ[p] keeps the merge (undoing it would need the round's sums, gone
        with it); a later durable merge of the fragment writes it down."""
        for credit in result.credits:
            push = credit.push
            self._refused(push, Rejected(RejectReason.NOT_DURABLE, detail))
            entry = self.ledger.get(push.learner)
            if entry is None or entry.incarnation != push.incarnation:
                continue   # a new incarnation's books start afresh: nothing of this one is there
            p, key = push.fragment, (push.learner, push.fragment)
            entry.merged_tokens_total -= push.c_tokens
            for books, before in ((entry.merged_steps, credit.step_before),
                                  (entry.merged_tokens, credit.tokens_before)):
                if before is None:
                    books.pop(p, None)
                else:
                    books[p] = before
            if credit.mark_before is None:
                self.merge_marks.pop(key, None)
            else:
                self.merge_marks[key] = credit.mark_before
            base = self.watermark_bases.get(push.learner)
            if base is None or base[0] != push.incarnation:   # (a restore made it all durable)
                base = (push.incarnation, (entry.applied_tokens_done, entry.applied_compute_s,
                                           entry.applied_step))
            marks = [base[1]] + [
                mark[1:] for (name, _), mark in self.merge_marks.items()
                if name == push.learner and mark[0] == push.incarnation]
            (entry.applied_tokens_done, entry.applied_compute_s,
             entry.applied_step) = max(marks, key=lambda m: m[0])

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
