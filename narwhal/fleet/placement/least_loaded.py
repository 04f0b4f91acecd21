"""The least-loaded rule: the engine with the fewest requests, saturated ones last, ties at random.

It orders every consumer, and as policy ``least_loaded`` (:class:`LeastLoaded`) the producers,
ignoring prefixes.

docs/behaviour.md "Placement". An engine's load for a phase is this host's fleet-wide in-flight legs of that
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
from typing import Any, TypeVar

from narwhal.fleet.placement.load import Loads
from narwhal.fleet.placement.policy import Asked, Candidate, KeepsNothing, Ordered, PromptText, by_load, producer_index
from narwhal.settings import PlacementSettings

T = TypeVar("T")


def _key(load: Callable[[T], Any], index: Callable[[T], int], loads: Loads | None,
         last: Sequence[bool] | None) -> Callable[[T], Any]:
    """The sort key: unreachable last (``last``, the second look's, :mod:`.fallback`), then
    saturated last, then load."""
    saturated = loads.saturated if loads is not None and loads.any_saturated else None
    if last is None:
        if saturated is None:
            return load
        return lambda item: (saturated[index(item)], load(item))
    if saturated is None:
        return lambda item: (last[index(item)], load(item))
    return lambda item: (last[index(item)], saturated[index(item)], load(item))


def order(
    items: list[T], load: Callable[[T], Any], index: Callable[[T], int], loads: Loads | None, rng: random.Random,
    last: Sequence[bool] | None = None,
) -> list[T]:
    """``items`` least loaded first (in place), saturated ones after all others, and after
    those the ones ``last`` names (by index: the unreachable, in the second look)."""
    if len(items) > 1:
        rng.shuffle(items)  # random tie-break under the stable sort below
        items.sort(key=_key(load, index, loads, last))
    return items


def pick(items: list[T], load: Callable[[T], Any], index: Callable[[T], int], loads: Loads | None,
         rng: random.Random, last: Sequence[bool] | None = None) -> T:
    """The first of :func:`order` over ``items`` (not empty), ties at random."""
    if len(items) == 1:
        return items[0]
    rng.shuffle(items)
    return min(items, key=_key(load, index, loads, last))


def all_saturated(indexes: Sequence[int], loads: Loads | None) -> bool:
    """Is every candidate saturated (so the choice is ``saturated``)?"""
    if loads is None or not loads.any_saturated or not indexes:
        return False
    saturated = loads.saturated
    return all(saturated[i] for i in indexes)


class LeastLoaded(KeepsNothing):
    """Policy ``least_loaded``: producers by load alone (the prompt is not read)."""

    name = "least_loaded"

    def __init__(self, settings: PlacementSettings | None = None, holdings: object = None) -> None:
        pass  # nothing of the settings or the holdings is read

    def prepare(self, prompt: PromptText) -> None:
        """Nothing: the prompt is not read."""
        return None

    def keeps_saturated(self, asked: Asked) -> Callable[[Candidate], bool] | None:
        """None: a saturated producer goes after every other."""
        return None

    def order(self, candidates: list[Candidate], asked: Asked) -> Ordered:
        """Least loaded first, ties at random."""
        return Ordered(order(candidates, asked.load, producer_index, None, asked.rng), by_load)
