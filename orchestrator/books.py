"""The job's books, one implementation for both bodies: tokens by fate and goodput.

Tokens: every inner step's tokens are *processed*; a learner's tokens are *applied* once a merge
included a push that carried them (the syncer's ledger), *dropped* when the incarnation that
processed them ended before they were applied, and *in flight* while their incarnation lives and
they are not applied yet. Goodput: Σ applied inner-step seconds ÷ Σ allocated learner-slot seconds,
where a slot is allocated from its first launch until it is retired (down time included).

Pure (no Ray, no clock): the Ray controller and the in-process driver feed the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass
class Fates:
    processed: int = 0
    applied: int = 0
    dropped: int = 0
    in_flight: int = 0

    def add(self, other: "Fates") -> "Fates":
        return Fates(self.processed + other.processed, self.applied + other.applied,
                     self.dropped + other.dropped, self.in_flight + other.in_flight)

    def as_dict(self) -> dict:
        return {"processed": self.processed, "applied": self.applied, "dropped": self.dropped,
                "in_flight": self.in_flight}


@dataclass
class _SlotBooks:
    closed: Fates = field(default_factory=Fates)   # finished incarnations
    allocated_closed_s: float = 0.0
    allocated_since_s: Optional[float] = None


class Books:
    """Tokens by fate and allocated seconds, per learner slot.

    >>> b = Books()
    >>> b.allocate("a:0", 0.0)
    >>> b.close_incarnation("a:0", processed=100, applied=60)   # it died: 40 dropped
    40
    >>> b.tokens({"a:0": (30, 10)}).as_dict()   # the next incarnation: 30 processed, 10 applied
    {'processed': 130, 'applied': 70, 'dropped': 40, 'in_flight': 20}
    >>> b.release("a:0", 10.0); b.allocated_s(99.0)
    10.0
    >>> goodput(useful_s=7.5, allocated_s=10.0)
    0.75
    """

    def __init__(self):
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
    def close_incarnation(self, learner: str, processed: int, applied: int) -> int:
        """An incarnation ended: its applied tokens stay applied, the rest are dropped.

        Returns the dropped tokens.
        """
        applied = min(applied, processed) if processed else applied
        dropped = max(processed - applied, 0)
        slot = self._slot(learner)
        slot.closed = slot.closed.add(Fates(max(processed, applied), applied, dropped, 0))
        return dropped

    def tokens(self, live: Mapping[str, tuple[int, int]]) -> Fates:
        """Totals; ``live`` maps each learner with a running incarnation to its
        ``(processed, applied)`` tokens so far."""
        total = Fates()
        for slot in self.slots.values():
            total = total.add(slot.closed)
        for processed, applied in live.values():
            processed = max(processed, applied)
            total = total.add(Fates(processed, applied, 0, processed - applied))
        return total

    def learner_tokens(self, learner: str, live: Optional[tuple[int, int]] = None) -> Fates:
        """One learner's tokens: its finished incarnations plus, if given, the running one."""
        return _one(self._slot(learner).closed, live)


    def to_json(self) -> dict:
        return {name: {"closed": b.closed.as_dict(), "allocated_closed_s": b.allocated_closed_s,
                       "allocated_since_s": b.allocated_since_s}
                for name, b in self.slots.items()}

    @classmethod
    def from_json(cls, data: dict) -> "Books":
        books = cls()
        for name, b in data.items():
            books.slots[name] = _SlotBooks(Fates(**b["closed"]), b["allocated_closed_s"],
                                           b["allocated_since_s"])
        return books


def _one(closed: Fates, live: Optional[tuple[int, int]]) -> Fates:
    if live is None:
        return Fates(closed.processed, closed.applied, closed.dropped, 0)
    processed, applied = max(live[0], live[1]), live[1]
    return closed.add(Fates(processed, applied, 0, processed - applied))


def goodput(useful_s: float, allocated_s: float) -> float:
    """Σ applied inner-step seconds ÷ Σ allocated seconds, at most 1 (0 before any allocation)."""
    return min(1.0, useful_s / allocated_s) if allocated_s > 0 else 0.0
