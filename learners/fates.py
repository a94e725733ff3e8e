"""Where every inner step's tokens went, per fragment, for one learner incarnation.

An inner step updates every fragment of the parameters, so its tokens are counted once per
fragment (a *fragment-token*); each fragment's share then has exactly one fate:

- **in flight**: in the fragment's drift (not pushed yet) or carried by its unanswered push;
- **applied**: a merge included the push that carried it;
- **dropped**, with a reason: ``overlap`` (the steps between a push and the adoption of its merge
  are overwritten by the adopted fragment, α = 0), ``refused`` (a push the syncer would not take,
  the learner started over from the global fragment), or how the incarnation ended (``killed``,
  ``drained``, ``stopped``, ...) for what it still held.

Each transition moves an amount from one bucket to another and ``processed`` is counted on its
own at every step, so ``processed == applied + dropped + in flight`` is a check of the
bookkeeping, not a definition. Seconds of inner-step compute travel with the tokens, so goodput's
useful time is the applied seconds. Totals over P fragments are divided by P to read as tokens.

Pure and JSON-serialisable: heartbeats and pushes carry ``to_json()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

# Why a fragment-token was dropped.
OVERLAP = "overlap"
REFUSED = "refused"


@dataclass
class Amount:
    tokens: int = 0
    seconds: float = 0.0

    def take(self) -> "Amount":
        """Empties this bucket, returning what it held."""
        out = Amount(self.tokens, self.seconds)
        self.tokens, self.seconds = 0, 0.0
        return out

    def add(self, other: "Amount") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds


@dataclass
class FragmentFates:
    processed: Amount = field(default_factory=Amount)
    applied: Amount = field(default_factory=Amount)
    drift: Amount = field(default_factory=Amount)    # in flight: in the drift, not pushed
    pushed: Amount = field(default_factory=Amount)   # in flight: carried by the open push
    pushed_step: Optional[int] = None                # the learner step of the open push
    dropped: dict[str, Amount] = field(default_factory=dict)

    def drop(self, reason: str, amount: Amount) -> None:
        if amount.tokens or amount.seconds:
            self.dropped.setdefault(reason, Amount()).add(amount)


class IncarnationFates:
    """The fates of one incarnation's fragment-tokens.

    >>> f = IncarnationFates(2)
    >>> f.step(10, 1.0); f.pushed(0, step=1); f.step(10, 1.0)
    >>> f.merged(0); f.overwritten(0)          # fragment 0: 10 applied, 10 overwritten
    >>> f.totals()["applied"], f.totals()["dropped"], f.totals()["in_flight"]
    (10, 10, 20)
    >>> f.balanced()
    True
    """

    def __init__(self, num_fragments: int):
        self.fragments = [FragmentFates() for _ in range(num_fragments)]
        self.events = 0   # grows with every change: the newest of two copies has more

    # -- transitions --------------------------------------------------------------------------
    def step(self, tokens: int, seconds: float) -> None:
        """An inner step: its tokens and seconds enter every fragment's drift."""
        for f in self.fragments:
            f.processed.add(Amount(tokens, seconds))
            f.drift.add(Amount(tokens, seconds))
        self.events += 1

    def add_seconds(self, seconds: float) -> None:
        """Step time counted after the step (its pushes' hand-over): drift seconds, no tokens."""
        for f in self.fragments:
            f.processed.seconds += seconds
            f.drift.seconds += seconds
        self.events += 1

    def pushed(self, p: int, step: int) -> None:
        """Fragment p's drift left in a push (with whatever an earlier push of it returned)."""
        f = self.fragments[p]
        f.pushed.add(f.drift.take())
        f.pushed_step = step
        self.events += 1

    def merged(self, p: int) -> None:
        """A merge included fragment p's open push."""
        f = self.fragments[p]
        f.applied.add(f.pushed.take())
        f.pushed_step = None
        self.events += 1

    def overwritten(self, p: int) -> None:
        """The merged fragment was adopted: the drift since the push is overwritten."""
        f = self.fragments[p]
        f.drop(OVERLAP, f.drift.take())
        self.events += 1

    def returned(self, p: int) -> None:
        """The open push was not judged, or was re-based: its work is drift again."""
        f = self.fragments[p]
        f.drift.add(f.pushed.take())
        f.pushed_step = None
        self.events += 1

    def discarded(self, p: int, reason: str) -> None:
        """Fragment p starts over from the global fragment: push and drift are dropped."""
        f = self.fragments[p]
        f.drop(reason, f.pushed.take())
        f.drop(reason, f.drift.take())
        f.pushed_step = None
        self.events += 1

    def settle(self, reason: str, merged_steps: Mapping[int, int]) -> None:
        """The incarnation ended. An open push the syncer merged (``merged_steps``: fragment ->
        learner step of its last merged push, from the syncer) is applied; everything else it
        still held is dropped for ``reason``."""
        for p, f in enumerate(self.fragments):
            if f.pushed_step is not None and merged_steps.get(p) == f.pushed_step:
                self.merged(p)
            self.discarded(p, reason)

    # -- views --------------------------------------------------------------------------------
    def totals(self) -> dict:
        """Fragment-token totals: processed, applied, dropped, in_flight, dropped_by, seconds."""
        by: dict[str, int] = {}
        by_s: dict[str, float] = {}
        for f in self.fragments:
            for reason, amount in f.dropped.items():
                by[reason] = by.get(reason, 0) + amount.tokens
                by_s[reason] = by_s.get(reason, 0.0) + amount.seconds
        return {
            "processed": sum(f.processed.tokens for f in self.fragments),
            "applied": sum(f.applied.tokens for f in self.fragments),
            "dropped": sum(by.values()),
            "in_flight": sum(f.drift.tokens + f.pushed.tokens for f in self.fragments),
            "dropped_by": by,
            "dropped_s_by": by_s,
            "processed_s": sum(f.processed.seconds for f in self.fragments),
            "applied_s": sum(f.applied.seconds for f in self.fragments),
        }

    def balanced(self) -> bool:
        t = self.totals()
        return t["processed"] == t["applied"] + t["dropped"] + t["in_flight"]

    def to_json(self) -> dict:
        return {"events": self.events, "fragments": [
            {"processed": [f.processed.tokens, f.processed.seconds],
             "applied": [f.applied.tokens, f.applied.seconds],
             "drift": [f.drift.tokens, f.drift.seconds],
             "pushed": [f.pushed.tokens, f.pushed.seconds], "pushed_step": f.pushed_step,
             "dropped": {r: [a.tokens, a.seconds] for r, a in f.dropped.items()}}
            for f in self.fragments]}

    @classmethod
    def from_json(cls, data: Mapping) -> "IncarnationFates":
        out = cls(len(data["fragments"]))
        out.events = int(data["events"])
        for f, d in zip(out.fragments, data["fragments"]):
            f.processed, f.applied = Amount(*d["processed"]), Amount(*d["applied"])
            f.drift, f.pushed = Amount(*d["drift"]), Amount(*d["pushed"])
            f.pushed_step = d["pushed_step"]
            f.dropped = {r: Amount(*a) for r, a in d["dropped"].items()}
        return out


def newest(*copies: Optional[Mapping]) -> Optional[Mapping]:
    """The newest of several ``to_json()`` copies of one incarnation's fates (None if none)."""
    present = [c for c in copies if c]
    return max(present, key=lambda c: c["events"]) if present else None
