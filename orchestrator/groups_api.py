"""What an owner loop needs from its learners and syncers, typed: two interfaces and the messages
that come out of them. No Ray here.

A body of the owner loop (orchestrator/seam.py) carries the fleet's actions out through a
``LearnerGroup`` (start, promote, call, kill learner units and warm spares) and a
``SyncerGroup`` (the syncer shards: start, attach, ask for status, forget, kill). What it hears
back is typed: ``RunEnded``, ``SpareReady`` / ``SpareFailed``, ``ShardEnded``, ``SyncerStatus``.
The Ray bodies are ``groups.LearnerGroups`` and ``groups.SyncerShards``; a region agent's one
syncer shard is its link client, behind the same ``SyncerGroup``; the in-process driver's are
``virtual_groups.VirtualLearnerGroup`` and ``VirtualSyncerGroup``, on its virtual clock.

>>> ended = RunEnded("a:0", 2, None, "actor died", How.PREEMPTED)
>>> ended.preempted, ended.crashed
(True, False)
>>> SyncerStatus.from_dict({"epoch": 3, "versions": [1, 2], "other": 1}).merges
0
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

from islands.learners.messages import Heartbeat, known_stats
from islands.syncer.status import SyncerStatus


class How(str, enum.Enum):
    """How a learner unit's run ended."""

    RETURNED = "returned"     # its run returned (drained, stopped)
    DIED = "died"             # its actor died (killed, its process or node gone)
    PREEMPTED = "preempted"   # its node was preempted (Ray says so)
    CRASHED = "crashed"       # its training loop raised (the actor itself was alive)


@dataclasses.dataclass(frozen=True)
class RunEnded:
    """A unit's run is over: what it returned (its final stats) or why it ended."""

    learner: str
    incarnation: int
    final: Optional[dict]     # the run's final stats (a learner's counters, as its beats carry)
    error: Optional[str]
    how: How = How.RETURNED

    @property
    def preempted(self) -> bool:
        return self.how == How.PREEMPTED

    @property
    def crashed(self) -> bool:
        return self.how == How.CRASHED


@dataclasses.dataclass(frozen=True)
class SpareReady:
    """A warm spare's ``prepare`` returned: it holds its devices and waits to be promoted."""

    name: str
    prepare_s: Optional[float]
    node_id: Optional[str]


@dataclasses.dataclass(frozen=True)
class SpareFailed:
    """A warm spare's ``prepare`` failed: it has ended."""

    name: str
    error: str


@dataclasses.dataclass(frozen=True)
class ShardEnded:
    """Syncer shard ``shard``'s actor (or a region's link) has ended."""

    shard: int


def combined(statuses: Sequence[Optional[SyncerStatus]]) -> SyncerStatus:
    """Every shard's status as one (``syncer/shards.py`` ``combine_status``); a shard that has
    not answered yet (None) adds nothing."""
    from islands.syncer.shards import combine_status

    return SyncerStatus.from_dict(combine_status(statuses))


@dataclasses.dataclass
class Incarnation:
    """What the owner knows of a slot's running incarnation (its Ray side is in the
    ``LearnerGroup``)."""

    number: int
    start_step: int = 0
    beat: Optional[Heartbeat] = None   # its last heartbeat (none yet: it is starting)
    remote: bool = False   # in a region's own cluster: known from its agent's reports (link/)

    def counters(self) -> dict:
        """Its newest counters as plain values (the books, the saved state and the snapshot
        read these): its last heartbeat's, or its start step before the first."""
        return self.beat.as_dict() if self.beat is not None else {"step": self.start_step}

    def ended_with(self, final: dict) -> None:
        """Its run returned ``final`` (the unit's last stats): they update its last beat."""
        stats = {k: v for k, v in known_stats(final).items() if k not in ("learner",
                                                                           "incarnation")}
        if self.beat is not None:
            self.beat = dataclasses.replace(self.beat, **stats)
            return
        self.beat = Heartbeat.from_dict({"step": self.start_step, "t": time.time(), **stats,
                                         "learner": final.get("learner", ""),
                                         "incarnation": self.number})


@runtime_checkable
class LearnerGroup(Protocol):
    """The learner units and warm spares of one body: what the owner loop does to them and
    what it polls from them. Every method runs on the owner's thread, except ``call``."""

    def launch(self, learner: str, incarnation: int, region: str, devices, spec,
               link_faults: Iterable = (), spare: Optional[str] = None,
               identity: Optional[dict] = None) -> Optional[str]:
        """Starts an incarnation (a new unit, or the spare ``spare`` promoted); why not, or
        None."""

    def launch_spare(self, name: str, region: str, devices, spec) -> Optional[str]:
        """Starts a warm spare; why not, or None."""

    def hurry_spare(self, name: str) -> None:
        """A restart waits for this spare: it finishes preparing at normal priority."""

    def end_spare(self, name: str) -> None:
        ...

    def call(self, learner: str, method: str, *args) -> bool:
        """A fire-and-forget control call on a running unit; False when it has none."""

    def kill(self, learner: str, incarnation: int, mode: str) -> bool:
        """Ends an incarnation (``exit``, ``kill`` or ``bury``); True when it is gone here."""

    def ended(self) -> list[RunEnded]:
        """The runs that ended since the last poll."""

    def placed(self) -> list[tuple[str, int, Optional[str]]]:
        """The new processes placed since the last poll: (learner, incarnation, node id)."""

    def spare_results(self) -> "list[SpareReady | SpareFailed]":
        """The spares whose ``prepare`` returned or failed since the last poll."""

    def stop_all(self, timeout_s: float) -> None:
        ...


@runtime_checkable
class SyncerGroup(Protocol):
    """The syncer shards of one body (a region agent's one shard is its link)."""

    @property
    def count(self) -> int:
        ...

    def start(self, s: int, spec, epoch: int, restore: bool, options: dict,
              timeout_s: float) -> dict:
        """Starts shard ``s`` and waits for its ``ready`` answer."""

    def attach(self, s: int, name: str, timeout_s: float) -> dict:
        """Takes over the running shard ``name``; its ``ready`` answer."""

    def ended(self) -> list[ShardEnded]:
        ...

    def kill(self, s: int) -> None:
        ...

    def refusals_since(self, seen: list[int], timeout_s: float = 10) -> list:
        ...

    def forget(self, learner: str, incarnation: int, reason: str,
               timeout_s: float = 10) -> None:
        ...

    def statuses(self, slowest_step_s: float, paused: bool,
                 timeout_s: float = 10) -> dict[int, SyncerStatus]:
        """Tells every shard the fleet's pace and pause; the statuses that came back."""

    def global_params(self, timeout_s: float = 30) -> dict:
        ...

    def snapshot_now(self, timeout_s: float = 60) -> None:
        ...
