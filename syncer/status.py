"""A syncer's status, typed: what the ``Syncer`` actor answers to ``status`` and the controller
holds per shard (orchestrator/groups_api.py). No Ray here.

>>> status = SyncerStatus.from_dict({"epoch": 3, "versions": [1, 2], "not_a_field": 1})
>>> status.epoch, list(status.versions), status.merges
(3, [1, 2], 0)
>>> SyncerStatus.of(status) is status, SyncerStatus.of(None) == SyncerStatus()
(True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence


def _fields_of(cls) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class SyncerStatus:
    """A syncer's status (one shard's, or every shard's combined by ``syncer/shards.py``): what
    the ``Syncer`` actor's ``status`` answers, and a region's link client for the home syncer.

    The tables inside are keyed by learner or fragment and stay plain values: ``ledger`` is per
    learner its incarnation, applied watermark, merged steps and token books.
    """

    epoch: int = 0
    versions: Sequence[int] = ()
    merges: int = 0
    merges_by_fragment: Mapping = dataclasses.field(default_factory=dict)
    quorum_size: Mapping = dataclasses.field(default_factory=dict)
    live_learners: Mapping = dataclasses.field(default_factory=dict)
    participation_counts: Mapping = dataclasses.field(default_factory=dict)
    grace_window_s: Optional[float] = None
    staleness_counts: Mapping = dataclasses.field(default_factory=dict)
    rejected: Mapping = dataclasses.field(default_factory=dict)
    registered: Mapping = dataclasses.field(default_factory=dict)
    refusals_total: int = 0
    quarantined: Mapping = dataclasses.field(default_factory=dict)
    ledger: Mapping = dataclasses.field(default_factory=dict)
    wire_bytes_up: Mapping = dataclasses.field(default_factory=dict)
    wire_bytes_down: Mapping = dataclasses.field(default_factory=dict)
    restored_from: Any = None
    syncer_shard: Optional[int] = None
    fragment_ids: Optional[Sequence[int]] = None
    snapshot_failures: int = 0                 # snapshot saves that raised (merging went on)
    snapshot_error: Optional[str] = None       # the newest one's error, while saves fail
    shards: Optional[Sequence[dict]] = None    # combined: per shard its epoch, versions, ...

    @classmethod
    def from_dict(cls, status: Optional[Mapping]) -> "SyncerStatus":
        """From plain values (the link's JSON); keys it does not know are ignored (a newer
        home), a missing or None one keeps its default."""
        names = _fields_of(cls)
        return cls(**{k: v for k, v in (status or {}).items() if k in names and v is not None})

    def as_dict(self) -> dict:
        """The plain values (``syncer/shards.py`` combines these), without the unknown (None)
        ones."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, status: "SyncerStatus | Mapping | None") -> "SyncerStatus":
        return status if isinstance(status, SyncerStatus) else cls.from_dict(status)
