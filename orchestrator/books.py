"""The job's books, one implementation for both bodies: tokens by fate and goodput.

Tokens: every inner step's tokens are *processed*, once per fragment (``learners/fates.py``); each
fragment's share is *applied* once a merge included the push that carried it, *dropped* with a
reason (overwritten at adoption, refused, or held by an incarnation that ended), or *in flight* (in
a drift or an unanswered push that still exists). Each term is counted where it happens, so their
balance is a check. Goodput: Σ applied inner-step seconds ÷ Σ allocated learner-slot seconds, where
a slot is allocated from its first launch until it is retired (down time included).

Pure (no Ray, no clock): the Ray controller and the in-process driver feed the same calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

from islands.learners.fates import IncarnationFates


@dataclass
class Fates:
    """Totals in fragment-tokens (a step's tokens counted once per fragment), with the
    fragment count that turns them into tokens (``as_dict``)."""

    processed: int = 0
    applied: int = 0
    dropped: int = 0
    in_flight: int = 0
    dropped_by: dict = field(default_factory=dict)
    applied_s: float = 0.0      # inner-step seconds of the applied fragment-tokens
    processed_s: float = 0.0
    dropped_s_by: dict = field(default_factory=dict)   # inner-step seconds dropped, by reason

    def add(self, other: "Fates") -> "Fates":
        by, by_s = dict(self.dropped_by), dict(self.dropped_s_by)
        for reason, n in other.dropped_by.items():
            by[reason] = by.get(reason, 0) + n
        for reason, x in other.dropped_s_by.items():
            by_s[reason] = by_s.get(reason, 0.0) + x
        return Fates(self.processed + other.processed, self.applied + other.applied,
                     self.dropped + other.dropped, self.in_flight + other.in_flight, by,
                     self.applied_s + other.applied_s, self.processed_s + other.processed_s,
                     by_s)

    @classmethod
    def of(cls, fates: Optional[Mapping]) -> "Fates":
        """From an incarnation's ``IncarnationFates.to_json()`` (None: nothing yet)."""
        if not fates:
            return cls()
        t = IncarnationFates.from_json(fates).totals()
        return cls(t["processed"], t["applied"], t["dropped"], t["in_flight"], t["dropped_by"],
                   t["applied_s"], t["processed_s"], t.get("dropped_s_by", {}))

    def balanced(self) -> bool:
        """Each term is counted on its own; this checks that they account for every token."""
        return (self.processed == self.applied + self.dropped + self.in_flight
                and self.dropped == sum(self.dropped_by.values()))

    def as_dict(self, num_fragments: int = 1) -> dict:
        """Tokens (fragment-tokens ÷ P) by fate, the exact fragment-token counts beside them."""
        per = float(num_fragments)
        return {"processed": self.processed / per, "applied": self.applied / per,
                "dropped": self.dropped / per, "in_flight": self.in_flight / per,
                "dropped_by": {r: n / per for r, n in sorted(self.dropped_by.items())},
                "fragment_tokens": {"processed": self.processed, "applied": self.applied,
                                    "dropped": self.dropped, "in_flight": self.in_flight},
                "balanced": self.balanced()}

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _SlotBooks:
    closed: Fates = field(default_factory=Fates)   # finished incarnations
    allocated_closed_s: float = 0.0
    allocated_since_s: Optional[float] = None
    # Allocated seconds by phase (PHASES): opened and closed with the allocation, switched at one
    # instant, so their sum is the allocated time exactly.
    phase_s: dict = field(default_factory=dict)
    phase: Optional[str] = None
    trained: bool = False        # has trained once: a later start is a restore, not a startup
    phase_since_s: Optional[float] = None


# A slot's phase while allocated, from its fleet state (``fleet.SlotState`` values).
PHASES = ("startup", "training", "paused", "recovery", "restore")


def phase_of(state: str, trained: bool) -> Optional[str]:
    """The allocated-time phase of a slot in ``state``; None where it holds nothing.

    >>> phase_of("starting", False), phase_of("starting", True), phase_of("restarting", True)
    ('startup', 'restore', 'recovery')
    """
    if state in ("pending", "starting"):
        return "restore" if trained else "startup"
    if state in ("training", "draining"):
        return "training"
    if state == "paused":
        return "paused"
    if state == "awaiting_placement":   # a handover with nowhere to run yet (fleet.py)
        return "placement"
    if state in ("restarting", "unreachable"):  # unreachable: a remote one, down as far as home knows
        return "recovery"
    return None


# Badput causes: ml-goodput-measurement's BadputType where one fits, then ours.
BADPUT_CAUSES = ("program_startup", "infrastructure_recovery", "disruption_wasted_progress",
                 "checkpoint_restore", "checkpoint_save", "data_loading", "refused", "overlap",
                 "paused", "awaiting_placement", "other")
# Drop reasons that are not a disruption: work an operator or the job's end let go of.
_NOT_DISRUPTION = ("drained", "stopped", "scaled")


def badput(phase_s: Mapping[str, float], fates: Fates, num_fragments: int = 1) -> dict:
    """Where every allocated learner-second went: goodput, one badput cause, or unsettled.

    ``goodput_s + Σ badput_s.values() + unsettled_s == Σ phase_s.values()`` (the allocated time)
    by construction; ``unsettled_s`` is inner-step time still in flight (a drift or an unanswered
    push), which becomes goodput or a drop later, and is 0 once every incarnation is closed.

    - program_startup / checkpoint_restore / infrastructure_recovery / paused: the allocated
      seconds of a first start, a restart's restore (parameters from the syncer, inner state from
      a peer, compilation), the wait between a failure and its relaunch, and a pause;
    - awaiting_placement: a learner handed over off a draining node, waiting for Ray to place
      its new process (no capacity elsewhere yet);
    - disruption_wasted_progress: inner-step seconds an incarnation held when it failed (its
      dropped seconds for a failure cause), measured by the token ledger;
    - refused / overlap: inner-step seconds dropped by a refused push / overwritten at adoption;
    - checkpoint_save, data_loading: 0 here — learners never stop for a checkpoint (the syncer
      snapshots Θ beside them) and read their batches inside the step;
    - other: the training phase's time outside inner steps (pushes, heartbeats, the time before a
      death is detected) and work dropped by a drain or the job's end.

    >>> f = Fates(applied_s=12.0, processed_s=20.0, dropped_s_by={"crash": 4.0, "overlap": 2.0})
    >>> b = badput({"startup": 3.0, "training": 14.0, "recovery": 1.0}, f, num_fragments=2)
    >>> b["goodput_s"], b["badput_s"]["disruption_wasted_progress"], b["unsettled_s"]
    (6.0, 2.0, 1.0)
    >>> b["badput_s"]["other"], b["goodput_s"] + sum(b["badput_s"].values()) + b["unsettled_s"]
    (4.0, 18.0)
    """
    per = float(num_fragments)
    allocated = float(sum(phase_s.values()))
    useful = fates.applied_s / per
    out = {c: 0.0 for c in BADPUT_CAUSES}
    out["program_startup"] = phase_s.get("startup", 0.0)
    out["checkpoint_restore"] = phase_s.get("restore", 0.0)
    out["infrastructure_recovery"] = phase_s.get("recovery", 0.0)
    out["paused"] = phase_s.get("paused", 0.0)
    out["awaiting_placement"] = phase_s.get("placement", 0.0)
    dropped = 0.0
    for reason, seconds in fates.dropped_s_by.items():
        x = seconds / per
        dropped += x
        if reason in ("refused", "overlap"):
            out[reason] += x
        elif reason.split(" ")[0] in _NOT_DISRUPTION:
            out["other"] += x
        else:
            out["disruption_wasted_progress"] += x
    unsettled = max(0.0, fates.processed_s / per - useful - dropped)
    # The rest of the allocated time: the training phase outside inner steps.
    rest = allocated - useful - unsettled - sum(out.values())
    out["other"] += max(0.0, rest)
    return {"goodput_s": useful, "badput_s": out, "unsettled_s": unsettled,
            "allocated_s": allocated}


class Books:
    """Tokens by fate and allocated seconds, per learner slot.

    A live incarnation's fates are its learner's own books (heartbeats carry them); when it
    ends, ``close_incarnation`` settles what it still held. Every figure is in fragment-tokens;
    ``num_fragments`` turns them into tokens.

    >>> from islands.learners.fates import IncarnationFates
    >>> b = Books(num_fragments=2)
    >>> b.allocate("a:0", 0.0)
    >>> f = IncarnationFates(2); f.step(10, 1.0); f.pushed(0, step=1); f.step(10, 1.0)
    >>> b.close_incarnation("a:0", f.to_json(), merged_steps={0: 1}, reason="crash")  # 0 merged
    30
    >>> t = b.tokens({}); (t.applied, t.dropped, t.dropped_by, t.balanced())
    (10, 30, {'crash': 30}, True)
    >>> b.release("a:0", 10.0); b.allocated_s(99.0)
    10.0
    >>> goodput(useful_s=7.5, allocated_s=10.0)
    0.75
    """

    def __init__(self, num_fragments: int = 1):
        self.num_fragments = num_fragments
        self.slots: dict[str, _SlotBooks] = {}

    def _slot(self, learner: str) -> _SlotBooks:
        return self.slots.setdefault(learner, _SlotBooks())

    # -- allocation -------------------------------------------------------------------------------
    def allocate(self, learner: str, now_s: float) -> None:
        """The slot holds resources from now (a no-op while it already does)."""
        slot = self._slot(learner)
        if slot.allocated_since_s is None:
            slot.allocated_since_s = now_s
            slot.phase = "restore" if slot.trained else "startup"
            slot.phase_since_s = now_s

    def release(self, learner: str, now_s: float) -> None:
        slot = self._slot(learner)
        if slot.allocated_since_s is not None:
            slot.allocated_closed_s += now_s - slot.allocated_since_s
            slot.allocated_since_s = None
            self._close_phase(slot, now_s)
            slot.phase = None

    def _close_phase(self, slot: _SlotBooks, now_s: float) -> None:
        if slot.phase is not None:
            since = slot.phase_since_s if slot.phase_since_s is not None else now_s
            slot.phase_s[slot.phase] = slot.phase_s.get(slot.phase, 0.0) + (now_s - since)
            slot.phase_since_s = now_s

    def track(self, states: Mapping[str, str], now_s: float) -> None:
        """Moves each allocated slot into the phase of its fleet state (``phase_of``)."""
        for learner, state in states.items():
            slot = self.slots.get(learner)
            if slot is None or slot.allocated_since_s is None:
                continue
            phase = phase_of(state, slot.trained)
            slot.trained = slot.trained or phase == "training"
            if phase is not None and phase != slot.phase:
                self._close_phase(slot, now_s)
                slot.phase = phase

    def phase_s(self, now_s: float) -> dict:
        """Allocated seconds by phase, the open phases counted up to ``now_s``."""
        out: dict = {}
        for slot in self.slots.values():
            for phase, x in slot.phase_s.items():
                out[phase] = out.get(phase, 0.0) + x
            if slot.phase is not None and slot.allocated_since_s is not None:
                since = slot.phase_since_s
                out[slot.phase] = out.get(slot.phase, 0.0) + (now_s - since)
        return out

    def badput(self, live: Mapping[str, Optional[Mapping]], now_s: float) -> dict:
        """``badput()`` of the whole job now."""
        return badput(self.phase_s(now_s), self.tokens(live), self.num_fragments)

    def allocated_s(self, now_s: float, learner: Optional[str] = None) -> float:
        slots = [self._slot(learner)] if learner is not None else self.slots.values()
        return sum(s.allocated_closed_s + (now_s - s.allocated_since_s
                                           if s.allocated_since_s is not None else 0.0)
                   for s in slots)

    # -- tokens -----------------------------------------------------------------------------------
    def close_incarnation(self, learner: str, fates: Optional[Mapping],
                          merged_steps: Mapping[int, int], reason: str) -> int:
        """An incarnation ended. ``fates``: the newest copy of its books (its last heartbeat or
        the one its newest push carried); ``merged_steps``: the syncer's fragment -> step of its
        last merged push. Its open pushes the syncer merged are applied, everything else it held
        is dropped for ``reason``. Returns the fragment-tokens dropped now."""
        if not fates:
            return 0
        final = IncarnationFates.from_json(fates)
        held = final.totals()["in_flight"]
        final.settle(reason, merged_steps)
        settled = Fates.of(final.to_json())
        slot = self._slot(learner)
        slot.closed = slot.closed.add(settled)
        return held - (settled.applied - Fates.of(fates).applied)

    def tokens(self, live: Mapping[str, Optional[Mapping]]) -> Fates:
        """Totals; ``live`` maps each learner with a running incarnation to its books."""
        total = Fates()
        for slot in self.slots.values():
            total = total.add(slot.closed)
        for fates in live.values():
            total = total.add(Fates.of(fates))
        return total

    def learner_tokens(self, learner: str, live: Optional[Mapping] = None) -> Fates:
        """One learner's tokens: its finished incarnations plus, if given, the running one."""
        return self._slot(learner).closed.add(Fates.of(live))

    def useful_s(self, live: Mapping[str, Optional[Mapping]]) -> float:
        """Σ applied inner-step seconds, in step-seconds (fragment-seconds ÷ P)."""
        return self.tokens(live).applied_s / self.num_fragments

    def to_json(self) -> dict:
        return {"num_fragments": self.num_fragments, "slots": {
            name: {"closed": b.closed.to_json(), "allocated_closed_s": b.allocated_closed_s,
                   "allocated_since_s": b.allocated_since_s, "phase_s": dict(b.phase_s),
                   "phase": b.phase, "phase_since_s": b.phase_since_s,
                   "trained": b.trained} for name, b in self.slots.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Books":
        books = cls(int(data["num_fragments"]))
        for name, b in data["slots"].items():
            slot = _SlotBooks(Fates(**b["closed"]), b["allocated_closed_s"],
                              b["allocated_since_s"], dict(b.get("phase_s") or {}),
                              b.get("phase"), bool(b.get("trained", False)),
                              b.get("phase_since_s"))
            if slot.phase is None and slot.allocated_since_s is not None:  # an older state file
                slot.phase, slot.phase_since_s = "training", slot.allocated_since_s
            books.slots[name] = slot
        return books


def goodput(useful_s: float, allocated_s: float) -> float:
    """Σ applied inner-step seconds ÷ Σ allocated seconds, at most 1 (0 before any allocation)."""
    return min(1.0, useful_s / allocated_s) if allocated_s > 0 else 0.0
