"""The engines a router knows and the decisions about them: the roster and permitted pairs,
placement and reservations, breakers and blame. Pure decisions: no I/O here.
"""

from narwhal.fleet.roster import Engine, Fleet, FleetView, pair_permitted

__all__ = ["Engine", "Fleet", "FleetView", "pair_permitted"]
