"""The least-loaded rule: the engine with the fewest requests, saturated ones last, ties at random.

It orders every consumer, and as policy ``least_loaded`` (:class:`LeastLoaded`) the producers,
ignoring prefixes.

SPEC §3.2. An engine's load for a phase is this host's fleet-wide in-flight legs of that
phase on it plus, where fresh, what it reports running and waiting (``load.Loads.extra``).
An engine whose fresh KV usage is at or above ``placement.kv_saturated`` is chosen only when
every candidate is saturated: more requests there would preempt running ones.

Ties are broken at random: a shuffle under a stable sort (or a ``min``), so equal engines
share the traffic rather than the first in the configuration taking it all. With no
saturated engine (the common case) the key is the bare count: nothing per candidate beyond
what placement paid before engines reported load.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

from narwhal.fleet.placement.load import Loads
from narwhal.fleet.placement.policy import Asked, Candidate, Ordered, by_load, producer_index

T = TypeVar("T")


def order(
    items: list[T], load: Callable[[T], float], index: Callable[[T], int], loads: Loads | None, rng: random.Random
) -> list[T]:
    """``items`` least loaded first (in place), saturated ones after all others."""
    if len(items) > 1:
        rng.shuffle(items)  # random tie-break under the stable sort below
        if loads is not None and loads.any_saturated:
            saturated = loads.saturated
            items.sort(key=lambda item: (saturated[index(item)], load(item)))
        else:
            items.sort(key=load)
    return items


def pick(items: list[T], load: Callable[[T], float], index: Callable[[T], int], loads: Loads | None,
         rng: random.Random) -> T:
    """The least loaded of ``items`` (not empty), unsaturated first, ties at random."""
    if len(items) == 1:
        return items[0]
    rng.shuffle(items)
    if loads is not None and loads.any_saturated:
        saturated = loads.saturated
        return min(items, key=lambda item: (saturated[index(item)], load(item)))
    return min(items, key=load)


def all_saturated(indexes: Sequence[int], loads: Loads | None) -> bool:
    """Is every candidate saturated (so the choice is ``saturated``)?"""
    if loads is None or not loads.any_saturated or not indexes:
        return False
    saturated = loads.saturated
    return all(saturated[i] for i in indexes)


class LeastLoaded:
    """Policy ``least_loaded``: producers by load alone (the prompt is not read)."""

    name = "least_loaded"
    wants_key = False
    wants_blocks = False
    wants_holdings = False

    def keeps_saturated(self, asked: Asked) -> Callable[[Candidate], bool] | None:
        """None: a saturated producer goes after every other."""
        return None

    def order(self, candidates: list[Candidate], asked: Asked) -> Ordered:
        """Least loaded first, ties at random."""
        return Ordered(order(candidates, asked.load, producer_index, None, asked.rng), by_load)
