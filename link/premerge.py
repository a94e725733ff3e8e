"""Regional pre-merge (``link.premerge``): a region's learners' pushes of one fragment round leave
over the WAN as ONE push, and the home's one reply is fanned out to each of them.

The region side of the link (``LinkClient``) holds each push of a round until every learner the
region has registered pushed that fragment from the same base, or ``link.premerge_window_s``
after the round's first push; then it sends the token-weighted mean of their decoded drifts,
re-encoded with the job's codec, with each learner carried as a member (its own identity,
counters and books, no codes). At home (``syncer/core.py``) each member enters the round as
itself with the group's outer gradient and its own weight, so for the weighted mean the merge is
the flat merge's; what differs and how the books stay exact: docs/regions.md#pre-merge.

The math is pure numpy below; ``PreMerger`` is the small piece of threading that gathers a
round's pushes (the link client is a threaded actor: one thread per learner's push call).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from islands.syncer import merge as merge_lib
from islands.syncer.validate import SYNCER_DOWN

# The name a pre-merged push is booked under at home (refusal events, the link's logs).
GROUP_SUFFIX = ":premerge"


def premerge_weights(pushes: Sequence) -> list[float]:
    """The syncer's merge weight of each push (``token_weight``: c_tokens² / c_steps). The
    staleness factor is left out: a group's pushes share one base, so it is the same for all
    and cancels in the mean (the home applies it to the members, each as itself).

    >>> from types import SimpleNamespace as P
    >>> premerge_weights([P(c_tokens=100, c_steps=1), P(c_tokens=300, c_steps=3),
    ...                   P(c_tokens=0, c_steps=0)])
    [10000.0, 30000.0, 0.0]
    """
    return [merge_lib.token_weight(p.c_tokens, p.c_steps) for p in pushes]


def premerged_drift(drifts: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
                    ) -> dict[str, np.ndarray]:
    """``δ̄ = Σ w_i δ_i / Σ w_i`` per tensor (float32), the drift that merges at home as its
    parts would: with ``g_i = Θ − base − δ_i`` and one base,
    ``Σ w_i g_i = (Σ w_i)(Θ − base − δ̄)``.
    Weights that sum to 0 (nobody trained since the base) give the plain mean, as the syncer's
    merge does then. One drift comes back unchanged.

    >>> d = premerged_drift([{"w": np.array([1.0, -2.0])}, {"w": np.array([3.0, 2.0])}], [1.0, 3.0])
    >>> d["w"].tolist()
    [2.5, 1.0]
    """
    if len(drifts) != len(weights) or not drifts:
        raise ValueError(f"need one weight per drift, got {len(drifts)} and {len(weights)}")
    if len(drifts) == 1:
        return {k: np.asarray(v, np.float32) for k, v in drifts[0].items()}
    total = float(np.sum(weights))
    if total <= 0.0:
        weights, total = [1.0] * len(drifts), float(len(drifts))
    out = {}
    for path in drifts[0]:
        acc = np.zeros(np.shape(drifts[0][path]), np.float64)
        for d, w in zip(drifts, weights):
            acc += (w / total) * np.asarray(d[path], np.float64)
        out[path] = acc.astype(np.float32)
    return out


def round_key(push) -> tuple:
    """A region's round: one fragment of one syncer epoch. It closes when every live learner of
    the region pushed it (whatever its base), or at the window."""
    return (push.fragment, push.epoch)


def base_key(push) -> tuple:
    """Pushes of a round pre-merge together when they share a base: their outer gradients share
    Θ − base, so their mean is the mean of their drifts. With an encoded downlink the base is a
    shadow (its id); the home sends a group's members one update and one shadow, so learners
    that merged together share a base again. A round whose learners hold different
    bases leaves as one push per base, together (they then merge together and adopt one version,
    so their next round shares a base again)."""
    return (push.base_version, push.base_shadow)


def by_base(pushes: Sequence) -> list[list]:
    """``pushes`` split by ``base_key``, in order of first appearance.

    >>> from types import SimpleNamespace as P
    >>> ps = [P(learner=n, base_version=v, base_shadow=0) for n, v in (("a", 3), ("b", 4), ("c", 3))]
    >>> [[p.learner for p in part] for part in by_base(ps)]
    [['a', 'c'], ['b']]
    """
    parts: dict[tuple, list] = {}
    for p in pushes:
        parts.setdefault(base_key(p), []).append(p)
    return list(parts.values())


def group_push(region: str, pushes: Sequence, codes: Mapping, wire_bytes: int):
    """The one push that carries ``pushes`` (same ``base_key``): the members keep everything
    but their codes; the counters are the members' sums (for the link's and the home's byte and
    token counts; the home weighs each member by its own)."""
    first = pushes[0]
    members = tuple(dataclasses.replace(p, codes={}, wire_bytes=0) for p in pushes)
    return dataclasses.replace(
        first, learner=region + GROUP_SUFFIX, codes=dict(codes),
        c_tokens=sum(p.c_tokens for p in pushes), c_steps=sum(p.c_steps for p in pushes),
        incarnation=0, step=max(p.step for p in pushes), tokens_done=0, compute_s=0.0,
        wire_bytes=int(wire_bytes), session="", fates=None, members=members)


class Encoder:
    """Decodes members' codes and re-encodes the mean with the job's codec, keeping the
    rounding error of that re-encoding per fragment (error feedback: it is added to the next
    group push of the fragment once this one merged, so it is delayed, not lost)."""

    def __init__(self, kind: str, block_size: int):
        from islands.syncer import codec as codec_lib

        self.codec_lib = codec_lib
        self.codec = codec_lib.make_codec(kind, block_size=block_size)
        self.residual: dict[int, dict] = {}

    def decode(self, codes) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float32)
                for k, v in self.codec_lib.decode_tree(self.codec, codes).items()}

    def encode(self, fragment: int, drift: Mapping[str, np.ndarray]) -> tuple[dict, int, dict]:
        """(codes, their wire bytes, the residual this encoding leaves)."""
        residual = self.residual.get(fragment)
        target = {k: v + residual[k] if residual is not None else v for k, v in drift.items()}
        codes = self.codec_lib.to_numpy(self.codec_lib.encode_tree(self.codec, target))
        decoded = self.decode(codes)
        left = {k: target[k] - decoded[k] for k in target}
        return codes, self.codec_lib.tree_wire_bytes(codes), left

    def merged(self, fragment: int, left: dict) -> None:
        self.residual[fragment] = left


@dataclasses.dataclass
class _Group:
    key: tuple
    opened_s: float
    pushes: dict = dataclasses.field(default_factory=dict)   # learner -> Push
    closed: bool = False
    replies: Optional[dict] = None                          # learner -> Reply, once answered


class PreMerger:
    """Gathers a region's pushes of one fragment round and sends them as one.

    Args:
      region: the region's name (the group push's name at home).
      encoder: an ``Encoder`` of the job's codec.
      window_s: the longest a round waits for the region's other learners after its first push.
      send: sends one push to home and returns the home's Reply (the link's ``push``).
      clock: seconds (monotonic).
    """

    def __init__(self, region: str, encoder: Encoder, window_s: float,
                 send: Callable, clock: Callable[[], float] = time.monotonic):
        self.region, self.encoder, self.window_s = region, encoder, float(window_s)
        self.send, self.clock = send, clock
        self.cond = threading.Condition()
        self.live: dict[str, int] = {}        # the region's registered learners: incarnation
        self.open: dict[tuple, _Group] = {}
        self.counts = {"groups": 0, "grouped_pushes": 0, "alone": 0, "fallbacks": 0,
                       "window_closes": 0, "split_rounds": 0}

    # -- membership (the link's register and forget) --------------------------------------------
    def registered(self, learner: str, incarnation: int) -> None:
        with self.cond:
            self.live[learner] = incarnation
            self.cond.notify_all()

    def forgotten(self, learner: str, incarnation: Optional[int] = None) -> None:
        """The learner left: no round waits for it. A push of it already in a round here goes
        with the round: home forgot it too, so the round's pre-merged push is refused and its
        members go alone (each judged: that one refused, the others merge)."""
        with self.cond:
            if incarnation is None or self.live.get(learner) == incarnation:
                self.live.pop(learner, None)
            self.cond.notify_all()

    # -- the push path --------------------------------------------------------------------------
    def push(self, push):
        """Blocks until the home answered the round ``push`` is in; returns this learner's
        Reply."""
        if push.members:
            return self.send(push)
        with self.cond:
            key = round_key(push)
            group = self.open.get(key)
            if group is None or push.learner in group.pushes:
                group = self.open[key] = _Group(key, self.clock())
            group.pushes[push.learner] = push
            self.cond.notify_all()
            while True:
                if group.replies is not None:
                    return group.replies[push.learner]
                if not group.closed and (self._complete(group)
                                         or self.clock() >= group.opened_s + self.window_s):
                    if not self._complete(group):
                        self.counts["window_closes"] += 1
                    group.closed = True
                    if self.open.get(key) is group:
                        del self.open[key]
                    break   # this thread sends the round
                left = group.opened_s + self.window_s - self.clock()
                self.cond.wait(None if group.closed else max(left, 1e-3))
        try:
            replies = self._send_group(list(group.pushes.values()))
        except Exception as exc:   # never leave the round's other learners waiting
            replies = {name: _not_sent(p, exc) for name, p in group.pushes.items()}
        with self.cond:
            group.replies = replies
            self.cond.notify_all()
        return replies[push.learner]

    def _complete(self, group: _Group) -> bool:
        return set(self.live) <= set(group.pushes)

    def _send_group(self, pushes: list) -> dict:
        parts = by_base(pushes)
        if len(parts) == 1:
            return self._send_part(parts[0])
        self.counts["split_rounds"] += 1
        return _in_parallel(self._send_part, parts)

    def _send_part(self, pushes: list) -> dict:
        if len(pushes) == 1:
            # Alone in its round, but still the region's: sent as a group of one (its own codes,
            # nothing averaged or re-encoded), so the home knows the region pre-merges and can
            # give a round split across bases one base again (syncer/core.py:
            # regions_to_rejoin). Its verdict is its own: no fallback.
            self.counts["alone"] += 1
            push = pushes[0]
            return {push.learner: self.send(group_push(self.region, pushes, push.codes,
                                                       push.wire_bytes))}
        fragment = pushes[0].fragment
        drift = premerged_drift([self.encoder.decode(p.codes) for p in pushes],
                                premerge_weights(pushes))
        codes, nbytes, left = self.encoder.encode(fragment, drift)
        reply = self.send(group_push(self.region, pushes, codes, nbytes))
        self.counts["groups"] += 1
        self.counts["grouped_pushes"] += len(pushes)
        if reply.status == "rejected" and reply.reason not in FAN_OUT_REFUSALS:
            # Refused as a whole before it entered a round (one member's identity, round or
            # base, or the mean's norm): each member goes alone and gets its own verdict.
            self.counts["fallbacks"] += 1
            return _in_parallel(lambda p: {p.learner: self.send(p)}, pushes)
        if reply.status == "merged":
            self.encoder.merged(fragment, left)
        return {p.learner: reply for p in pushes}



def _in_parallel(fn: Callable[..., dict], items: Sequence) -> dict:
    """``fn(item)`` for each item on its own thread (each waits for its merge); the union of
    their {learner: Reply}."""
    out: dict = {}
    lock = threading.Lock()

    def run(item):
        try:
            got = fn(item)
        except Exception as exc:
            got = {p.learner: _not_sent(p, exc)
                   for p in (item if isinstance(item, list) else [item])}
        with lock:
            out.update(got)

    threads = [threading.Thread(target=run, args=(item,), daemon=True) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _not_sent(push, exc):
    """The answer to a push whose round could not be sent: as a link that is down (the learner
    keeps its drift and pushes it again)."""
    from islands.syncer.actor import Reply

    return Reply("rejected", push.fragment, push.epoch, reason=SYNCER_DOWN,
                 detail=f"the region's pre-merge failed: {exc!r}"[:300])


# Refusals of a pre-merged push that are every member's: it entered the round and its merge was
# refused (Θ kept), or it never reached home (the link was down: each member keeps its drift).
FAN_OUT_REFUSALS = frozenset({"bad_merge", "unadopted", "not_durable", SYNCER_DOWN})
