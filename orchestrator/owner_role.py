"""Where an owner loop runs, as the points of its loop that differ: the home's controller or a
region's agent (``region_agent.RegionRole``). One ``controller.Controller`` serves both; a role
is what it is built with, in place of overriding it. No Ray here.
"""

from __future__ import annotations

from typing import Any

from islands.learners.messages import Heartbeat

from . import fleet as fleet_lib
from . import seam


class OwnerRole:
    """Where an owner runs, as the points of its loop that differ: this base is the home's
    controller (its own syncer shards, its own evaluation, nothing more on a step); a region's
    agent is the same owner with ``region_agent.RegionRole``, whose one syncer is its link.

    The owner calls these at fixed points; a role holds no fleet state of its own beyond what
    it reports elsewhere (a region's last failure causes), so the owner stays the one writer.
    """

    owns_syncers = True   # False: its one syncer shard is a link it attaches (attach_link)
    evaluates = True      # False: the home evaluates Θ; a region fetches nothing for it

    def bind(self, owner: Any) -> None:
        """The owner it serves, told before the owner builds or recovers anything."""

    def fleet_settings(self, settings: fleet_lib.FleetSettings) -> fleet_lib.FleetSettings:
        return settings

    def attach_link(self) -> None:
        """Attaches the syncer shard that is a link. The owner asks only a role that does not
        ``owns_syncers``; the home starts its own shards, so this is a caller's mistake here."""
        raise RuntimeError("attach_link called for the home, which starts its own syncer shards "
                           "(owns_syncers is True)")

    def recovery_observations(self) -> list:
        """What a restarted owner's first step hears besides its rebuilt fleet."""
        return []

    def heard(self, beat: Heartbeat) -> None:
        """A heartbeat the owner took."""

    def recorded(self, transition: fleet_lib.Transition) -> None:
        """A transition the owner recorded (its event is emitted)."""

    def stepped(self) -> None:
        """The owner's step is done (its new fleet adopted, its actions carried out)."""

    def handlers(self) -> seam.Table:
        """Handlers that replace the owner's for some action types (none: the home's)."""
        return {}


HOME = OwnerRole()   # holds no state: every home controller shares it
