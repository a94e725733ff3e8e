"""What an owner (orchestrator/owner.py) needs from its learners and syncers, typed: two
interfaces and what comes out of them. No Ray here.

An ``owner.Owner`` carries the fleet's actions out through a ``LearnerGroup`` (start, promote,
drain, pause, hang, fault and kill learner units and warm spares) and a ``SyncerGroup`` (the
syncer shards: start, attach, ask for status, forget, kill). What the learner group reports is
already the fleet's observations (``fleet.RunEnded``, ``fleet.Placed``, ``fleet.SpareReady`` /
``fleet.SpareEnded``); a syncer group reports ``ShardEnded`` (the owner adds the epoch the shard
last reported) and ``SyncerStatus``. The Ray bodies are ``groups.LearnerGroups`` and
``groups.SyncerShards``; a region agent's one syncer shard is its link client, behind the same
``SyncerGroup``; the in-process driver's are ``virtual_groups.VirtualLearnerGroup`` and
``VirtualSyncerGroup``, on its virtual clock.

>>> SyncerStatus.from_dict({"epoch": 3, "versions": [1, 2], "other": 1}).merges
0
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

from islands.learners.messages import Heartbeat, known_stats
from islands.syncer.status import SyncerStatus

if TYPE_CHECKING:
    from islands.faults import Fault

    from . import fleet


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
    """The learner units and warm spares of one body: what the owner does to them and what it
    polls from them. Every method runs on the owner's thread."""

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

    def drain(self, learner: str) -> bool:
        """It finishes its step and its run returns once its pushes are answered; False when
        nothing of it is running (a drain holds for its slot)."""

    def pause(self, learner: str, paused: bool) -> bool:
        """Pauses (at its next step boundary) or resumes it; the newest call wins."""

    def hang(self, learner: str, duration_s: float) -> bool:
        """Chaos: it wedges (no steps, no heartbeats) for ``duration_s``."""

    def apply_fault(self, learners: Sequence[str], fault: "Fault") -> None:
        """A slowdown or a link fault on ``learners`` (their region's link: ``fault.target``)."""

    def partition_home(self, fault: "Fault") -> None:
        """The home's side of every remote region's link goes down for ``fault.duration_s``."""

    def kill(self, learner: str, incarnation: int, mode: str, fault: "Optional[Fault]" = None,
             reason: str = "") -> bool:
        """Ends an incarnation: ``exit`` or ``ray_kill`` (a chaos ``fault``: its end is seen
        later), or ``bury`` (decided dead for ``reason``); True when it is gone here."""

    def ended(self) -> "list[fleet.RunEnded]":
        """The runs that ended since the last poll."""

    def placed(self) -> "list[fleet.Placed]":
        """The new processes placed since the last poll."""

    def spare_results(self) -> "list[fleet.SpareReady | fleet.SpareEnded]":
        """The spares whose ``prepare`` returned or failed since the last poll."""

    def stop_all(self, timeout_s: float) -> None:
        ...

    def wait(self, other_refs: list, timeout_s: float) -> bool:
        """Blocks until a run ends, a spare is ready, one of ``other_refs`` (the syncer group's
        ``closed_refs()``) resolves, or ``timeout_s``; False at once when there is nothing to
        wait on (the caller then waits on its own clock)."""

    def reattach(self, learner: str, actor: str, hosts: int = 1,
                 timeout_s: float = 10) -> Optional[dict]:
        """A restarted owner takes over the incarnation still running under ``actor``'s name:
        its ``ping`` (incarnation, state, start step), or None when none runs there."""

    def end_stray_spares(self, keep: set) -> None:
        """Ends every spare but those named in ``keep``: a restarted owner does not recover
        the spares that were waiting."""


@runtime_checkable
class SyncerGroup(Protocol):
    """The syncer shards of one body (a region agent's one shard is its link)."""

    @property
    def count(self) -> int:
        ...

    def start(self, s: int, spec, epoch: int, restore: bool, options: dict,
              timeout_s: float) -> dict:
        """Starts shard ``s``; its ``ready`` answer (with ``back_at_s``: it answers only then,
        and its body reports it)."""

    def attach(self, s: int, name: str, timeout_s: float) -> dict:
        """Takes over the running shard ``name``; its ``ready`` answer."""

    def ended(self) -> list[ShardEnded]:
        ...

    def kill(self, s: int, fault: "Optional[Fault]" = None) -> None:
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

    def closed_refs(self) -> list:
        """What ``LearnerGroup.wait`` also wakes on: one per shard, resolved when it ends."""

    def shard(self, s: int) -> Any:
        """Shard ``s`` itself (None before it is started or attached), for what only its body
        does with it: a region agent's one shard is its link client."""
