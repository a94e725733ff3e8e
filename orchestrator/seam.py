"""The seam between the fleet brain and its bodies: one action table per body, built at its start.

``fleet.step`` returns actions (``fleet.ACTIONS``: every type it can return); a body (the Ray
controller, a region agent, the in-process driver) carries each out with a method named after its
type: ``<prefix><type name in lower case>`` (``_do_launch``, ``do_drainlearner``). A body builds
its table once, when it is made, so a missing handler stops it at its start, naming the action
types it lacks, rather than as an ``AttributeError`` the first time the fleet asks for that
action, deep into a run. No Ray here.

>>> from islands.orchestrator import fleet
>>> class Body:
...     def __init__(self):
...         self.done = []
...     def __getattr__(self, name):        # a handler for every action but Kill
...         if not name.startswith("do_") or name == "do_kill":
...             raise AttributeError(name)
...         return lambda now, action: self.done.append((now, type(action).__name__))
>>> handler_table(Body(), "do_")
Traceback (most recent call last):
...
islands.orchestrator.seam.MissingHandlers: Body has no handler for Kill (do_kill)
>>> body = Body()
>>> table = handler_table(body, "do_", fleet.ACTIONS[:1])
>>> dispatch(table, fleet.Launch("a:0", "a", 0, 0, 1, 1.0, None, 0), 2.5)
>>> body.done
[(2.5, 'Launch')]
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from . import fleet as fleet_lib

Table = dict[type, Callable[..., None]]  # action type -> the body's bound handler


class MissingHandlers(TypeError):
    """A body lacks a handler for some action types the fleet can return."""


def handler_name(action_type: type, prefix: str) -> str:
    """``handler_name(fleet.DrainLearner, "_do_") == "_do_drainlearner"``."""
    return prefix + action_type.__name__.lower()


def missing_handlers(body: Any, prefix: str,
                     actions: Sequence[type] = fleet_lib.ACTIONS) -> list[type]:
    """The action types ``body`` (an instance or a class) has no callable handler for."""
    return [t for t in actions if not callable(getattr(body, handler_name(t, prefix), None))]


def handler_table(body: Any, prefix: str,
                  actions: Sequence[type] = fleet_lib.ACTIONS) -> Table:
    """``{action type: body's handler}`` for every type in ``actions``.

    Raises:
      MissingHandlers: ``body`` has no handler for some of them (all named at once).
    """
    missing = missing_handlers(body, prefix, actions)
    if missing:
        owner = body if isinstance(body, type) else type(body)
        raise MissingHandlers(
            f"{owner.__name__} has no handler for "
            + ", ".join(f"{t.__name__} ({handler_name(t, prefix)})" for t in missing))
    return {t: getattr(body, handler_name(t, prefix)) for t in actions}


def dispatch(table: Table, action: Any, *context: Any) -> None:
    """Carries out one action: its handler is called with ``*context`` then the action.

    Raises:
      TypeError: ``action`` is not of a type in the table (not a ``fleet.ACTIONS`` type).
    """
    handler = table.get(type(action))
    if handler is None:
        raise TypeError(f"{type(action).__name__} is not a fleet action this body handles "
                        f"({', '.join(sorted(t.__name__ for t in table))})")
    handler(*context, action)


def turn(state: "fleet_lib.FleetState", observations: Sequence[Any], now: float, *,
         adopt: Callable[["fleet_lib.FleetState"], None],
         record: Callable[["fleet_lib.Transition"], None], table: Table,
         context: Sequence[Any] = (), recorded: Optional[Callable[[], None]] = None,
         on_error: Optional[Callable[[Any, Exception], None]] = None) -> "fleet_lib.Step":
    """One turn of the owner loop every body runs: what it observed goes through ``fleet.step``;
    the body adopts the new state (``adopt``) before anything else, so every handler sees it;
    each transition is recorded (``record``: events, books), then ``recorded`` (the books'
    state track), then every action is carried out through the body's table, with ``context``
    before the action (the in-process driver's virtual ``now``) and ``on_error`` as in
    :func:`dispatch_all`. The Ray controller, the region agent and the in-process driver differ
    only in these callbacks and handlers, not in the loop.

    >>> from islands.orchestrator import fleet
    >>> from islands.orchestrator.health import RestartPolicy
    >>> plan = fleet.RegionPlan(1, 1, (1.0,), ("a:0",))
    >>> settings = fleet.FleetSettings({"a": plan}, 1, RestartPolicy())
    >>> seen = {}
    >>> class Body:
    ...     def do_launch(self, now, action):
    ...         seen.setdefault("launched", []).append((now, action.learner))
    >>> table = handler_table(Body(), "do_", (fleet.Launch,))
    >>> result = turn(fleet.initial(settings), [], 0.0, adopt=lambda s: seen.update(state=s),
    ...               record=lambda t: seen.setdefault("transitions", []).append(t.name),
    ...               table=table, context=(0.0,))
    >>> seen["launched"], seen["transitions"], seen["state"] is result.fleet
    ([(0.0, 'a:0')], ['learner_launched'], True)
    """
    result = fleet_lib.step(state, observations, now)
    adopt(result.fleet)
    for transition in result.transitions:
        record(transition)
    if recorded is not None:
        recorded()
    dispatch_all(table, result.actions, *context, on_error=on_error)
    return result


def dispatch_all(table: Table, actions: Iterable[Any], *context: Any,
                 on_error: Optional[Callable[[Any, Exception], None]] = None) -> None:
    """Carries out ``actions`` in order. ``on_error``: called with (action, exception) for an
    action whose handler raised, and the next action goes on (the Ray controller: one failed
    call must not stop the owner loop); None: the first error propagates."""
    for action in actions:
        if on_error is None:
            dispatch(table, action, *context)
            continue
        try:
            dispatch(table, action, *context)
        except Exception as exc:
            on_error(action, exc)
