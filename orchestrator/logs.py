"""The controller's bounded records: what a job keeps in memory must not grow with its failures.

A long job fails thousands of times. Everything it must keep forever is a count (a histogram,
a total); what it keeps as rows is the newest N. The files (``events.jsonl``, ``summary.json``)
hold the full story; these are the controller's working copies.
"""

from __future__ import annotations

import collections
from typing import Iterable, Mapping, Optional

EVENTS_KEPT = 5_000        # at least; 20 per learner slot (``events_kept``)
EVENTS_PER_SLOT = 20       # a start, a stop or a restart of the whole fleet emits a few each
RECOVERIES_KEPT = 1_000    # rows for summary.json's table; the histogram counts every one
RECOVERIES_IN_SNAPSHOT = 20   # rows in each periodic snapshot (metrics.jsonl): the newest
RECOVERY_PHASES = ("detect", "restart", "restore", "first_contribution", "total")
RECOVERY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def events_kept(slots: int) -> int:
    """How many events the controller keeps: enough that the job driver, polling every quarter
    second, misses none even when the whole fleet starts or stops at once.

    >>> events_kept(4), events_kept(1000)
    (5000, 20000)
    """
    return max(EVENTS_KEPT, EVENTS_PER_SLOT * slots)


class EventLog:
    """The newest ``keep`` events, each with an absolute index that never goes back.

    Indexes start at ``first_index``: the controller passes its process's start time in
    microseconds, so an index handed out by an earlier incarnation (restarted by Ray, its log
    gone with it) is always below this one's first, and its reader gets everything kept here
    rather than skipping the first events of the new one. ``since(index)`` returns the events
    after ``index`` and the next index to ask for; a reader that fell more than ``keep`` behind
    gets what is kept (the file its job writes has the rest); an index past the end (from no
    incarnation of this log) starts from the oldest kept too.

    >>> log = EventLog(keep=2, first_index=100)
    >>> for n in range(3): log.append({"n": n})
    >>> log.since(0), log.since(102), log.since(999)
    (([{'n': 1}, {'n': 2}], 103), ([{'n': 2}], 103), ([{'n': 1}, {'n': 2}], 103))
    """

    def __init__(self, keep: int = EVENTS_KEPT, first_index: int = 0):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.rows: collections.deque = collections.deque(maxlen=keep)
        self.total = int(first_index)   # the index of the next event

    def append(self, event: dict) -> None:
        self.rows.append(event)
        self.total += 1

    def since(self, index: int) -> tuple[list[dict], int]:
        rows = list(self.rows)   # one copy (atomic): appends may come from other threads
        first = self.total - len(rows)   # the absolute index of rows[0]
        if index > self.total:
            index = first
        return rows[max(0, index - first):], self.total

    def newest(self, n: int) -> list[dict]:
        rows = list(self.rows)
        return rows[max(0, len(rows) - n):]

    def __len__(self) -> int:
        return len(self.rows)


def _bucket_counts(values: Iterable[float], bounds=RECOVERY_BUCKETS_S) -> list[int]:
    """Per bound (and +Inf last), how many values are ≤ it: cumulative, as Prometheus reads."""
    values = list(values)
    return [sum(1 for v in values if v <= b) for b in bounds] + [len(values)]


class RecoveryLog:
    """Every recovery counted in a running histogram per phase; the newest ``keep`` as rows.

    >>> log = RecoveryLog(keep=1)
    >>> for total in (0.2, 7.0): log.append({"cause": "crash", "total_s": total})
    >>> log.newest(5), log.histogram()["total"]["count"], log.histogram()["total"]["sum"]
    ([{'cause': 'crash', 'total_s': 7.0}], 2, 7.2)
    >>> log.histogram()["total"]["buckets"][:4], log.histogram()["total"]["buckets"][-1]
    ([0, 1, 1, 1], 2)
    """

    def __init__(self, keep: int = RECOVERIES_KEPT):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.rows: collections.deque = collections.deque(maxlen=keep)
        self.counts = {p: [0] * (len(RECOVERY_BUCKETS_S) + 1) for p in RECOVERY_PHASES}
        self.sums = {p: 0.0 for p in RECOVERY_PHASES}
        self.total = 0

    def append(self, row: Mapping) -> None:
        self.rows.append(dict(row))
        self.total += 1
        for phase in RECOVERY_PHASES:
            value = row.get(f"{phase}_s")
            if value is None:
                continue
            for i, n in enumerate(_bucket_counts([float(value)])):
                self.counts[phase][i] += n
            self.sums[phase] += float(value)

    def newest(self, n: int) -> list[dict]:
        rows = list(self.rows)   # one copy (atomic): the owner thread appends meanwhile
        return [dict(r) for r in rows[max(0, len(rows) - n):]]

    def histogram(self) -> dict:
        """``{phase: {"bounds", "buckets" (cumulative, +Inf last), "sum", "count"}}``."""
        return {p: {"bounds": list(RECOVERY_BUCKETS_S), "buckets": list(self.counts[p]),
                    "sum": self.sums[p], "count": self.counts[p][-1]} for p in RECOVERY_PHASES}

    def to_json(self) -> dict:
        return {"rows": [dict(r) for r in list(self.rows)],
                "counts": {p: list(c) for p, c in self.counts.items()}, "sums": dict(self.sums),
                "total": self.total}

    @classmethod
    def from_json(cls, saved, keep: int = RECOVERIES_KEPT) -> "RecoveryLog":
        """From ``to_json``, or from an older save's plain list of rows (counted again)."""
        log = cls(keep)
        if isinstance(saved, list):
            for row in saved:
                log.append(row)
            return log
        rows = saved.get("rows") or []
        log.rows.extend(rows)
        log.total = int(saved.get("total") or 0)
        for phase in RECOVERY_PHASES:
            counts = (saved.get("counts") or {}).get(phase)
            if counts is not None and len(counts) == len(RECOVERY_BUCKETS_S) + 1:
                log.counts[phase] = [int(n) for n in counts]
                log.sums[phase] = float((saved.get("sums") or {}).get(phase, 0.0))
            else:   # a save with other buckets (or none): counted again from the rows kept
                values = [float(r[f"{phase}_s"]) for r in rows if r.get(f"{phase}_s") is not None]
                log.counts[phase] = _bucket_counts(values)
                log.sums[phase] = sum(values)
        return log


def trim_before(history: collections.deque, oldest_s: float) -> None:
    """Drops the samples ``(t, …)`` of a time-ordered deque older than ``oldest_s``."""
    while history and history[0][0] < oldest_s:
        history.popleft()


def keep_span_s(window_s: Optional[float], console_span_s: float = 600.0) -> float:
    """How far back the goodput samples are read: the console's span plus one window before it
    (``console.goodput_series``), and the sliding window itself."""
    window = float(window_s or 0.0)
    return max(console_span_s, window) + window
