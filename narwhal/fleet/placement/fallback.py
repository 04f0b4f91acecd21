"""Placement's second look: engines it would rather avoid, in the order to fall back on them.

The first look (the hot path) takes only *admitted* engines: not out, not quarantined, not
unreachable. When it finds no pair, and the view says some engine is avoided, this second look
runs (docs/behaviour.md "Recovery" round 4), with its own notion of usable and an order that outweighs load:

====  ===========================================================  =============================
tier  engines                                                      within the tier
====  ===========================================================  =============================
0     placeable and reachable: quarantined (or degraded, admitted)  quarantine left, then load
1     ejected by the breaker (not the operator, not draining) and   load
      reachable — only when every placeable engine of that role is
      unreachable (Envoy's panic mode)
2     unreachable, whatever their state (but not out by hand)       load
====  ===========================================================  =============================

Why: a consumer that refuses connections fails fast, so it looks least loaded, and quarantine
and ``max_ejected_fraction`` never take the last engines of a role out, so before this rule a
dead consumer took every request while a live one, ejected for stream faults but reachable, was
held out by the cap (300 of 300 requests answered 502 in 0.26 s). Ejected engines are
used only in a role's panic, never merely because the others are full: a full fleet waits for a
slot (``placement.queue_timeout_s``) rather than spilling onto engines the breaker took out.
When no engine of a role is placeable at all, nothing changes: the model has no pair, 503
``no_engine``, as before. Pure: the view answers, nothing here reads shared memory itself.

**Reachable before unreachable, whatever else** (docs/behaviour.md, "Placement"): the tiers
above outrank load, but saturation is decided elsewhere (a saturated engine goes after the
others), and a dead engine's last load reading is stale and unsaturated. So the one order for
every fallback is: reachability first, then saturation, then the tier, then load. Two things
carry it, both from here: :attr:`Fallback.down` is the leading sort key of every order the
second look makes (``least_loaded.order``/``pick``'s ``last``), and :func:`reachable_first`
splits the producers so that a policy's own order (or its saturated set-aside) never puts an
unreachable producer before a reachable one. Before this, a quarantined consumer at 97 % KV
usage lost to a dead one five times in five.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

from narwhal.fleet import Engine, Fleet
from narwhal.fleet.roster import FleetView

Rank = tuple[int, float]
T = TypeVar("T")


class Fallback(NamedTuple):
    """Who may be taken in the second look, by role, and the order to take them in (lower first)."""

    producer_ok: Callable[[Engine], bool]
    consumer_ok: Callable[[Engine], bool]
    rank: Callable[[Engine], Rank]
    down: Sequence[bool]  # by engine index: unreachable, the leading key of every order here


def reachable_first(items: list[T], engine_of: Callable[[T], Engine], down: Sequence[bool]) -> list[list[T]]:
    """``items`` as the groups to try in turn: the reachable ones, then the unreachable ones (each
    in its order; an empty group left out)."""
    near = [item for item in items if not down[engine_of(item).index]]
    if len(near) == len(items):
        return [items]
    far = [item for item in items if down[engine_of(item).index]]
    return [near, far] if near else [far]


def fallback(view: FleetView, fleet: Fleet, producers: Iterable[Engine], consumers: Iterable[Engine]) -> Fallback:
    """The second look over ``producers`` and ``consumers`` (those serving the model), read once."""
    placeable = fleet.by_index(view.placeable)
    down = fleet.by_index(view.unreachable)
    spare = fleet.by_index(view.ejected_by_breaker)
    left = fleet.by_index(view.quarantine_left)

    def usable_in(engines: Iterable[Engine]) -> Callable[[Engine], bool]:
        panic = not any(placeable[e.index] and not down[e.index] for e in engines)
        if not panic:
            return lambda e: bool(placeable[e.index])
        return lambda e: bool(placeable[e.index] or (spare[e.index] and not down[e.index]))

    def rank(e: Engine) -> Rank:
        i = e.index
        return (2 if down[i] else 0 if placeable[i] else 1), left[i]

    return Fallback(usable_in(producers), usable_in(consumers), rank, down)
