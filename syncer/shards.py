"""Syncer shards: which syncer shard owns each fragment, and how shard-local ids map to global ones.

A job with ``syncer.shards = S`` runs S syncer actors; shard s owns the fragments ``owned[s]`` and
is a ``SyncerCore`` over exactly those (its own rounds, outer state, snapshots and epoch). Learners
and the controller speak in global fragment ids p; a shard's core speaks in its local ids i (the
position of p in ``owned[s]``). The word "shard" alone means a learner's *data* shard elsewhere in
the code, hence ``syncer_shard`` here.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .status import SyncerStatus

SYNCER_NAME = "islands:syncer"


def syncer_shard_name(syncer_shard: int) -> str:
    """The Ray actor name of a syncer shard: shard 0 keeps the single syncer's name (so existing
    tooling finds it), shard s > 0 is ``islands:syncer-s``.

    >>> syncer_shard_name(0), syncer_shard_name(2)
    ('islands:syncer', 'islands:syncer-2')
    """
    if syncer_shard < 0:
        raise ValueError(f"syncer shard ({syncer_shard}) must be >= 0")
    return SYNCER_NAME if syncer_shard == 0 else f"{SYNCER_NAME}-{syncer_shard}"


def assign_fragments(sizes: Sequence[int], num_shards: int) -> tuple[tuple[int, ...], ...]:
    """Fragments to shards, balanced by parameter count and deterministic.

    Longest-processing-time first: fragments in decreasing size (ties: lower id first) each go to
    the shard holding the fewest parameters so far (ties: lower shard). Each shard's fragments are
    returned in increasing id order.

    Args:
      sizes: parameters per fragment, indexed by global fragment id.
      num_shards: S.

    Returns:
      ``owned[s]``: the global ids shard s owns.

    Raises:
      ValueError: S < 1, S above the number of fragments (a shard would own nothing), or a
        negative size.

    >>> assign_fragments([10, 10, 10, 10], 2)
    ((0, 2), (1, 3))
    >>> assign_fragments([7, 1, 1, 5], 2)
    ((0,), (1, 2, 3))
    """
    if num_shards < 1:
        raise ValueError(f"syncer shards ({num_shards}) must be >= 1")
    if num_shards > len(sizes):
        raise ValueError(f"syncer shards ({num_shards}) exceed fragments ({len(sizes)}): "
                         "a shard would own no fragment")
    if any(n < 0 for n in sizes):
        raise ValueError(f"fragment sizes must be >= 0, got {list(sizes)}")
    load = [(0, s) for s in range(num_shards)]   # (parameters, shard): a min-heap
    owned: list[list[int]] = [[] for _ in range(num_shards)]
    for p in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        total, s = heapq.heappop(load)
        owned[s].append(p)
        heapq.heappush(load, (total + sizes[p], s))
    return tuple(tuple(sorted(ids)) for ids in owned)


@dataclass(frozen=True)
class ShardMap:
    """Global fragment id <-> (syncer shard, local id)."""

    owned: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        flat = sorted(p for ids in self.owned for p in ids)
        if flat != list(range(len(flat))):
            raise ValueError(f"syncer shards must own every fragment exactly once, got "
                             f"{[list(ids) for ids in self.owned]}")

    @classmethod
    def single(cls, num_fragments: int) -> "ShardMap":
        """One shard owning everything (local id = global id)."""
        return cls((tuple(range(num_fragments)),))

    @property
    def num_shards(self) -> int:
        return len(self.owned)

    @property
    def num_fragments(self) -> int:
        return sum(len(ids) for ids in self.owned)

    def shard_of(self, p: int) -> int:
        for s, ids in enumerate(self.owned):
            if p in ids:
                return s
        raise ValueError(f"fragment {p} not in [0, {self.num_fragments})")

    def local(self, p: int) -> int:
        return self.owned[self.shard_of(p)].index(p)

    def to_global(self, syncer_shard: int, i: int) -> int:
        return self.owned[syncer_shard][i]


# -- one shard's boundary: global ids outside, local ids inside its core --------------------------
def localize(fragment_ids: Optional[Sequence[int]], p: int) -> int:
    """The local id of global fragment p in a shard owning ``fragment_ids`` (None: all, identity);
    -1 when the shard does not own it (its core then refuses the push as an unknown fragment)."""
    if fragment_ids is None:
        return p
    try:
        return list(fragment_ids).index(p)
    except ValueError:
        return -1


def globalize(fragment_ids: Optional[Sequence[int]], i: int) -> int:
    """The global id of a shard's local fragment i (-1 stays -1)."""
    return i if fragment_ids is None or i < 0 else int(fragment_ids[i])


def localize_push(fragment_ids: Optional[Sequence[int]], push: Any) -> Any:
    """A push with its fragment in the shard's local ids (the same object when nothing changes)."""
    i = localize(fragment_ids, push.fragment)
    return push if i == push.fragment else dataclasses.replace(push, fragment=i)


def localize_adopted(fragment_ids: Optional[Sequence[int]], adopted: Optional[Sequence]
                     ) -> Optional[list]:
    """A learner's adopted [(version, fragment)] indexed by global id -> this shard's entries."""
    if adopted is None or fragment_ids is None:
        return None if adopted is None else list(adopted)
    return [adopted[p] for p in fragment_ids if p < len(adopted)]


# -- the controller's view: every shard's status as one ------------------------------------------
def _newer_fates(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    if a is None or (b is not None and b.get("events", 0) > a.get("events", 0)):
        return b
    return a


def combine_status(statuses: Sequence[Optional[Mapping]]) -> dict:
    """One syncer status (the single syncer's shape, global fragment ids) from each shard's,
    plus ``shards``: per shard its epoch, fragments, versions, merges and snapshot.

    Sums: merges, counts, bytes, a learner's merged fragment-tokens. Per fragment: the owner's
    value. A learner's applied watermark (tokens, compute, step) is the newest any shard holds (a
    shard's is over its fragments only; the books read the exact per-fragment steps). ``epoch``:
    the highest shard epoch. A shard that could not answer (None) adds nothing. A status may
    be typed (``status.SyncerStatus``, as the actor answers) or its plain values.
    """
    statuses = [s.as_dict() if isinstance(s, SyncerStatus) else s for s in statuses]
    live = [s for s in statuses if s]
    if len(statuses) == 1 and live:
        return dict(live[0], shards=[_shard_row(0, live[0])])
    out: dict = {"epoch": 0, "versions": [], "merges": 0, "merges_by_fragment": {},
                 "quorum_size": {}, "live_learners": {}, "participation_counts": {},
                 "grace_window_s": 0.0, "staleness_counts": {}, "rejected": {},
                 "registered": {}, "refusals_total": 0, "quarantined": {}, "ledger": {},
                 "snapshot_failures": 0, "snapshot_error": None,
                 "wire_bytes_up": {}, "wire_bytes_down": {}, "restored_from": None,
                 "shards": [_shard_row(s, st) for s, st in enumerate(statuses) if st]}
    versions: dict[int, int] = {}
    for st in live:
        out["epoch"] = max(out["epoch"], int(st.get("epoch") or 0))
        out["merges"] += int(st.get("merges") or 0)
        out["grace_window_s"] = max(out["grace_window_s"], float(st.get("grace_window_s") or 0))
        out["refusals_total"] += int(st.get("refusals_total") or 0)
        out["snapshot_failures"] += int(st.get("snapshot_failures") or 0)
        out["snapshot_error"] = out["snapshot_error"] or st.get("snapshot_error")
        for p, v in (st.get("merges_by_fragment") or {}).items():
            versions[int(p)] = int(v)
        out["merges_by_fragment"].update({int(p): v for p, v in
                                          (st.get("merges_by_fragment") or {}).items()})
        for key in ("quorum_size", "live_learners"):
            out[key].update({int(p): v for p, v in (st.get(key) or {}).items()})
        for key in ("staleness_counts", "participation_counts", "rejected", "wire_bytes_up",
                    "wire_bytes_down"):
            for k, n in (st.get(key) or {}).items():
                out[key][k] = out[key].get(k, 0) + n
        # A learner is registered (or quarantined) as its newest incarnation any shard knows.
        for key in ("registered", "quarantined"):
            for name, inc in (st.get(key) or {}).items():
                out[key][name] = max(out[key].get(name, inc), inc)
        for name, entry in (st.get("ledger") or {}).items():
            out["ledger"][name] = _combine_entry(out["ledger"].get(name), entry)
    out["versions"] = [versions[p] for p in sorted(versions)]
    return out


def _combine_entry(a: Optional[dict], b: dict) -> dict:
    if a is None:
        return dict(b, merged_steps=dict(b.get("merged_steps") or {}))
    if b["incarnation"] != a["incarnation"]:  # one shard has not seen the new incarnation yet
        newer, older = (a, b) if a["incarnation"] > b["incarnation"] else (b, a)
        merged = dict(newer, merged_steps=dict(newer.get("merged_steps") or {}))
        merged["merged_tokens_total"] = (int(newer.get("merged_tokens_total") or 0)
                                         + int(older.get("merged_tokens_total") or 0))
        return merged
    out = dict(a)
    for key in ("applied_tokens", "applied_tokens_incarnation", "applied_compute_s",
                "applied_compute_incarnation_s", "applied_step"):
        out[key] = max(a.get(key) or 0, b.get(key) or 0)
    out["merged_steps"] = {**(a.get("merged_steps") or {}), **(b.get("merged_steps") or {})}
    out["merged_tokens_total"] = (int(a.get("merged_tokens_total") or 0)
                                  + int(b.get("merged_tokens_total") or 0))
    out["fates"] = _newer_fates(a.get("fates"), b.get("fates"))
    return out


def _shard_row(syncer_shard: int, status: Mapping) -> dict:
    return {"shard": int(status.get("syncer_shard", syncer_shard)),
            "epoch": int(status.get("epoch") or 0),
            "fragments": list(status.get("fragment_ids") or
                              range(len(status.get("versions") or []))),
            "versions": list(status.get("versions") or []),
            "merges": int(status.get("merges") or 0),
            "restored_from": status.get("restored_from"),
            "snapshot_failures": int(status.get("snapshot_failures") or 0)}


# -- building the shards ---------------------------------------------------------------------------
def shard_snapshot_dir(checkpoint_dir: Optional[str], syncer_shard: int) -> Optional[str]:
    """Where shard s keeps its snapshots: shard 0 where the single syncer does, shard s > 0 in the
    sibling ``<dir>-shard-<s>`` (each shard restores only its own fragments).

    >>> shard_snapshot_dir("/runs/a/syncer", 0), shard_snapshot_dir("/runs/a/syncer", 2)
    ('/runs/a/syncer', '/runs/a/syncer-shard-2')
    """
    if checkpoint_dir is None or syncer_shard == 0:
        return checkpoint_dir
    return f"{checkpoint_dir.rstrip('/')}-shard-{syncer_shard}"


def fragment_sizes(fragments: Sequence[Mapping[str, Any]]) -> list[int]:
    """Parameters per fragment (what ``assign_fragments`` balances)."""
    return [sum(int(getattr(v, "size", 1)) for v in frag.values()) for frag in fragments]


def shard_specs(spec: Any, num_shards: int) -> list:
    """One ``SyncerSpec`` per shard from the whole job's: its fragments, their global ids, its
    snapshot directory. ``num_shards`` 1 returns ``[spec]`` unchanged (the single syncer)."""
    if num_shards == 1:
        return [spec]
    owned = assign_fragments(fragment_sizes(spec.fragments), num_shards)
    return [dataclasses.replace(spec, fragments=[spec.fragments[p] for p in ids],
                                fragment_ids=tuple(ids), syncer_shard=s,
                                checkpoint_dir=shard_snapshot_dir(spec.checkpoint_dir, s))
            for s, ids in enumerate(owned)]
