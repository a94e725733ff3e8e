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

    def add(self, other: "Fates") -> "Fates":
        by = dict(self.dropped_by)
        for reason, n in other.dropped_by.items():
            by[reason] = by.get(reason, 0) + n
        return Fates(self.processed + other.processed, self.applied + other.applied,
                     self.dropped + other.dropped, self.in_flight + other.in_flight, by,
                     self.applied_s + other.applied_s, self.processed_s + other.processed_s)

    @classmethod
    def of(cls, fates: Optional[Mapping]) -> "Fates":
        """From an incarnation's ``IncarnationFates.to_json()`` (None: nothing yet)."""
        if not fates:
            return cls()
        t = IncarnationFates.from_json(fates).totals()
        return cls(t["processed"], t["applied"], t["dropped"], t["in_flight"], t["dropped_by"],
                   t["applied_s"], t["processed_s"])

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

    def release(self, learner: str, now_s: float) -> None:
        slot = self._slot(learner)
        if slot.allocated_since_s is not None:
            slot.allocated_closed_s += now_s - slot.allocated_since_s
            slot.allocated_since_s = None

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
                   "allocated_since_s": b.allocated_since_s} for name, b in self.slots.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Books":
        books = cls(int(data["num_fragments"]))
        for name, b in data["slots"].items():
            books.slots[name] = _SlotBooks(Fates(**b["closed"]), b["allocated_closed_s"],
                                           b["allocated_since_s"])
        return books


def goodput(useful_s: float, allocated_s: float) -> float:
    """Σ applied inner-step seconds ÷ Σ allocated seconds, at most 1 (0 before any allocation)."""
    return min(1.0, useful_s / allocated_s) if allocated_s > 0 else 0.0
