"""The controller's bounded records: what a job keeps in memory must not grow with its failures.

A long job fails thousands of times. Everything it must keep forever is a count (a histogram,
a total); what it keeps as rows is the newest N. The files (``events.jsonl``, ``summary.json``)
hold the full story; these are the controller's working copies.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterable, Mapping, Optional

EVENTS_KEPT = 10_000       # the job driver reads events every ~0.25 s: far behind this is gone
RECOVERIES_KEPT = 1_000    # rows for summary.json's table; the histogram counts every one
RECOVERIES_IN_SNAPSHOT = 20   # rows in each periodic snapshot (metrics.jsonl): the newest
RECOVERY_PHASES = ("detect", "restart", "restore", "first_contribution", "total")
RECOVERY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class EventLog:
    """The newest ``keep`` events, each with an absolute index that never goes back.

    ``since(index)`` returns the events after the first ``index`` ever emitted and the next
    index to ask for; a reader that fell more than ``keep`` behind gets what is kept (the file
    its job writes has the rest), and an index past the end (a reader of a controller that
    restarted since) starts again from the oldest kept.

    >>> log = EventLog(keep=2)
    >>> for n in range(3): log.append({"n": n})
    >>> log.since(0), log.since(2), log.since(9)
    (([{'n': 1}, {'n': 2}], 3), ([{'n': 2}], 3), ([{'n': 1}, {'n': 2}], 3))
    """

    def __init__(self, keep: int = EVENTS_KEPT):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.rows: collections.deque = collections.deque(maxlen=keep)
        self.total = 0    # events ever appended: the index of the next one

    def append(self, event: dict) -> None:
        self.rows.append(event)
        self.total += 1

    def since(self, index: int) -> tuple[list[dict], int]:
        first = self.total - len(self.rows)   # the absolute index of rows[0]
        if index > self.total:
            index = first
        skip = max(0, index - first)
        return list(itertools.islice(self.rows, skip, None)), self.total

    def newest(self, n: int) -> list[dict]:
        return list(itertools.islice(self.rows, max(0, len(self.rows) - n), None))

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
        return [dict(r) for r in itertools.islice(self.rows, max(0, len(self.rows) - n), None)]

    def histogram(self) -> dict:
        """``{phase: {"bounds", "buckets" (cumulative, +Inf last), "sum", "count"}}``."""
        return {p: {"bounds": list(RECOVERY_BUCKETS_S), "buckets": list(self.counts[p]),
                    "sum": self.sums[p], "count": self.counts[p][-1]} for p in RECOVERY_PHASES}

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "counts": self.counts, "sums": self.sums,
                "total": self.total}

    @classmethod
    def from_json(cls, saved, keep: int = RECOVERIES_KEPT) -> "RecoveryLog":
        """From ``to_json``, or from an older save's plain list of rows (counted again)."""
        log = cls(keep)
        if isinstance(saved, list):
            for row in saved:
                log.append(row)
            return log
        log.rows.extend(saved.get("rows") or [])
        log.total = int(saved.get("total") or 0)
        for phase in RECOVERY_PHASES:
            counts = (saved.get("counts") or {}).get(phase)
            if counts is not None and len(counts) == len(RECOVERY_BUCKETS_S) + 1:
                log.counts[phase] = [int(n) for n in counts]
                log.sums[phase] = float((saved.get("sums") or {}).get(phase, 0.0))
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
